"""Plan: which shards the bind step moves, grouped into pools, with their predicted layout.

The plan is a pure function of the gate's verdicts, so it is the same on every rank. The
run-time bind places the shards with the same rule (``WindowPool.plan_slots``, NOTE
[symmetric layout] in windows.py); the predicted offsets here are for explain() and the
golden dumps.
"""
from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..config import Config
from .gate import Seed


@dataclasses.dataclass
class PlannedShard:
    node: fx.Node  # the shard placeholder
    group_size: int
    group_name: str
    nbytes: int
    dtype: str
    reason: str = ""  # "" : eligible; else why this rank keeps its gathers on NCCL
    window: int = 0  # predicted window number within its pool
    offset: int = 0  # predicted byte offset in that window


@dataclasses.dataclass
class Plan:
    seeds: list[Seed]  # eligible gathers, program order
    shards: list[PlannedShard]  # every candidate weight, program order of first gather
    pools: dict  # (group_name, dtype) -> list[PlannedShard] (eligible ones)


def plan(seeds: list[Seed], cfg: Config, whole_graph_refused: bool = False) -> Plan:
    """Candidates for the bind step: every weight a gather reads, eligible or not."""
    eligible = [s for s in seeds if s.eligible]
    shards: dict[fx.Node, PlannedShard] = {}
    if not whole_graph_refused:
        for s in seeds:
            if s.weight is None:
                continue
            ps = shards.get(s.weight)
            if ps is None:
                val = s.weight.meta["val"]
                dtype = str(val.dtype).replace("torch.", "")
                ps = shards[s.weight] = PlannedShard(
                    s.weight, s.group_size, s.group_name, s.nbytes, dtype, s.reason or ""
                )
            elif s.eligible:
                ps.reason = ""
    pools: dict[tuple, list[PlannedShard]] = {}
    for ps in shards.values():
        if not ps.reason:
            pools.setdefault((ps.group_name, ps.dtype), []).append(ps)
    return Plan(eligible, list(shards.values()), pools)
