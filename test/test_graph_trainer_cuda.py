"""graph_trainer's CUDA graphs over torch_ce's ops, on one GPU (NOTE [CUDA graphs under
the torch_ce pipeline] in torch_ce/integrations/torchtitan.py).

graph_trainer's ``cudagraph_pass`` wraps the finished step graph in its
``CUDAGraphWrapper``: the first call runs eagerly (warm-up), the second is captured, every
later one replays. What a torch_ce step graph holds at its head and around each gather:
``magi.ce_stage`` (fence, refresh each staging slot from its weight, fence),
``magi.ce_staged`` (the slots), ``magi.ce_all_gather_coalesced`` + ``wait_tensor``.

- ``test_stage_and_gathers_replay_under_graph_trainers_wrapper``: that graph, built with
  torch.fx over one weight whose 2-rank staging slot is a loopback slot (the "peer" copy a
  second local tensor: ``cuda_helpers.register_loopback``), wrapped by ``cudagraph_pass``
  itself, on an NCCL group of one rank (the fences are NCCL all_reduces, as on a real
  mesh). Between calls the "optimizer" writes the weight in place and the "peer" writes its
  slot; every call, captured or replayed, must gather exactly ``cat(weight in bf16, peer)``
  and leave the refreshed slot equal to the new weight. Each call runs under a dispatch
  recorder: the warm-up and the capture dispatch ``ce_stage`` and
  ``ce_all_gather_coalesced``, a replay dispatches no magi op at all, and is still exact on
  the new weight and the new peer slot: the stage step's refresh and the gather's copies
  are in the captured graph, and no host-side decision is skipped. It runs on torch 2.11
  too (the GPU machine's): only the wrapper's ``enable_annotations`` keyword, off, is given
  to 2.11's ``torch.cuda.graph``.
- ``test_graph_trainer_step_with_cudagraph_pass``: graph_trainer's step (Llama3 debug
  config, CPU-sized, world 1) with the torch_ce pipeline and ``cudagraph_pass`` on, against
  the default pipeline: the same losses over 3 AdamW steps, and the step graph captured.
  With one rank there is no gather to serve and so no stage step: it proves only that the
  torch_ce pipeline leaves graph_trainer's capture working (the test above is the proof
  that a stage step and a gather are captured and replayed).

Skipped without a GPU or without the built C++ kernels (the per-peer capture path is
theirs). Run: ``python3 -m pytest -q test/test_graph_trainer_cuda.py``.
"""
from __future__ import annotations

import operator

import pytest
import torch
from cuda_helpers import needs_gpu_and_kernels

pytestmark = needs_gpu_and_kernels
if not torch.cuda.is_available():  # before importing torchtitan (seconds on CPU CI)
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("torchtitan")

from mp_harness import run_ranks, seed_base  # noqa: E402


def _step_module(w, name):
    """The head and one gather of a torch_ce training graph, as torch.fx code."""
    import torch.fx as fx

    magi, c10d = torch.ops.magi, torch.ops._c10d_functional
    g = fx.Graph()
    wp, xp = g.placeholder("w"), g.placeholder("x")
    g.call_function(magi.ce_stage.default, ([wp], ["bfloat16"], [2], [name], ["w"], [""], True))
    staged = g.call_function(magi.ce_staged.default, ([wp], ["bfloat16"], [name]))
    slot = g.call_function(operator.getitem, (staged, 0))
    co = g.call_function(magi.ce_all_gather_coalesced.default, ([slot], 2, name))
    got = g.call_function(operator.getitem, (co, 0))
    full = g.call_function(c10d.wait_tensor.default, (got,))
    mm = g.call_function(torch.ops.aten.mm.default, (xp, g.call_function(torch.ops.aten.t.default, (full,))))
    g.output((full, mm))
    return fx.GraphModule(torch.nn.Module(), g)


def _graph_takes_annotations_flag() -> None:
    """graph_trainer's wrapper captures with ``torch.cuda.graph(..., enable_annotations=...)``
    (kernel annotations for its trace post-processor, off unless that is configured): a
    keyword torch 2.11's ``torch.cuda.graph`` lacks. There, a ``torch.cuda.graph`` that takes
    it, off only, so that the wrapper's own capture and replay run on the GPU machine's torch."""
    import inspect

    base = torch.cuda.graph
    if "enable_annotations" in inspect.signature(base.__init__).parameters:
        return

    class graph(base):
        def __init__(self, *args, enable_annotations: bool = False, **kwargs):
            if enable_annotations:
                raise NotImplementedError(f"torch {torch.__version__} has no CUDA-graph kernel annotations")
            super().__init__(*args, **kwargs)

    torch.cuda.graph = graph


