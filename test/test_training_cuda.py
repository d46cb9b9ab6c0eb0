"""Training on the copy engines, on GPUs: test_training_host's checks with NCCL ranks.

torchtitan's Llama3 (zoo layers, small dims) under SimpleFSDP ``fully_shard``, bf16
``param_dtype``, AdamW, 20 steps: every step's loss bit-identical to the same run on NCCL,
with rank 1 delayed before its forwards and optimizer steps, and every staging slot equal to
its weight's cast after each step; the magi ops in the forward and the backward code. Both
runs use deterministic algorithms (GPU kernels are not bit-reproducible by default). Runs on TORCH_CE_GPU_WORLD ranks (default 2), skipped with fewer GPUs.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

pytest.importorskip("torchtitan")  # its modules then import, or the file fails loudly

from cuda_helpers import GPU_WORLD, needs_gpu_world  # noqa: E402
from mp_harness import run_ranks, seed_base  # noqa: E402

pytestmark = needs_gpu_world
SHAPES = dict(model="llama3_8b", layers=2, dim=256, vocab=1024)


def _rank(rank, world, seed):
    from test_training_host import MAGI_CALL, _train, _zoo_builder

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"torch_ce_train_r{rank}_")
    import torch._inductor.config as ic

    ic.fx_graph_cache = False
    # GPU training kernels are not bit-reproducible by default (atomics in the embedding
    # backward): the reference and the CE run must be, to be compared bit for bit.
    torch.use_deterministic_algorithms(True)  # warn_only=False: cuDNN attention too
    dev = torch.device("cuda", rank)
    gen = torch.Generator(device=dev).manual_seed(seed + 100 + rank)
    batches = [[torch.randint(0, SHAPES["vocab"], (2, 129), device=dev, generator=gen)] for _ in range(20)]
    build = _zoo_builder(seed, torch.bfloat16, dev, SHAPES)
    ref = _train("nccl", build, batches, rank, lr=1e-3)[0]
    ce, code, _ = _train("copy_engine", build, batches, rank, delay=0.05, lr=1e-3)
    return ref, ce, code[0].count(MAGI_CALL), code[-1].count(MAGI_CALL)


def test_zoo_llama3_trains_bit_identical_on_gpus():
    res = run_ranks(_rank, GPU_WORLD, seed_base(), timeout=400, backend="nccl",
                    env={"CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    for rank, (ref, ce, fw, bw) in enumerate(res):
        assert ce == ref, f"rank {rank}: losses differ\nref {ref}\nce  {ce}"
        assert len(set(ref)) > 10, f"rank {rank}: nothing trains"
        assert fw > 0 and bw > 0, f"rank {rank}: magi ops fw={fw} bw={bw}"
