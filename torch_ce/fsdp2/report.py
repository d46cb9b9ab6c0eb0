"""What ``torch_ce.fsdp2`` did, for ``explain()``: one row per FSDP2 param group.

A row holds the group's gathered bytes per all-gather (its chunk x group size, as NOTE
[coverage bytes] in torch_ce/report.py counts a gather), whether torch_ce serves it (and
how: in place, a cast slot, staged for training) or why FSDP2 keeps its own, the window
and offset of its chunk, and what its calls moved in this process. ``coverage`` is the
share of gathered bytes per step on the copy engines (each group counted once: every
group is gathered at least once per forward). ``totals`` is what the calls moved (NOTE
[FSDP2 bytes as run]).

# NOTE [FSDP2 bytes as run]
FSDP2 gathers a group more than once per step: in the forward, again in the backward
(``reshard_after_forward``), and ahead of time (its prefetches), and it reduce-scatters
each group's gradients once per backward. So besides the static rows (each group's
gathered bytes once), every group of an enabled model counts what its calls moved, from
``enable()`` on: the all-gathers torch_ce serves (``comm.served``: each call's output
bytes), FSDP2's own all-gathers of a group torch_ce does not serve (a pass-through around
FSDP2's comm, or the user's, counts them: ``CountingComm``), and the reduce-scatters'
input bytes (the copy-engine protocol's own accounting, ``runtime.reduce_scatter.served``,
from enable() on; FSDP2's collective counted like its all-gathers). ``totals(rows)`` sums
them, on the copy engines and on the collective by reason; a step's bytes are the
difference across it. A disabled model's rows keep what was counted until ``disable``.
"""
from __future__ import annotations

import dataclasses
import sys

import torch


@dataclasses.dataclass
class GroupRow:
    """One FSDP2 param group of an enabled model."""

    module: str  # the fully_shard'ed module's name ("<root>" for the model itself)
    params: int  # parameters in the group
    gathered_bytes: int  # one all-gather's output bytes (0: not known, refused before)
    status: str  # "bound" | "refused" | "disabled"
    how: str = ""  # "in place" | "cast slot (bfloat16)" | "staged (training)"
    reason: str = ""  # why FSDP2 keeps its own all-gather
    window: int | None = None
    offset: int | None = None
    calls: int = 0  # all-gathers served so far in this process
    served_bytes: int = 0
    no_grad_calls: int = 0  # of a training group: those under no_grad / inference_mode
    reduce_scatter: str = ""  # "collective", "copy engine", or why not
    # NOTE [FSDP2 bytes as run]: FSDP2's own all-gathers of the group since enable() (its
    # output bytes), and its reduce-scatters (input bytes) on the copy engines and not.
    collective_calls: int = 0
    collective_bytes: int = 0
    rs_calls: int = 0
    rs_ce_bytes: int = 0
    rs_collective_bytes: int = 0
    rs_collective_reason: str = ""


@dataclasses.dataclass
class Counts:
    """What a group's calls of a comm moved (NOTE [FSDP2 bytes as run])."""

    calls: int = 0
    bytes: int = 0


class CountingComm:
    """FSDP2's own comm of a group (or the user's), counted on its way through (NOTE
    [FSDP2 bytes as run]): ``which`` "all_gather" counts each call's output bytes,
    "reduce_scatter" its input bytes. ``disable()`` puts ``inner`` back."""

    def __init__(self, inner, counts: Counts, which: str):
        self.inner, self.counts, self.which = inner, counts, which

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, *args, **kwargs):
        ag = self.which == "all_gather"
        t = kwargs.get("output_tensor" if ag else "input_tensor")
        if t is None:
            t = args[0 if ag else 1]
        self.counts.calls += 1
        self.counts.bytes += t.numel() * t.element_size()
        return self.inner(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.which}, {self.inner!r})"


def _rs_served(group):
    """The copy-engine reduce-scatter's accounting of ``group`` since enable(): (calls,
    ce bytes, collective bytes, reason), or None where it is not installed."""
    base = getattr(group, "rs_base", None)
    RS = sys.modules.get("torch_ce.runtime.reduce_scatter")
    if base is None or RS is None:
        return None
    s = RS.served.get(f"fsdp2 {group.name}")
    if s is None:
        return (0, 0, 0, "")
    return (s.calls - base[0], s.ce_bytes - base[1], s.collective_bytes - base[2], s.reason)


def row(group, bound, comm, disabled: bool = False) -> GroupRow:
    r = GroupRow(group.name, len(group.fsdp_params), group.gathered_bytes,
                 "refused" if group.reason else ("disabled" if disabled else "bound"),
                 reason=group.reason, reduce_scatter=group.rs_reason)
    if bound is not None:
        r.window, r.offset = bound.slot.window.index, bound.slot.offset
        dt = str(group.dtype).removeprefix("torch.")
        r.how = ("staged (training)" if group.mode == "staged" else
                 f"cast slot ({dt})" if group.cast else "in place")
    if comm is not None:
        r.calls, r.served_bytes = comm.served.calls, comm.served.bytes
        r.no_grad_calls = comm.served.no_grad_calls
    ag, rs = getattr(group, "ag_counts", None), getattr(group, "rs_counts", None)
    if ag is not None:
        r.collective_calls, r.collective_bytes = ag.calls, ag.bytes
        if not r.gathered_bytes and ag.calls:  # refused before its chunk was sized: as FSDP2 ran it
            r.gathered_bytes = ag.bytes // ag.calls
    served = _rs_served(group)
    if served is not None:
        r.rs_calls, r.rs_ce_bytes, r.rs_collective_bytes, r.rs_collective_reason = served
    elif rs is not None:
        r.rs_calls, r.rs_collective_bytes = rs.calls, rs.bytes
    return r


