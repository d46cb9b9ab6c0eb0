#!/usr/bin/env bash
# One device call on one H200 for issues 49 and 48 (run from the repo root, at most ~570 s):
#   1. install (the nvcc build: csrc/*.cu)
#   2. test/test_reduce_scatter_cuda.py: each loopback case on the Python path, with
#      rs_native (C++ launch/completion, the fused reduction kernel) and with rs_native on
#      host-mapped flags (rs_host_flags), worlds 2 and 3, given outputs (FSDP2's hook),
#      capture and replay, the profile, flag order, a dead peer released, and the same under
#      CUDA_DEVICE_MAX_CONNECTIONS=1 (test_one_hardware_queue; the dead-peer cases under one
#      queue on host-mapped flags: NOTE [poison word] in csrc/ce_flags.cu)
#   3. test/test_fsdp2_cuda.py: FSDP2's all-gather hook on a loopback slot, exact, no kernel
#   4. (last: the budget goes to issue 49 first) torch-ce bench fsdp2 --loopback: host us per call of the hook beside NCCL's
#   5. bench/rs_cost.py: host us per rank-call (NCCL functional, Python path, native path),
#      the reduction kernel's GB/s against the HBM copy bandwidth, CUDA-graph replay
#   5b. bench/compare/reduce_kernel_probe.py: the reduction kernel's four tunings
#   6. the same for buckets of 8 tensors (--members 8: the pushes' batched memcpys)
#   7. bench/compare/rs_host_breakdown.py, worlds 2 and 3: where a native call's host time
#      goes, and the GPU's own time per rank-call, with the flag operations batched and one
#      driver call each (native.rs_memop_batching); each exact
# JSON and PNG under $OUT, the logs packed into $OUT/logs.tgz (the device hands back a few
# files a call, not fifteen); a short table last.
#   run: bash bench/gpu_h200_session.sh
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/h200_session}
mkdir -p "$OUT"
t0=$(date +%s)
timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - t0 )) s)" | tee "$OUT/summary.txt"
python3 -c "from torch_ce.runtime import native; native.load(); print('build', native.build_info(), 'rs_native', native.has_rs_native(), 'kernel', native.rs_has_kernel())" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
t1=$(date +%s)
timeout "$(cap 260)" python3 -m pytest -v -s -p no:cacheprovider test/test_reduce_scatter_cuda.py test/test_fsdp2_cuda.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? ($(( $(date +%s) - t1 )) s)" | tee -a "$OUT/summary.txt"
t3=$(date +%s)
timeout "$(cap 200)" python3 bench/rs_cost.py --iters 30 --out "$OUT" > "$OUT/rs_cost.log" 2>&1
echo "rs_cost rc=$? ($(( $(date +%s) - t3 )) s)" | tee -a "$OUT/summary.txt"
t7=$(date +%s)
timeout "$(cap 90)" python3 bench/compare/reduce_kernel_probe.py --out "$OUT" > "$OUT/reduce_kernel_probe.log" 2>&1
echo "reduce_kernel_probe rc=$? ($(( $(date +%s) - t7 )) s)" | tee -a "$OUT/summary.txt"
t5=$(date +%s)
timeout "$(cap 60)" python3 bench/rs_cost.py --iters 30 --members 8 --mib 1,16 --dtypes float32 --out "$OUT/members8" \
  > "$OUT/rs_cost_members8.log" 2>&1
echo "rs_cost --members 8 rc=$? ($(( $(date +%s) - t5 )) s)" | tee -a "$OUT/summary.txt"
t4=$(date +%s)
timeout "$(cap 60)" python3 bench/compare/rs_host_breakdown.py > "$OUT/rs_host_breakdown.txt" 2>&1
echo "rs_host_breakdown rc=$? ($(( $(date +%s) - t4 )) s)" | tee -a "$OUT/summary.txt"
t6=$(date +%s)
timeout "$(cap 60)" python3 bench/compare/rs_host_breakdown.py --world 3 > "$OUT/rs_host_breakdown_w3.txt" 2>&1
echo "rs_host_breakdown --world 3 rc=$? ($(( $(date +%s) - t6 )) s)" | tee -a "$OUT/summary.txt"
t2=$(date +%s)
timeout "$(cap 60)" python3 -m torch_ce.cli bench fsdp2 --loopback --out "$OUT" > "$OUT/fsdp2_loopback.log" 2>&1
echo "fsdp2 loopback rc=$? ($(( $(date +%s) - t2 )) s)" | tee -a "$OUT/summary.txt"
echo "---- short table ----"
grep -hE "(PASSED|FAILED|ERROR|XFAIL|XPASS)|passed|failed" "$OUT/tests.log" | sed 's/^test\///' | cut -c1-150 | tail -40
grep -hE "chunk MiB|^ *[0-9.]+ +[0-9.]+ +[0-9.]+" "$OUT/fsdp2_loopback.log" | head -n 8
tail -n 15 "$OUT/rs_cost.log" | cut -c1-180
tail -n 7 "$OUT/rs_cost_members8.log" | cut -c1-180
tail -n 11 "$OUT/reduce_kernel_probe.log" | cut -c1-120
for f in rs_host_breakdown rs_host_breakdown_w3; do
  echo "-- $f"; grep -hE "^==|per rank-call us|C\+\+ total|NCCL functional" "$OUT/$f.txt" | cut -c1-160
done
( cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt members8 && rm -rf ./*.log ./*.txt members8 )
echo "total $(( $(date +%s) - t0 )) s"
