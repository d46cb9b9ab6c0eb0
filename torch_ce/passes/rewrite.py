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

A training graph (NOTE [training: staged windows and step fences] in runtime/staging.py)
gets ``magi.ce_stage`` instead, and ``magi.ce_staged``, whose outputs are the staging
slots the gathers read::

    %w : placeholder                                   (an fp32 shard)
    %st : magi.ce_stage([%w], ['bfloat16'], [2], ['0'], ['w'], [''], True)
    %sl : magi.ce_staged([%w], ['bfloat16'], ['0'])
    %s0 : getitem(%sl, 0)                              (its bf16 staging slot)
    %ag : magi.ce_all_gather(%s0, 2, '0')              (was: all_gather(convert(%w, bf16)))

ce_stage's last argument says whether this graph refreshes the slots (a forward: fence, copy,
fence) or only reads them (a backward: its forward refreshed them this step). The cast
before the gather goes: the stage step casts.

A Shard(d) gather, d >= 1 (NOTE [Shard(1) reads] in gate.py), loses its re-split too
(``rewrite_dim``)::

    %ag : all_gather_into_tensor(%w, 2, '0')           %ag : magi.ce_all_gather_dim(%w, 2, '0', 1)
    %wt : wait_tensor(%ag)                       ->    %wt : wait_tensor(%ag)
    %sp : split(%wt, E); %b0, %b1 : getitem(%sp, .)    (gone: %wt is the weight in its
    %cat : cat([%b0, %b1], 1)                           final layout, the cat's users read it)
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from . import fx_utils as U
from .param_names import param_name
from .plan import Plan


def rewrite(graph: fx.Graph, p: Plan, refresh: bool = True) -> fx.Node | None:
    """Retarget the planned gathers and insert the bind (or stage) step; returns it."""
    if p.staged:
        return _rewrite_staged(graph, p.shards, p.seeds, refresh)
    for s in p.seeds:
        if s.cast_slot:
            continue
        if s.padded_rows:
            _retarget_padded(graph, s, s.weight)
        else:
            s.gather.target = U.magi.ce_all_gather.default
            if s.gather_dim:
                rewrite_dim(graph, s)
    bind = None
    if p.shards:
        bind = _head_step(graph, U.magi.ce_bind.default, p.shards, False)
        bind.meta["val"] = None
    if p.cast_shards:  # NOTE [cast slots] in runtime/staging.py: never refreshed
        stage = _rewrite_staged(graph, p.cast_shards, [s for s in p.seeds if s.cast_slot],
                                False, static=True, after=bind)
        bind = bind or stage
    return bind


def _retarget_padded(graph: fx.Graph, s, shard: fx.Node) -> None:
    """An uneven Shard(0) gather: ``ce_all_gather_padded(shard, rows, ...)``, whose output
    has the collective's padded shape on every rank; this rank's pad (a short rank) goes
    (NOTE [uneven Shard(0): padded slots] in runtime/windows.py)."""
    old = s.gather.args[0]
    s.gather.target = U.magi.ce_all_gather_padded.default
    s.gather.args = (shard, s.padded_rows, *s.gather.args[1:])
    s.shard = shard
    U.erase_unread_chain(graph, old)



def _head_step(graph: fx.Graph, target, shards, staged: bool, *extra, after=None) -> fx.Node:
    """The bind or stage step after the last placeholder (or ``after``), listing every
    planned shard: (shards, [dtypes,] group sizes, group names, parameter names, reasons,
    *extra)."""
    dtypes = ([ps.dtype for ps in shards],) if staged else ()
    rows = [ps.rows for ps in shards]
    if any(rows) and target is U.magi.ce_bind.default:
        extra = (*extra, rows)  # uneven Shard(0): each padded slot's rows
    with graph.inserting_after(after if after is not None else U.last_placeholder(graph)):
        return graph.call_function(target, (
            [ps.node for ps in shards],
            *dtypes,
            [ps.group_size for ps in shards],
            [ps.group_name for ps in shards],
            [param_name(ps.node) for ps in shards],  # NOTE [parameter names]
            [ps.reason for ps in shards],
            *extra,
        ))


def _rewrite_staged(graph: fx.Graph, shards, seeds, refresh: bool, static: bool = False,
                    after=None) -> fx.Node | None:
    if not shards:
        return None
    rows = [ps.rows for ps in shards]
    extra = (refresh, rows, True) if static else (refresh, rows) if any(rows) else (refresh,)
    stage = _head_step(graph, U.magi.ce_stage.default, shards, True, *extra, after=after)
    stage.meta["val"] = None
    # The slots of the shards the compile side found eligible (the others are listed in the
    # stage step only so that every rank agrees over the same candidates). ce_stage is
    # declared as mutating the shards, so this read of them runs after it.
    ok = [ps for ps in shards if not ps.reason]
    if not ok:
        return stage
    with graph.inserting_after(stage):
        staged = graph.call_function(U.magi.ce_staged.default, (
            [ps.node for ps in ok], [ps.dtype for ps in ok], [ps.group_name for ps in ok],
            *((True,) if static else ())))
    slots: dict[tuple, fx.Node] = {}
    vals = []
    prev = staged
    for i, ps in enumerate(ok):
        w = ps.node.meta["val"]
        # A padded slot comes back as its live rows (the weight's shape): the gather reads
        # the full slot it views (ce_all_gather_padded).
        val = w.new_empty(w.shape, dtype=getattr(torch, ps.dtype))
        with graph.inserting_after(prev):
            item = graph.call_function(operator.getitem, (staged, i))
        item.meta["val"] = val
        vals.append(val)
        slots[(ps.node, ps.dtype, ps.rows)] = item
        prev = item
    staged.meta["val"] = vals
    for s in seeds:
        slot = slots.get((s.weight, str(s.stage_dtype).removeprefix("torch."), s.padded_rows))
        if slot is None:  # cannot happen: an eligible seed's weight is an eligible shard
            continue
        if s.padded_rows:
            _retarget_padded(graph, s, slot)  # the pad and the cast go: the stage step casts
            continue
        old = s.gather.args[0]
        s.gather.target = U.magi.ce_all_gather.default
        s.gather.args = (slot, *s.gather.args[1:])
        s.shard = slot
        if s.gather_dim:
            rewrite_dim(graph, s)
        if isinstance(old, fx.Node) and old.op == "call_function" and not old.users:
            graph.erase_node(old)  # the cast: the stage step casts
    return stage


def rewrite_dim(graph: fx.Graph, s) -> None:
    """Fold a Shard(d) gather's re-split into the gather (NOTE [Shard(1) reads] in gate.py):
    the gather becomes ``magi.ce_all_gather_dim(shard, W, group, d)``, whose output (and its
    wait's) is the cat's, and the split, its getitems and the cat leave the graph."""
    cat, wait = s.resplit, s.wait
    full = cat.meta.get("val")
    split = wait.args[0] is s.gather and next(iter(wait.users))
    s.gather.target = U.magi.ce_all_gather_dim.default
    s.gather.args = (*s.gather.args[:3], s.gather_dim)
    if full is not None:
        s.gather.meta["val"] = full
        wait.meta["val"] = full
    cat.replace_all_uses_with(wait)
    graph.erase_node(cat)
    for item in list(split.users):
        graph.erase_node(item)
    graph.erase_node(split)
    s.resplit = None
