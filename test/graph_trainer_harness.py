"""torchtitan's graph_trainer training step on CPU gloo ranks, as its users run it: the test
side of torch_ce/integrations/torchtitan.py (test/test_graph_trainer.py,
test/test_graph_trainer_zoo.py).

One step is graph_trainer's own ``GraphTrainer.forward_backward_step`` with
``compile.mode = "aot_fx_trace"``: ``minimal_fx_tracer(make_fwd_bwd_step(model, loss))``
traces forward + loss + backward once, the pipeline named by ``compile.pass_pipeline``
(``PASS_PIPELINE_REGISTRY``, the ``"torch_ce"`` one included) goes through
``apply_graph_passes``, and ``run_traced`` runs it; AdamW steps between calls. The trainer
is graph_trainer's class built without its ``__init__`` (which also builds a dataloader, a
tokenizer, checkpointing and metrics: what graph_trainer's own tests do,
``tests/_trainer_test_utils.build_minimal_trainer``), from graph_trainer's config of the
model (``graph_trainer_llama3_debugmodel_sdpa``, ``graph_trainer_qwen3_debugmodel_moe``,
...) with the zoo's CPU-sized model of the family (test/zoo_models.py: 2 blocks, dim 64)
wrapped in graph_trainer's model class and parallelized by its own ``parallelize_fn``
(module annotations, expert parallelism, ``apply_simple_fsdp`` with the config's bf16
``param_dtype``). The loss is ``CrossEntropyLoss`` (Qwen3-MoE's debug config chunks it).

What CPU needs (``prepare``), each named here because it is what a CPU run drops or
stands in for, never what a GPU run does:

- flex attention has no CPU backward: every layer's ``inner_attention`` is SDPA (the
  ``*_sdpa`` debug configs; graph_trainer's tests do the same);
- SAC needs SDPA's math backend on CPU: CPU's fused SDPA kernel
  (``_scaled_dot_product_flash_attention_for_cpu``) is tagged ``nondeterministic_seeded``,
  which ``selective_activation_remat_pass`` refuses in a recompute region
  (``cpu_math_sdpa``);
- the bucketer's runtime estimator (overlap_scheduling's roofline) asks Triton for the
  GPU's DRAM bandwidth: stand-in device numbers (``torch.utils._runtime_estimation``'s
  ``get_gpu_dram_gbps`` / ``get_device_tflops``);
- ``cudagraph_pass`` is CUDA-only: ``--compile.disable_passes cudagraph_pass``;
- with expert parallelism, graph_trainer's FSDP bucketing and reordering
  (``GLOO_EP_DISABLED``), in both pipelines alike: its schedule keeps several collectives
  in flight (prefetched gathers, reduce-scatters, beside the experts' all-to-alls), which
  gloo does not survive (its default pipeline aborted on 4 CPU ranks with "Received data
  size doesn't match expected size"; NOTE [gloo: one functional collective in flight] in
  torch_ce/ops.py);
- import-only stand-ins for packages absent from the CPU CI install (``torchdata``'s
  dataloader, HF ``tokenizers`` / ``datasets``, TensorBoard, the Triton kernels module of
  ``torchtitan.distributed.minimal_async_ep``): the trainer's modules import them, no
  traced step calls them (each stand-in raises when called).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
import time
import types

import torch

SEQ, BATCH, STEPS = 16, 2, 3
CONFIGS = {  # family -> graph_trainer's debug config (its model replaced by the zoo's CPU size)
    "llama3": ("llama3", "graph_trainer_llama3_debugmodel_sdpa"),
    "qwen3": ("qwen3", "graph_trainer_qwen3_debugmodel"),
    "qwen3_moe": ("qwen3", "graph_trainer_qwen3_debugmodel_moe"),
    "deepseek_v3": ("deepseek_v3", "graph_trainer_deepseek_v3_debugmodel"),
}
GATHER_TARGETS = ("all_gather_into_tensor", "_pre_bucket_all_gather")
# NOTE in the module docstring: gloo and several collectives in flight.
GLOO_EP_DISABLED = "joint_transformer_block_bucketing_reordering_pass"


class _Missing(types.ModuleType):
    """A package the CPU install lacks: any name is a class whose construction raises."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        mod = self.__name__

        def refuse(*a, **k):
            raise RuntimeError(f"{mod}.{name} is not installed (a CPU test stand-in)")

        cls = type(name, (), {"__init__": refuse, "__module__": mod})
        setattr(self, name, cls)
        return cls


def _stand_in(name: str) -> None:
    if name not in sys.modules:
        m = _Missing(name)
        m.__path__ = []
        sys.modules[name] = m


