#!/usr/bin/env bash
# Issue 48 on GPUs, one device call (run from the repo root; any kind: nvidia-h200 runs the
# loopback figures, nvidia-h200-x2 and up also the 2+-GPU bench):
#   1. the install (python3 -m pip install --no-build-isolation --no-deps -e .)
#   2. test/test_fsdp2*.py (gloo ranks, host transport: the FSDP2 hooks on this torch)
#   3. torch-ce bench fsdp2 --loopback: host us per call of torch_ce's FSDP2 all-gather hook
#      on a loopback slot next to NCCL's all_gather_into_tensor on a one-rank group
#   4. with 2+ GPUs: torch-ce bench fsdp2 (FSDP2's default, set_symm_mem_for_comm, torch_ce
#      gathers, + reduce-scatter; Llama3-8B blocks and Wan DiT blocks; inference and training)
# Logs, the JSON and the PNG under $OUT (copy them to bench/results/ to commit); a short
# table last. NVLink multicast off (KINDS.md). Everything inside ${BUDGET_S:-570} s: the bench
# gets what the install and the tests leave (run it alone on a warm machine for more:
# python3 -m torch_ce.cli bench fsdp2 --out $OUT).
set -u
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-570} ))  # inside the device call's 600 s
left() { echo $(( DEADLINE - $(date +%s) )); }
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/fsdp2}
mkdir -p "$OUT"
t0=$(date +%s)
timeout 200 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1
echo "install rc=$? ($(( $(date +%s) - t0 )) s)" | tee "$OUT/summary.txt"
t1=$(date +%s)
timeout $(( $(left) > 240 ? 240 : $(left) )) python3 -m pytest -q -p no:cacheprovider test/test_fsdp2_host.py test/test_fsdp2_uneven_host.py \
    test/test_fsdp2_reduce_scatter_host.py test/test_fsdp2_torchtitan.py > "$OUT/tests.log" 2>&1
echo "fsdp2 tests rc=$? ($(( $(date +%s) - t1 )) s): $(tail -n 1 "$OUT/tests.log")" | tee -a "$OUT/summary.txt"
t2=$(date +%s)
timeout 60 python3 -m torch_ce.cli bench fsdp2 --loopback --out "$OUT" > "$OUT/loopback.log" 2>&1
echo "loopback rc=$? ($(( $(date +%s) - t2 )) s)" | tee -a "$OUT/summary.txt"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${ngpu:-0}" -ge 2 ] && [ "$(left)" -gt 90 ]; then
    t3=$(date +%s)
    b=$(( $(left) - 15 ))
    timeout $(( b + 10 )) python3 -m torch_ce.cli bench fsdp2 --timeout $b --steps 8 --warmup 2 --out "$OUT" > "$OUT/bench.log" 2>&1
    echo "bench fsdp2 on $ngpu GPUs rc=$? ($(( $(date +%s) - t3 )) s)" | tee -a "$OUT/summary.txt"
else
    echo "bench fsdp2: skipped: $ngpu GPU(s) visible (needs 2+), $(left) s left" | tee -a "$OUT/summary.txt"
fi
echo "---- short table ----"
grep -hE "passed|failed|error" "$OUT/tests.log" | tail -n 3
grep -hE "chunk MiB|^ *[0-9.]+ +[0-9.]+ +[0-9.]+|skipped" "$OUT/loopback.log" | head -n 8
if [ -f "$OUT/bench.log" ]; then
    sed -n '/model\/mode\/variant/,/^wrote/p' "$OUT/bench.log" | cut -c1-160
    grep -hE "Error|Traceback|TIMEOUT" "$OUT/bench.log" | head -n 5
fi
echo "total $(( $(date +%s) - t0 )) s"
