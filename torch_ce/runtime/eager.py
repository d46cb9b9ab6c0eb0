"""Weight gathers outside compiled graphs: SimpleFSDP's parametrization run eagerly.

# NOTE [eager gathers]
Users do not compile whole models. A graph break (a print, ``.item()``, data-dependent
experts), Hugging Face's gradient checkpointing (every decoder layer breaks the graph, and
``torch.utils.checkpoint`` re-runs it in backward, under the autograd engine, never under
Dynamo) or an eager evaluation runs modules outside any compiled graph, and their
SimpleFSDP parametrization gathers each weight eagerly: ``redistribute(Replicate())``,
one ``all_gather_into_tensor`` per weight, on the collective. ``gather_param`` is what
such a gather does instead while ``transport="copy_engine"``: the parametrization calls it
(torchtitan's through ``integrations/simple_fsdp.py``, torch_ce's own ``gathered``) and it
returns the full weight, read one-sidedly from the peers' windows, exactly the bytes the
collective would give; or None, and the caller gathers as before. Either way the gather is
counted (``report.count_eager``: weight, path, reason, where), so ``explain()`` counts
calls, not graphs (NOTE [calls, not graphs] in report.py).

What it reads, for a weight ``w`` gathered in ``dtype`` (``param_dtype`` or its own):
- ``w`` bound in place by an inference graph: its window (the version net checks it, NOTE
  [the version net] in versions.py), cast after the gather when ``dtype`` differs
  (elementwise: the same bits as casting before);
- a cast slot in ``dtype`` (an inference graph's, NOTE [cast slots] in staging.py): it;
- otherwise a staging slot in ``dtype`` (a training graph's, or, for a gather that needs a
  gradient, one the eager path binds itself: one bind round, agreed by every rank at the
  same eager gather, since every rank runs the same collectives in the same order). An
  inference gather (no gradient) of a weight no compiled graph bound stays on the
  collective (``NOT_BOUND``): binding it here would decide for the compiled graphs to come. A staging slot holds the weight as of its
  last refresh. An eager gather of a slot whose weight changed since (its version
  counters moved: the optimizer stepped) refreshes it first: fence, copy (cast) every
  stale eager slot of the group, fence (``staging.fence``, the step fences of NOTE
  [training: staged windows and step fences]). Every rank runs the same program, so
  every rank finds the same slot stale at the same gather and the fences pair up; the
  argument of that NOTE carries over: a peer reads a slot only after the fence that
  follows its owner's refresh, and an owner rewrites it only after the fence that
  follows every peer's earlier reads. A compiled training forward refreshes the slots it
  stages without telling this module: the next eager gather of such a slot refreshes it
  once more (one extra round, never a stale read).

Training: the gather is an autograd Function whose backward is what DTensor's backward
of ``redistribute(Replicate())`` + ``to_local(grad_placements=[Partial()])`` does: the
gradient cast to ``backward_dtype``, ``reduce_scatter_tensor(sum)`` over the group, cast
back to the parameter's dtype, a ``Shard(0)`` DTensor. So losses are bit-identical to the
collective run. The Function is used for every judged gather (a refused one gathers by
the collective inside it), so a checkpointed region saves the same tensors in its forward
and in its re-run.

What stays on the collective, with the reason counted and a warning once: a placement
other than even ``Shard(0)`` on a 1-D mesh, an inference tensor (no version counter to
tell its writes), a bind's refusal (its reason), ``eager_gathers=False``, and any gather
while torch_ce is not on ``copy_engine``. Not seen at all: parametrizations that do not
call this (torch's ``parametrize`` variants): their gathers are neither served nor counted.

Only while torch_ce is enabled (``active``): before ``enable()`` and after ``disable()``
the parametrization gathers as without torch_ce. Inert under tracing: ``gather_param`` is only called when no Dynamo, make_fx, fake or
functional tracing is active (``tracing``), so compiled graphs are unchanged.
"""
from __future__ import annotations

import logging
import weakref

import torch

from .. import report
from ..config import config
from . import updates as _updates
from . import windows as W
from .window_pools import on_release

log = logging.getLogger("torch_ce")

_warned = False
# Set by torch_ce.enable(), cleared by disable(): outside them, eager gathers are the
# parametrization's own, neither served nor counted.
active = False
# id(weight) -> (weakref, name): names found through report.roots
_names: dict = {}
_roots_seen = 0
# (group ranks, device) -> {id(slot view): (weak weight, weak local, slot view, versions)}:
# the staging slots eager gathers read, and the weight's versions at their last refresh.
_eager_slots: dict = {}
on_release(_eager_slots.clear)