def prepare(register: bool = True) -> None:
    """Make graph_trainer importable and runnable on this CPU install (module docstring);
    call before importing anything of torchtitan's. ``register``: import
    torch_ce.integrations.torchtitan (registers its pipelines); False leaves registration to
    ``torch_ce.enable()`` (integrations/import_hook.py)."""
    for pkg, mods in (("torchdata", ("torchdata", "torchdata.stateful_dataloader")),
                      ("tokenizers", ("tokenizers",)),
                      ("datasets", ("datasets", "datasets.distributed")),
                      ("tensorboard", ("torch.utils.tensorboard",)),
                      ("triton", ("torchtitan.distributed.minimal_async_ep.kernels",))):
        if importlib.util.find_spec(pkg) is None:
            for m in mods:
                _stand_in(m)
    if not torch.cuda.is_available():
        import torch.utils._runtime_estimation as est

        est.get_gpu_dram_gbps = lambda *a, **k: 3000  # an H100's order of magnitude (GB/s)
        est.get_device_tflops = lambda *a, **k: 500.0  # torch 2.15 passes device=
    # The real trainer stack first: test/zoo_models.py stubs some of its modules (for
    # torch.compile runs without it) only where nothing imported them yet.
    import torchtitan.experiments.graph_trainer.passes  # noqa: F401
    import torchtitan.experiments.graph_trainer.trainer  # noqa: F401

    if register:
        import torch_ce.integrations.torchtitan  # noqa: F401  (registers the "torch_ce" pipeline)


def importable() -> str | None:
    """Why graph_trainer cannot be used here (None: it can)."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed"
    return too_old_torch()


# What torchtitan 0.3.0's graph_trainer imports that torch 2.11 lacks, as
# torch_ce.passes.install.has_feature asks for it ("module" or "module:attribute").
GRAPH_TRAINER_NEEDS = ("torch._functorch._activation_offloading.offload_ops",
                       "torch.distributed.fsdp:DataParallelMeshDims")


def too_old_torch() -> str | None:
    """The torch internals torchtitan 0.3.0's graph_trainer imports that this torch lacks
    (``GRAPH_TRAINER_NEEDS``), asked of this torch itself, not of its version number."""
    from torch_ce.passes.install import has_feature

    missing = [f.replace(":", ".") for f in GRAPH_TRAINER_NEEDS if not has_feature(f)]
    if missing:
        return (f"torchtitan 0.3.0's graph_trainer imports what torch {torch.__version__} lacks: "
                f"{', '.join(missing)}")
    return None


def cpu_math_sdpa(model) -> None:
    """SAC on CPU: SDPA's math backend (module docstring)."""
    from torch.nn.attention import SDPBackend
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for m in model.modules():
        if isinstance(m, ScaledDotProductAttention):
            m.sdpa_backends = [SDPBackend.MATH]


def graph_trainer_config(family: str, *, mode: str, pipeline: str, param_dtype: str = "bfloat16",
                         experts: int = 4, layers: int = 2):
    """graph_trainer's config of ``family`` (``CONFIGS``) with the zoo's CPU-sized model
    (SDPA), ``compile.inductor_compilation = mode``, ``compile.pass_pipeline = pipeline``."""
    import importlib

    import zoo_models as zm
    from torchtitan.components.loss import CrossEntropyLoss

    fam, name = CONFIGS[family]
    cfg = getattr(importlib.import_module(f"torchtitan.experiments.graph_trainer.{fam}.config_registry"), name)()
    small = zm.model_config(family, zm.Dims(layers=layers, experts=experts))
    cls = type(cfg.model_spec.model)  # GraphTrainer<X>Model.Config
    cfg.model_spec.model = cls(**{f.name: getattr(small, f.name) for f in dataclasses.fields(small)})
    cfg.loss = CrossEntropyLoss.Config()
    cfg.training.seq_len, cfg.training.local_batch_size = SEQ, BATCH
    cfg.training.mixed_precision_param = param_dtype
    cfg.compile.inductor_compilation = mode
    cfg.compile.pass_pipeline = pipeline
    if not torch.cuda.is_available():
        cfg.compile.disable_passes = ["cudagraph_pass"]
    return cfg


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_trainer(cfg, pdims, seed: int):
    """(GraphTrainer, model): the model built, initialised from ``seed`` and parallelized
    by graph_trainer's ``parallelize_fn``; the trainer as its tests build it, the
    pipeline's post-init hook run as ``GraphTrainer.__init__`` runs it."""
    from torchtitan.distributed.utils import get_spmd_context
    from torchtitan.experiments.graph_trainer import simple_fsdp
    from torchtitan.experiments.graph_trainer.registry import POST_INIT_HOOKS
    from torchtitan.experiments.graph_trainer.trainer import GraphTrainer

    mcfg = cfg.model_spec.model
    cfg.parallelism.expert_parallel_degree = pdims.ep
    mcfg.update_from_config(config=cfg)  # as Trainer.__init__: RoPE, the MoE sharding configs
    if pdims.ep_enabled and not torch.cuda.is_available():
        cfg.compile.disable_passes = [*cfg.compile.disable_passes, GLOO_EP_DISABLED]
    dev = device()
    torch.manual_seed(seed)
    with dev:
        net = mcfg.build()
        net.init_states(buffer_device=dev)
    simple_fsdp._wrap_class_cache.clear()  # its wrapper classes close over the first mesh
    net = cfg.model_spec.parallelize_fn(
        net, parallel_dims=pdims, training=cfg.training, parallelism=cfg.parallelism,
        compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder=cfg.dump_folder)
    net.train()
    if not torch.cuda.is_available():
        cpu_math_sdpa(net)
    tr = object.__new__(GraphTrainer)
    tr.model_parts, tr.model_config, tr.config = [net], mcfg, cfg
    tr.loss_fn = cfg.loss.build()
    tr.parallel_dims = pdims
    tr.train_context = get_spmd_context()
    tr.fwd_bwd_fn = tr._forward_backward_body
    tr.device = dev
    tr.tokenizer, tr.ntokens_seen, tr._traced_step = None, 0, None
    POST_INIT_HOOKS.get(cfg.compile.pass_pipeline, lambda _: None)(tr)
    return tr, net


