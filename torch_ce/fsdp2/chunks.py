"""Binding FSDP2 chunks into the pooled windows, through the bind rounds every bind uses.

A group's chunk is one rank's FSDP2 all-gather input: its parameters' padded shards
(``_sharded_param_data``), concatenated, cast to ``param_dtype`` when there is one. One
bind round (``runtime.binding.bind_candidates``: agree, place, open, move, publish) binds
every served group of the model; each group becomes one slot, so a gather is one read per
peer. What the slot holds:

- static, in place (no cast): the chunk itself. The bind moves it into the window, then
  each parameter's padded shard and DTensor local tensor are re-pointed at their part of
  it (as FSDP2's own ``reset_sharded_param`` re-points them), so the weights live in the
  window once and peers read them where they are. Their views share the chunk's version
  counter, so the version net sees every in-place write of any of them.
- static, cast (``param_dtype``): a cast copy of the chunk, made once (NOTE [cast slots] in
  runtime/staging.py); the weights stay where they are, watched by the net, and
  ``updating_weights`` refreshes the copy (fsdp2/updates.py).
- staged (training): a staging buffer that each call refreshes from FSDP2's own input, and
  two step words beside it in their own slot (NOTE [FSDP2 training: step words]).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from .. import report
from ..runtime import versions
from ..runtime import windows as W
from ..runtime.binding import Candidate, bind_candidates, local_reason
from .groups import Group

log = logging.getLogger("torch_ce")


@dataclasses.dataclass(eq=False)
class Bound:
    """What a served group reads: its chunk's ``slot`` (peers' copies in
    ``slot.peer_views``), this rank's ``buffer`` (the chunk's local view), and for a
    staged group its ``words`` slot (this rank's two words in ``words.peer_views``)."""

    slot: W.Slot
    buffer: torch.Tensor
    words: W.Slot | None = None


def _fill(buffer: torch.Tensor, group: Group) -> None:
    """``buffer`` <- the group's chunk (cast like FSDP2's ``_to_dtype_if_needed``)."""
    off = 0
    with torch.no_grad():
        for fp in group.fsdp_params:
            n = fp._sharded_param_data.numel()
            buffer[off:off + n].copy_(fp._sharded_param_data)
            off += n


def refresh(group: Group, bound: Bound) -> None:
    """A cast chunk's slot <- the weights now (``updating_weights``' exit)."""
    _fill(bound.buffer, group)


def _repoint(group: Group, chunk: torch.Tensor) -> None:
    """Each parameter's padded shard and local tensor now view their part of ``chunk``
    (which views the window): what FSDP2's ``reset_sharded_param`` does when it re-pads."""
    off = 0
    for fp in group.fsdp_params:
        n = fp._sharded_param_data.numel()
        padded = chunk[off:off + n]
        local = fp._sharded_local_tensor
        dim = fp.fsdp_placement.dim
        length = local.size(dim) if local.numel() > 0 else 0
        fp._sharded_param_data = padded
        fp.sharded_param._local_tensor = padded.view(fp.padded_sharded_param_size).narrow(dim, 0, length)
        off += n


def _watch(group: Group, bound: Bound) -> None:
    """The version net's watch of a static group (NOTE [the version net]): the weights'
    counters (the chunk's, shared by the views of an in-place chunk; a cast chunk's
    weights' own), the DTensor parameters', their state dicts'; named by the parameters'
    local tensors and the module to ``updating_weights``."""
    fps = group.fsdp_params
    wrappers = [fp.sharded_param for fp in fps]
    locals_ = [fp._sharded_local_tensor for fp in fps]
    tensors = [] if not group.cast else [fp._sharded_param_data for fp in fps] + locals_
    versions.watch_members(bound.slot, owners=wrappers, members=[*locals_, *wrappers, group.module],
                           tensors=tensors)


def bind(groups: list[Group]) -> dict[int, Bound]:
    """Bind every served group (one round; collective over each group's ranks, every rank
    calls it with the same groups in the same order). A candidate the agreement refuses
    (on any rank) leaves its group on FSDP2's all-gather, with the reason, on every rank.
    Returns ``Bound`` by ``id(group)``."""
    cands: list[Candidate] = []
    made: dict[int, tuple] = {}
    for g in groups:
        name = f"fsdp2:{g.name}"
        if g.reason:  # a rank that refused it lists fewer candidates: its peers' agreement refuses them too
            continue
        device = g.fsdp_params[0]._sharded_param_data.device
        chunk = torch.empty(g.numel, dtype=g.dtype, device=device)
        if g.mode == "static":
            _fill(chunk, g)
        else:
            chunk.zero_()
        c = Candidate(name, chunk, g.process_group, local_reason(chunk, g.process_group),
                      owners=[fp.sharded_param for fp in g.fsdp_params] if g.mode == "static" else [])
        cands.append(c)
        words = None
        if g.mode == "staged":
            wt = torch.zeros(2, dtype=torch.int64, device=device)
            words = Candidate(f"{name}/step words", wt, g.process_group,
                              local_reason(wt, g.process_group, min_shard_bytes=0))
            cands.append(words)
        made[id(g)] = (c, words)
    if not made:
        return {}
    res = bind_candidates(cands)
    report.record_bind(res)
    out: dict[int, Bound] = {}
    for g in groups:
        if id(g) not in made:
            continue
        c, words = made[id(g)]
        slot = W.lookup(c.tensor)
        wslot = W.lookup(words.tensor) if words is not None else None
        if not isinstance(slot, W.Slot) or (words is not None and not isinstance(wslot, W.Slot)):
            g.reason = res.skipped.get(c.name) or (res.skipped.get(words.name) if words else "") \
                or "not bound"
            g.mode = ""
            continue
        b = Bound(slot, c.tensor, wslot)
        if g.mode == "static":
            if not g.cast:
                _repoint(g, c.tensor)
            _watch(g, b)
        else:
            slot.watch = None  # refreshed every call: nothing for the net to see
            wslot.watch = None
        out[id(g)] = b
    return out
