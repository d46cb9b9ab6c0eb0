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
from ..windows import WindowPool
from .gate import Seed


@dataclasses.dataclass
class PlannedShard:
    node: fx.Node  # the shard placeholder
    group_size: int
    group_name: str
    nbytes: int
    dtype: str
    window: int = 0  # predicted window number within its pool
    offset: int = 0  # predicted byte offset in that window


@dataclasses.dataclass
class Plan:
    seeds: list[Seed]  # eligible gathers, program order
    shards: list[PlannedShard]  # unique shards, program order of first gather
    pools: dict  # (group_name, dtype) -> list[PlannedShard]


def plan(seeds: list[Seed], cfg: Config) -> Plan:
    eligible = [s for s in seeds if s.eligible]
    shards: dict[fx.Node, PlannedShard] = {}
    for s in eligible:
        if s.shard not in shards:
            dtype = str(s.shard.meta["val"].dtype).replace("torch.", "")
            shards[s.shard] = PlannedShard(s.shard, s.group_size, s.group_name, s.nbytes, dtype)
    pools: dict[tuple, list[PlannedShard]] = {}
    for ps in shards.values():
        pools.setdefault((ps.group_name, ps.dtype), []).append(ps)
    for key, members in pools.items():
        placed = WindowPool(key, cfg.window_cap_bytes).plan_slots([m.nbytes for m in members])
        for m, (wi, off, _) in zip(members, placed):
            m.window, m.offset = wi, off
    return Plan(eligible, list(shards.values()), pools)
