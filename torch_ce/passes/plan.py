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


@dataclasses.dataclass
class Plan:
    seeds: list[Seed]  # eligible gathers, program order
    shards: list[PlannedShard]  # every candidate weight, program order of first gather
    staged: bool = False  # a training graph: the weights are staged, not bound in place


def plan(seeds: list[Seed], whole_graph_refused: bool = False) -> Plan:
    """Candidates for the bind step: every weight a gather reads, eligible or not (a weight
    with one eligible gather is eligible)."""
    shards: dict[tuple, PlannedShard] = {}
    staged = any(s.stage_dtype is not None for s in seeds)
    if not whole_graph_refused:
        for s in seeds:
            if s.weight is None:
                continue
            # A training graph could gather one weight in two dtypes: one slot per dtype.
            dtype = str(s.stage_dtype).removeprefix("torch.") if staged else ""
            ps = shards.get((s.weight, dtype))
            if ps is None:
                # str(): the graph may carry only plain, rank-independent constants.
                shards[(s.weight, dtype)] = PlannedShard(
                    s.weight, s.group_size, s.group_name, encode(s.reason), dtype)
            elif s.eligible:
                ps.reason = ""
    return Plan([s for s in seeds if s.eligible], list(shards.values()), staged)