def _wrapper_rank(rank, world, seed):
    import torch.distributed as dist
    from cuda_helpers import register_loopback

    # Only graph_trainer's cudagraph module: it imports on every supported torch (the
    # trainer's own modules need torch >= 2.12, graph_trainer_harness.too_old_torch).
    import torch_ce  # noqa: F401  (the magi ops)
    from torch_ce.runtime import windows as W
    from torchtitan.experiments.graph_trainer.cudagraph import cudagraph_pass

    _graph_takes_annotations_flag()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(seed)
    name = dist.group.WORLD.group_name
    w = torch.randn(64, 32, generator=gen, device=dev)  # the fp32 parameter shard
    mine = torch.empty(64, 32, dtype=torch.bfloat16, device=dev)  # its staging slot
    peer = torch.randn(64, 32, generator=gen, device=dev).to(torch.bfloat16)  # the peer's slot
    slot = register_loopback(mine, peer, dist.group.WORLD, 0)
    W.register_staged(w, torch.bfloat16, slot, view=mine)
    x = torch.randn(8, 32, generator=gen, device=dev).to(torch.bfloat16)
    gm = cudagraph_pass(_step_module(w, name), (w, x), static_input_indices=[0], tensor_input_indices=[0, 1])
    wrapped = type(gm.forward).__name__
    res = dict(wrapped=wrapped, calls=[])
    for call in range(4):  # warm-up, capture + replay, replay, replay
        with _Dispatched() as seen:
            full, mm = gm(w, x)
        torch.cuda.synchronize()
        exp = torch.cat([w.to(torch.bfloat16), peer])
        res["calls"].append(dict(
            magi=sorted({op for op in seen.ops if op.startswith("magi.")}),
            gather_exact=bool(torch.equal(full, exp)),
            slot_refreshed=bool(torch.equal(mine, w.to(torch.bfloat16))),
            mm_close=bool(torch.allclose(mm.float(), (x @ exp.t()).float(), rtol=1e-2, atol=1e-2))))
        with torch.no_grad():  # the optimizer writes the weight; the peer refreshes its slot
            w.add_(torch.randn(w.shape, generator=gen, device=dev))
            peer.copy_(torch.randn(peer.shape, generator=gen, device=dev).to(torch.bfloat16))
    res["captured"] = getattr(gm.forward, "_cudagraph", None) is not None
    _teardown()
    return res


class _Dispatched:
    """The ops dispatched while in use (``ops``: "namespace.name" each), through a
    ``TorchDispatchMode``: a CUDA-graph replay dispatches none of the captured ones."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func._schema.name.replace("::", "."))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


def _teardown():
    """graph_trainer's explicit CUDA-graph teardown (its graphs hold NCCL references that
    would keep the process group from being destroyed: Note [explicit cudagraph teardown])."""
    from torchtitan.experiments.graph_trainer.cudagraph import cudagraph_teardown

    torch.cuda.synchronize()
    cudagraph_teardown()


def test_stage_and_gathers_replay_under_graph_trainers_wrapper():
    (r,) = run_ranks(_wrapper_rank, 1, seed_base(), backend="nccl", timeout=300)
    print(r)
    assert r["wrapped"] == "CUDAGraphWrapper" and r["captured"], r
    for i, c in enumerate(r["calls"]):
        assert c["gather_exact"] and c["slot_refreshed"] and c["mm_close"], (i, r)
    ran = {"magi.ce_stage", "magi.ce_staged", "magi.ce_all_gather_coalesced"}
    assert ran <= set(r["calls"][0]["magi"]) and ran <= set(r["calls"][1]["magi"]), r["calls"]  # warm-up, capture
    assert [c["magi"] for c in r["calls"][2:]] == [[], []], r["calls"]  # replays: the graph did it


def _step_rank(rank, world, seed, cache):
    import graph_trainer_harness as H

    H.prepare()
    from mp_harness import setup_compile

    setup_compile(cache, rank)
    import zoo_models as zm

    pdims = zm.parallel_dims(world, "fully_shard", device="cuda")
    out = {}
    for pipeline in ("default", "torch_ce"):
        r = H.one_run("llama3", pdims, world, rank, seed, mode="regional", pipeline=pipeline)
        out[pipeline] = r
    _teardown()
    return out


def test_graph_trainer_step_with_cudagraph_pass(tmp_path):
    import graph_trainer_harness as H

    if H.importable():
        pytest.skip(H.importable())
    (r,) = run_ranks(_step_rank, 1, seed_base(), str(tmp_path), backend="nccl", timeout=900)
    print(r["torch_ce"]["table"])
    for p in ("default", "torch_ce"):
        assert r[p]["captured"], (p, r[p])
    assert all(torch.equal(a, b) for a, b in zip(r["default"]["losses"], r["torch_ce"]["losses"], strict=True)), r
