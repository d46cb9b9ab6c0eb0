"""torch_ce in torchtitan's graph_trainer: the ``"torch_ce"`` pass pipeline.

graph_trainer (torchtitan >= 0.3.0) trains by default with ``compile.mode = "aot_fx_trace"``:
``minimal_fx_tracer(make_fwd_bwd_step(model, loss_fn))`` traces forward, loss and backward
into one FX graph, the pass pipeline named by ``compile.pass_pipeline`` transforms it
(``apply_graph_passes``) and ``run_traced`` runs it every step. Plain ``torch.compile``
never sees that graph, so ``torch_ce.enable()`` alone serves none of its gathers.
Importing this module registers, in graph_trainer's registries:

- the pass pipeline ``"torch_ce"`` (``torch_ce_graph_passes``): graph_trainer's default
  pipeline with ``torch_ce_pass`` inserted after the memory policy's rematerialization and
  before graph_trainer's FSDP bucketing (``joint_transformer_block_bucketing_reordering_pass``):
  the weight gathers, forward and the backward's recomputed ones, become copy-engine
  gathers of staging slots (NOTE [joint graphs: facts from the tracer] in
  passes/joint.py), coalesced along graph_trainer's own transformer-block bucket plan and
  launched one bucket early (NOTE [buckets along the caller's plan, launched one bucket
  early]); the gradient reduce-scatters keep graph_trainer's bucketing, process-group
  reassignment and ordering; regional or full Inductor compiles what follows, as in the
  default pipeline;
- its post-init hook (``post_init``): refuses a precompiled artifact (NOTE [no precompiled
  artifacts]) and an out-of-process FX compile, registers the Inductor lowerings of the
  magi ops, and warns when graph_trainer will not run the pipeline at all (another
  ``compile.mode``, pipeline parallelism, ``compile.enable_passes`` false: NOTE [said when
  nothing is served]); no pre-train-step hook is needed (the stage step at the graph's head
  does the per-step work, NOTE [training: staged windows and step fences] in
  runtime/staging.py);
- an observer of the ``"default"`` pipeline (``default_graph_passes``): graph_trainer's
  list as it is, unless ``torch_ce.enable(transport="copy_engine")`` is on; then two things
  change, and its warning says both: a census pass before the Inductor passes records every
  weight gather as collective bytes whose reason names ``--compile.pass_pipeline torch_ce``
  (NOTE [every gather is counted] in passes/census.py), so a user reads why nothing is on
  the copy engines instead of "100.0% of 0 gathered B"; and graph_trainer's Inductor passes
  compile with the Inductor settings ``enable()`` changed (torch_ce's own post-grad pass
  off there). The observer is registered whichever of graph_trainer's import and
  ``enable()`` comes first (integrations/import_hook.py).

What torch_ce takes from graph_trainer (its node annotations, pass names, traced-input
layouts, the passes it must run before, its families) is found and checked once, at
registration (integrations/graph_trainer_api.py): a torchtitan that renamed one fails with
an error that says which, never a pipeline that quietly serves nothing.

# NOTE [said when nothing is served]
Users check the log for ``torch_ce: graph_trainer trains through the 'torch_ce' pass
pipeline``. That line is printed by ``torch_ce_pass`` once it has decided a graph, with the
graph's coverage; never at construction, since graph_trainer may never run the pipeline.
Where it will not (``_not_run_by``), the post-init hook warns with the setting and the
route that works there; a graph of which the pipeline serves no byte warns with its top
reasons; a graph with no weight gather says so.

From torchtitan's command line (``torchrun ... -m torchtitan.train``), either
``--module torch_ce.integrations.torchtitan --config <a graph_trainer config name>``: this
module is the config registry, and ``graph_trainer_<family>_<flavor>`` is graph_trainer's
config of that name with ``compile.pass_pipeline = "torch_ce"`` (``__getattr__``); or, with
graph_trainer's own (or your) ``--module``/``--config``, ``--override.imports
torch_ce.integrations.torchtitan.register_pipeline --compile.pass_pipeline torch_ce``
(torchtitan imports the override's module, which registers the pipeline; the override
itself changes nothing). README.md has the lines.

# NOTE [no precompiled artifacts]
``compile.precompile_artifact_dir`` makes graph_trainer load a graph that
``precompile_main`` traced and passed through ``compile_time_passes``, graph_trainer's
own list, never a registered pipeline: the artifact's weight gathers are already bucketed
NCCL collectives, and its serializer keeps only aten, c10d, dtensor, device_mesh and
bucketing ops, so an artifact could not hold the magi ops anyway. A torch_ce run from such
an artifact would silently be an NCCL run, so the pipeline refuses it with an error that
says what to unset, at trainer construction and again when the pipeline is built.

# NOTE [CUDA graphs under the torch_ce pipeline]
graph_trainer wraps the finished graph in its ``CUDAGraphWrapper`` (``cudagraph_pass``, on
by default on GPU): the first call runs eagerly (warm-up), the second is captured, every
later one replays. torch_ce's ops are capture-safe in that order: the warm-up run binds the
staging slots (on a thread of its own, off the graph pool: NOTE [bind off the graph pool]
in runtime/binding.py); the capture records the stage step's fences (one-element NCCL
all_reduces), its refresh copies and the gathers' copies (per-peer ``cudaMemcpyAsync``
during capture, NOTE in runtime/cuda.py), all stream-ordered; a replay re-runs exactly those
with the same slots and weights (graph_trainer keeps parameters at fixed addresses), and no
host-side decision is skipped (the stage step decides nothing after its first run in a
joint graph: it always refreshes). So the pipeline keeps ``cudagraph_pass``.
test/test_graph_trainer_cuda.py captures and replays the stage step and CE gathers under
graph_trainer's own wrapper on one GPU's loopback slots.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable

from . import graph_trainer_api as G

log = logging.getLogger("torch_ce")

PIPELINE = "torch_ce"
OPTION = f"--compile.pass_pipeline {PIPELINE}"
# graph_trainer's Inductor passes (one of them ends every pipeline it builds), and the
# passes that end a pipeline: torch_ce's launch pass and the census go before them.
_INDUCTOR = ("regional_inductor_pass", "full_inductor_compilation_pass")
_TERMINAL = ("annotate_flex_attention_for_regional_inductor_pass", *_INDUCTOR, "cudagraph_pass")


def _pass_name(p: Callable) -> str:
    """graph_trainer's name of a pass (what ``--compile.disable_passes`` matches)."""
    return G.partner().pass_name(p)


