#!/usr/bin/env bash
# Issue 46's last GPU run (one H200, torch 2.11+cu130), on the submitted tree: the build,
# the copy-engine reduce-scatter's CUDA tests (a dead peer released with the host in
# torch.cuda.synchronize(), with and without CUDA_DEVICE_MAX_CONNECTIONS=1; flag order
# under load; capture; profile) and the weight-update CUDA tests (the C++ gather sees a
# state-dict write; .data = goes back into its slot). Logs under $OUT; a short table last.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/issue46}
mkdir -p "$OUT"
t0=$(date +%s)
timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - t0 )) s)"
t1=$(date +%s)
timeout 240 python3 -m pytest -v -s -p no:cacheprovider test/test_reduce_scatter_cuda.py > "$OUT/rs_cuda.log" 2>&1
echo "rs tests rc=$? ($(( $(date +%s) - t1 )) s)"
t2=$(date +%s)
timeout 90 python3 -m pytest -v -p no:cacheprovider test/test_weight_updates_cuda.py > "$OUT/weight_updates_cuda.log" 2>&1
echo "weight-update tests rc=$? ($(( $(date +%s) - t2 )) s)"
grep -hE "(PASSED|FAILED|SKIPPED|ERROR)|one hardware queue|DEAD_PEER|released|^(FAILED|ERROR) |passed|failed" "$OUT/rs_cuda.log" "$OUT/weight_updates_cuda.log" | cut -c1-200 | tail -40
echo "total $(( $(date +%s) - t0 )) s"
