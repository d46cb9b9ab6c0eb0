"""Symmetric windows: what a window and a slot are, the one layout rule, and the
bound-shard registry. The process's pools of windows, and their release:
window_pools.py.

# NOTE [symmetric layout]
Every rank of a group binds the same shards in the same order with the same sizes (the
agreement in ``agreement.py`` checks it), and ``place`` is a pure function of (the pool's
windows and fill, the sizes, the cap). So a shard sits at the same (window, offset) on
every rank, and a peer's copy of it is ``peer_base + offset``: no address exchange per
shard. ``place`` is the only place the layout is decided; the agreement compares its
result across ranks before anything moves.

# NOTE [windows that pool]
A model compiled into many graphs (graph breaks, recompiles for new shapes) binds once per
graph. Each bind first fills the free tails of its pool's windows (first fit, in window
order), and only the shards that fit nowhere open new windows. A new window is sized
``max(what it must hold, GROWTH x the pool's reserved bytes, MIN_WINDOW_BYTES)``, capped at
the cap (a shard larger than the cap gets a window of exactly its size). So:
- a first bind of a whole model opens windows sized to what it holds (as before);
- later small binds land in the free tails; the pool grows geometrically, so a pool of
  R reserved bytes has at most ``log(R / MIN_WINDOW_BYTES) / log(1 + GROWTH) + 1 +
  R / cap`` windows (200 graphs of small weights: one or two windows);
- free bytes never exceed ``max(MIN_WINDOW_BYTES, GROWTH x reserved)`` in the newest
  window, plus tails shorter than the shard that did not fit them in older ones.
Slots start on 512-byte boundaries (peak copy-engine throughput; Inductor also assumes
16-byte-aligned parameters). The driver allows at most 128 symmetric windows per process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

SLOT_ALIGN = 512
MAX_WINDOWS_PER_PROCESS = 128
MIN_WINDOW_BYTES = 8 * 2**20
GROWTH = 0.25


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
    used: int = 0  # bytes filled from the start (slots are never freed one by one)

    @property
    def group_size(self) -> int:
        return len(self.group_ranks)

    @property
    def free(self) -> int:
        return self.nbytes - self.used


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
    # its device address (CUDA transport). Filled when the slot is published.
    peer_views: list = dataclasses.field(default_factory=list)
    peer_ptrs: list = dataclasses.field(default_factory=list)
    ref: Any = None  # weakref to the bound tensor (NOTE [window lifetime] in window_pools.py)
    # The version counters of the weight it holds (in place, padded or cast; not a training
    # graph's staging slot, refreshed every step): NOTE [the version net] in versions.py.
    watch: Any = None

    @property
    def group_size(self) -> int:
        return self.window.group_size


@dataclasses.dataclass(eq=False)
class Fallback:
    """A shard whose binding was refused by agreement: its CE gathers run on NCCL/gloo."""

    reason: str
    group_name: str
    ref: Any = None  # weakref to the tensor: a freed tensor's address may be reused
    code: int = 0  # eligibility.Reason of the refusal


@dataclasses.dataclass
class Layout:
    """Where a bind puts its shards: ``(window index, offset)`` per shard, in order, and
    the sizes of the windows to open (their indices follow the pool's)."""

    places: list[tuple[int, int]]
    new_windows: list[int]

    def digest(self) -> list:
        return [list(map(list, self.places)), list(self.new_windows)]


def place(state: list[tuple[int, int]], sizes: list[int], cap: int) -> Layout:
    """The layout rule (NOTE [symmetric layout], NOTE [windows that pool]).

    ``state``: (nbytes, used) of the pool's windows; ``sizes``: shard bytes in bind order.
    Pure: the same inputs give the same layout on every rank.
    """
    fill = [used for _, used in state]
    caps = [nbytes for nbytes, _ in state]
    reserved = sum(caps)
    places: list[tuple[int, int] | None] = [None] * len(sizes)
    pending: list[int] = []
    for i, nbytes in enumerate(sizes):
        need = align_up(nbytes)
        for w in range(len(caps)):
            if fill[w] + need <= caps[w]:
                places[i] = (w, fill[w])
                fill[w] += need
                break
        else:
            pending.append(i)
    new: list[int] = []
    k = 0
    while k < len(pending):
        first = align_up(sizes[pending[k]])
        if first >= cap:  # an over-cap shard sits alone, in a window of exactly its size
            size, take = first, 1
        else:
            total, take = 0, 0
            while k + take < len(pending) and total + align_up(sizes[pending[k + take]]) <= cap:
                total += align_up(sizes[pending[k + take]])
                take += 1
            size = min(cap, max(total, int(GROWTH * reserved), MIN_WINDOW_BYTES))
        w = len(caps)
        caps.append(size)
        fill.append(0)
        new.append(size)
        reserved += size
        for j in pending[k:k + take]:
            places[j] = (w, fill[w])
            fill[w] += align_up(sizes[j])
        k += take
    return Layout([p for p in places if p is not None], new)


def window_bound(reserved: int, cap: int) -> int:
    """The most windows a pool of ``reserved`` bytes can hold (NOTE [windows that pool])."""
    import math

    grow = math.log(max(reserved, MIN_WINDOW_BYTES) / MIN_WINDOW_BYTES) / math.log(1 + GROWTH)
    return int(grow) + 1 + reserved // cap + 1


# ---------------------------------------------------------------------------------------
# Process-wide state: the data_ptr -> Slot registry (the pools: window_pools.py).
# ---------------------------------------------------------------------------------------

# One lock for the registry and the pools: a release changes both at once.
_lock = threading.RLock()
_registry: dict[int, Slot | Fallback] = {}


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


# Mirrors of the CUDA slots beyond the C++ index (the Triton row kernel's address tables,
# runtime/gather.py): fn(key, slot) when a CUDA slot is registered at ``key``, fn(key, None)
# when it leaves. Hooks, so that the module choosing the kernels is entered from above only.
_slot_hooks: list[Callable[[int, Slot | None], None]] = []


def on_cuda_slot(fn: Callable[[int, Slot | None], None]) -> None:
    _slot_hooks.append(fn)


def _mirror(key: int, slot: Slot | None) -> None:
    """The C++ index and every ``on_cuda_slot`` hook learn that ``key`` holds ``slot`` now
    (None: no CUDA slot)."""
    from . import native

    if slot is not None:
        native.register_slot(slot)
    else:
        native.unregister(key)
    for fn in _slot_hooks:
        fn(key, slot)


def register(t: torch.Tensor, entry: Slot | Fallback) -> None:
    """Record ``t``'s slot (or Fallback). The one writer of the indexes: a CUDA slot is
    mirrored into the C++ kernels' index (and the ``on_cuda_slot`` hooks), and an entry that
    replaces one leaves them."""
    from . import native

    key = t.data_ptr()
    with _lock:
        old = _registry.get(key)
        if isinstance(entry, Slot):
            entry.ref = weakref.ref(t)  # NOTE [window lifetime]
        _registry[key] = entry
        if native.loaded():
            if isinstance(entry, Slot) and entry.window.device.type == "cuda":
                _mirror(key, entry)
            elif isinstance(old, Slot) and old.window.device.type == "cuda":
                _mirror(key, None)


@contextlib.contextmanager
def registered_probe(t: torch.Tensor, slot: Slot):
    """``t`` registered as ``slot`` for the block, then the entry it displaced restored:
    the calibration's probe starts at a window's first slot, whose shard is bound."""
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
                _mirror(key, None)


# Training graphs' staging slots (NOTE [training: staged windows and step fences] in
# staging.py), keyed by (weight address, staging dtype): (weakref to the weight, its Slot
# or Fallback, the slot's local view or None). The slot's view is registered above too, so
# the gathers find it like any bound shard.
_staged: dict[tuple[int, torch.dtype], tuple[Any, Slot | Fallback, torch.Tensor | None]] = {}
def _wkey(t: torch.Tensor) -> int:
    """A weight's key: its address; an empty weight (address 0) its identity instead."""
    return t.data_ptr() if t.numel() else -id(t)


def staged(t: torch.Tensor, dtype: torch.dtype) -> tuple[Slot | Fallback, torch.Tensor | None] | None:
    """The staging entry of weight ``t`` in ``dtype`` ((Slot, view) or (Fallback, None))."""
    hit = _staged.get((_wkey(t), dtype))
    if hit is None:
        return None
    ref, entry, view = hit
    live = ref()
    if live is None or live.data_ptr() != t.data_ptr() or tuple(live.shape) != tuple(t.shape):
        return None  # the weight was freed (or replaced) and its address reused
    if not t.numel() and live is not t:
        return None
    return entry, view


def is_staged(t: torch.Tensor) -> bool:
    """Whether some training graph stages ``t`` (a trained weight)."""
    k = _wkey(t)
    return any(staged(t, d) is not None for (ptr, d) in list(_staged) if ptr == k)


# Cast slots of inference graphs (NOTE [cast slots] in staging.py), keyed like ``_staged``:
# (weakref to the weight, its Slot or Fallback, the slot's view or None, the weight's
# version counter when the slot was copied). Apart from the training slots: a weight that
# a training graph stages and an inference graph casts has both, and the cast slot is
# refused (its values would be a step old after the next optimizer step).
_cast: dict[tuple[int, torch.dtype], tuple[Any, Slot | Fallback, torch.Tensor | None, int]] = {}


def cast_slot(t: torch.Tensor, dtype: torch.dtype) -> tuple[Slot | Fallback, torch.Tensor | None, int] | None:
    """The cast slot of weight ``t`` in ``dtype``: (Slot, view, version) or (Fallback, None, 0)."""
    hit = _cast.get((_wkey(t), dtype))
    if hit is None:
        return None
    ref, entry, view, version = hit
    live = ref()
    if live is None or live.data_ptr() != t.data_ptr() or tuple(live.shape) != tuple(t.shape):
        return None
    if not t.numel() and live is not t:
        return None
    return entry, view, version


def register_cast_slot(t: torch.Tensor, dtype: torch.dtype, entry: Slot | Fallback,
                       view: torch.Tensor | None = None, full: torch.Tensor | None = None) -> None:
    """Record weight ``t``'s cast slot (its view registered as bound, like a staging slot)."""
    with _lock:
        if full is not None and isinstance(entry, Slot):
            register_padded(full, entry)
        elif view is not None:
            register(view, entry)
        _cast[(_wkey(t), dtype)] = (weakref.ref(t), entry, view, 0 if t.is_inference() else t._version)


def cast_slots() -> list[tuple[torch.Tensor, Slot]]:
    """(weight, slot) of every live cast slot (explain(): their bytes)."""
    out = []
    for ref, entry, _, _ in list(_cast.values()):
        w = ref()
        if w is not None and isinstance(entry, Slot):
            out.append((w, entry))
    return out


def follow_moved_weights() -> int:
    """Re-key the cast and staging entries whose weight now has another address (a
    ``.data =`` inside ``updating_weights``), so the next call finds them instead of
    binding the weight again. Returns how many moved."""
    n = 0
    with _lock:
        for table in (_cast, _staged):
            for key, val in list(table.items()):
                w = val[0]()
                if w is not None and (_wkey(w), key[1]) != key:
                    del table[key]
                    table[(_wkey(w), key[1])] = val
                    n += 1
    return n


def register_staged(t: torch.Tensor, dtype: torch.dtype, entry: Slot | Fallback,
                    view: torch.Tensor | None = None, full: torch.Tensor | None = None) -> None:
    """Record weight ``t``'s staging slot (and register the slot's view as bound). ``full``:
    a padded slot's ceil-row view (``view`` its first rows; NOTE [uneven Shard(0): padded
    slots])."""
    with _lock:
        if full is not None and isinstance(entry, Slot):
            register_padded(full, entry)
        elif view is not None:
            register(view, entry)
        _staged[(_wkey(t), dtype)] = (weakref.ref(t), entry, view)


# NOTE [uneven Shard(0): padded slots]
# torch.chunk gives the first ranks ``ceil(rows / W)`` rows and the last ones fewer (or
# none), so a gather of an uneven Shard(0) weight is the collective gather of the shards
# zero-padded to ``ceil`` rows, sliced to ``rows`` after the wait (the padding lands past
# the weight's last row). Its slot holds ``ceil`` rows on every rank (the agreed,
# rank-independent shape): the live shard in the first rows, zeros in the rest (written
# once at bind, never again: a refresh copies only the live rows), so every peer's slab
# has one size and the gather reads W fixed-size slabs, bit for bit the collective's
# padded output. The parameter (or, for a staging slot, the view the stage step writes)
# views the slot's first rows, so the address of its first element (storage address plus
# offset) names the slot even when it has 0 rows (an empty tensor's ``data_ptr()`` is 0).
# The full ceil-row view is registered like any bound shard (the C++ index matches it by
# address and shape); ``padded`` maps a live-rows view back to it. A refused padded
# weight is recorded by the tensor's identity (``id`` and a weakref), since an empty shard
# has no address.
_padded: dict[int, tuple[Slot, torch.Tensor]] = {}
_padded_fb: dict[int, tuple[Any, Fallback]] = {}


def _first_addr(t: torch.Tensor) -> int:
    """The address of ``t``'s first element, also when it has none: its storage's address
    plus its storage offset (0: no storage)."""
    try:
        base = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 (a tensor without storage: not a slot view)
        return 0
    return base + t.storage_offset() * t.element_size() if base else 0


def register_padded(full: torch.Tensor, entry: Slot, live: torch.Tensor | None = None) -> None:
    """Record a padded slot: ``full`` its ceil-row view (registered as bound too), ``live``
    the parameter that views its first rows (then the owner NOTE [window lifetime] counts)."""
    with _lock:
        register(full, entry)
        if live is not None:
            entry.ref = weakref.ref(live)
        _padded[_first_addr(full)] = (entry, full)


def is_padded_slot(slot: Slot) -> bool:
    """Whether ``slot`` is a padded slot (its weight views its first rows)."""
    return any(e is slot for e, _ in list(_padded.values()))


def register_padded_fallback(t: torch.Tensor, fb: Fallback) -> None:
    with _lock:
        _padded_fb[id(t)] = (weakref.ref(t), fb)


def padded(t: torch.Tensor) -> tuple[Slot, torch.Tensor] | Fallback | None:
    """A live-rows view's padded slot and the slot's full view, or its Fallback, or None."""
    addr = _first_addr(t)
    if addr:
        hit = _padded.get(addr)
        if hit is not None:
            slot, full = hit
            if (t.dtype == slot.dtype and tuple(t.shape[1:]) == tuple(slot.shape[1:])
                    and t.shape[0] <= slot.shape[0] and t.is_contiguous()):
                return hit
    fb = _padded_fb.get(id(t))
    if fb is not None and fb[0]() is t:
        return fb[1]
    entry = lookup(t)  # a runtime fallback's plain cast (staging.staged_slots)
    return entry if isinstance(entry, Fallback) else None


def bound_slots() -> list[Slot]:
    return [e for e in _registry.values() if isinstance(e, Slot)]


def forget_slots_of(windows: list[Window]) -> int:
    """Drop every registry entry of a slot in ``windows`` (``window_pools.release_owner``);
    returns how many."""
    ids = {id(w) for w in windows}
    n = 0
    with _lock:
        for key, entry in list(_registry.items()):
            if isinstance(entry, Slot) and id(entry.window) in ids:
                _registry.pop(key, None)  # pop: a finalizer may release another owner meanwhile
                n += 1
                if entry.window.device.type == "cuda":
                    from . import native

                    if native.loaded():
                        _mirror(key, None)
        for table in (_staged, _cast):
            for key, val in list(table.items()):
                if isinstance(val[1], Slot) and id(val[1].window) in ids:
                    table.pop(key, None)
        for key, (entry, _) in list(_padded.items()):
            if id(entry.window) in ids:
                _padded.pop(key, None)
    return n


def clear_registry() -> None:
    """Forget every bound shard, staging, cast and padded slot and Fallback
    (``window_pools.release_all``)."""
    with _lock:
        _registry.clear()
        _staged.clear()
        _padded.clear()
        _padded_fb.clear()
        _cast.clear()


def group_ranks_of(group) -> tuple:
    return tuple(dist.get_process_group_ranks(group))
