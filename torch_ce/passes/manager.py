"""The pass manager: runs gate -> plan -> rewrite -> bucket on each post-grad graph, and
installs / removes torch_ce in ``torch._inductor.config`` exactly.

Order (DESIGN.md, "The pipeline"): gate decides per gather; plan lists the weights the bind
step takes; rewrite retargets the eligible gathers and inserts the bind step; bucket
coalesces adjacent ones. The reorder (``reorder.py``) runs later, on Inductor's scheduler nodes.

The manager is a ``CustomGraphPass`` whose ``uuid()`` is ``identity.identity(config)`` (the
source of every module that shapes the compiled graph, and every config value that changes
it), so the FX graph cache stays on and stays correct.
"""
from __future__ import annotations

import collections
import hashlib
import logging
from typing import Any

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

try:  # torch >= 2.12 tells inference-aware passes whether the graph is an inference graph
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
except ImportError:  # pragma: no cover - older torch: gate.graph_reason falls back on names
    _PassBase = CustomGraphPass

from .. import report
from ..config import config, update
from . import bucket as bucket_mod
from . import gate as gate_mod, param_names, plan as plan_mod, prefetch as prefetch_mod, rewrite as rewrite_mod
from . import rows as rows_mod
from .identity import identity
from .reshard import ReshardPass

log = logging.getLogger("torch_ce")


# Callables run with each graph after our passes (tests record golden dumps here).
observers: list = []


def run_passes(graph: fx.Graph, is_inference: bool | None = None) -> report.GraphRecord | None:
    """gate -> plan -> rewrite -> rows -> bucket -> prefetch on one post-grad graph
    (copy_engine)."""
    if config.transport != "copy_engine":
        return None
    seeds = gate_mod.gate(graph, config, is_inference)
    if not seeds:
        return None
    rec = report.new_graph(config.transport)
    refused_whole = gate_mod.graph_reason(graph, is_inference, config)
    p = plan_mod.plan(seeds, whole_graph_refused=refused_whole is not None)
    # A training forward refreshes its staging slots; its backward only reads them.
    bind_node = rewrite_mod.rewrite(graph, p, refresh=not gate_mod.is_backward_graph(graph))
    # NOTE [row gathers] in rows.py: the row-gathered weights' gathers leave the graph.
    # Not in training graphs yet: a row gather would have to read the staging slot.
    row_weights = rows_mod.find(seeds) if config.row_gathers and not p.staged else []
    gone = rows_mod.rewrite(graph, row_weights)
    kept = [s for s in seeds if id(s) not in gone]
    buckets = [] if refused_whole else bucket_mod.bucket(graph, kept, config)
    # Cross-call prefetch parks gathers for the next call: stale after an optimizer step.
    pf_node, pf_what = (None, "off") if p.staged else prefetch_mod.insert_prefetch(graph, buckets, config)
    if pf_what != "off":
        rec.prefetch = dict(members=[a.name for a in pf_node.args[0]] if pf_node is not None else [],
                            what=pf_what)
    # One row per weight (a forward may gather a weight twice: torchtitan's Embedding reads
    # its parametrized weight twice), named by its parameter (NOTE [parameter names]).
    rows: dict = {}
    for s in seeds:
        key = s.weight if s.weight is not None else s.shard
        rows.setdefault(key, []).append(s)
    row_of = {rw.weight: rw for rw in row_weights}
    for key, ss in rows.items():
        ok = [s for s in ss if s.eligible]
        row = dict(name=getattr(key, "name", str(key)), param=param_names.param_name(key), gathers=len(ss))
        if ok:
            rw = row_of.get(ok[0].shard)
            rec.bound.append(dict(row, bytes=ok[0].nbytes, group=ok[0].group_name,
                                  refused_gathers=[str(s.reason) for s in ss if not s.eligible],
                                  rows=rw.account() if rw is not None else None,
                                  staged=str(ok[0].stage_dtype).removeprefix("torch.") if p.staged else None,
                                  cast_slot=(str(ok[0].stage_dtype).removeprefix("torch.")
                                             if ok[0].cast_slot else None),
                                  padded_rows=ok[0].padded_rows or None))
        else:
            rec.refused.append(dict(row, reason=str(ss[0].reason)))
    for b in buckets:
        rec.buckets.append(dict(kind="ce" if b.bound else "collective",
                                members=[m.shard.name for m in b.members], bytes=b.nbytes))
    graph.lint()
    gm = graph.owning_module
    if gm is not None:
        gm.recompile()
    counts = collections.Counter(r["reason"] for r in rec.refused)
    log.info(
        "torch_ce: graph %d: %d gather(s) -> copy engine (%.1f MiB, %d bucket(s), bind step %s, "
        "%d weight(s) by rows); %d refused %s; prefetch for the next call: %s",
        rec.graph_id, len(rec.bound), sum(b["bytes"] for b in rec.bound) / 2**20,
        sum(1 for b in buckets if b.bound),
        ("none" if bind_node is None else
         "inserted" if not p.staged else
         "staged (refresh + fences)" if bind_node.args[-1] else "staged (read only)"),
        sum(1 for rw in row_weights if rw.reason is None), len(rec.refused), dict(counts) if counts else "", pf_what,
    )
    return rec


class TorchCEPass(_PassBase):
    """torch_ce's post-grad pass, cache-safe through ``uuid()``."""

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        run_passes(graph, is_inference)
        for fn in observers:
            fn(graph)

    def uuid(self) -> Any:
        return identity(config)  # NOTE in identity.py: code, config and this rank's view


