"""Bucket: program-adjacent weight gathers of one group coalesce into one launch.

A run is a sequence of weight gathers with nothing but other gathers and their waits
between them (``to_local()`` waits right after each gather). It breaks at a group or dtype
change and at the size cap (``bucket_size_mib``); several bound gathers become one
``magi.ce_all_gather_coalesced`` (one copy-engine submission). Every other gather is a
bucket of one, left as it is (the report lists it as a collective).

# NOTE [refused gathers stay single]
Gathers the gate refused are never coalesced (each is a bucket of one). Whether a gather
is refused can differ across ranks (a rank-dependent config such as symm_min_shard_mib),
and a CE bucket whose binding was refused at run time falls back member by member
(ops.gather). One collective per gather, in program order, is the only sequence that
matches on every rank; a coalesced NCCL launch facing single fallback gathers on a peer
crashed gloo ("Received data size doesn't match") and would hang NCCL.

Before::

    %ag0 : magi.ce_all_gather(%w0, 2, '0')
    %ag1 : magi.ce_all_gather(%w1, 2, '0')
    ...  %wt0 : wait_tensor(%ag0) ... %wt1 : wait_tensor(%ag1)

After::

    %co : magi.ce_all_gather_coalesced([%w0, %w1], 2, '0')
    %g0 : getitem(%co, 0)
    %g1 : getitem(%co, 1)
    ...  %wt0 : wait_tensor(%g0) ... %wt1 : wait_tensor(%g1)

Each member's wait stays where it was.
"""
from __future__ import annotations

import dataclasses
import operator

import torch.fx as fx

from ..config import Config
from . import fx_utils as U
from .gate import Seed


@dataclasses.dataclass
class Bucket:
    members: list[Seed]
    bound: bool
    node: fx.Node | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.members)


def _key(s: Seed) -> tuple:
    if s.padded_rows:  # an uneven Shard(0) gather (magi.ce_all_gather_padded) stays single
        return ("padded", id(s))
    return (s.group_size, s.group_name, str(s.shard.meta["val"].dtype))


def _runs(graph: fx.Graph, seeds: list[Seed]) -> list[list[Seed]]:
    """Runs of gathers with nothing but gathers and waits between them."""
    by_node = {s.gather: s for s in seeds}
    runs, cur = [], []
    for n in graph.nodes:
        s = by_node.get(n)
        if s is not None:
            cur.append(s)
        elif cur and not U.is_wait(n):
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def plan_buckets(graph: fx.Graph, seeds: list[Seed], cfg: Config) -> list[Bucket]:
    """Split program-adjacent runs of weight gathers into buckets (no graph change)."""
    cap = cfg.bucket_cap_bytes
    buckets: list[Bucket] = []
    for run in _runs(graph, seeds):
        cur: list[Seed] = []
        for s in run:
            # NOTE [refused gathers stay single]: a refused gather neither joins nor takes.
            # A Shard(d) gather (NOTE [Shard(1) reads] in gate.py) stays single as well.
            if cur and (not s.eligible or not cur[-1].eligible or _key(s) != _key(cur[-1])
                        or s.gather_dim or cur[-1].gather_dim
                        or (cap and sum(m.nbytes for m in cur) + s.nbytes > cap)):
                buckets.append(Bucket(cur, cur[0].eligible))
                cur = []
            cur.append(s)
        if cur:
            buckets.append(Bucket(cur, cur[0].eligible))
    return buckets


def bucket(graph: fx.Graph, seeds: list[Seed], cfg: Config) -> list[Bucket]:
    """Coalesce each multi-member bucket in place; single members stay as they are."""
    return coalesce(graph, plan_buckets(graph, seeds, cfg))


def coalesce(graph: fx.Graph, buckets: list[Bucket]) -> list[Bucket]:
    """Each multi-member (all-bound) bucket becomes one ``ce_all_gather_coalesced`` before
    its first member's gather (every member's shard must exist there); single members
    stay as they are. Sets ``Bucket.node``."""
    for b in buckets:
        if len(b.members) < 2:
            b.node = b.members[0].gather
            continue
        first = b.members[0]  # a bucket of several is all-bound (NOTE [refused gathers stay single])
        with graph.inserting_before(first.gather):
            co = graph.call_function(
                U.magi.ce_all_gather_coalesced.default,
                ([s.shard for s in b.members], first.group_size, first.group_name),
            )
            co.meta["val"] = [s.gather.meta.get("val") for s in b.members]
        prev = co
        for i, s in enumerate(b.members):
            with graph.inserting_after(prev):
                item = graph.call_function(operator.getitem, (co, i))
            item.meta["val"] = s.gather.meta.get("val")
            s.gather.replace_all_uses_with(item)
            graph.erase_node(s.gather)
            s.gather = item
            prev = item
        b.node = co
    return buckets
