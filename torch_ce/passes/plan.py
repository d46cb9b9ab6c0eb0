"""Plan: which weights the bind step lists, in program order.

The plan is a pure function of the gate's verdicts, so it is the same on every rank. It
decides no layout: the run-time bind places the agreed shards (NOTE [symmetric layout] in
runtime/windows.py), and explain() reads the real windows and offsets from there.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..runtime.eligibility import encode
from .gate import Seed


@dataclasses.dataclass
class PlannedShard:
    node: fx.Node  # the shard placeholder
    group_size: int
    group_name: str
    reason: str = ""  # "": eligible; else why this rank keeps its gathers on NCCL (eligibility.encode)
    dtype: str = ""  # training graphs: the staging slot's dtype ("bfloat16"); "": in place
    rows: int = 0  # an uneven Shard(0) weight: its padded slot's rows (the same on every rank)


@dataclasses.dataclass
class Plan:
    seeds: list[Seed]  # eligible gathers, program order
    shards: list[PlannedShard]  # every candidate weight, program order of first gather
    staged: bool = False  # a training graph: the weights are staged, not bound in place
    # An inference graph's cast gathers: their weights' cast slots (NOTE [cast slots] in
    # runtime/staging.py); the other weights of the graph are bound in place (``shards``).
    cast_shards: list[PlannedShard] = dataclasses.field(default_factory=list)


def plan(seeds: list[Seed], whole_graph_refused: bool = False) -> Plan:
    """Candidates for the bind step: every weight a gather reads, eligible or not (a weight
    with one eligible gather is eligible)."""
    shards: dict[tuple, PlannedShard] = {}
    casts: dict[tuple, PlannedShard] = {}
    staged = any(s.stage_dtype is not None and not s.cast_slot for s in seeds)
    if not whole_graph_refused:
        for s in seeds:
            if s.weight is None:
                continue
            # A training graph could gather one weight in two dtypes: one slot per dtype.
            dtype = str(s.stage_dtype).removeprefix("torch.") if staged or s.cast_slot else ""
            into = casts if s.cast_slot else shards
            ps = into.get((s.weight, dtype, s.padded_rows))
            if ps is None:
                # str(): the graph may carry only plain, rank-independent constants.
                into[(s.weight, dtype, s.padded_rows)] = PlannedShard(
                    s.weight, s.group_size, s.group_name, encode(s.reason), dtype, s.padded_rows)
            elif s.eligible:
                ps.reason = ""
    return Plan([s for s in seeds if s.eligible], list(shards.values()), staged, list(casts.values()))