def batches(vocab: int, world: int, rank: int, seed: int, n: int = STEPS) -> list:
    """(tokens, labels) per step, this rank's own."""
    g = torch.Generator().manual_seed(seed + 7919 * rank)
    return [(torch.randint(0, vocab, (BATCH, SEQ), generator=g), torch.randint(0, vocab, (BATCH, SEQ), generator=g))
            for _ in range(n)]


def train(tr, net, data, world: int) -> list:
    """graph_trainer's step (``forward_backward_step``) and AdamW, per batch: the losses."""
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    dev = device()
    pos = torch.arange(SEQ, device=dev).repeat(BATCH, 1)
    tokens = torch.tensor(float(BATCH * SEQ * world), device=dev)
    out = []
    for x, y in data:
        opt.zero_grad()
        x, y = x.to(dev), y.to(dev)
        loss = tr.forward_backward_step(input_dict={"input": x, "positions": pos}, labels=y,
                                        global_valid_tokens=tokens)
        opt.step()
        out.append(loss.detach().clone().cpu())
    return out


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Inductor's C++ compiler)."""
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def gathers_left(gm) -> list[str]:
    """Weight all-gather nodes (every form) left in a final graph module's FX graph."""
    return [f"{n.name}: {n.target}" for n in gm.graph.nodes
            if n.op == "call_function" and any(t in str(n.target) for t in GATHER_TARGETS)]


def scatters_left(gm) -> list[str]:
    """Collective reduce-scatter nodes left in a final graph module's FX graph."""
    return [f"{n.name}: {n.target}" for n in gm.graph.nodes
            if n.op == "call_function" and "_c10d_functional.reduce_scatter" in str(n.target)]


