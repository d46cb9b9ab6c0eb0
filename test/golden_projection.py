"""What the golden tests compare: the part of a post-grad graph that torch_ce decided.

A raw FX dump changes with every torch release (placeholders renumbered, casts folded
elsewhere, compute decomposed differently) although torch_ce did the same thing. The
projection keeps only torch_ce's own nodes (``magi.*``), every collective and its wait,
and the getitems of those, in graph order, with their arguments in order:

    magi.ce_bind([0.weight, 1.weight], [2, 2], ['0', '0'], ['0.weight', '1.weight'], ['', ''])
    %0 = magi.ce_all_gather(0.weight, 2, '0')
    %1 = _c10d_functional.wait_tensor(%0) -> aten.permute

- a graph input is its parameter's name (NOTE [parameter names]); inputs nothing listed
  reads do not appear;
- casts between an input and a listed node are folded into it: ``w.to(bfloat16)``;
- a listed node is ``%N``, numbered in order of appearance; any other node it reads is
  ``<op>`` (``<aten.mul>``), without its arguments but an input it reads first
  (``<aten.constant_pad_nd>(w)``);
- ``-> ...``: the readers outside the projection (``output`` for the graph's result).

Must run while the graph is being compiled (manager.observing): parameter names come from
the Dynamo frame.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torch_ce.passes.param_names import param_name

_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def _listed(n: fx.Node, kept: set) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:
        return n.args[0] in kept
    return getattr(n.target, "namespace", None) in ("magi", "_c10d_functional")


def _op(n: fx.Node) -> str:
    if n.op != "call_function":
        return n.op
    t = n.target
    return str(t.overloadpacket) if hasattr(t, "overloadpacket") else getattr(t, "__name__", str(t))


def _input(n: fx.Node) -> str | None:
    """``name``, or ``name.to(dtype)`` through a chain of casts; None if not an input."""
    x = n
    while x.op == "call_function" and x.target in _CASTS:
        x = x.args[0]
    if x.op != "placeholder":
        return None
    dtype = n.meta["val"].dtype
    return param_name(x) if dtype == x.meta["val"].dtype else f"{param_name(x)}.to({_arg(dtype, {})})"


def _arg(a, names: dict) -> str:
    if isinstance(a, fx.Node):
        if a in names:
            return names[a]
        inp = _input(a)
        if inp is not None:
            return inp
        src = a.args[0] if a.args and isinstance(a.args[0], fx.Node) else None
        src = _input(src) if src is not None else None
        return f"<{_op(a)}>" + (f"({src})" if src is not None else "")
    if isinstance(a, (list, tuple)):
        return "[" + ", ".join(_arg(x, names) for x in a) + "]"
    if isinstance(a, torch.dtype):
        return str(a).removeprefix("torch.")
    return repr(a)


def project(graph: fx.Graph) -> str:
    """The projection of ``graph`` described above, one line per listed node."""
    kept: set = set()
    for n in graph.nodes:
        if _listed(n, kept):
            kept.add(n)
    order = {n: i for i, n in enumerate(graph.nodes)}
    names: dict = {}
    lines = []
    for n in graph.nodes:
        if n not in kept:
            continue
        if n.target is operator.getitem:
            call = f"{_arg(n.args[0], names)}[{n.args[1]}]"
        else:
            args = [_arg(a, names) for a in n.args]
            args += [f"{k}={_arg(v, names)}" for k, v in n.kwargs.items()]
            call = f"{_op(n)}({', '.join(args)})"
        if n.users:
            names[n] = f"%{len(names)}"
            call = f"{names[n]} = {call}"
        readers = [_op(u) for u in sorted(n.users, key=order.get) if u not in kept]
        lines.append(call + (f" -> {', '.join(readers)}" if readers else ""))
    return "\n".join(lines)