class _Chained(_PassBase):
    """A pass the user had installed, then ours (2.11 takes one callable per hook)."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        if _PassBase is not CustomGraphPass and isinstance(self.first, _PassBase):
            self.first(graph, is_inference=is_inference)
        else:
            self.first(graph)
        self.second(graph, is_inference)

    def uuid(self) -> Any:
        u = getattr(self.first, "uuid", None)
        first = u() if callable(u) else None
        if first is None:  # a bare function bypasses the caches, as it did before us
            return None
        return hashlib.sha256((str(first) + str(self.second.uuid())).encode()).hexdigest()


# Inductor settings that fight ours while our pass or our reorder is installed (NOTE in
# DESIGN.md: they only match all_gather_into_tensor, 2.11's overlap scheduler crashes on our
# buckets, and a second comm scheduler or Inductor's own CE gathers would undo our reorder's
# placement or its NCCL baseline).
_OFF = [
    # Hoists every collective to the top of the graph, which would make all weight gathers
    # "program-adjacent" (one bucket) and leave our reorder nothing to place.
    ("reorder_for_locality", False),
    ("bucket_all_gathers_fx", "none"),
    ("aten_distributed_optimizations.enable_overlap_scheduling", False),
    ("aten_distributed_optimizations.enable_low_contention_collectives", False),
]

class _ChainedJoint(CustomGraphPass):
    """A joint-graph pass the user had installed, then ours."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, graph: fx.Graph) -> None:
        self.first(graph)
        self.second(graph)

    def uuid(self) -> Any:
        u = getattr(self.first, "uuid", None)
        first = u() if callable(u) else None
        if first is None:
            return None
        return hashlib.sha256((str(first) + str(self.second.uuid())).encode()).hexdigest()


_saved: dict[str, Any] | None = None
_pass = TorchCEPass()
_reshard = ReshardPass()


def _get(cfg, dotted: str):
    obj = cfg
    *head, last = dotted.split(".")
    for h in head:
        obj = getattr(obj, h, None)
        if obj is None:
            return _MISSING
    return getattr(obj, last, _MISSING)


def _set(cfg, dotted: str, value) -> None:
    obj = cfg
    *head, last = dotted.split(".")
    for h in head:
        obj = getattr(obj, h)
    setattr(obj, last, value)


_MISSING = object()


def _install(ic) -> dict[str, Any]:
    """Apply the current config to Inductor's; returns the old values of what it changed.

    Our post-grad pass, always: with "copy_engine" it rewrites gathers; with "nccl" it
    leaves every graph as it is and only carries our cache identity, whose per-rank part
    keeps a cache dir shared by the ranks safe (NOTE [a cache shared by ranks] in
    identity.py). reorder: our reorder pass and cost estimate (either transport: with
    "nccl" it reorders the NCCL gathers). With "copy_engine" or reorder, the ``_OFF``
    settings; ``enable(transport="nccl", reorder=False)`` changes nothing else.
    """
    ce, reorder = config.transport == "copy_engine", config.reorder
    keys = ["post_grad_custom_post_pass"]
    if config.reshards_after_forward:
        keys.append("joint_custom_pre_pass")
    if reorder:
        keys += ["reorder_for_compute_comm_overlap", "reorder_for_compute_comm_overlap_passes",
                 "estimate_op_runtime"]
    if ce or reorder:
        keys += [k for k, _ in _OFF]
    saved = {k: _get(ic, k) for k in keys}
    prev = saved["post_grad_custom_post_pass"]
    if prev is None:
        ic.post_grad_custom_post_pass = _pass
    elif isinstance(prev, (list, tuple)):
        ic.post_grad_custom_post_pass = type(prev)([*prev, _pass])
    else:
        ic.post_grad_custom_post_pass = _Chained(prev, _pass)
    if config.reshards_after_forward:  # NOTE [reshard after forward] in reshard.py
        prev = saved["joint_custom_pre_pass"]
        ic.joint_custom_pre_pass = _reshard if prev in (None, _MISSING) else _ChainedJoint(prev, _reshard)
    if reorder:
        from .reorder import install as install_reorder

        install_reorder(ic)
    if ce or reorder:
        for k, v in _OFF:
            if saved[k] is not _MISSING:
                _set(ic, k, v)
    return saved


def _restore(ic) -> None:
    global _saved
    for k, v in (_saved or {}).items():
        if v is not _MISSING:
            _set(ic, k, v)
    _saved = None


def enable(**overrides: Any):
    """Apply ``overrides`` to the config, then make Inductor's config match it: each call
    first undoes what the previous one installed (``enable(); enable(reorder=False)``
    leaves no reorder), so ``disable()`` restores what was there before the first call."""
    global _saved
    import torch._inductor.config as ic

    if overrides:
        update(**overrides)
    from ..inductor_lowering import register_lowerings

    register_lowerings()
    _restore(ic)
    _saved = _install(ic)
    log.info("torch_ce: enabled (transport=%s, reorder=%s)", config.transport, config.reorder)
    return config


def disable() -> None:
    """Restore every Inductor setting enable() changed, exactly."""
    import torch._inductor.config as ic

    if _saved is None:
        return
    _restore(ic)
    log.info("torch_ce: disabled")


def is_enabled() -> bool:
    return _saved is not None
