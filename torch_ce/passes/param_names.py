"""Which user parameter a post-grad placeholder is: ``layers.0.attention.wqkv.weight``, not
``arg0_1``.

# NOTE [parameter names]
AOTAutograd renames every graph input (``arg0_1``, ``primals_1``), but keeps where it came
from in the placeholder's ``meta["desc"]``: a DTensor weight's local shard is
``SubclassGetAttrAOTInput(base=PlainAOTInput(idx=i), attr='_local_tensor')``, ``i`` being
the position in the flat inputs Dynamo handed to the backend. Dynamo's ``GraphArg`` at that
position carries the input's source, e.g.
``L['self']._modules['layers']._modules['0']._parameters['weight']``. The post-grad pass
runs inside that backend call, while Dynamo's ``InstructionTranslator.current_tx()`` is
still set (torch 2.11 and 2.13); we only trust it when its tracing context is the one
being compiled. A source becomes a module path: ``_modules`` / ``_parameters`` /
``_buffers`` are dropped, a root that holds a module (``L['self']`` in a compiled
forward; ``L['fn']`` for a torch.nn.* module, which torch.compile wraps in a closure;
``L['args'][0]`` in a decorated forward, ``def wrapper(*args, **kwargs)``, as Hugging Face
transformers 5 wraps its models' forwards: an element of a tuple, list or dict local that
is a module) is dropped, so the name reads as in ``model.named_parameters()``; any other
root keeps its name; and ``parametrizations.<name>.original`` (torch's
parametrize, as a SimpleFSDP variant uses) becomes ``<name>``.

Anything else (no Dynamo frame, e.g. a hand-built graph, or a graph compiled lazily
outside tracing) falls back on ``ParamAOTInput.target`` and then on the placeholder name.
The result is a pure function of the model's code, so it is the same on every rank: the
bind step may carry it as a constant (cached code is shared across ranks).
"""
from __future__ import annotations

import re

import torch
import torch.fx as fx

_META_KEY = "torch_ce_param"
_TOKEN = re.compile(r"\.(\w+)|\[\s*'([^']*)'\s*\]|\[\s*\"([^\"]*)\"\s*\]|\[\s*(-?\d+)\s*\]")
_ROOT = re.compile(r"^([LG])\[\s*'([^']*)'\s*\]")
_CONTAINERS = {"_modules", "_parameters", "_buffers", "__dict__"}  # __dict__: a module read through it
# Without the frame's values: ``self`` (a forward's module) and ``fn`` (the closure of the
# frame torch.compile wraps around a torch.nn.* module, ``external_utils.wrap_inline``).
# A root is the path of parts to a module from a frame variable: ``("self",)``, or
# ``("args", "0")`` for ``L['args'][0]`` (a decorated forward's ``*args``).
_MODULE_ROOTS = frozenset({("self",), ("fn",)})


def fqn_from_source(source_name: str, module_roots=_MODULE_ROOTS) -> str | None:
    """``L['self']._modules['a']._modules['0']._parameters['weight']`` -> ``a.0.weight``
    (None when the text is not a module-attribute path). The longest root in
    ``module_roots`` (paths from a frame variable to an nn.Module: ``("self",)``,
    ``("args", "0")``; a plain string is a variable) that the source starts with is dropped:
    names are relative to that module, as its ``named_parameters()`` gives them."""
    m = _ROOT.match(source_name)
    if m is None:
        return None
    parts = [m.group(2)]
    rest, pos = source_name[m.end():], 0
    while pos < len(rest):
        t = _TOKEN.match(rest, pos)
        if t is None:
            return None  # a call, a slice, an unknown wrapper: not a plain path
        pos = t.end()
        part = next(g for g in t.groups() if g is not None)
        if part not in _CONTAINERS:
            parts.append(part)
    if m.group(1) == "L":
        roots = [(r,) if isinstance(r, str) else tuple(r) for r in module_roots]
        drop = max((len(r) for r in roots if tuple(parts[:len(r)]) == r), default=0)
        parts = parts[drop:]
    # torch.nn.utils.parametrize keeps the tensor at parametrizations.<name>.original[N].
    out: list[str] = []
    i = 0
    while i < len(parts):
        if (parts[i] == "parametrizations" and i + 2 < len(parts)
                and re.fullmatch(r"original\d*", parts[i + 2])):
            out.append(parts[i + 1])
            i += 3
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out) or None


def roots_of(frame_locals: dict) -> frozenset:
    """The paths from a frame's variables to the modules they hold: a module variable, or a
    module element of a tuple, list or dict variable (a decorated forward's ``args[0]``)."""
    roots = set()
    for k, v in frame_locals.items():
        if isinstance(v, torch.nn.Module):
            roots.add((k,))
        elif isinstance(v, (tuple, list)):
            roots.update((k, str(i)) for i, x in enumerate(v) if isinstance(x, torch.nn.Module))
        elif isinstance(v, dict):
            roots.update((k, key) for key, x in v.items()
                         if isinstance(key, str) and isinstance(x, torch.nn.Module))
    return frozenset(roots)


