"""torch_ce's passes on a traced joint training graph (forward + loss + backward in one FX
graph, as torchtitan's graph_trainer traces a step), before Inductor sees it.

``run(gm, state)`` is ``manager.run_passes`` on the joint graph with training semantics,
the facts the gate asks for given by the tracer instead of AOTAutograd (``JointRun``
carries them, and what ``launch`` needs later); ``launch(gm, state)``, run after the
caller's own collective scheduling, coalesces the CE gathers along the caller's bucket
plan and launches them early (``plan_bucketer``). ``record_unserved(gm, facts, why)``
records the graph's gathers as collective bytes without touching it (a pipeline that does
not run torch_ce). The caller (``torch_ce/integrations/torchtitan.py``) decides when to
call them.

# NOTE [joint graphs: facts from the tracer]
The gate reads which inputs are parameters and which the graph mutates from AOTAutograd's
metadata, and names from Dynamo's frame (NOTE [parameter names]). A graph traced by
make_fx has neither: its placeholders are the flat step inputs, parameters first (each
DTensor unwrapped to its local shard), then buffers and the batch. The tracer knows them
(graph_trainer's ``TracedResult``: state FQNs, subclass layouts), so ``JointFacts`` carries
them in: which flat inputs are parameter shards (``weights``), their state FQNs
(``names``, what ``explain()`` lists), and the inputs the graph mutates, read from the
graph's own in-place ops (an MoE layer's token counts). ``_facts`` hands them to the gate
as AOTAutograd would (a tracing context whose ``fw_metadata`` has ``static_input_indices``
and ``input_info``), so the gate's rules are the same code for both kinds of graph. The
graph is always a training graph here (``is_inference=False``; NOTE [a joint graph is
never an inference graph] in census.py): one stage step at its head refreshes every
staging slot between the two step fences, and every gather, forward and backward (the
backward's are the memory policy's recomputed copies), reads the slots.

# NOTE [buckets along the caller's plan, launched one bucket early]
The post-grad pipeline coalesces program-adjacent gathers and leaves their placement to
Inductor's scheduler and our reorder. A graph that is run as FX (graph_trainer's regional
Inductor compiles only tagged regions) has neither: the FX order is the execution order.
So the CE gathers are coalesced along the caller's bucket plan (graph_trainer's
transformer-block plan: one bucket per block and direction, by the ``module_fqn`` each node
carries, matched as graph_trainer's own bucketer matches it), one
``ce_all_gather_coalesced`` per (plan entry, direction, group, dtype) capped by
``bucket_size_mib``, and each bucket's launch is moved just before the first consumer of
the bucket before it in the same direction: its copies run while that block computes,
which is graph_trainer's prefetch depth for its NCCL buckets. The waits stay at their
consumers. Refused, uneven (padded) and Shard(d) gathers stay single and where they were
(NOTE [refused gathers stay single] in bucket.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import types
from typing import Callable, Iterator

import torch
import torch.fx as fx

from .. import report
from ..config import config
from . import bucket as bucket_mod, census, manager
from . import param_names

log = logging.getLogger("torch_ce")


@dataclasses.dataclass
class JointFacts:
    """What the tracer knows about a joint graph's flat inputs (NOTE [joint graphs: facts
    from the tracer])."""

    names: dict  # flat input index -> state FQN (a parameter's or buffer's)
    weights: frozenset  # flat input indices that are parameter shards


def mutated_inputs(graph: fx.Graph) -> set[int]:
    """Flat input indices the graph writes in place (through a view or directly)."""
    phs = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    out: set[int] = set()
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        schema = n.target._schema
        if not schema.is_mutable:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
            for x in v if isinstance(v, (list, tuple)) else [v]:
                src = census.source_of(x)
                if src in phs:
                    out.add(phs[src])
    return out


def _fake_mode(graph: fx.Graph):
    for n in graph.nodes:
        val = n.meta.get("val") if n.op == "placeholder" else None
        if getattr(val, "fake_mode", None) is not None:
            return val.fake_mode
    return None


@contextlib.contextmanager
def _facts(graph: fx.Graph, facts: JointFacts) -> Iterator[None]:
    """The tracer's facts where the gate and the namer look for them."""
    phs = [n for n in graph.nodes if n.op == "placeholder"]
    for i, ph in enumerate(phs):
        if i in facts.names:
            ph.meta[param_names._META_KEY] = facts.names[i]
    mutated = mutated_inputs(graph)
    info = [types.SimpleNamespace(mutates_data=i in mutated, mutates_metadata=False, requires_grad=False)
            for i in range(len(phs))]
    ctx = torch._guards.TracingContext(_fake_mode(graph))
    ctx.fw_metadata = types.SimpleNamespace(static_input_indices=sorted(facts.weights), input_info=info)
    with torch._guards.tracing(ctx), config.patch(transport="copy_engine"):
        yield


@dataclasses.dataclass
class JointRun:
    """One joint graph between ``run`` (the decisions, before the caller's own collective
    scheduling) and ``launch`` (the buckets, after it: NOTE [buckets along the caller's
    plan, launched one bucket early])."""

    facts: JointFacts
    plans: list | None = None  # the bucket plan: module FQNs (or lists of them) per bucket
    module_fqn: Callable[[fx.Node], str] | None = None  # the module a node belongs to
    is_backward: Callable[[fx.Node], bool] | None = None
    record: report.GraphRecord | None = None
    seeds: list = dataclasses.field(default_factory=list)  # the gathers left to bucket


