"""Gradient reduce-scatters -> magi.ce_reduce_scatter[_coalesced] (``reduce_scatter``
"copy_engine"), each one judged, with a reason for every one left on the collective
(``RsReason``, torch_ce/rs_reasons.py: the same list the run time's refusals use).

The node keeps its arguments (the op mirrors ``_c10d_functional.reduce_scatter_tensor``)
and gains the bucket's name for the run time's errors; its ``wait_tensor`` stays. Every
rank compiles the same graph and decides the same: the run time then meets its peers in
the same workspace rounds (a rank whose graph differs gets an error at the first one,
NOTE [reduce-scatter workspaces] in runtime/reduce_scatter/workspace.py).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..config import Config
from ..rs_reasons import RsReason, RsRefusal
from . import fx_utils as U

_C10D = torch.ops._c10d_functional
_TARGETS = {_C10D.reduce_scatter_tensor.default: "ce_reduce_scatter",
            _C10D.reduce_scatter_tensor_coalesced.default: "ce_reduce_scatter_coalesced"}
DTYPES = (torch.float32, torch.bfloat16)
REDUCE_OPS = ("sum", "avg")

OFF = RsReason.OFF.text


def _vals(node: fx.Node) -> list | None:
    xs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    vals = [x.meta.get("val") if isinstance(x, fx.Node) else None for x in xs]
    return None if any(v is None for v in vals) else vals


def judge(node: fx.Node, cfg: Config) -> RsRefusal | None:
    """Why this reduce-scatter stays on the collective (None: it may use CE)."""
    if cfg.reduce_scatter != "copy_engine":
        return RsReason.OFF.says()
    vals = _vals(node)
    if vals is None:
        return RsReason.NO_SHAPE.says()
    op, group_size = str(node.args[1]), int(node.args[2])
    if op not in REDUCE_OPS:
        return RsReason.REDUCE_OP.says(op=op, ops="/".join(REDUCE_OPS))
    if group_size < 2:
        return RsReason.GROUP_OF_ONE.says()
    if any(v.dtype not in DTYPES for v in vals) or len({v.dtype for v in vals}) != 1:
        return RsReason.DTYPE.says(dtypes=sorted({str(v.dtype) for v in vals}))
    if any(v.dim() == 0 or int(v.shape[0]) % group_size for v in vals):
        return RsReason.DIM0.says()
    dev = vals[0].device.type
    if dev == "cpu" and not cfg.host_transport:
        return RsReason.HOST_TRANSPORT_OFF.says()
    if dev not in ("cpu", "cuda"):
        return RsReason.DEVICE.says(device=dev)
    return None


def _name(node: fx.Node, vals: list | None) -> str:
    """The bucket's name: its node, its inputs' shapes, and the gradients it carries (the
    graph inputs they belong to, where AOTAutograd says: ``<- grad of inputs 3, 5``). The
    run time makes the call's identity from it (NOTE [reduce-scatter workspaces], "call
    identity"): node names are renumbered when one rank's graph lacks a bucket, the
    gradients' inputs are not."""
    if not vals:
        return node.name
    shapes = ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in vals)
    grads = _grads_of(node)
    return f"{node.name} ({shapes})" + (f" <- grad of {', '.join(grads)}" if grads else "")


_MAX_WALK = 64  # nodes looked at from a reduce-scatter towards the graph's outputs


def _grads_of(node: fx.Node) -> list[str]:
    """The graph inputs whose gradients ``node``'s outputs become (the backward's output
    descriptors: ``GradAOTOutput(grad_of=...)``), by their flat Dynamo input index or
    parameter name; [] where the graph has no descriptors (a hand-built graph)."""
    out = next((n for n in reversed(node.graph.nodes) if n.op == "output"), None)
    descs = out.meta.get("desc") if out is not None else None
    if not descs or not out.args or not isinstance(out.args[0], (list, tuple)):
        return []
    where: dict = {}
    for i, a in enumerate(out.args[0]):
        if isinstance(a, fx.Node):
            where.setdefault(a, []).append(i)
    found, seen, frontier = [], {node}, [node]
    while frontier and len(seen) < _MAX_WALK:
        nxt = []
        for n in frontier:
            for i in where.get(n, ()):
                found.append(_input_name(_grad_of(descs[i])) if i < len(descs) else None)
            for u in n.users:
                if u not in seen and u.op != "output":
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return sorted({f for f in found if f}, key=lambda t: (len(t), t))


def _grad_of(desc):
    """The input an output descriptor is the gradient of, through subclass attributes
    (``SubclassGetAttrAOTOutput(base=GradAOTOutput(grad_of=...))``: a DTensor's local part)."""
    while desc is not None and not hasattr(desc, "grad_of") and hasattr(desc, "base"):
        desc = desc.base
    return getattr(desc, "grad_of", None)


def _input_name(desc) -> str | None:
    """``input 3`` (a Dynamo input, through subclass attributes) or a parameter's name."""
    base = desc
    while base is not None and hasattr(base, "base"):
        base = base.base
    if base is None:
        return None
    idx = getattr(base, "idx", None)
    if type(base).__name__ == "PlainAOTInput" and isinstance(idx, int):
        return f"input {idx}"
    target = getattr(base, "target", None)
    return target if isinstance(target, str) else None


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
                         reason=str(why or ""), group=str(node.args[3])))
    return rows