def tracing(x=None) -> bool:
    """Whether a gather here is being traced (Dynamo, make_fx, fake or functional
    tensors), not run: the caller then takes its own path, unchanged."""
    if torch.compiler.is_compiling():
        return True
    from torch._guards import TracingContext

    if TracingContext.try_get() is not None:  # Dynamo reading a module attribute for real while it compiles
        return True
    M = torch._C._TorchDispatchModeKey
    if any(torch._C._get_dispatch_mode(k) is not None for k in (M.PROXY, M.FAKE, M.FUNCTIONAL)):
        return True
    if x is not None:
        local = getattr(x, "_local_tensor", x)
        if type(local) is not torch.Tensor and not isinstance(local, torch.nn.Parameter):
            return True  # a fake / functional / proxy tensor
    return False


def where() -> str:
    """Where this eager gather runs: "backward" (re-run by the autograd engine: activation
    checkpointing), "graph break" (an eager stretch of a frame Dynamo compiles), "eager"
    (Dynamo off: outside torch.compile, or in a region it skips, as
    ``torch.utils.checkpoint`` is, so Hugging Face's checkpointed layers in forward)."""
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    if torch._C._dynamo.eval_frame.get_eval_frame_callback() not in (None, False):
        return "graph break"
    return "eager"


def name_of(x) -> str:
    """``x``'s name as ``named_parameters()`` of a compiled root module gives it."""
    global _roots_seen
    hit = _names.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    roots = list(report.roots)
    if len(roots) != _roots_seen:
        _roots_seen = len(roots)
        for m in roots:  # the outermost root names it: the longest name
            for n, p in m.named_parameters(remove_duplicate=False):
                old = _names.get(id(p))
                if old is None or old[0]() is not p or len(old[1]) < len(n):
                    _names[id(p)] = (weakref.ref(p), n)
        hit = _names.get(id(x))
        if hit is not None and hit[0]() is x:
            return hit[1]
    return f"<weight {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}>"


def _judge(x, dtype) -> str:
    """Why this gather cannot be served eagerly ("" when it can, as far as placement goes)."""
    from torch.distributed.tensor import DTensor, Shard

    if config.transport != "copy_engine":
        return 'transport="nccl"'
    if not config.eager_gathers:
        return "eager_gathers=False"
    if not isinstance(x, DTensor):
        return "not a DTensor"
    mesh = x.device_mesh
    if mesh.ndim != 1 or tuple(x.placements) != (Shard(0),):
        return f"placement {tuple(x.placements)} on a {mesh.ndim}-D mesh (eager gathers serve Shard(0) on a 1-D mesh)"
    if x.shape[0] % mesh.size(0):
        return "uneven Shard(0) (eager gathers serve even shards)"
    local = x._local_tensor
    if local.is_inference():
        return "an inference tensor (no version counter: its writes cannot be told)"
    if not local.is_contiguous():
        return "non-contiguous shard"
    return ""


