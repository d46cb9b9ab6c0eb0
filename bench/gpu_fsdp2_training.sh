#!/usr/bin/env bash
# One device call on one GPU (H100 or H200) for FSDP2's training gathers on CUDA (run from
# the repo root, at most ~560 s): the library built, the step words' loopback tests
# (test/test_fsdp2_training_cuda.py: exact over steps at worlds 2 and 3, a dead peer
# released under both queue settings, no kernel), the reduce-scatter's CUDA tests (its
# watchdog is the shared stream watchdog now), FSDP2's static hook, then the loopback host
# cost of the static and the training hook against NCCL's all-gather, and where the
# training hook's host time goes (bench/compare/step_gather_cost.py). JSON under $OUT, logs
# packed into $OUT/logs.tgz, a short table last.
#   run: bash bench/gpu_fsdp2_training.sh      (RS_TESTS=0: without the reduce-scatter's tests)
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
left() { echo $(( DEADLINE - $(date +%s) )); }
cap() { local l; l=$(left); echo $(( l < $1 ? (l > 5 ? l : 5) : $1 )); }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/fsdp2_training}
mkdir -p "$OUT"
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/summary.txt"
timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - t0 )) s)" | tee -a "$OUT/summary.txt"
python3 -c "from torch_ce.runtime import native; native.load(); print('build', native.build_info(), 'step_gather', native.has_step_gather())" 2>&1 | tail -1 | tee -a "$OUT/summary.txt"
t1=$(date +%s)
timeout "$(cap 220)" python3 -m pytest -v -rfEs -p no:cacheprovider test/test_fsdp2_training_cuda.py \
  > "$OUT/tests_training.log" 2>&1
echo "training tests rc=$? ($(( $(date +%s) - t1 )) s)" | tee -a "$OUT/summary.txt"
t2=$(date +%s)
timeout "$(cap 60)" python3 -m torch_ce.cli bench fsdp2 --loopback --out "$OUT" > "$OUT/fsdp2_loopback.log" 2>&1
echo "fsdp2 loopback rc=$? ($(( $(date +%s) - t2 )) s)" | tee -a "$OUT/summary.txt"
t25=$(date +%s)
timeout "$(cap 60)" torchrun --nproc_per_node 1 bench/compare/step_gather_cost.py > "$OUT/step_gather_cost.log" 2>&1
echo "step_gather_cost rc=$? ($(( $(date +%s) - t25 )) s)" | tee -a "$OUT/summary.txt"
tail -n 1 "$OUT/step_gather_cost.log" > "$OUT/step_gather_cost.json"
t3=$(date +%s)
if [ "${RS_TESTS:-1}" = 1 ]; then
  timeout "$(cap 260)" python3 -m pytest -q -rfEs -p no:cacheprovider test/test_fsdp2_cuda.py \
    test/test_reduce_scatter_cuda.py test/test_native_cuda.py > "$OUT/tests_rs.log" 2>&1
  echo "rs + hook tests rc=$? ($(( $(date +%s) - t3 )) s)" | tee -a "$OUT/summary.txt"
fi
echo "---- short table ----"
cat "$OUT/summary.txt"
grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests_training.log" | cut -c1-160 | tail -12
grep -hsE "passed|failed|FAILED|ERROR" "$OUT/tests_rs.log" | cut -c1-200 | tail -12
grep -hE "chunk MiB|^ *[0-9.]+ +[0-9.]+ +[0-9.]+" "$OUT/fsdp2_loopback.log" | head -n 6
grep -h "^chunk" "$OUT/step_gather_cost.log" | cut -c1-200
( cd "$OUT" && tar czf logs.tgz ./*.log ./*.txt && rm -f ./*.log )
echo "total $(( $(date +%s) - t0 )) s"
