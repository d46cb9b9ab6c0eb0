"""The pass pipeline: gate -> plan -> rewrite -> rows -> bucket -> prefetch on each post-grad
graph, and the record ``explain()`` reads.

Order (DESIGN.md, "The pipeline"): gate decides per gather; plan lists the weights the bind
step takes; rewrite retargets the eligible gathers and inserts the bind step (the stage step
in a training graph); rows turns embedding lookups of a gathered weight into row gathers;
bucket coalesces adjacent gathers; prefetch (opt-in) lists the next call's first weights.
The reorder (``reorder.py``) runs later, on Inductor's scheduler nodes; the joint-graph
reshard (``reshard.py``) earlier. ``install.py`` puts these passes into Inductor's config.

``TorchCEPass`` is a ``CustomGraphPass`` whose ``uuid()`` is ``identity.identity(config)``
(the source of every module that shapes the compiled graph, and every config value that
changes it), so the FX graph cache stays on and stays correct.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import logging
from typing import Any, Callable, Iterator

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

try:  # torch >= 2.12 tells inference-aware passes whether the graph is an inference graph
    from torch._inductor.custom_graph_pass import CustomInferenceAwareGraphPass as _PassBase
except ImportError:  # pragma: no cover - older torch: gate.graph_reason falls back on names
    _PassBase = CustomGraphPass

from .. import report
from ..config import config
from . import bucket as bucket_mod, census, fx_utils as U
from . import gate as gate_mod, param_names, plan as plan_mod, prefetch as prefetch_mod, rewrite as rewrite_mod
from . import reduce_scatter as rs_mod, rows as rows_mod
from .identity import identity, note_mesh_dims

log = logging.getLogger("torch_ce")


_observers: list[Callable[[fx.Graph], None]] = []


@contextlib.contextmanager
def observing(fn: Callable[[fx.Graph], None]) -> Iterator[None]:
    """Inside the block, ``fn(graph)`` runs on each post-grad graph after our passes (the
    golden-dump tests record what the passes did)."""
    _observers.append(fn)
    try:
        yield
    finally:
        _observers.remove(fn)


# Set while a pipeline that ran torch_ce's passes on an FX graph itself (a graph_trainer
# pass pipeline: integrations/torchtitan.py) hands that graph to Inductor: the post-grad
# pass then leaves it alone (it was decided and recorded once, before Inductor).
_decided_before_inductor: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "torch_ce_decided_before_inductor", default=False)


@contextlib.contextmanager
def decided_before_inductor() -> Iterator[None]:
    """Inside the block, ``TorchCEPass`` skips the graphs Inductor compiles: the caller ran
    torch_ce's passes (or its census) on them already."""
    token = _decided_before_inductor.set(True)
    try:
        yield
    finally:
        _decided_before_inductor.reset(token)


