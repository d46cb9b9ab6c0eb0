"""Weights that change: ``updating_weights``, the protocol every rank runs around an update
of bound weights (NOTE [updating bound weights]).

# NOTE [updating bound weights]
Gathers read peers' windows one-sidedly, with no per-call barrier. An inference weight
bound in place *is* its window, and a cast slot is a copy of it made once, so a write
races with every peer's reads: a peer may read this rank's new values while its own are
old, or old values after this rank moved on (an RL weight sync, a hot reload, an eval
of another checkpoint). ``with updating_weights(model):`` makes an update as safe as with
NCCL. Per group whose windows hold the weights, in one order on every rank (sorted by
ranks, as binds):

  enter     a store exchange: every rank has arrived (a peer that never does is an
            ``UpdateError`` naming it within ``timeout_s``, before any collective that
            could hang); this rank's parked prefetch is waited on the current stream and
            dropped; every watch is poisoned (a gather inside the block raises);
  fence 1   a one-element all_reduce on the current stream: every rank's earlier reads
            are complete (every CE gather's output is waited on by its consumer's
            stream, NOTE [training: staged windows and step fences] in staging.py), so no
            peer still reads what the block writes;
  the block the caller writes its weights, any way at all, on its current stream (or
            waits for what wrote them: a ``dist.broadcast`` returns ordered);
  exit      a store exchange: every rank finished its block (one that raised aborts the
            round: every rank raises, and the watches stay poisoned); each in-place
            weight the block gave new storage goes back into its slot (NOTE [a weight
            re-pointed inside the protocol]); each cast slot is refreshed from its
            weight (cast) on the current stream; the watches record the new versions;
  fence 2   every rank's writes and refreshes precede any peer's next read.

On CUDA the fences are stream-ordered, NCCL's (no host synchronization, capturable: under
a CUDA-graph capture the exchanges run once, at capture, and the fences and refreshes are
captured); on CPU (gloo, host transport) reads are synchronous and the fences block.
Training graphs' staging slots are refreshed between their own step fences at the next
training forward, so a rollback (model and optimizer state loaded inside the block) trains
on as a fresh run from that checkpoint does; the protocol only fences their groups.
"""
from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist

from ..config import config
from . import prefetch, staging, versions
from . import windows as W
from .agreement import Round
from .session import PeerError

log = logging.getLogger("torch_ce")


# fn(wanted) after the exit exchange, before the watches take the new versions and fence
# 2: what holds copies of weights outside the slots refreshes them (fsdp2/updates.py: an
# FSDP2 group's cast chunk, its unsharded parameters). ``wanted``: _locals(params).
_exit_hooks: list = []


def on_exit(fn) -> None:
    _exit_hooks.append(fn)


def _run_exit_hooks(wanted) -> None:
    for fn in list(_exit_hooks):
        fn(wanted)


class UpdateError(PeerError):
    """``updating_weights`` did not complete on every rank of a group (a peer never entered
    it, or its block raised); raised on every rank that entered."""


def _locals(params) -> dict[int, list[torch.Tensor]] | None:
    """id(local shard) -> the tensors wrapping it (DTensor parameters), or None: every
    bound weight of this process."""
    if params is None:
        return None
    modules = []
    if isinstance(params, torch.nn.Module):
        modules = list(params.modules())
        params = list(params.parameters())
    elif isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, dict):
        params = list(params.values())
    out: dict[int, list[torch.Tensor]] = {}
    for m in modules:  # a slot may be named by the module that holds its weights (Watch.members)
        out.setdefault(id(m), [])
    for p in params:
        local = getattr(p, "_local_tensor", None)
        if local is not None:
            out.setdefault(id(local), []).append(p)
        else:
            out.setdefault(id(p), [])
    return out


def _targets(params):
    """(watched slots, cast refreshes [(view, weight)], fence groups) of ``params``."""
    wanted = _locals(params)

    def mine(t) -> bool:
        return t is not None and (wanted is None or id(t) in wanted)

    watched, seen = [], set()
    for slot in W.bound_slots():
        w = slot.watch
        if w is None or id(slot) in seen:
            continue
        if mine(w.weight()) or any(mine(m()) for m in w.members):
            seen.add(id(slot))
            watched.append(slot)
    refresh = []
    for ref, entry, view, _ in list(W._cast.values()):
        weight = ref()
        if isinstance(entry, W.Slot) and view is not None and mine(weight):
            refresh.append((view, weight))
            if id(entry) not in seen:
                seen.add(id(entry))
                watched.append(entry)
    groups: dict[tuple, tuple] = {}
    for slot in watched:
        win = slot.window
        groups.setdefault((win.group_ranks, str(win.device)), (win.group, win.device))
    for ref, entry, _ in list(W._staged.values()):
        if isinstance(entry, W.Slot) and mine(ref()):
            win = entry.window
            groups.setdefault((win.group_ranks, str(win.device)), (win.group, win.device))
    return watched, refresh, [(k, groups[k]) for k in sorted(groups)], wanted