def _refusal(code_name: str, text: str):
    from ..runtime.eligibility import Reason, Refusal

    return Refusal(getattr(Reason, code_name), text)


def not_in_pipeline():
    """The reason of a gather graph_trainer's default pipeline left on the collective."""
    return _refusal("NOT_IN_PIPELINE",
                    f"graph_trainer's pass pipeline is not torch_ce's: its passes did not run on this "
                    f"graph ({OPTION}, after importing torch_ce.integrations.torchtitan)")


# ---------------------------------------------------------------------------------------
# What the tracer knows
# ---------------------------------------------------------------------------------------


def joint_facts(traced_result) -> Any:
    """``passes.joint.JointFacts`` of a graph_trainer ``TracedResult``: the flat inputs are
    the state (``state_fqns``), each DTensor unwrapped into its inner values as
    ``input_subclass_layouts`` says (its ``_local_tensor``, and on torch 2.13 its device
    mesh as an opaque input), then the batch; a parameter shard is a DTensor state entry's
    ``_local_tensor``."""
    from torch.distributed.tensor import DTensor

    from ..passes.joint import JointFacts

    names, weights, flat = {}, set(), 0
    for i, fqn in enumerate(traced_result.state_fqns):
        layout = traced_result.input_subclass_layouts.get(i)
        n = layout.num_tensors if layout is not None else 1
        meta = layout.meta if layout is not None else None  # fields checked: graph_trainer_api
        for k in range(n):
            names[flat + k] = fqn
        if meta is not None and isinstance(meta.cls, type) and issubclass(meta.cls, DTensor):
            at = 0
            for attr in meta.attrs:
                if attr == "_local_tensor":
                    weights.add(flat + at)
                at += meta.inner_metas[attr][0]
        flat += n
    return JointFacts(names, frozenset(weights))


# ---------------------------------------------------------------------------------------
# The passes
# ---------------------------------------------------------------------------------------