def run_passes(graph: fx.Graph, is_inference: bool | None = None, *,
               bucketer: Callable | None = None, scatters: bool = True) -> report.GraphRecord | None:
    """gate -> plan -> rewrite -> rows -> bucket -> prefetch on one post-grad graph
    (copy_engine), and the gradient reduce-scatters (``scatters``: a joint graph's wait for
    its caller's bucketing, passes/joint.py). ``bucketer(graph, seeds, config) -> [Bucket]``
    replaces the program-adjacent bucketing (``bucket.bucket``)."""
    if config.transport != "copy_engine":
        # The graph stays as it is; its gathers are counted (NOTE [every gather is counted]).
        return record_unserved(graph, census.NCCL_TRANSPORT)
    U.merge_waits(graph)  # NOTE [one gather, several waits] in fx_utils.py
    if is_inference and census.is_joint_graph(graph):  # NOTE [a joint graph is never an inference graph]
        log.info("torch_ce: a joint forward+backward graph compiled as inference: treated as training")
        is_inference = False
    # NOTE [every gather is counted] in census.py: bucketed forms are counted, not judged.
    seeds = [s for s in gate_mod.gate(graph, config, is_inference) if census.judged_by_gate(s.gather)]
    others = census.bucketed_gathers(graph)
    # NOTE [copy-engine reduce-scatter] in runtime/reduce_scatter/__init__.py: the
    # gradients' own pass.
    scatters = rs_mod.rewrite(graph, config) if scatters else []
    if not seeds:
        rec = record_unserved(graph, census.BUCKETED, others=others) if others else None
        if scatters:
            rec = rec or report.new_graph(config.transport)
            rec.reduce_scatters.extend(scatters)
            _log_scatters(rec)
            _recompile(graph)
        return rec
    rec = report.new_graph(config.transport)
    rec.reduce_scatters.extend(scatters)
    refused_whole = gate_mod.graph_reason(graph, is_inference, config)
    # NOTE [unread gathers] in gate.py: dropped on every rank before anything is planned.
    gate_mod.drop_unread(graph, seeds)
    live = [s for s in seeds if not s.unread]
    p = plan_mod.plan(live, whole_graph_refused=refused_whole is not None)
    # A training forward refreshes its staging slots; its backward only reads them.
    bind_node = rewrite_mod.rewrite(graph, p, refresh=not gate_mod.is_backward_graph(graph))
    rec.step_key = step_key_of(bind_node)  # NOTE [calls, not graphs] in report.py
    # NOTE [row gathers] in rows.py: the row-gathered weights' gathers leave the graph.
    # Not in training graphs yet: a row gather would have to read the staging slot.
    row_weights = rows_mod.find(live) if config.row_gathers and not p.staged else []
    gone = rows_mod.rewrite(graph, row_weights)
    kept = [s for s in live if id(s) not in gone]
    buckets = [] if refused_whole else (bucketer or bucket_mod.bucket)(graph, kept, config)
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
        name, param = getattr(key, "name", str(key)), param_names.param_name(key)
        # NOTE [coverage bytes] in report.py: what each gather writes, by where it runs.
        ce, coll = 0, collections.Counter()
        rw = row_of.get(key) if ok else None  # by the placeholder (a seed's shard may be its cast slot)
        for s in ss:
            nb = s.nbytes * s.group_size
            if s.unread:  # dropped: nothing gathered
                continue
            if not s.eligible:
                coll[str(s.reason)] += nb
            elif rw is None or rw.reason is not None:
                ce += nb
        if rw is not None and rw.reason is None:  # its gathers became row gathers
            per = rw.account()["bytes_per_forward"]
            ce += per if per is not None else sum(s.nbytes * s.group_size for s in ok)
        common = dict(name=name, param=param, gathers=len(ss), gathered_bytes=ce + sum(coll.values()),
                      ce_gathered_bytes=ce, collective_bytes=dict(coll))
        if ok:
            rec.bound.append(report.BoundWeight(
                **common, bytes=ok[0].nbytes, group=ok[0].group_name,
                refused_gathers=[str(s.reason) for s in ss if not s.eligible],
                rows=rw.account() if rw is not None else None,
                staged=str(ok[0].stage_dtype).removeprefix("torch.") if p.staged else None,
                cast_slot=str(ok[0].stage_dtype).removeprefix("torch.") if ok[0].cast_slot else None,
                padded_rows=ok[0].padded_rows or None))
        else:
            why = next((s.reason for s in ss if not s.unread), ss[0].reason)  # a live gather's first
            rec.refused.append(report.RefusedWeight(**common, reason=str(why), code=int(why.code)))
    _add_unserved(rec, others, census.BUCKETED)
    rec.buckets.extend(bucket_rows(buckets))
    _recompile(graph)
    counts = collections.Counter(r.reason for r in rec.refused)
    log.info(
        "torch_ce: graph %d: %d gather(s) -> copy engine (%.1f MiB, %d bucket(s), bind step %s, "
        "%d weight(s) by rows); %d refused %s; prefetch for the next call: %s",
        rec.graph_id, len(rec.bound), sum(b.bytes for b in rec.bound) / 2**20,
        sum(1 for b in buckets if b.bound),
        ("none" if bind_node is None else
         "inserted" if not p.staged else
         "staged (refresh + fences)" if bind_node.args[-1] else "staged (read only)"),
        sum(1 for rw in row_weights if rw.reason is None), len(rec.refused), dict(counts) if counts else "", pf_what,
    )
    _log_scatters(rec)
    return rec


def step_key_of(step: fx.Node | None) -> tuple | None:
    """The key the run time counts the calls of a graph under (NOTE [calls, not graphs] in
    report.py): from its bind step's or stage step's constant arguments."""
    if step is None:
        return None
    numel = 0
    for n in step.args[0]:
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        k = U.numel(val) if val is not None else None
        if k is None:  # a dynamic shard size: its calls are not matched
            return None
        numel += int(k)
    if step.target is U.magi.ce_bind.default:
        return report.step_key("bind", step.args[3], numel)
    a = list(step.args)
    refresh = a[6] if len(a) > 6 else step.kwargs.get("refresh", False)
    static = a[8] if len(a) > 8 else step.kwargs.get("static", False)
    return report.step_key("stage", a[4], numel, tuple(a[1]), bool(refresh), bool(static))


