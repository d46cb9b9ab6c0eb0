"""The run-time bind step: what ``magi::ce_bind`` does when a compiled graph runs.

# NOTE [run-time bind]
Binding needs the live shards (a window must hold the weight itself), and a post-grad pass
does not run at all on an FX-graph-cache hit; a collective inside a compile pass would hang
when one rank hits the cache and another misses. So the passes only decide (from graph
facts identical on every rank) and insert one ``magi::ce_bind`` at the head of the graph.
Its first run agrees, opens windows, moves the shards and publishes them (one bind round, runtime/agreement.py); every
rank executes the same generated code, so the collectives line up. Later runs find every
shard already bound (or marked Fallback) and return after one lookup per shard.
"""
from __future__ import annotations

import logging

import torch

from .. import report
from . import windows as W
from .window_pools import on_release

log = logging.getLogger("torch_ce")


# Steps whose shards are all resolved, keyed by (names, first shard's address). Only
# recorded when that address is a window slot: unique while the windows live (a freed
# ordinary tensor's address can be reused by the next model's weight).
_done: set = set()
on_release(_done.clear)


def run_bind_step(shards, group_sizes, group_names, names, reasons=None, rows=()) -> None:
    if not shards:
        return
    report.count_call(report.step_key("bind", names, sum(s.numel() for s in shards)))  # NOTE [calls, not graphs] in report.py
    rows = list(rows) or [0] * len(shards)
    key = (tuple(names), shards[0].data_ptr())
    if key in _done:
        return
    from .binding import Candidate, bind_candidates, local_reason, resolved

    # Resolved by a bind round, empty shards included (NOTE [empty shards] in binding.py):
    # the same answer on every rank of the step.
    if all(resolved(s, rows=r) is not None for s, r in zip(shards, rows)):
        _remember(key, shards[0])
        return
    from .eligibility import Reason, decode, refusal

    resolve = torch._C._distributed_c10d._resolve_process_group
    cands = []
    reasons = reasons or [""] * len(shards)
    for t, gs, gname, name, why, nrows in zip(shards, group_sizes, group_names, names, reasons, rows):
        try:
            pg = resolve(gname)
        except RuntimeError as e:
            raise RuntimeError(
                f"torch_ce: the bind step of a compiled graph needs process group {gname!r} "
                f"(for {name}), which is not a live group on this rank (destroyed, or never "
                "created). Run compiled graphs before destroying their process groups."
            ) from e
        # A compile-time refusal still takes part in the agreement (as refused).
        reason = decode(why) if why else local_reason(t, pg, rows=nrows)
        if reason is None and pg.size() != gs:
            reason = refusal(Reason.GROUP_SIZE_MISMATCH, f"group size {pg.size()} != gather group size {gs}")
        cands.append(Candidate(name, t, pg, reason, rows=nrows))
    res = bind_candidates(cands)
    report.record_bind(res)
    _remember((tuple(names), shards[0].data_ptr()), shards[0])


def _remember(key, first) -> None:
    if isinstance(W.lookup(first), W.Slot):
        _done.add(key)