def _served(record) -> Any:
    """A graph record's gathered bytes as ``explain``'s ``Coverage``: what the gate put on
    the copy engines, the rest by reason."""
    from ..explanation import Coverage

    cov = Coverage(graph_id=record.graph_id)
    for w in record.bound:
        cov.add(w.ce_gathered_bytes, dict(w.collective_bytes))
    for w in record.refused:
        cov.add(0, dict(w.collective_bytes))
    return cov


def _say_what_was_served(record) -> None:
    """The line the README tells users to look for, once the pipeline ran on a graph; a
    warning with the top reasons when it serves none of the graph's gathered bytes."""
    cov = _served(record)
    if cov.ce_bytes:
        log.info("torch_ce: graph_trainer trains through the %r pass pipeline: %s", PIPELINE, cov.line())
        return
    grouped: dict = {}  # a reason without its per-weight details -> [bytes, one full text]
    for why, nb in cov.by_reason.items():
        g = grouped.setdefault(why.split(" (")[0], [0, why])
        g[0] += nb
    top = sorted(grouped.values(), key=lambda g: -g[0])[:3]
    log.warning("torch_ce: the %r pass pipeline put none of this step graph's %s gathered weight bytes "
                "on the copy engines; top reasons: %s", PIPELINE, f"{cov.collective_bytes:,d}",
                "; ".join(f"{nb:,d} B {why}" for nb, why in top) or "no weight gather of any bytes")


def torch_ce_pass(gm, example_inputs, *, state):
    """torch_ce's decisions on graph_trainer's joint graph (passes/joint.py ``run``), in
    place: every weight gather a copy-engine gather of a staging slot, or refused with its
    reason; what it served, said (``_say_what_was_served``)."""
    from ..passes import joint

    del example_inputs
    record = joint.run(gm, state)
    if record is None:
        log.warning("torch_ce: the graph_trainer step graph has no weight all-gather: nothing to serve")
    else:
        _say_what_was_served(record)
    return gm


def torch_ce_launch_pass(gm, example_inputs, *, state):
    """After graph_trainer's FSDP bucketing and scheduling (which then sees each CE gather
    alone: its overlap scheduler takes any op named ``*all_gather*`` for an NCCL collective,
    and cannot read a coalesced one's process group): the CE gathers coalesced along its
    bucket plan and launched one bucket early (passes/joint.py ``launch``)."""
    from ..passes import joint

    del example_inputs
    joint.launch(gm, state)
    return gm


def census_pass(gm, example_inputs, *, facts):
    """Record the graph's weight gathers as collective bytes (the default pipeline with
    torch_ce enabled); the graph is unchanged."""
    from ..passes import joint

    del example_inputs
    joint.record_unserved(gm, facts, not_in_pipeline())
    return gm


def _decided(p: Callable) -> Callable:
    """``p`` run with torch_ce's post-grad pass off (the graph was decided before
    Inductor: manager.decided_before_inductor), under ``p``'s own name (graph_trainer's
    ``--compile.disable_passes`` matches names)."""
    from ..passes.manager import decided_before_inductor

    def run(gm, example_inputs):
        with decided_before_inductor():
            return p(gm, example_inputs)

    run.__name__ = run.__qualname__ = _pass_name(p)
    return run


def _before_anchor(passes: list, new: Callable) -> list:
    """``new`` before graph_trainer's first FSDP collective pass (``G.require_anchor``:
    an error when there is none)."""
    at = G.require_anchor([_pass_name(p) for p in passes])
    return passes[:at] + [new] + passes[at:]


def _before_terminal(passes: list, new: Callable) -> list:
    """``new`` before the terminal Inductor / CUDA-graph passes; an error when the list has
    no Inductor pass (every pipeline graph_trainer builds ends in one: a list without one
    has renamed it, and ``_inductor_decided`` would not find it)."""
    names = [_pass_name(p) for p in passes]
    if not any(n in _INDUCTOR for n in names):
        raise G.changed(f"pass list has none of {list(_INDUCTOR)} (the list: {names})")
    at = next(i for i, n in enumerate(names) if n in _TERMINAL)
    return passes[:at] + [new] + passes[at:]


def _inductor_decided(passes: list) -> list:
    """The Inductor passes wrapped in ``_decided``."""
    return [_decided(p) if _pass_name(p) in _INDUCTOR else p for p in passes]


