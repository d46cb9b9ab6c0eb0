#!/usr/bin/env bash
# One device call on one GPU (H100 or H200) for the protocol core (run from the repo root,
# at most ~560 s): the library built from the split csrc/, every one-GPU CUDA test file
# (loopback slots and workspaces: the gathers, the reduce-scatter on its own package with
# the session core, the bind's peer read-back, FSDP2's hook, the version net), then
# bench/rs_cost.py (the reduce-scatter's host cost against NCCL's functional call, and the
# reduction kernel's bandwidth) and the FSDP2 loopback hook cost. JSON under $OUT, logs
# packed into $OUT/logs.tgz, a short table last.
#   run: bash bench/gpu_core_session.sh
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/core_session}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
python3 -c "from torch_ce.runtime import native; native.load(); print('build', native.build_info(), 'rs_native', native.has_rs_native(), 'kernel', native.rs_has_kernel())" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
t1=$(date +%s)
timeout "$(cap 330)" python3 -m pytest -q -rfEs -p no:cacheprovider \
  test/test_reduce_scatter_cuda.py test/test_peer_readback_cuda.py test/test_fsdp2_cuda.py \
  test/test_native_cuda.py test/test_weight_updates_cuda.py test/test_uneven_cuda.py test/test_dim1_cuda.py \
  > "$OUT/tests.log" 2>&1
echo "tests rc=$? ($(( $(date +%s) - t1 )) s)" | tee -a "$OUT/summary.txt"
t2=$(date +%s)
timeout "$(cap 90)" python3 bench/rs_cost.py --iters 30 --out "$OUT" > "$OUT/rs_cost.log" 2>&1
echo "rs_cost rc=$? ($(( $(date +%s) - t2 )) s)" | tee -a "$OUT/summary.txt"
t3=$(date +%s)
timeout "$(cap 45)" python3 -m torch_ce.cli bench fsdp2 --loopback --out "$OUT" > "$OUT/fsdp2_loopback.log" 2>&1
echo "fsdp2 loopback rc=$? ($(( $(date +%s) - t3 )) s)" | tee -a "$OUT/summary.txt"
echo "---- short table ----"
cat "$OUT/summary.txt"
grep -hE "passed|failed|FAILED|ERROR" "$OUT/tests.log" | cut -c1-200 | tail -25
grep -hE "chunk MiB|^ *[0-9.]+ +[0-9.]+ +[0-9.]+" "$OUT/fsdp2_loopback.log" | head -n 6
tail -n 16 "$OUT/rs_cost.log" | cut -c1-180
( cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt && rm -f ./*.log )
echo "total $(( $(date +%s) - t0 )) s"