def _recompile(graph: fx.Graph) -> None:
    graph.lint()
    gm = graph.owning_module
    if gm is not None:
        gm.recompile()


def add_scatters(graph: fx.Graph, rec: report.GraphRecord | None) -> report.GraphRecord | None:
    """The gradient reduce-scatters of ``graph`` retargeted (passes/reduce_scatter.py) and
    added to ``rec`` (a new record when there is none and the graph has some)."""
    rows = rs_mod.rewrite(graph, config)
    if rows:
        rec = rec or report.new_graph(config.transport)
        rec.reduce_scatters.extend(rows)
        _log_scatters(rec)
    return rec


def _log_scatters(rec: report.GraphRecord) -> None:
    rows = rec.reduce_scatters
    if not rows:
        return
    ce = [r for r in rows if r["kind"] == "ce"]
    why = collections.Counter(r["reason"] for r in rows if r["kind"] != "ce")
    log.info("torch_ce: graph %d: %d of %d reduce-scatter(s) -> copy engine (%.1f of %.1f MiB)%s",
             rec.graph_id, len(ce), len(rows), sum(r["bytes"] for r in ce) / 2**20,
             sum(r["bytes"] for r in rows) / 2**20, f"; on the collective: {dict(why)}" if why else "")


def bucket_rows(buckets: list) -> list[dict]:
    """The record's view of buckets (bucket.Bucket): kind, member shards, bytes."""
    return [dict(kind="ce" if b.bound else "collective", members=[m.shard.name for m in b.members],
                 bytes=b.nbytes) for b in buckets]


def _add_unserved(rec: report.GraphRecord, members: list, why) -> None:
    """One refused row per graph input that ``members`` (census.Member) gather."""
    by_src: dict = {}
    for m in members:
        by_src.setdefault(m.source if m.source is not None else m.gather, []).append(m)
    for key, ms in by_src.items():
        nb = sum(m.nbytes for m in ms)
        rec.refused.append(report.RefusedWeight(
            name=key.name, param=param_names.param_name(key), gathers=len(ms), gathered_bytes=nb,
            ce_gathered_bytes=0, collective_bytes={str(why): nb}, reason=str(why), code=int(why.code)))


def record_unserved(graph: fx.Graph, why, *, others: list | None = None) -> report.GraphRecord | None:
    """A record of a graph whose weight gathers all stay on the collective, for ``why``
    (a ``Refusal``): the gate's gathers and the bucketed ones (NOTE [every gather is
    counted] in census.py). None when the graph gathers nothing. The graph is unchanged."""
    plain = [census.Member(g, census.source_of(g.args[0]), (U.nbytes(g.args[0].meta.get("val")) or 0)
                           * int(g.args[1]), "all_gather_into_tensor")
             for g in U.find_op_nodes(graph, U.ALL_GATHER) if census.judged_by_gate(g)
             and isinstance(g.args[0], fx.Node)]
    members = plain + (census.bucketed_gathers(graph) if others is None else others)
    if not members:
        return None
    rec = report.new_graph(config.transport)
    _add_unserved(rec, members, why)
    log.info("torch_ce: graph %d: %d weight gather(s) stay on the collective (%.1f MiB): %s",
             rec.graph_id, len(members), sum(m.nbytes for m in members) / 2**20, why)
    return rec


class TorchCEPass(_PassBase):
    """torch_ce's post-grad pass, cache-safe through ``uuid()``."""

    def __call__(self, graph: fx.Graph, is_inference: bool | None = None) -> None:
        if _decided_before_inductor.get():
            return  # decided (and recorded) on the FX graph already: decided_before_inductor
        note_mesh_dims()
        from ..integrations import simple_fsdp  # a SimpleFSDP imported after enable()

        simple_fsdp.install()
        run_passes(graph, is_inference)
        for fn in list(_observers):
            fn(graph)

    def uuid(self) -> Any:
        # NOTE in identity.py: code, config and this rank's view; and whether this pass runs
        if _decided_before_inductor.get():
            return identity(config) + ":decided-before-inductor"
        return identity(config)