def _refuse_precompile(config) -> None:
    """NOTE [no precompiled artifacts]."""
    d = getattr(getattr(config, "compile", None), "precompile_artifact_dir", "")
    if d:
        raise ValueError(
            f"torch_ce: --compile.pass_pipeline {PIPELINE} cannot run from a precompiled artifact "
            f"(--compile.precompile_artifact_dir {d!r}): graph_trainer's precompile_main passes the "
            "graph through its own compile_time_passes, never a registered pipeline, so the artifact's "
            "weight gathers are bucketed NCCL collectives (and its serializer drops torch_ce's magi "
            "ops). Unset --compile.precompile_artifact_dir to trace and compile at the first step, or "
            "run the precompiled artifact with --compile.pass_pipeline default.")


def _bucket_plans(passes: list) -> list | None:
    """graph_trainer's transformer-block bucket plan (its bucketing pass's keyword); a
    warning naming the pass and the torchtitan version when it is not there."""
    bucketing = next((p for p in passes if _pass_name(p) == G.BUCKETING), None)
    plans = bucketing.keywords.get(G.BUCKET_PLANS) if isinstance(bucketing, functools.partial) else None
    if plans is None:
        log.warning("torch_ce: torchtitan %s's graph_trainer pipeline has no %s(%s=...): the copy-engine "
                    "gathers coalesce only where they are adjacent in the graph, and none is launched a "
                    "bucket early", G.torchtitan_version(), G.BUCKETING, G.BUCKET_PLANS)
    return plans


def torch_ce_graph_passes(traced_result, config, *, parallel_dims=None) -> list:
    """The ``"torch_ce"`` pipeline (module docstring)."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    from ..inductor_lowering import register_lowerings
    from ..passes.install import refuse_out_of_process_compile
    from ..passes.joint import JointRun

    _refuse_precompile(config)
    refuse_out_of_process_compile()
    register_lowerings()  # full Inductor compiles the magi ops (ce_staged's slots never reused)
    passes = construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
    partner = G.partner()
    state = JointRun(joint_facts(traced_result), _bucket_plans(passes), partner.module_fqn,
                     partner.is_backward)
    out = _before_anchor(passes, functools.partial(torch_ce_pass, state=state))
    out = _inductor_decided(_before_terminal(out, functools.partial(torch_ce_launch_pass, state=state)))
    log.info("torch_ce: graph_trainer pass pipeline %r: %s", PIPELINE, [_pass_name(p) for p in out])
    return out


def _ce_enabled() -> bool:
    from ..config import config as cfg
    from ..passes.install import is_enabled

    return is_enabled() and cfg.transport == "copy_engine"


def default_graph_passes(traced_result, config, *, parallel_dims=None) -> list:
    """graph_trainer's ``"default"`` pipeline, observed (module docstring): graph_trainer's
    own list; while torch_ce is enabled, with the census pass before its Inductor passes,
    which then run with the Inductor settings ``enable()`` changed (the warning lists them)."""
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    from ..passes.install import changed_settings

    passes = construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
    if not _ce_enabled():
        return passes
    log.warning("torch_ce is enabled but graph_trainer runs its default pass pipeline: no weight "
                "gather goes to the copy engines (%s). What torch_ce changes in that pipeline: a "
                "census pass before its Inductor passes, which counts the gathers and leaves the graph "
                "as it is; in those Inductor passes, torch_ce's post-grad pass is installed but off, "
                "and these settings are as torch_ce.enable() set them: %s", OPTION,
                ", ".join(f"{k}={v}" for k, v in changed_settings().items()
                          if k != "post_grad_custom_post_pass") or "none")
    census = functools.partial(census_pass, facts=joint_facts(traced_result))
    return _inductor_decided(_before_terminal(passes, census))


def _not_run_by(trainer) -> str | None:
    """Why graph_trainer will not run a registered pass pipeline for ``trainer`` (its
    ``trainer.py``: only ``compile.mode = "aot_fx_trace"`` traces the step, never under
    pipeline parallelism, and only with ``compile.enable_passes``), with the route that
    does work there; None when it will."""
    c = trainer.config.compile
    if c.mode != "aot_fx_trace":
        route = ('torch_ce.enable(transport="copy_engine") before the trainer is built serves the gathers '
                 "that torch.compile compiles" if c.mode == "jit" else
                 "nothing is compiled: --compile.mode aot_fx_trace (this pipeline) or jit with "
                 'torch_ce.enable(transport="copy_engine")')
        return (f"--compile.mode {c.mode}: graph_trainer runs a pass pipeline only under "
                f"--compile.mode aot_fx_trace. Here {route}")
    pdims = getattr(trainer, "parallel_dims", None)
    if getattr(pdims, "pp_enabled", False):
        return ("pipeline parallelism is on (--parallelism.pipeline_parallel_degree "
                f"{pdims.pp}): graph_trainer then runs torchtitan's plain training step, never a pass "
                'pipeline. Here torch_ce.enable(transport="copy_engine") with --compile.mode jit serves '
                "the gathers torch.compile compiles in each stage")
    if not c.enable_passes:
        return ("--compile.enable_passes is false: graph_trainer runs the traced step without any pass "
                "pipeline. Here --compile.enable_passes true runs this one")
    return None


def post_init(trainer) -> None:
    """The ``"torch_ce"`` pipeline's post-init hook (module docstring): refusals, the
    lowerings, and a warning when graph_trainer will not run the pipeline at all."""
    from ..inductor_lowering import register_lowerings
    from ..passes.install import refuse_out_of_process_compile

    _refuse_precompile(trainer.config)
    refuse_out_of_process_compile()
    register_lowerings()
    why = _not_run_by(trainer)
    if why is not None:
        log.warning("torch_ce: graph_trainer will not run the %r pass pipeline: no weight gather goes "
                    "to the copy engines. %s.", PIPELINE, why)
    else:
        log.info("torch_ce: the %r pass pipeline runs at graph_trainer's first step (a line then says "
                 "what it serves)", PIPELINE)


# ---------------------------------------------------------------------------------------
# Registration, and torchtitan's command line
# ---------------------------------------------------------------------------------------

_registered = False


def register() -> None:
    """Register the pipeline, its hook and the default observer (idempotent), once
    graph_trainer's helpers are found (``G.partner``: an error naming what is gone)."""
    global _registered
    if _registered:
        return
    from torchtitan.experiments.graph_trainer import registry

    from .import_hook import is_trampoline

    G.partner()
    registry.register_pass_pipeline(PIPELINE)(torch_ce_graph_passes)
    registry.register_post_init_hook(PIPELINE)(post_init)
    if is_trampoline(registry.PASS_PIPELINE_REGISTRY.get("default")):  # import_hook.py's
        del registry.PASS_PIPELINE_REGISTRY["default"]
    registry.PASS_PIPELINE_REGISTRY.setdefault("default", default_graph_passes)
    _registered = True


