"""The run-time stage step of training graphs: what ``magi::ce_stage`` and
``magi::ce_staged`` do.

# NOTE [training: staged windows and step fences]
In a training step a weight changes (the optimizer writes each rank's shard in place) and
may be read in a compute dtype (mixed precision casts each shard before it is gathered).
Peers read one-sidedly, whenever they gather, so two hazards exist for a window that holds
a weight: a peer reads it before its owner's optimizer has written this step's values
(read after write), or an owner overwrites it while a peer still reads it for the last
step's backward (write after read).

So a training graph never binds the weight itself. Each gathered weight gets a *staging
slot* in a window, in the dtype the graph gathers (the weight's own, or the
``param_dtype`` cast), and the gathers read the slots. Only this step writes a slot, at
the head of each training forward, in one pass between two fences over the slot's group:

    fence 1   every rank has finished every read of the slots it issued before this
              forward (the last backward's gathers, an earlier forward's);
    refresh   each slot <- its weight (cast), on the current stream;
    fence 2   every rank has refreshed: this step's values are in every slot.

A backward graph's stage step only returns the slots (its forward refreshed them this
step). Why that suffices, whatever the ranks' relative speeds:
- Read after write: a peer reads slot s in step t only after its fence 2 of step t, which
  completes only after every owner's refresh of step t, which runs after the owner's own
  optimizer step t-1 in program order (the forward of step t starts after it). An
  optimizer step inside backward hooks, gradient accumulation (several forwards per
  optimizer step: each refreshes, the values are the same) and frozen weights change
  nothing: the optimizer never writes a slot, and the refresh reads the weight after
  whatever wrote it on this rank.
- Write after read: an owner overwrites slot s only after its fence 1 of step t, which
  completes only after every peer reached its forward of step t, i.e. after every read
  the peer issued in step t-1 (all of them precede that forward in program order).
- On CUDA each fence is a one-element all_reduce on the current stream (NCCL's stream
  waits for it, and the current stream waits for NCCL). Every CE gather's output is
  waited on by the consumer's stream (``wait_tensor``), so a rank's fence is ordered after
  the copies it issued; the refresh is ordered after fence 1 and before fence 2 on the
  same stream. No host sync. On CPU (host transport) reads are synchronous memcpys and the
  fence is a gloo all_reduce.
Inference graphs keep binding in place with no fences (their weights are static). A
weight that a training graph stages is refused in place by later inference binds
(``Reason.TRAINED_WEIGHT``); a weight already bound in place cannot be staged (an error:
the optimizer would write a window peers read without a fence).

Cost: two tiny all_reduces per training forward per group, one device copy of the shard
bytes (in param_dtype), and the staging memory: one slot per gathered weight and dtype,
i.e. the local shard's numel x param_dtype's size (+50% of fp32 sharded parameters with
bf16 param_dtype, +100% without mixed precision), plus the windows' growth slack
(NOTE [windows that pool]).

# NOTE [cast slots]
An inference graph of fp32 weights under ``MixedPrecisionPolicy(param_dtype=bf16)`` casts
each shard before gathering it. Its weights are static, so the cast is made once: the
graph's stage step (``static``: never refreshed, no fences) binds a *cast slot* per weight
and dtype, the param_dtype copy of the shard in a window, exactly like a training graph's
staging slot that is never refreshed, and the gathers read it (the graph's cast goes). The
fp32 weight stays where it is, so this costs the shard once more in param_dtype (+50% of
the fp32 sharded bytes with bf16); the bind record says how much (``cast_slot_bytes``, in
``explain()``). ``config.cast_slots=False`` (``TORCH_CE_CAST_SLOTS=0``) turns it off: such
gathers stay on the collective ("cast before gather").

Weights that change: the slot was copied at bind, so the fp32 weight changes only inside
``torch_ce.updating_weights`` (NOTE [updating bound weights] in updates.py), whose exit
refreshes the slot on the current stream between its fences; a write outside it that a
version counter shows raises at the next read (NOTE [the version net] in versions.py).
A weight that a training graph stages is refused a cast slot (its staging slot
is refreshed by training forwards only, and an eval forward between steps must see this
step's values): such gathers stay on the collective, on every rank alike.

``unsafe_no_step_fence()`` skips both fences inside its block. It exists for the test that
shows the fences are needed (a delayed rank then reads stale weights); never use it otherwise.
"""
from __future__ import annotations

import contextlib
import logging
import weakref

import torch
import torch.distributed as dist

from . import versions
from . import windows as W
from .window_pools import on_release

log = logging.getLogger("torch_ce")

# One-element fence tensors, per device.
_flags: dict = {}
on_release(_flags.clear)


_no_step_fence = False  # only unsafe_no_step_fence() sets it


@contextlib.contextmanager
def unsafe_no_step_fence():
    """Skip both step fences inside the block, in this process (every rank enters it
    itself): the negative control of test/test_training_host.py, where a delayed peer then
    reads stale slots. Never for anything else."""
    global _no_step_fence
    old, _no_step_fence = _no_step_fence, True
    try:
        yield
    finally:
        _no_step_fence = old


def fences_disabled() -> bool:
    return _no_step_fence


def fence(groups: list) -> None:
    """Every rank of each group has reached this point in stream order (a one-element
    all_reduce on the current stream; host-blocking only on gloo)."""
    if fences_disabled():
        return
    for pg, device in groups:
        flag = _flags.get(device)
        if flag is None:
            flag = _flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
        dist.all_reduce(flag, group=pg)