@contextlib.contextmanager
def _protocol(params=None, *, timeout_s: float | None = None):
    """Update bound weights safely on every rank (NOTE [updating bound weights]).

    ``params``: a module, parameters (or a dict of them), or None for every weight bound
    in this process. Collective: every rank of each group whose windows hold them enters
    the block, and writes its own shards inside it (``load_state_dict``,
    ``dcp.load`` + ``set_state_dict``, ``copy_``, ``.data`` writes, a ``dist.broadcast``
    from another group). After it every rank's next call reads the new weights, exactly.
    ``timeout_s`` (default ``bind_arrival_timeout_s``): how long a rank waits for its
    peers to enter, and to finish, before ``UpdateError`` (a collective of the caller's
    inside the block is bounded by its own group's timeout).
    """
    watched, refresh, groups, wanted = _targets(params)
    if not groups:
        log.debug("torch_ce.updating_weights: no bound weight among these: nothing to fence")
        yield
        with torch.no_grad():
            _run_exit_hooks(wanted)
        return
    t = float(config.bind_arrival_timeout_s if timeout_s is None else timeout_s)
    me = dist.get_rank()
    rounds = [Round(ranks, me, t, t, what="update", error=UpdateError,
                    timeout_names=("timeout_s", "timeout_s")) for (ranks, _), _ in groups]
    fence_groups = [g for _, g in groups]
    inside = ("torch_ce.updating_weights is open on this rank (the update is not complete "
              "on every rank yet): leave the block before running the model")
    for slot in watched:
        versions.poison(slot, inside)
    try:
        for rnd in rounds:
            rnd.exchange("enter", True)
    except BaseException as e:
        for slot in watched:
            versions.poison(slot, f"torch_ce.updating_weights failed: {e}")
        raise
    prefetch.drop(on_current_stream=True)  # its reads end before fence 1 in stream order
    with torch.no_grad():
        staging.fence(fence_groups)  # fence 1: no peer still reads the old values
    try:
        yield
    except BaseException as e:
        why = f"torch_ce.updating_weights: the update raised on rank {me}: {type(e).__name__}: {e}"
        for rnd in rounds:
            rnd.abort(why)
        for slot in watched:
            versions.poison(slot, why + " (update again, on every rank)")
        raise
    moved = _moved_off(watched)
    problem = _unhomeable(moved)
    if problem:
        why = f"torch_ce.updating_weights: rank {me}: {problem}"
        for rnd in rounds:
            rnd.abort(why)
        for slot in watched:
            versions.poison(slot, why + " (update again, on every rank)")
        raise UpdateError(why)
    try:
        for rnd in rounds:
            rnd.exchange("exit", True)
    except BaseException as e:
        for slot in watched:
            versions.poison(slot, f"{e} (update again, on every rank)")
        raise
    with torch.no_grad():
        _rehome(moved)
        W.follow_moved_weights()
        if refresh:
            torch._foreach_copy_([v for v, _ in refresh], [w for _, w in refresh])  # casts too
        _run_exit_hooks(wanted)
        for slot in watched:
            weight = slot.watch.weight()
            extra = wanted.get(id(weight), ()) if wanted is not None and weight is not None else ()
            versions.reset(slot, extra)
        staging.fence(fence_groups)  # fence 2: every rank's new values are in place
    prefetch.drop(on_current_stream=True)



_open = [0]  # updating_weights blocks open on this rank


def is_open() -> bool:
    """Whether this rank is inside ``updating_weights`` (an eager gather there, such as
    the one ``get_model_state_dict`` makes by reading a SimpleFSDP weight's attribute,
    keeps the collective: the windows are being written)."""
    return _open[0] > 0


@contextlib.contextmanager
def updating_weights(params=None, *, timeout_s: float | None = None):
    _open[0] += 1
    try:
        with _protocol(params, timeout_s=timeout_s):
            yield
    finally:
        _open[0] -= 1


updating_weights.__doc__ = _protocol.__doc__

# NOTE [a weight re-pointed inside the protocol]
# ``p._local_tensor.data = new`` (or ``p.to_local().data = new``) inside the block gives
# the weight other storage: its slot no longer holds it, and the next call would bind it
# again (a new slot each update, the old one never freed) or find it unbound. At the exit,
# before the exchange, each in-place weight the block re-pointed is checked (the same
# dtype, the slot's shape; a padded slot's trailing dims and at most its rows): one that
# does not fit aborts the update on every rank. After the exchange its new values are
# copied into its slot and it is pointed back there (what the bind did), so the window
# holds it as before and nothing grows; a cast or staging slot's weight keeps its new
# storage, and its entry follows it (``windows.follow_moved_weights``).
def _moved_off(watched) -> list:
    """(slot, weight) of the in-place and padded weights no longer in their slots."""
    cast = {id(e) for _, e, _, _ in list(W._cast.values())}
    out = []
    for slot in watched:
        weight = slot.watch.weight()
        if weight is None or id(slot) in cast or W.lookup(weight) is slot:
            continue
        hit = W.padded(weight)
        if isinstance(hit, tuple) and hit[0] is slot:
            continue
        out.append((slot, weight))
    return out


def _unhomeable(moved) -> str:
    for slot, weight in moved:
        rows_ok = (tuple(weight.shape) == slot.shape if not W.is_padded_slot(slot) else
                   tuple(weight.shape[1:]) == slot.shape[1:] and weight.shape[0] <= slot.shape[0])
        if weight.dtype != slot.dtype or not rows_ok:
            return (f"{slot.name or 'a weight'} was given new storage of {tuple(weight.shape)} "
                    f"{weight.dtype} inside the block, where its window slot holds "
                    f"{slot.shape} {slot.dtype}: a bound weight keeps its shape and dtype")
    return ""


def _rehome(moved) -> None:
    """Copy each re-pointed weight into its slot and point it back there."""
    from .transports import transport

    for slot, weight in moved:
        w = slot.window
        # What the bind pointed it at (a window without a transport handle: a test's
        # loopback slot, whose own view is its peer view).
        full = transport(w.device).slot_local_view(slot) if w.handle is not None else slot.peer_views[w.rank]
        home = full[:weight.shape[0]] if W.is_padded_slot(slot) else full
        home.copy_(weight)
        if home.shape[0] < full.shape[0]:
            full[home.shape[0]:].zero_()
        weight.data = home
        log.debug("torch_ce.updating_weights: %s re-pointed into its slot", slot.name)
