"""What ``torch_ce.fsdp2`` did, for ``explain()``: one row per FSDP2 param group.

A row holds the group's gathered bytes per all-gather (its chunk x group size, as NOTE
[coverage bytes] in torch_ce/report.py counts a gather), whether torch_ce serves it (and
how: in place, a cast slot, staged for training) or why FSDP2 keeps its own, the window
and offset of its chunk, and what its calls moved in this process. ``coverage`` is the
share of gathered bytes per step on the copy engines (each group counted once: every
group is gathered at least once per forward).
"""
from __future__ import annotations

import dataclasses


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
    reduce_scatter: str = ""  # "collective", "copy engine", or why not


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
    return r


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