def _warn(name: str, reason: str, at: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    log.warning("torch_ce: weights gathered outside compiled graphs stay on the collective (first: %s, "
                "%s, %s); explain().coverage() counts them", name, at, reason)


def _versions(x, local) -> tuple:
    return (x._version, local._version)


def _refresh_round(gkey, pg, device) -> None:
    """Fence, copy every stale eager slot of the group from its weight, fence."""
    from .staging import fence

    slots = _eager_slots.get(gkey, {})
    with torch.no_grad():
        fence([(pg, device)])
        dst, src = [], []
        for k, (wx, wl, view, vers) in list(slots.items()):
            x, local = wx(), wl()
            if x is None or local is None:
                del slots[k]
                continue
            now = _versions(x, local)
            if now != vers:
                dst.append(view)
                src.append(local)
                slots[k] = (wx, wl, view, now)
        if dst:
            torch._foreach_copy_(dst, src)  # casts too
        fence([(pg, device)])


NOT_BOUND = ("not bound by a compiled graph (an inference gather outside compiled graphs binds "
             "nothing: a later compiled graph binds it as its kind requires)")


def _staged_source(x, local, dtype, gs, gname, name, training: bool):
    """The staging slot to read (refreshed if stale), or the refusal's reason. Only a
    training gather (one that needs a gradient) binds a new slot, as a training graph
    would: an inference gather binding one would make a later inference graph refuse the
    weight in place ("a training graph stages this weight")."""
    from .staging import _bind_new

    e = W.staged(local, dtype)
    if e is None and not training:
        return NOT_BOUND
    if e is None:
        _bind_new([local], [dtype], [gs], [gname], [name], [""])
        e = W.staged(local, dtype)
        if e is not None and isinstance(e[0], W.Slot):
            w = e[0].window
            gkey = (w.group_ranks, str(w.device))
            # the bind copied the weight and published it with its last exchange
            _eager_slots.setdefault(gkey, {})[id(e[1])] = (weakref.ref(x), weakref.ref(local), e[1],
                                                            _versions(x, local))
    if e is None:
        return "not staged (the bind round listed no slot)"
    if not isinstance(e[0], W.Slot):
        return e[0].reason
    view = e[1]
    w = e[0].window
    gkey = (w.group_ranks, str(w.device))
    slots = _eager_slots.setdefault(gkey, {})
    ent = slots.get(id(view))
    if ent is None or ent[2] is not view:  # a training graph's slot, new to this module: refresh
        slots[id(view)] = (weakref.ref(x), weakref.ref(local), view, None)
        _refresh_round(gkey, w.group, w.device)
    elif ent[3] != _versions(x, local):
        _refresh_round(gkey, w.group, w.device)
    return view


def _read(t, gs, gname):
    out = torch.ops.magi.ce_all_gather(t, gs, gname)
    return torch.ops._c10d_functional.wait_tensor(out)


def _gather(x, dtype, name: str, at: str, training: bool = False) -> torch.Tensor:
    """The full weight in ``dtype``: from a window when it can, else the collective."""
    local = x._local_tensor
    mesh = x.device_mesh
    gs, gname = mesh.size(0), mesh.get_group(0).group_name
    nbytes = local.numel() * gs * dtype.itemsize
    with torch.no_grad():
        src, cast_after = None, False
        entry = W.lookup(local)
        if isinstance(entry, W.Slot):  # bound in place (inference)
            src, cast_after = local, dtype != local.dtype
        elif dtype != local.dtype and (c := W.cast_slot(local, dtype)) is not None and isinstance(c[0], W.Slot):
            from .versions import check

            check(c[0])
            src = c[1]
        elif isinstance(entry, W.Fallback):
            src = entry.reason
        else:
            src = _staged_source(x, local, dtype, gs, gname, name, training)
        if isinstance(src, torch.Tensor):
            out = _read(src, gs, gname)
            if cast_after:
                out = out.to(dtype)
            report.count_eager(name, "ce", "", at, nbytes)
            return out
        _warn(name, src, at)
        report.count_eager(name, "collective", src, at, nbytes)
        c10d = torch.ops._c10d_functional
        return c10d.wait_tensor(c10d.all_gather_into_tensor(local.to(dtype).contiguous(), gs, gname))


class _EagerGather(torch.autograd.Function):
    """Forward: ``_gather``. Backward: DTensor's backward of the gather (NOTE [eager
    gathers]): reduce-scatter (sum) of the gradient in ``backward_dtype``, as a
    ``Shard(0)`` DTensor of the parameter's dtype."""

    @staticmethod
    def forward(ctx, x, dtype, bwd_dtype, name, at):
        ctx.mesh, ctx.placements = x.device_mesh, x.placements
        ctx.shape, ctx.stride, ctx.dtype, ctx.bwd_dtype = x.shape, x.stride(), x.dtype, bwd_dtype
        ctx.name = name
        return _gather(x, dtype, name, at, training=True)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        c10d = torch.ops._c10d_functional
        g = grad if grad.dtype == ctx.bwd_dtype else grad.to(ctx.bwd_dtype)
        gs, gname = ctx.mesh.size(0), ctx.mesh.get_group(0).group_name
        local = c10d.wait_tensor(c10d.reduce_scatter_tensor(g, "sum", gs, gname))
        if config.reduce_scatter == "copy_engine":  # counted where the others are, with its reason
            from ..rs_reasons import RsReason
            from .reduce_scatter import note

            note(f"eager {ctx.name}", g.numel() * g.element_size(), RsReason.EAGER.says())
        if local.dtype != ctx.dtype:
            local = local.to(ctx.dtype)
        return (DTensor.from_local(local, ctx.mesh, ctx.placements, run_check=False, shape=ctx.shape,
                                   stride=ctx.stride), None, None, None, None)


def gather_param(x, forward_dtype: torch.dtype | None = None,
                 backward_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """The full weight of the ``Shard(0)`` DTensor parameter ``x``, as
    ``x.redistribute(placements=[Replicate()], forward_dtype=..., backward_dtype=...)
    .to_local(grad_placements=[Partial()])`` gives it, gathered outside a compiled graph
    (NOTE [eager gathers]); None when this gather is not served here (the caller runs its
    own; the gather is counted with the reason). Call it only when ``tracing(x)`` is False.

    >>> full = gather_param(linear._parameters["weight"], torch.bfloat16, torch.float32)
    """
    if not active:
        return None
    dtype = forward_dtype or x.dtype
    at = where()
    why = _judge(x, dtype)
    name = name_of(x)
    if not why and _updates.is_open():
        why = "inside torch_ce.updating_weights (the windows are being written)"
    if why:
        from torch.distributed.tensor import DTensor

        if isinstance(x, DTensor) and x.device_mesh.ndim >= 1:
            dims = [i for i, p in enumerate(x.placements) if p.is_shard()]
            gs = 1
            for i in dims:
                gs *= x.device_mesh.size(i)
            if gs > 1:
                if config.transport == "copy_engine" and not why.startswith("inside torch_ce.updating"):
                    _warn(name, why, at)
                report.count_eager(name, "collective", why, at, x._local_tensor.numel() * gs * dtype.itemsize)
        return None
    if x.device_mesh.size(0) == 1:
        return None  # nothing to gather
    if torch.is_grad_enabled() and x.requires_grad:
        return _EagerGather.apply(x, dtype, backward_dtype or x.dtype, name, at)
    return _gather(x, dtype, name, at)
