"""Plan: which weights the bind step lists, in program order.

The plan is a pure function of the gate's verdicts, so it is the same on every rank. It
decides no layout: the run-time bind places the agreed shards (NOTE [symmetric layout] in
runtime/windows.py), and explain() reads the real windows and offsets from there.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from .gate import Seed


@dataclasses.dataclass
class PlannedShard:
    node: fx.Node  # the shard placeholder
    group_size: int
    group_name: str
    reason: str = ""  # "" : eligible; else why this rank keeps its gathers on NCCL


@dataclasses.dataclass
class Plan:
    seeds: list[Seed]  # eligible gathers, program order
    shards: list[PlannedShard]  # every candidate weight, program order of first gather


def plan(seeds: list[Seed], whole_graph_refused: bool = False) -> Plan:
    """Candidates for the bind step: every weight a gather reads, eligible or not (a weight
    with one eligible gather is eligible)."""
    shards: dict[fx.Node, PlannedShard] = {}
    if not whole_graph_refused:
        for s in seeds:
            if s.weight is None:
                continue
            ps = shards.get(s.weight)
            if ps is None:
                # str(): the graph may carry only plain, rank-independent constants.
                shards[s.weight] = PlannedShard(s.weight, s.group_size, s.group_name,
                                                str(s.reason) if s.reason else "")
            elif s.eligible:
                ps.reason = ""
    return Plan([s for s in seeds if s.eligible], list(shards.values()))