class LogLines(logging.Handler):
    """The ``torch_ce`` logger's records of INFO and above while in use, as (level, text)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))

    def __enter__(self):
        lg = logging.getLogger("torch_ce")
        self._level = lg.level
        lg.addHandler(self)
        lg.setLevel(min(lg.getEffectiveLevel(), logging.INFO))
        return self

    def __exit__(self, *exc):
        lg = logging.getLogger("torch_ce")
        lg.removeHandler(self)
        lg.setLevel(self._level)


TRAINS_THROUGH = "graph_trainer trains through the 'torch_ce' pass pipeline"


def one_run(family, pdims, world, rank, seed, *, mode, pipeline, enable=False, experts=4,
            param_dtype="bfloat16", layers=2, disable=(), steps=STEPS, setup=None) -> dict:
    """Build, trace, pass, and train ``steps`` steps: losses, the gathers left in the final
    FX graph, explain()'s coverage of this run, torch_ce's log lines (``log``), the seconds
    it took. ``disable``: more graph_trainer passes to leave out
    (``--compile.disable_passes``); ``setup(cfg, pdims)``: more changes to the config (and
    the parallel dims) before the trainer is built."""
    import torch.distributed as dist
    import torch_ce
    from torch_ce import report

    t0, c0 = time.monotonic(), cpu_seconds()
    torch._dynamo.reset()
    report.clear()
    if enable:
        torch_ce.enable(transport="copy_engine")
    lines = LogLines().__enter__()
    try:
        cfg = graph_trainer_config(family, mode=mode, pipeline=pipeline, experts=experts,
                                   param_dtype=param_dtype, layers=layers)
        cfg.compile.disable_passes = [*cfg.compile.disable_passes, *disable]
        if setup is not None:
            setup(cfg, pdims)
        tr, net = build_trainer(cfg, pdims, seed)
        losses = train(tr, net, batches(cfg.model_spec.model.vocab_size, world, rank, seed, steps), world)
        gm = tr._traced_step.gm if tr._traced_step is not None else None  # jit: no traced step
        left = gathers_left(gm) if isinstance(gm, torch.fx.GraphModule) else None
        rs_left = scatters_left(gm) if isinstance(gm, torch.fx.GraphModule) else None
        captured = getattr(getattr(gm, "forward", None), "_cudagraph", None) is not None
        e = torch_ce.explain()
        cov = e.coverage()
        names = sorted({w.param for w in e.weights})
        placements = {n: (tuple(p.device_mesh.mesh_dim_names or ()), tuple(str(x) for x in p.placements))
                      for n, p in net.named_parameters() if hasattr(p, "placements")}
        cpu = cpu_seconds() - c0
        print(f"[rank {rank}] {family} {mode} {pipeline}{' (torch_ce enabled)' if enable else ''}: "
              f"{time.monotonic() - t0:.0f} s ({cpu:.0f} s of CPU); {cov.total.line()}", file=sys.stderr,
              flush=True)
        return dict(losses=losses, left=left, share=cov.total.share, ce_bytes=cov.total.ce_bytes,
                    collective_bytes=cov.total.collective_bytes, by_reason=dict(cov.total.by_reason),
                    graphs=len(e.graphs), names=names, table=e.table(), seconds=time.monotonic() - t0,
                    placements=placements, captured=captured, cpu_seconds=cpu, log=list(lines.lines),
                    rs_left=rs_left, rs=e.reduce_scatter_coverage(),
                    per_call=(sum(g.ce_bytes for g in cov.per_graph),  # one call of each graph
                              sum(g.collective_bytes for g in cov.per_graph)))
    finally:
        lines.__exit__(None, None, None)
        if enable:
            torch_ce.disable()
        dist.barrier()  # peers may still read this rank's staging slots
        torch_ce.release_all()


# ---------------------------------------------------------------------------------------
# A joint graph taken for an inference graph
# ---------------------------------------------------------------------------------------

MISCLASSIFIED = "torch_ce_test_misclassified"


def _misclassified_pass(gm, example_inputs, *, facts, seen):
    """torch_ce's post-grad entry point (``manager.run_passes``) on the joint graph with
    ``is_inference=True``, as Inductor hands it over when a caller compiles the joint graph
    standalone (graph_trainer's full Inductor without torch_ce's pipeline). ``seen``: what the gate alone
    would have planned for an inference graph (the hazard), and what the passes did."""
    from torch_ce.passes import gate, joint, manager, plan
    from torch_ce.config import config

    with joint._facts(gm.graph, facts):
        seeds = [s for s in gate.gate(gm.graph, config, True) if s.eligible]
        p = plan.plan(seeds)
        seen["as_inference"] = dict(cast_slots=sum(s.cast_slot for s in seeds),
                                    in_place=len(p.shards), staged=p.staged)
        manager.run_passes(gm.graph, is_inference=True)
    gm.recompile()
    magi = torch.ops.magi
    stages = [n for n in gm.graph.nodes if n.target is magi.ce_stage.default]
    seen["after"] = dict(
        binds=sum(n.target is magi.ce_bind.default for n in gm.graph.nodes),
        stages=len(stages),
        refresh=[bool(n.args[6]) for n in stages],
        static=[bool(n.kwargs.get("static", n.args[8] if len(n.args) > 8 else False)) for n in stages],
        ce_gathers=sum(n.target in (magi.ce_all_gather.default, magi.ce_all_gather_coalesced.default)
                       for n in gm.graph.nodes),
        plain_gathers=len(gathers_left(gm)))
    return gm


def register_misclassified_pipeline(seen: dict) -> None:
    """A test pipeline: graph_trainer's default list without its FSDP bucketing (as with
    full Inductor and the bucketing pass disabled, the joint graph reaches Inductor with its
    per-weight gathers) and ``_misclassified_pass`` where Inductor would get the graph."""
    import functools

    from torch_ce.integrations import graph_trainer_api as G, torchtitan as tt
    from torchtitan.experiments.graph_trainer import registry
    from torchtitan.experiments.graph_trainer.passes import construct_default_graph_passes

    def pipeline(traced_result, config, *, parallel_dims=None):
        passes = [p for p in construct_default_graph_passes(traced_result, config, parallel_dims=parallel_dims)
                  if tt._pass_name(p) != G.BUCKETING]
        ours = functools.partial(_misclassified_pass, facts=tt.joint_facts(traced_result), seen=seen)
        return tt._before_terminal(passes, ours)

    registry.register_pass_pipeline(MISCLASSIFIED)(pipeline)
