"""Symmetric windows: pools per (process group, dtype), slots, and the bound-shard registry.

# NOTE [symmetric layout]
Every rank of a group binds the same shards in the same order with the same sizes (the
agreement in ``binding.py`` guarantees it), and ``plan_slots`` is a pure function of
(pool state, sizes). So a shard sits at the same (window, offset) on every rank, and a
peer's copy of it is simply ``peer_base + offset``: no address exchange per shard.

Slots start on 512-byte boundaries (peak copy-engine throughput; Inductor also assumes
16-byte-aligned parameters). A window holds at most ``window_cap`` bytes; a shard larger
than the cap gets a window of its own. The driver allows at most 128 symmetric windows per
process, so shards are pooled, never one window per weight.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger("torch_ce")

SLOT_ALIGN = 512
MAX_WINDOWS_PER_PROCESS = 128


def align_up(n: int, a: int = SLOT_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclasses.dataclass(eq=False)
class Window:
    """One symmetric allocation of ``nbytes`` on every rank of ``group``."""

    pool_key: tuple
    index: int
    nbytes: int
    group: Any  # ProcessGroup
    group_ranks: tuple  # global ranks, in group-rank order
    rank: int  # this process's rank in the group
    device: torch.device
    local: torch.Tensor  # uint8 view of this rank's whole window
    handle: Any = None  # transport-specific (symm_mem handle / host mappings)
    peer_locals: list = dataclasses.field(default_factory=list)  # uint8 views (host)
    peer_base_ptrs: list = dataclasses.field(default_factory=list)  # ints (cuda)
    base_offset: int = 0  # bytes from the symmetric allocation's base to this window (cuda)
    used: int = 0

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)


@dataclasses.dataclass(eq=False)
class Slot:
    """Where one bound shard lives: the same (window, offset) on every rank."""

    window: Window
    offset: int
    nbytes: int
    shape: tuple
    dtype: torch.dtype
    name: str = ""
    # Per peer (group-rank order): a typed view of that rank's copy (host transport) or
    # its device address (CUDA transport). Filled when the window is published.
    peer_views: list = dataclasses.field(default_factory=list)
    peer_ptrs: list = dataclasses.field(default_factory=list)

    @property
    def group_size(self) -> int:
        return self.window.group_size


@dataclasses.dataclass(eq=False)
class Fallback:
    """A shard whose binding was refused by agreement: its CE gathers run on NCCL/gloo."""

    reason: str
    group_name: str
    ref: Any = None  # weakref to the tensor: a freed tensor's address may be reused


class WindowPool:
    """The windows of one (process group, dtype); ``plan_slots`` places shards in them."""

    def __init__(self, key: tuple, cap_bytes: int):
        self.key = key
        self.cap_bytes = cap_bytes
        self.windows: list[Window] = []

    def plan_slots(self, sizes: list[int]) -> list[tuple[int, int, int]]:
        """(new_window_number, offset, nbytes) per shard, in order, plus new window sizes.

        Fresh windows are opened for each bind (sized to what they hold, capped), so the
        layout depends only on the sizes: identical on every rank.
        """
        placed, cur_n, cur_used = [], 0, 0
        for nbytes in sizes:
            need = align_up(nbytes)
            if cur_used and cur_used + need > self.cap_bytes:
                cur_n, cur_used = cur_n + 1, 0
            placed.append((cur_n, cur_used, nbytes))
            cur_used += need
            if cur_used >= self.cap_bytes:  # an over-cap shard sits alone
                cur_n, cur_used = cur_n + 1, 0
        return placed


# ---------------------------------------------------------------------------------------
# Process-wide state: pools and the data_ptr -> Slot registry.
# ---------------------------------------------------------------------------------------

_lock = threading.RLock()
_pools: dict[tuple, WindowPool] = {}
_registry: dict[int, Slot | Fallback] = {}
_window_count = 0


def pool_key(group_ranks: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
    # Keyed by the group's global ranks, not its name: subgroup names differ across ranks.
    return (group_ranks, str(dtype).replace("torch.", ""), device.type)


def get_pool(key: tuple, cap_bytes: int) -> WindowPool:
    with _lock:
        if key not in _pools:
            _pools[key] = WindowPool(key, cap_bytes)
        _pools[key].cap_bytes = cap_bytes  # new windows follow the current config
        return _pools[key]


def pools() -> dict[tuple, WindowPool]:
    return dict(_pools)


def lookup(t: torch.Tensor) -> Slot | Fallback | None:
    """The slot of a bound shard (or its Fallback marker), matched by address and size."""
    entry = _registry.get(t.data_ptr())
    if isinstance(entry, Slot):
        if t.dtype != entry.dtype or tuple(t.shape) != entry.shape or not t.is_contiguous():
            return None
    elif isinstance(entry, Fallback) and entry.ref is not None:
        live = entry.ref()
        if live is None or live.data_ptr() != t.data_ptr():
            return None
    return entry


def register(t: torch.Tensor, entry: Slot | Fallback) -> None:
    """Record ``t``'s slot (or Fallback). The one writer of both indexes: a CUDA slot is
    mirrored into the C++ kernels' index, and an entry that replaces one leaves it."""
    from . import native

    key = t.data_ptr()
    with _lock:
        old = _registry.get(key)
        _registry[key] = entry
        if native.loaded():
            if isinstance(entry, Slot) and entry.window.device.type == "cuda":
                native.register_slot(entry)
            elif isinstance(old, Slot) and old.window.device.type == "cuda":
                native.unregister(key)


@contextlib.contextmanager
def registered_probe(t: torch.Tensor, slot: Slot):
    """``t`` registered as ``slot`` for the block, then the entry it displaced restored:
    the calibration's probe starts at a window's first slot, whose shard is bound."""
    from . import native

    key = t.data_ptr()
    with _lock:
        old = _registry.get(key)
        register(t, slot)
    try:
        yield
    finally:
        with _lock:
            if old is not None:
                register(t, old)
            else:
                _registry.pop(key, None)
                native.unregister(key)


def bound_slots() -> list[Slot]:
    return [e for e in _registry.values() if isinstance(e, Slot)]


def reserve_windows(n: int) -> None:
    global _window_count
    with _lock:
        if _window_count + n > MAX_WINDOWS_PER_PROCESS:
            raise RuntimeError(
                f"torch_ce: opening {n} more symmetric windows would exceed the driver's "
                f"limit of {MAX_WINDOWS_PER_PROCESS} per process ({_window_count} open); "
                "raise window_cap_mib so shards share windows"
            )
        _window_count += n


def add_window(pool: WindowPool, w: Window) -> None:
    with _lock:
        pool.windows.append(w)


_teardown_hooks: list[Callable[[], None]] = []


def on_release(fn: Callable[[], None]) -> None:
    _teardown_hooks.append(fn)


def release_all() -> None:
    """Forget every pool, window and binding (teardown; bound parameters keep their data).

    Window memory is freed when the last tensor viewing it dies; shared-memory names are
    already unlinked at publish time, so nothing of ours stays in /dev/shm.
    """
    global _window_count
    with _lock:
        for fn in list(_teardown_hooks):
            try:
                fn()
            except Exception as e:  # teardown must not mask the caller's exception
                log.warning("torch_ce: teardown hook failed: %s", e)
        _pools.clear()
        _registry.clear()
        _window_count = 0


def group_ranks_of(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group))
