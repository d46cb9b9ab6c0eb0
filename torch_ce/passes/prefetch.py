"""Prefetch: list the graph's first CE weights in one ``magi.ce_prefetch`` at its last launch.

NOTE [cross-call prefetch] in torch_ce/runtime/prefetch.py says why and what it costs. After
bucketing, the leading CE buckets of the graph's first CE group, in program order, are
taken while their gathered bytes stay within ``config.prefetch_next_call_mib``; their shards
go into one prefetch inserted right after the group's last CE launch (padded and
over-a-dim gathers included, which would otherwise drop the set), so at run time its
copies queue behind this call's own gathers and run under its last compute. The reorder
treats it as a launch like the gathers (it may move up, never ahead of an earlier launch).
Graphs compiled for CUDA graphs get none.

Before::

    %co0 : magi.ce_all_gather_coalesced([%w0, %w1], 2, '0')
    ...
    %ag7 : magi.ce_all_gather(%w7, 2, '0')
    ...

After::

    %co0 : magi.ce_all_gather_coalesced([%w0, %w1], 2, '0')
    ...
    %ag7 : magi.ce_all_gather(%w7, 2, '0')
    %ce_prefetch : magi.ce_prefetch([%w0, %w1], 2, '0')
    ...

Only rank-independent values go into the graph (shard placeholders, group size and name).
"""
from __future__ import annotations

import operator

import torch.fx as fx

from ..config import Config
from . import fx_utils as U
from .bucket import Bucket


def insert_prefetch(graph: fx.Graph, buckets: list[Bucket], cfg: Config) -> tuple[fx.Node | None, str]:
    """Insert the prefetch node; returns it (or None) and a one-line account."""
    import torch._inductor.config as ic

    cap = int(cfg.prefetch_next_call_mib * 2**20)
    if cap <= 0:
        return None, "off"
    if ic.triton.cudagraphs:  # part of the FX graph cache key, like our config
        # A replay re-runs no Python: nothing would park or take, and a warm-up run would
        # leave the parked outputs in the graph's private pool, untracked.
        return None, "none under CUDA graphs (mode='reduce-overhead')"
    pos = {n: i for i, n in enumerate(graph.nodes)}
    ce = sorted((b for b in buckets if b.bound and b.node is not None and U.is_ce_gather(b.node)),
                key=lambda b: pos[b.node])
    if not ce:
        return None, "no CE gather"
    group = ce[0].members[0].group_name
    chosen, total = [], 0
    for b in ce:
        if b.members[0].group_name != group:
            continue
        out_bytes = b.nbytes * b.members[0].group_size
        if total + out_bytes > cap:
            break
        chosen.append(b)
        total += out_bytes
    if not chosen:
        return None, (f"the first CE bucket gathers {ce[0].nbytes * ce[0].members[0].group_size / 2**20:.1f} "
                      f"MiB > prefetch_next_call_mib {cfg.prefetch_next_call_mib:g}")
    shards = [m.shard for b in chosen for m in b.members]
    # After the group's last launch of any form: a later padded or dim gather of the group
    # would find the set parked, take none of it, and drop it (NOTE [cross-call prefetch]).
    last = max((n for n in graph.nodes if U.ce_launch_group(n) == group), key=lambda n: pos[n])
    with graph.inserting_after(_after_launch(last, pos)):
        node = graph.call_function(U.magi.ce_prefetch.default,
                                   (shards, chosen[0].members[0].group_size, group))
    node.meta["val"] = None
    return node, f"{len(shards)} weight(s), {total / 2**20:.1f} MiB"


def _after_launch(launch: fx.Node, pos: dict) -> fx.Node:
    """The node to insert after: a coalesced launch's last getitem, else the launch."""
    items = [u for u in launch.users if u.target is operator.getitem]
    return max(items, key=lambda n: pos[n]) if items else launch
