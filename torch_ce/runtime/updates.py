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
            round: every rank raises, and the watches stay poisoned); each cast slot is
            refreshed from its weight (cast) on the current stream; the watches record
            the new versions;
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

log = logging.getLogger("torch_ce")


class UpdateError(RuntimeError):
    """``updating_weights`` did not complete on every rank of a group (a peer never entered
    it, or its block raised); raised on every rank that entered."""


def _locals(params) -> dict[int, list[torch.Tensor]] | None:
    """id(local shard) -> the tensors wrapping it (DTensor parameters), or None: every
    bound weight of this process."""
    if params is None:
        return None
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    elif isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, dict):
        params = list(params.values())
    out: dict[int, list[torch.Tensor]] = {}
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
        if w is None or id(slot) in seen or not w.refs:
            continue
        if mine(w.refs[0]()):
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
def updating_weights(params=None, *, timeout_s: float | None = None):
    """Update bound weights safely on every rank (NOTE [updating bound weights]).

    ``params``: a module, parameters (or a dict of them), or None for every weight bound
    in this process. Collective: every rank of each group whose windows hold them enters
    the block, and writes its own shards inside it (``load_state_dict``,
    ``dcp.load`` + ``set_state_dict``, ``copy_``, ``.data`` writes, a ``dist.broadcast``
    from another group). After it every rank's next call reads the new weights, exactly.
    ``timeout_s`` (default ``bind_arrival_timeout_s``): how long a rank waits for its
    peers to enter, and to finish, before ``UpdateError``.
    """
    watched, refresh, groups, wanted = _targets(params)
    if not groups:
        log.debug("torch_ce.updating_weights: no bound weight among these: nothing to fence")
        yield
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
    try:
        for rnd in rounds:
            rnd.exchange("exit", True)
    except BaseException as e:
        for slot in watched:
            versions.poison(slot, f"{e} (update again, on every rank)")
        raise
    with torch.no_grad():
        if refresh:
            torch._foreach_copy_([v for v, _ in refresh], [w for _, w in refresh])  # casts too
        for slot in watched:
            weight = slot.watch.refs[0]() if slot.watch.refs else None
            extra = wanted.get(id(weight), ()) if wanted is not None and weight is not None else ()
            versions.reset(slot, extra)
        staging.fence(fence_groups)  # fence 2: every rank's new values are in place
    prefetch.drop(on_current_stream=True)