def totals(rows: list[GroupRow]) -> dict:
    """What the calls of these groups moved since enable() (NOTE [FSDP2 bytes as run]):
    all-gather output bytes and reduce-scatter input bytes, on the copy engines and on
    the collective by reason."""
    ag_by: dict = {}
    rs_by: dict = {}
    for r in rows:
        if r.collective_bytes:
            why = r.reason or "fsdp2.disable()"
            ag_by[why] = ag_by.get(why, 0) + r.collective_bytes
        if r.rs_collective_bytes:
            why = (r.rs_collective_reason or (r.reduce_scatter if r.reduce_scatter not in ("", "copy engine")
                                              else "FSDP2's reduce-scatter (enable(reduce_scatter='collective'))"))
            rs_by[why] = rs_by.get(why, 0) + r.rs_collective_bytes
    return dict(
        all_gather=dict(calls=sum(r.calls + r.collective_calls for r in rows),
                        ce_bytes=sum(r.served_bytes for r in rows),
                        collective_bytes=sum(ag_by.values()), by_reason=ag_by),
        reduce_scatter=dict(calls=sum(r.rs_calls for r in rows), ce_bytes=sum(r.rs_ce_bytes for r in rows),
                            collective_bytes=sum(rs_by.values()), by_reason=rs_by))


def coverage(rows: list[GroupRow]) -> dict:
    """Gathered bytes per step on the copy engines and on FSDP2's collective, by reason."""
    ce = sum(r.gathered_bytes for r in rows if r.status == "bound")
    by_reason: dict = {}
    for r in rows:
        if r.status != "bound":
            why = r.reason or "fsdp2.disable()"
            by_reason[why] = by_reason.get(why, 0) + r.gathered_bytes
    coll = sum(by_reason.values())
    return dict(ce_bytes=ce, collective_bytes=coll, by_reason=by_reason,
                share=ce / (ce + coll) if ce + coll else None, groups=len(rows))


def lines(rows: list[GroupRow]) -> list[str]:
    """The rows as ``explain().table()`` prints them."""
    if not rows:
        return []
    width = max(24, *(len(r.module) for r in rows))
    out = [f"fsdp2: {sum(r.status == 'bound' for r in rows)} of {len(rows)} param group(s) "
           "gathered on the copy engines"]
    for r in rows:
        head = f"  {r.status:<8} {r.module:<{width}} {r.params:>3} param(s) {r.gathered_bytes:>12,d} B"
        rs = f"; reduce-scatter: {r.reduce_scatter}" if r.reduce_scatter else ""
        if r.status == "refused":
            out.append(f"{head}  {r.reason}{rs}")
        else:
            out.append(f"{head}  {r.how}, window {r.window} @ {r.offset}, {r.calls} call(s){rs}")
    tot = totals(rows)
    for what, t in (("all-gather", tot["all_gather"]), ("reduce-scatter", tot["reduce_scatter"])):
        if t["calls"]:
            out.append(f"fsdp2 as run: {t['calls']} {what}(s) since enable(), "
                       f"{t['ce_bytes'] + t['collective_bytes']:,d} B, {t['ce_bytes']:,d} B on the copy "
                       "engines" + "".join(
                           f"; {nb:,d} B {why}" for why, nb in
                           sorted(t["by_reason"].items(), key=lambda kv: -kv[1])))
    hint = inference_hint(rows)
    if hint:
        out.append(hint)
    cov = coverage(rows)
    if cov["share"] is None:
        out.append("fsdp2 coverage: no gathered bytes")
    else:
        out.append(f"fsdp2 coverage: {100 * cov['share']:.1f}% of "
                   f"{cov['ce_bytes'] + cov['collective_bytes']:,d} gathered B per step on the copy "
                   f"engines ({cov['ce_bytes']:,d} B)" + "".join(
                       f"; {nb:,d} B {why}" for why, nb in
                       sorted(cov["by_reason"].items(), key=lambda kv: -kv[1])))
    return out


def inference_hint(rows: list[GroupRow]) -> str:
    """One line for training groups that were only ever gathered with grad off: a model
    whose parameters require grad (as ``from_pretrained`` leaves them) run only under
    ``no_grad`` / ``inference_mode`` / ``generate()`` pays a staging copy and the step
    words per call that static weights do not ("" where none)."""
    idle = [r for r in rows if r.status == "bound" and r.how == "staged (training)" and r.calls
            and r.no_grad_calls == r.calls]
    if not idle:
        return ""
    return (f"fsdp2 hint: {len(idle)} training group(s) were gathered only under no_grad / "
            f"inference_mode ({sum(r.calls for r in idle)} call(s)): their parameters require grad "
            "(from_pretrained leaves them so). For inference, model.requires_grad_(False) after "
            "loading (before fully_shard), or fsdp2.enable(model, weights=\"static\"), reads them "
            "as static weights: no staging copy or step words per call")