def _with_pipeline(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def config_fn():
        cfg = fn()
        cfg.compile.pass_pipeline = PIPELINE
        return cfg

    return config_fn


@functools.cache
def _graph_trainer_config(name: str) -> Callable | None:
    import importlib

    fams = G.families()
    for fam in [f for f in fams if name.startswith(f"graph_trainer_{f}_")] or list(fams):
        mod = importlib.import_module(f"{G.GT}.{fam}.config_registry")
        fn = getattr(mod, name, None)
        if callable(fn):
            return _with_pipeline(fn)
    return None


def __getattr__(name: str):
    """``graph_trainer_<family>_<flavor>``: graph_trainer's config of that name with the
    torch_ce pipeline (torchtitan's ``--module torch_ce.integrations.torchtitan --config``),
    for every family graph_trainer has a ``config_registry`` of."""
    if name.startswith("graph_trainer_"):
        fn = _graph_trainer_config(name)
        if fn is not None:
            return fn
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}: no graph_trainer family "
                             f"({', '.join(sorted(G.families()))}) has a config of that name")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _override_target():
    from torchtitan.tools.profiler import Profiler

    return Profiler.Config


def register_pipeline(cfg, **_: Any):
    """``--override.imports torch_ce.integrations.torchtitan.register_pipeline``: importing
    this module registered the pipeline; the override returns the profiler config as it was
    (an override must name a config node; the profiler's is in every trainer config)."""
    return cfg


def _register_override() -> None:
    from torchtitan.config.override import _REGISTRY, override

    if f"{__name__}.register_pipeline" not in _REGISTRY:
        override(target=_override_target(),
                 description="registers torch_ce's graph_trainer pass pipeline (changes no config)")(
            register_pipeline)


register()
_register_override()
