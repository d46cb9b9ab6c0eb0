#!/usr/bin/env bash
# Issue 46's GPU run (one H200, torch 2.11+cu130): the install, the copy-engine
# reduce-scatter's CUDA tests (the dead-peer release with and without
# CUDA_DEVICE_MAX_CONNECTIONS=1, the flag-order load test), then the release probe
# (bench/compare/rs_release_probe.py). Logs under $OUT; a short table last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/rs_issue46}
mkdir -p "$OUT"
t0=$(date +%s)
timeout 150 python3 -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - t0 )) s)"
python3 -c "import torch, torch_ce; print('torch', torch.__version__, torch.cuda.get_device_name()); print('stream_flags_info [mem_ops_v1, can_flush_remote_writes, wait flags]', list(torch.ops.torch_ce_native.stream_flags_info()))" 2>&1 | tee "$OUT/info.log"
t1=$(date +%s)
timeout 240 python3 -m pytest -v -s -p no:cacheprovider test/test_reduce_scatter_cuda.py 2>&1 | tee "$OUT/run59_rs_integrity_h200.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|DEAD_PEER|one hardware queue|connections" | cut -c1-220
echo "tests: $(( $(date +%s) - t1 )) s"
timeout 60 python3 bench/compare/rs_release_probe.py > "$OUT/probe.log" 2>&1
grep -E "^\('" "$OUT/probe.log" | cut -c1-200
echo "total $(( $(date +%s) - t0 )) s"
