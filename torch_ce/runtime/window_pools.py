"""The process's window pools: the shared ones per (group ranks, dtype, device type), an
owner's own (NOTE [windows of one owner]), their count against the driver's limit, and
their release (``release_owner``, ``release_all``). What a window is, the layout rule
(``windows.place``) and the bound-shard registry: windows.py.

# NOTE [window lifetime]
``release_all()`` forgets every binding, but a window whose shards are still held by live
tensors (the parameters view it) stays allocated and counted until the last of them dies;
only then is it freed. CUDA views of a window do not own its memory (symmetric memory's
``get_buffer``), so the window must outlive them.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Callable

import torch

from . import windows as W
from .windows import MAX_WINDOWS_PER_PROCESS, Window

log = logging.getLogger("torch_ce")


class WindowPool:
    """The windows of one (process group ranks, dtype, device type)."""

    def __init__(self, key: tuple):
        self.key = key
        self.windows: list[Window] = []

    @property
    def reserved(self) -> int:
        return sum(w.nbytes for w in self.windows)

    @property
    def used(self) -> int:
        return sum(w.used for w in self.windows)

    def state(self) -> list[tuple[int, int]]:
        """(nbytes, used) per window: what ``windows.place`` depends on (agreed across
        ranks)."""
        return [(w.nbytes, w.used) for w in self.windows]


# ---------------------------------------------------------------------------------------
# Process-wide state: the pools (the registry of their slots: windows.py).
# ---------------------------------------------------------------------------------------

_lock = W._lock  # the registry's: a release changes both at once
_pools: dict[tuple, WindowPool] = {}
_retired: dict[int, Window] = {}  # id -> window still viewed by live tensors after release


def pool_key(group_ranks: tuple, dtype: torch.dtype, device: torch.device) -> tuple:
    # Keyed by the group's global ranks, not its name: subgroup names differ across ranks.
    return (group_ranks, str(dtype).replace("torch.", ""), device.type)


def get_pool(key: tuple) -> WindowPool:
    with _lock:
        if _owner:  # NOTE [windows of one owner]
            return _owned.setdefault(_owner[-1], {}).setdefault(key, WindowPool(key))
        if key not in _pools:
            _pools[key] = WindowPool(key)
        return _pools[key]


def pools() -> dict[tuple, WindowPool]:
    """Every pool: the shared ones by their key, an owner's by its key and the owner's
    label (NOTE [windows of one owner])."""
    with _lock:
        out = dict(_pools)
        for owner, ps in _owned.items():
            for key, pool in ps.items():
                out[(*key, str(owner))] = pool
        return out


def open_count() -> int:
    """Windows this process holds: in pools (an owner's too), plus released ones still
    viewed or not yet freed."""
    with _lock:
        return (sum(len(p.windows) for p in pools().values()) + len(_retired)
                + len(_deferred))


def check_window_limit(n_new: int) -> None:
    have = open_count()
    if have + n_new > MAX_WINDOWS_PER_PROCESS:
        raise RuntimeError(
            f"torch_ce: opening {n_new} more symmetric windows would exceed the driver's "
            f"limit of {MAX_WINDOWS_PER_PROCESS} per process ({have} open, released ones "
            "still viewed by live tensors included); raise window_cap_mib, or drop models "
            "bound earlier and call torch_ce.release_all()"
        )


def add_windows(pool: WindowPool, windows: list[Window]) -> None:
    with _lock:
        pool.windows.extend(windows)


# NOTE [windows of one owner]
# Pooled windows outlive every binding in them: slots are never freed one by one, and a
# pool's state must stay the same on every rank (NOTE [symmetric layout] in windows.py),
# so a window could only go when all of its pool went. What is bound for one owner that
# comes and goes (an FSDP2 model: torch_ce.fsdp2.enable/disable) is therefore bound under
# ``owned_pools(owner)``: its bind places every shard in pools of the owner's own, which
# start empty (so every rank computes the same layout from the same sizes, whatever else
# it bound before) and which nothing else fills. ``release_owner(owner)`` then forgets
# them whole: the registry's entries of their slots, the pools and our references to
# their windows. The memory goes when the last tensor viewing it does (host: a view holds
# its mapping; the owner moves the weights out first). When it may go is the transport's:
# - host: at once. A peer that still reads (it has not disabled yet, or it gathers for a
#   model this rank dropped) reads its own mapping of this rank's segment, which
#   outlives this rank's unmapping (the name was unlinked at open), and this rank never
#   writes the window again: the peer reads the values of the last update.
# - CUDA: symmetric memory freed here may be handed out again here while a peer's copies
#   of it are still queued. So the windows wait in ``_deferred`` (still counted) until
#   every rank of their group has passed a point after its last read of them:
#   ``flush_deferred(ranks)`` after a round whose every rank synchronized its device first
#   (the next fsdp2.enable over those ranks does), or ``release_all()``. CUDA views of a
#   window do not own it (NOTE [window lifetime]): ``fsdp2.disable`` moves the weights
#   out first, and a dropped model's views die with it.
_owned: dict[Any, dict[tuple, WindowPool]] = {}  # owner -> its pools
_owner: list = []  # the owner binds are placed for now (innermost last)
_deferred: list[Window] = []  # CUDA windows released, freed at the next fence


@contextlib.contextmanager
def owned_pools(owner):
    """Binds inside the block place their shards in ``owner``'s own pools (NOTE [windows of
    one owner]). ``owner``: any hashable token (this process's: the ranks compare only
    the layouts); ``str(owner)`` labels its pools in ``pools()``."""
    with _lock:
        _owner.append(owner)
    try:
        yield
    finally:
        with _lock:
            _owner.remove(owner)


def owned(owner) -> list[Window]:
    """``owner``'s windows."""
    with _lock:
        return [w for p in _owned.get(owner, {}).values() for w in p.windows]


