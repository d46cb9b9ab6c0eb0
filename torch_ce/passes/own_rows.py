"""Own rows in place: a gathered weight that only feeds matmuls is read for the other
ranks' rows only, and the matmuls take this rank's rows straight from the shard.

# NOTE [own rows in place]
A full gather writes every rank's rows into a fresh buffer, this rank's included: at
world 2 half of its HBM writes and a DtoD copy (read + write) of the shard, while the shard
sits in memory already. When every use of a gathered weight is ``mm(x, w.t())`` (how
``F.linear`` reaches the post-grad graph), the gather becomes ``ce_all_gather.peers``
(output: the other ranks' rows, rank order) and each matmul becomes ``magi.ce_linear``,
which computes this rank's output columns from the shard and the rest from the peer rows,
each block written in place into one output. Per gather that removes the own-row copy (a
read and a write of the shard) and, at world W, 1/W of the output buffer. The arithmetic is
the same matmul split by column blocks, so results match the full gather's exactly.
Anything else that reads the gathered weight (a bias-add ``addmm``, a reshape, a second
kind of use) keeps the full gather; the reason is logged.

Before::

    %ag : magi.ce_all_gather(%w, 2, '0')
    %wt : wait_tensor(%ag)
    %t : aten.permute(%wt, [1, 0])
    %mm : aten.mm(%x, %t)

After::

    %ag : magi.ce_all_gather.peers(%w, 2, '0')
    %wt : wait_tensor(%ag)
    %mm : magi.ce_linear(%x, %w, %wt, 2, '0')

The rank is found at run time from the group name (cached code is shared across ranks).
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from . import fx_utils as U
from .gate import Seed

log = logging.getLogger("torch_ce")
aten = torch.ops.aten


def _is_transpose(n: fx.Node, src: fx.Node) -> bool:
    if n.op != "call_function" or n.args[0] is not src:
        return False
    if n.target is aten.t.default:
        return True
    return n.target is aten.permute.default and list(n.args[1]) == [1, 0]


def refusal(s: Seed) -> str | None:
    """Why this gathered weight keeps its full gather (None: its uses are all matmuls)."""
    if s.wait is None:
        return "gather without a single wait_tensor"
    val = s.shard.meta.get("val")
    if val is None or val.dim() != 2:
        return "weight is not 2-D"
    if not s.wait.users:
        return "gathered weight unused"
    for t in s.wait.users:
        if not _is_transpose(t, s.wait):
            return f"gathered weight used by {getattr(t.target, '__name__', t.target)}, not only w.t()"
        for mm in t.users:
            if not (mm.op == "call_function" and mm.target is aten.mm.default
                    and len(mm.args) == 2 and mm.args[1] is t and mm.args[0] is not t):
                return f"w.t() used by {getattr(mm.target, '__name__', mm.target)}, not only mm(x, w.t())"
    return None


def own_rows_in_place(graph: fx.Graph, seeds: list[Seed]) -> tuple[list[str], dict[str, str]]:
    """Rewrite every eligible gather whose uses are all ``mm(x, w.t())``; returns the
    weights rewritten and, per weight left alone, why."""
    done, kept = [], {}
    for s in seeds:
        if not s.eligible or not U.is_ce_gather(s.gather):
            continue
        why = refusal(s)
        if why is not None:
            kept[s.shard.name] = why
            continue
        s.gather.target = U.magi.ce_all_gather.peers
        full = s.gather.meta.get("val")
        if full is not None:
            rows = full.shape[0] // s.group_size
            peers = full.new_empty(((s.group_size - 1) * rows, *full.shape[1:]))
            s.gather.meta["val"] = peers
            s.wait.meta["val"] = peers
        for t in list(s.wait.users):
            for mm in list(t.users):
                with graph.inserting_before(mm):
                    lin = graph.call_function(
                        U.magi.ce_linear.default,
                        (mm.args[0], s.shard, s.wait, s.group_size, s.group_name))
                lin.meta.update(mm.meta)
                mm.replace_all_uses_with(lin)
                graph.erase_node(mm)
            graph.erase_node(t)
        s.peers_only = True
        done.append(s.shard.name)
    if kept:
        log.debug("torch_ce: own rows in place refused for %s", kept)
    return done, kept
