"""Gradient reduce-scatters -> magi.ce_reduce_scatter[_coalesced] (``reduce_scatter``
"copy_engine"), each one judged, with a reason for every one left on the collective.

The node keeps its arguments (the op mirrors ``_c10d_functional.reduce_scatter_tensor``)
and gains the bucket's name for the run time's errors; its ``wait_tensor`` stays. Every
rank compiles the same graph and decides the same: the run time then meets its peers in
the same workspace rounds (a rank whose graph differs gets an error at the first one,
NOTE [reduce-scatter workspaces] in runtime/rs_workspace.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..config import Config
from . import fx_utils as U

_C10D = torch.ops._c10d_functional
_TARGETS = {_C10D.reduce_scatter_tensor.default: "ce_reduce_scatter",
            _C10D.reduce_scatter_tensor_coalesced.default: "ce_reduce_scatter_coalesced"}
DTYPES = (torch.float32, torch.bfloat16)
REDUCE_OPS = ("sum", "avg")

OFF = "reduce_scatter='collective' (the default; set it to 'copy_engine')"


def _vals(node: fx.Node) -> list | None:
    xs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in xs]
    return None if any(v is None for v in vals) else vals


def judge(node: fx.Node, cfg: Config) -> str | None:
    """Why this reduce-scatter stays on the collective (None: it may use CE)."""
    if cfg.reduce_scatter != "copy_engine":
        return OFF
    vals = _vals(node)
    if vals is None:
        return "no shape on its input (not a traced tensor)"
    op, group_size = str(node.args[1]), int(node.args[2])
    if op not in REDUCE_OPS:
        return f"reduce op {op!r} (CE reduces {'/'.join(REDUCE_OPS)})"
    if group_size < 2:
        return "a group of one rank"
    if any(v.dtype not in DTYPES for v in vals) or len({v.dtype for v in vals}) != 1:
        return f"dtype {sorted({str(v.dtype) for v in vals})} (CE reduces one of fp32, bf16)"
    if any(v.dim() == 0 or int(v.shape[0]) % group_size for v in vals):
        return "dim 0 does not split in equal chunks"
    dev = vals[0].device.type
    if dev == "cpu" and not cfg.host_transport:
        return "host_transport is off"
    if dev not in ("cpu", "cuda"):
        return f"device {dev}"
    return None


def _name(node: fx.Node, vals: list | None) -> str:
    if not vals:
        return node.name
    shapes = ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in vals)
    return f"{node.name} ({shapes})"


def rewrite(graph: fx.Graph, cfg: Config) -> list[dict]:
    """Retarget every eligible reduce-scatter; one row per reduce-scatter (the record's
    ``reduce_scatters``: name, bytes reduced per call, kind "ce" or "collective", reason)."""
    rows = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TARGETS:
            continue
        vals = _vals(node)
        name = _name(node, vals)
        nbytes = sum(U.nbytes(v) or 0 for v in vals) if vals else 0
        why = judge(node, cfg)
        if why is None:
            node.target = getattr(torch.ops.magi, _TARGETS[node.target]).default
            node.args = (*node.args[:4], name)
            node.kwargs = {}
        rows.append(dict(name=name, bytes=nbytes, kind="ce" if why is None else "collective",
                         reason=why or "", group=str(node.args[3])))
    return rows