def run(gm: fx.GraphModule, state: JointRun) -> report.GraphRecord | None:
    """torch_ce's passes on the joint graph ``gm`` (module docstring), in place, each
    gather left single (``launch`` buckets them); its record."""

    def keep_single(graph, seeds, cfg):
        state.seeds = list(seeds)
        return [bucket_mod.Bucket([s], s.eligible, s.gather) for s in seeds]

    with _facts(gm.graph, state.facts):
        # The reduce-scatters wait for the caller's bucketing: ``launch`` retargets them.
        state.record = manager.run_passes(gm.graph, is_inference=False, bucketer=keep_single, scatters=False)
    gm.recompile()
    return state.record


def launch(gm: fx.GraphModule, state: JointRun) -> list:
    """The CE gathers ``run`` left coalesced along the plan and launched one bucket early
    (program-adjacent buckets without a plan), and the caller's gradient reduce-scatters,
    bucketed by it, retargeted (``reduce_scatter="copy_engine"``); the record lists both."""
    # A refused gather stayed a plain collective, which the caller's own bucketing may have
    # replaced since ``run``: only the gathers still in the graph are left to bucket.
    live = set(gm.graph.nodes)
    seeds = [s for s in state.seeds if s.gather in live]
    # NOTE [copy-engine reduce-scatter]: the caller's reduce-scatter buckets, as it made them.
    with config.patch(transport="copy_engine"):
        state.record = manager.add_scatters(gm.graph, state.record)
    if not seeds:
        gm.graph.lint()
        gm.recompile()
        return []
    with config.patch(transport="copy_engine"):
        if state.plans is not None and state.module_fqn is not None:
            bucketer = plan_bucketer(state.plans, state.module_fqn, state.is_backward or (lambda n: False))
            buckets = bucketer(gm.graph, seeds, config)
        else:
            buckets = bucket_mod.bucket(gm.graph, seeds, config)
    if state.record is not None:
        state.record.buckets = manager.bucket_rows(buckets)
    gm.graph.lint()
    gm.recompile()
    return buckets


def record_unserved(gm: fx.GraphModule, facts: JointFacts, why) -> report.GraphRecord | None:
    """The graph's weight gathers as collective bytes for ``why``; the graph is unchanged."""
    with _facts(gm.graph, facts):
        return manager.record_unserved(gm.graph, why)


def plan_bucketer(plans: list, module_fqn: Callable[[fx.Node], str],
                  is_backward: Callable[[fx.Node], bool]) -> Callable:
    """A ``run_passes`` bucketer (NOTE [buckets along the caller's plan, launched one bucket
    early])."""

    def bucketer(graph: fx.Graph, seeds: list, cfg) -> list:
        from torch._inductor.fx_passes.graph_view import get_subgraph_by_path, make_graph_view

        view = make_graph_view(graph, lambda n: [(module_fqn(n), torch.nn.Module)] if module_fqn(n) else [])
        plan_of: dict = {}
        for i, p in enumerate(plans if view is not None else []):
            for n in get_subgraph_by_path(view, p):
                plan_of.setdefault(n, i)
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_bwd = next((order[n] for n in graph.nodes if is_backward(n)), len(order))
        groups: dict = {}
        buckets, direction = [], {}
        for s in seeds:
            i = plan_of.get(s.gather)
            if not s.eligible or s.padded_rows or s.gather_dim or i is None:
                buckets.append(bucket_mod.Bucket([s], s.eligible))
                continue
            bwd = order[s.gather] >= first_bwd or is_backward(s.gather)
            key = (bwd, i, s.group_size, s.group_name, str(s.shard.meta["val"].dtype))
            groups.setdefault(key, []).append(s)
        cap = cfg.bucket_cap_bytes
        for (bwd, *_), members in groups.items():
            cur: list = []
            for s in members:
                if cur and cap and sum(m.nbytes for m in cur) + s.nbytes > cap:
                    buckets.append(bucket_mod.Bucket(cur, True))
                    direction[id(buckets[-1])] = bwd
                    cur = []
                cur.append(s)
            buckets.append(bucket_mod.Bucket(cur, True))
            direction[id(buckets[-1])] = bwd
        buckets.sort(key=lambda b: order[b.members[0].gather])
        bucket_mod.coalesce(graph, buckets)
        early = launch_early(graph, [b for b in buckets if id(b) in direction], direction)
        log.info("torch_ce: %d copy-engine bucket(s) along the plan, %d launched one bucket early",
                 len(direction), early)
        return buckets

    return bucketer


def launch_early(graph: fx.Graph, buckets: list, direction: dict) -> int:
    """Move each bucket's launch (its node and the getitems of a coalesced one) before the
    first wait of the bucket before it in the same direction; returns how many moved."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    moved = 0
    for bwd in (False, True):
        chain = sorted((b for b in buckets if direction[id(b)] == bwd), key=lambda b: order[b.node])
        for prev, cur in zip(chain, chain[1:]):
            waits = [u for m in prev.members for u in m.gather.users]
            if not waits:
                continue
            target = min(waits, key=lambda u: order[u])
            if order[target] >= order[cur.node]:
                continue
            launch = [cur.node] + [m.gather for m in cur.members if m.gather is not cur.node]
            for n in launch:
                target.prepend(n)
            moved += 1
    return moved
