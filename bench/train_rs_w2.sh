#!/bin/bash
# Issue 37's 2-GPU comparison, one command, for when 2 GPUs are lent (device machine, repo
# root, after `python3 -m pip install --no-build-isolation --no-deps -e .`):
#   the CE reduce-scatter's GPU tests on 2 NCCL ranks (test_two_gpus), then torch-ce bench
#   train: Llama3-8B shapes, 4 layers, 2048 tokens per rank, bf16 params, fp32 reduce;
#   NCCL vs CE gathers vs CE gathers + CE reduce-scatters vs (torch >= 2.14) Inductor's
#   low-contention collectives; each with its deterministic twin for the loss check.
#   Writes under ${OUT:-bench/results}: the JSON and PNG of bench train, the test log.
set -o pipefail
OUT=${OUT:-bench/results}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
TORCH_CE_GPU_WORLD=2 timeout 300 python3 -m pytest -q -p no:cacheprovider -rs test/test_reduce_scatter_cuda.py \
    2>&1 | tee "$OUT/rs_gpu_tests_w2.log" | tail -3
variants=nccl,ce,ce_rs
if python3 -c "import torch._inductor.config as c, sys; sys.exit(0 if hasattr(getattr(c, 'aten_distributed_optimizations', None), 'enable_low_contention_collectives') else 1)"; then
    variants+=,nccl_lc
fi
timeout 580 python3 -m torch_ce.cli bench train --nprocs 2 --model llama3_8b --layers 4 --tokens 2048 \
    --variants "$variants" --out "$OUT" 2>&1 | tee "$OUT/rs_bench_train_w2.log" | tail -16