def release_owner(owner) -> int:
    """Forget ``owner``'s pools, windows and slots (NOTE [windows of one owner]); host
    windows go with their last view, CUDA ones wait for ``flush_deferred``. Idempotent.
    Returns the window bytes released."""
    with _lock:
        ps = _owned.pop(owner, None)
        if not ps:
            return 0
        windows = [w for p in ps.values() for w in p.windows]
        W.forget_slots_of(windows)
        _deferred.extend(w for w in windows if w.device.type == "cuda")
        return sum(w.nbytes for w in windows)


def deferred(ranks: tuple | None = None) -> list[Window]:
    """The released CUDA windows not yet freed (of the groups inside ``ranks``)."""
    with _lock:
        return [w for w in _deferred if ranks is None or set(w.group_ranks) <= set(ranks)]


def flush_deferred(ranks: tuple) -> int:
    """Free the deferred windows of groups inside ``ranks``: call it only after a round of
    those ranks in which each synchronized its device first (NOTE [windows of one
    owner]). Returns how many went."""
    with _lock:
        keep = [w for w in _deferred if not set(w.group_ranks) <= set(ranks)]
        n = len(_deferred) - len(keep)
        _deferred[:] = keep
        return n


# ---------------------------------------------------------------------------------------
# Release: every pool and binding (teardown)
# ---------------------------------------------------------------------------------------

_teardown_hooks: list[Callable[[], None]] = []


def on_release(fn: Callable[[], None]) -> None:
    """``fn()`` runs first in every ``release_all()`` (the state other modules keep of
    the bindings)."""
    _teardown_hooks.append(fn)


def _retire(w: Window, live: list[torch.Tensor]) -> None:
    """Keep ``w`` (and count it) until every tensor in ``live`` is gone."""
    key = id(w)
    _retired[key] = w
    left = [len(live)]

    def one_gone():
        with _lock:
            left[0] -= 1
            if left[0] == 0:
                _retired.pop(key, None)

    for t in live:
        weakref.finalize(t, one_gone)


def release_all() -> None:
    """Forget every pool and binding (teardown). Call ``torch.cuda.synchronize()`` and a
    barrier first so no peer is still reading. Windows still viewed by live parameters stay
    allocated (and counted) until those die (NOTE [window lifetime]); shared-memory names
    are unlinked at open time, so nothing of ours stays in /dev/shm."""
    with _lock:
        for fn in list(_teardown_hooks):
            try:
                fn()
            except Exception as e:  # teardown must not mask the caller's exception
                log.warning("torch_ce: teardown hook failed: %s", e)
        by_window: dict[int, list[torch.Tensor]] = {}
        for s in W.bound_slots():
            t = s.ref() if s.ref is not None else None
            if t is not None:
                by_window.setdefault(id(s.window), []).append(t)
        for pool in pools().values():
            for w in pool.windows:
                if id(w) in by_window:
                    _retire(w, by_window[id(w)])
        _pools.clear()
        _owned.clear()
        _deferred.clear()
        W.clear_registry()