def _note_root_modules(frame_locals: dict, roots) -> None:
    """Keep (weakly) the modules a compiled frame holds, and the outermost module a frame
    of the Python stack holds as ``self`` (the frame being compiled may be a submodule's,
    resumed after a graph break), so a gather outside compiled graphs names its weight as
    ``named_parameters()`` of the outermost does (report.roots; runtime/eager.py)."""
    import sys

    from .. import report

    for r in roots:
        v = frame_locals.get(r[0])
        if len(r) > 1:
            v = v[int(r[1])] if isinstance(v, (tuple, list)) else v.get(r[1])
        if isinstance(v, torch.nn.Module):
            report.roots.add(v)
    outer, f = None, sys._getframe()
    while f is not None:
        v = f.f_locals.get("self") if f.f_code.co_varnames[:1] == ("self",) else None
        if isinstance(v, torch.nn.Module):
            outer = getattr(v, "_orig_mod", v)  # torch.compile's OptimizedModule: the model
        f = f.f_back
    if outer is not None:
        report.roots.add(outer)


def _flat_input_index(desc) -> int | None:
    """The Dynamo input a placeholder unpacks (through subclass attributes), if plain."""
    while desc is not None and hasattr(desc, "base"):
        desc = desc.base
    if desc is not None and type(desc).__name__ == "PlainAOTInput":
        return getattr(desc, "idx", None)
    return None


def _dynamo_sources() -> tuple[list[str], frozenset] | None:
    """Source names of the inputs of the graph being compiled, and the frame variables
    that hold modules (None outside Dynamo)."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator
        from torch._guards import TracingContext

        tx = InstructionTranslator.current_tx()
        tc = TracingContext.try_get()
        if tx is None or tc is None or tx.output.tracing_context is not tc:
            return None  # not the frame whose graph is being compiled
        out = []
        for arg in tx.output.graphargs:
            src = getattr(arg, "source", None)
            name = getattr(src, "name", None)
            out.append(name() if callable(name) else name)  # 2.11: method; 2.13: property
        frame_locals = getattr(getattr(tx.output, "root_tx", tx), "f_locals", None)
        if not isinstance(frame_locals, dict):
            return out, _MODULE_ROOTS
        roots = roots_of(frame_locals)
        _note_root_modules(frame_locals, roots)
        return out, roots
    except Exception:  # noqa: BLE001 (names are for people; never fail a compile on them)
        return None


def _tracing_context():
    try:
        from torch._guards import TracingContext

        return TracingContext.try_get()
    except Exception:  # noqa: BLE001
        return None


def annotate(graph: fx.Graph) -> None:
    """Record each placeholder's parameter name in its meta (see NOTE above)."""
    found = _dynamo_sources()
    sources, roots = found if found is not None else (None, _MODULE_ROOTS)
    flat = [i for i in (_flat_input_index(n.meta.get("desc")) for n in graph.nodes if n.op == "placeholder")
            if i is not None]
    if sources is not None and (not flat or max(flat) + 1 != len(sources)):
        # Not the inputs Dynamo handed over (a graph split by DDPOptimizer, say): no names.
        sources = None
    # A training step's backward is compiled later, outside the Dynamo frame, but under the
    # forward's tracing context and with the forward's placeholder names (primals_N): the
    # names found for the forward are kept on that context for it.
    tc = _tracing_context()
    known = getattr(tc, "_torch_ce_param_names", None) if tc is not None else None
    if known is None:
        known = {}
        if tc is not None:
            try:
                tc._torch_ce_param_names = known
            except Exception:  # noqa: BLE001 (a context that takes no attributes: no names)
                pass
    for n in graph.nodes:
        if n.op != "placeholder" or _META_KEY in n.meta:
            continue
        desc = n.meta.get("desc")
        name = None
        idx = _flat_input_index(desc)
        if sources is not None and idx is not None and 0 <= idx < len(sources) and sources[idx]:
            name = fqn_from_source(sources[idx], roots)
            if name is not None:
                known[n.name] = name
        elif sources is None:
            name = known.get(n.name)
        if name is None:
            base = desc
            while base is not None and hasattr(base, "base"):
                base = base.base
            target = getattr(base, "target", None)  # ParamAOTInput / BufferAOTInput
            name = target if isinstance(target, str) else None
        n.meta[_META_KEY] = name or n.name


def param_name(node) -> str:
    """The parameter name of a placeholder (annotating its graph on first use); for any
    other node, or a graph without a Dynamo frame, its FX name."""
    if not isinstance(node, fx.Node):
        return str(node)
    if node.op == "placeholder":
        if _META_KEY not in node.meta:
            annotate(node.graph)
        return node.meta[_META_KEY]
    return node.name