def _bind_new(params, dtypes, group_sizes, group_names, names, reasons, rows=None,
              static=False) -> None:
    """One bind round for the weights that have no staging entry yet (agreed by every rank).
    ``static``: cast slots of an inference graph (NOTE [cast slots])."""
    from .. import report
    from .binding import Candidate, bind_candidates, local_reason
    from .eligibility import Reason, decode, refusal

    resolve = torch._C._distributed_c10d._resolve_process_group
    cands = []
    rows = list(rows or ()) or [0] * len(params)
    for p, d, gs, gname, name, why, nrows in zip(params, dtypes, group_sizes, group_names, names,
                                                 reasons, rows):
        try:
            pg = resolve(gname)
        except RuntimeError as e:
            raise RuntimeError(
                f"torch_ce: the stage step of a compiled training graph needs process group "
                f"{gname!r} (for {name}), which is not a live group on this rank") from e
        if not static and isinstance(W.lookup(p), W.Slot):  # identical on every rank: no exchange needed
            raise RuntimeError(
                f"torch_ce: {name} was bound in place by an inference graph (weights static "
                "from then on), and a training graph now gathers it: an optimizer step would "
                "write the window while peers read it. Run the training graphs before "
                "compiling inference graphs on the same weights, or keep inference on the "
                "collective (torch_ce.enable(training=...) / transport='nccl').")
        reason = decode(why) if why else local_reason(p, pg, stage_dtype=d, rows=nrows)
        if reason is None and static and W.is_staged(p):
            reason = refusal(Reason.TRAINED_WEIGHT,
                             "a training graph stages this weight (it changes every step): an "
                             "inference graph cannot read a cast slot made once")
        if reason is None and pg.size() != gs:
            reason = refusal(Reason.GROUP_SIZE_MISMATCH, f"group size {pg.size()} != gather group size {gs}")
        cands.append(Candidate(name, p, pg, reason, stage_dtype=d, rows=nrows, static=static))
    report.record_bind(bind_candidates(cands))


def _fence_groups(entries) -> list:
    """(group, device) of every slot, once each, in one order on every rank."""
    seen = {}
    for e in entries:
        if e is not None and isinstance(e[0], W.Slot):
            w = e[0].window
            seen.setdefault((w.group_ranks, str(w.device)), (w.group, w.device))
    return [seen[k] for k in sorted(seen)]


def run_stage_step(params, dtypes, group_sizes, group_names, names, reasons, refresh,
                   rows=(), static=False) -> None:
    """Bind the staging slots (first run), and when ``refresh`` (a training forward) fence,
    copy every weight (cast) into its slot, fence. ``static``: cast slots (NOTE [cast
    slots]), bound once, never refreshed."""
    from .. import report
    from .binding import resolved

    # NOTE [calls, not graphs] in report.py
    report.count_call(report.step_key("stage", names, sum(p.numel() for p in params), tuple(dtypes),
                                      bool(refresh), bool(static)))
    dts = [getattr(torch, d) for d in dtypes]
    if static:
        if any(resolved(p, d, static=True) is None for p, d in zip(params, dts)):
            _bind_new(params, dts, group_sizes, group_names, names, reasons, rows, static=True)
        return
    entries = [W.staged(p, d) for p, d in zip(params, dts)]
    # Empty shards too (NOTE [empty shards] in binding.py): every rank binds at the same call.
    if any(resolved(p, d) is None for p, d in zip(params, dts)):
        # First run (or a weight replaced since): bind; the bind's last exchange publishes
        # the copies it made, so a backward that binds needs no fence of its own.
        _bind_new(params, dts, group_sizes, group_names, names, reasons, rows)
        entries = [W.staged(p, d) for p, d in zip(params, dts)]
    if refresh:
        groups = _fence_groups(entries)
        with torch.no_grad():
            fence(groups)  # fence 1: no peer still reads last step's values
            pairs = [(e[1], p) for p, e in zip(params, entries) if e is not None and isinstance(e[0], W.Slot)]
            if pairs:
                torch._foreach_copy_([d for d, _ in pairs], [p for _, p in pairs])  # casts too
            fence(groups)  # fence 2: every slot holds this step's values


def staged_slots(params, dtypes, group_names, static=False) -> list[torch.Tensor]:
    """The staging slots of ``params`` (what the gathers read), after ``run_stage_step``
    (``static``: the cast slots)."""
    outs = []
    for p, dt, gname in zip(params, dtypes, group_names):
        d = getattr(torch, dt)
        if static:
            c = W.cast_slot(p, d)
            e = None if c is None else (c[0], c[1])
            if c is not None and isinstance(c[0], W.Slot):
                versions.check(c[0])  # NOTE [the version net] in versions.py
        else:
            e = W.staged(p, d)
        if e is not None and isinstance(e[0], W.Slot):
            outs.append(e[1])
            continue
        # Refused at run time (identically on every rank: agreed): a plain cast, gathered
        # by the collective (ops.gather sees the Fallback).
        fb = e[0] if e is not None else W.Fallback("not staged", gname)
        t = p.detach().to(d, copy=True)
        W.register(t, W.Fallback(fb.reason, fb.group_name, weakref.ref(t), fb.code))
        if not t.numel():  # no address to find it by (NOTE [empty shards] in binding.py)
            W.register_padded_fallback(t, W.Fallback(fb.reason, fb.group_name, weakref.ref(t), fb.code))
        outs.append(t)
    return outs
