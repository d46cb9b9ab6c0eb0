"""Rewrite: planned weight gathers become ``magi.ce_all_gather``; one bind step at the head.

Before::

    %w : placeholder
    %ag : _c10d_functional.all_gather_into_tensor(%w, 2, '0')
    %wt : _c10d_functional.wait_tensor(%ag)

After::

    %w : placeholder
    %ce_bind : magi.ce_bind([%w], [2], ['0'], ['w'], [''])
    %ag : magi.ce_all_gather(%w, 2, '0')
    %wt : _c10d_functional.wait_tensor(%ag)

The args are unchanged (the signatures mirror the functional collective), the wait and any
slice after it stay. ``ce_bind`` is declared as mutating its shards, so Inductor keeps every
read of them after it (NOTE [run-time bind] in bind_step.py). Only rank-independent
constants go into the graph: cached code is shared across ranks. The bind step also lists
weights whose gathers this rank refused (with the reason), so every rank of the group
agrees over the same candidates even when a refusal is rank-dependent.
"""
from __future__ import annotations

import torch.fx as fx

from . import fx_utils as U
from .param_names import param_name
from .plan import Plan


def rewrite(graph: fx.Graph, p: Plan) -> fx.Node | None:
    """Retarget the planned gathers and insert the bind step; returns the bind node."""
    for s in p.seeds:
        s.gather.target = U.magi.ce_all_gather.default
    if not p.shards:
        return None
    anchor = U.last_placeholder(graph)
    with graph.inserting_after(anchor):
        bind = graph.call_function(
            U.magi.ce_bind.default,
            (
                [ps.node for ps in p.shards],
                [ps.group_size for ps in p.shards],
                [ps.group_name for ps in p.shards],
                [param_name(ps.node) for ps in p.shards],  # NOTE [parameter names]
                [ps.reason for ps in p.shards],
            ),
        )
    bind.meta["val"] = None
    return bind
