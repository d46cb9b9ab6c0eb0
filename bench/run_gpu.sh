#!/usr/bin/env bash
# Device-machine runs (2 or more H200s): build the extension, run the GPU tests, then both
# benchmarks. Everything is logged under $OUT; a short summary is printed last.
# Usage there: bash bench/run_gpu.sh   (with .whl/ carried for torchtitan's modules)
# STEPS picks what runs (default "tests titan issue ops e2e scaling"; also "train_tests"
# and "train": test/test_training_cuda.py and bench train, TRAIN_ARGS passed to it), so the work can be
# split over calls that each fit the 10-minute limit. WORLDS (default "2") lists the world
# sizes: every step but scaling runs once per world (the tests through TORCH_CE_GPU_WORLD,
# the benches with --nprocs), logging to <step>_w<world>.log; scaling plots the ops JSONs of
# $OUT (bench/results/ops_scaling_<gpu>.png's source). OPS_ARGS and E2E_ARGS pass options
# to bench ops and bench e2e. TORCH_CE_PEER_ORDER / TORCH_CE_PEER_CHUNK_MIB (NOTE [peer
# order] in csrc/ce_copy.h) pass through to everything.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/torch_ce_out}
# An explicitly empty STEPS (STEPS="") runs nothing but the install: only an unset STEPS
# means the default (run 20 lost a device budget to STEPS="" running everything).
STEPS=" ${STEPS-tests titan issue ops e2e scaling} "
WORLDS=${WORLDS:-2}
NGPU=$(nvidia-smi -L | wc -l)
for W in $WORLDS; do
  [ "$W" -ge 2 ] && [ "$W" -le "$NGPU" ] || { echo "WORLDS: $W is not within 2..$NGPU GPUs"; exit 1; }
done
mkdir -p "$OUT"
has() { [[ "$STEPS" == *" $1 "* ]]; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
TORCH_CE_CUDA_ARCH=90 timeout ${INSTALL_TIMEOUT:-90} python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/torch_ce_install.log 2>&1 \
  || { tail -40 /tmp/torch_ce_install.log; exit 1; }
python3 -c "import torch_ce, torch_ce.runtime.native as N, torch_ce.runtime.gather as G, torch; print('torch', torch.__version__, 'lib', N.library_path(), 'gather', G.kernel_path('cuda'))"
for W in $WORLDS; do
  export TORCH_CE_GPU_WORLD=$W
  if has tests; then
    TESTS=${TESTS:-"test/test_build.py test/test_ops_cuda.py test/test_native_cuda.py test/test_compile_cuda.py test/test_refusals_cuda.py test/test_prefetch_cuda.py"}
    TESTS=$(for t in $TESTS; do [ -f "$t" ] && echo "$t"; done)
    timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -s -p no:cacheprovider $TESTS > "$OUT/gpu_tests_w$W.log" 2>&1
    echo "gpu tests w$W rc=$?"
  fi
  if has titan; then
    timeout ${TITAN_TIMEOUT:-60} torchrun --nproc_per_node $W test/gpu/run_torchtitan_gpu.py >> "$OUT/gpu_tests_w$W.log" 2>&1
    echo "torchtitan gpu w$W rc=$?"
  fi
  if has issue; then
    timeout ${ISSUE_TIMEOUT:-60} torchrun --nproc_per_node $W bench/issue_cost.py > "$OUT/issue_cost_w$W.log" 2>&1
    echo "issue cost w$W rc=$?"
  fi
  if has ops; then
    timeout ${OPS_TIMEOUT:-150} python3 -m torch_ce.cli bench ops --nprocs $W --out "$OUT" ${OPS_ARGS:-} > "$OUT/bench_ops_w$W.log" 2>&1
    echo "bench ops w$W rc=$?"
  fi
  if has train_tests; then
    timeout ${TRAIN_TEST_TIMEOUT:-300} python3 -m pytest -q -s -p no:cacheprovider test/test_training_cuda.py > "$OUT/gpu_train_tests_w$W.log" 2>&1
    echo "gpu training tests w$W rc=$?"
  fi
  if has train; then
    timeout ${TRAIN_TIMEOUT:-420} python3 -m torch_ce.cli bench train --nprocs $W --out "$OUT" ${TRAIN_ARGS:-} > "$OUT/bench_train_w$W.log" 2>&1
    echo "bench train w$W rc=$?"
  fi
  if has e2e; then
    # SM clocks and power beside the timed loops (perf-notes section 9: is the GPU slowing
    # under sustained load?); each variant's wall-clock start/end is in the e2e JSON.
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
      --format=csv -lms 200 > "$OUT/gpu_clocks_w$W.csv" 2>/dev/null &
    SMI=$!
    timeout ${E2E_TIMEOUT:-160} python3 -m torch_ce.cli bench e2e --nprocs $W --out "$OUT" --trace ${E2E_ARGS:-} > "$OUT/bench_e2e_w$W.log" 2>&1
    echo "bench e2e w$W rc=$?"
    kill $SMI 2>/dev/null
  fi
done
if has scaling; then
  python3 -m torch_ce.cli bench plot-scaling --results "$OUT" > "$OUT/plot_scaling.log" 2>&1
  echo "plot scaling rc=$?"; cat "$OUT/plot_scaling.log"
fi
for W in $WORLDS; do
  if has tests || has titan; then
    echo "===== gpu tests w$W"; grep -E "passed|failed|FAIL|PASS|error|Error|^\{|bytes" "$OUT/gpu_tests_w$W.log" | cut -c1-400 | tail -30
  fi
  has issue && { echo "===== issue cost w$W"; grep "\[issue\]" "$OUT/issue_cost_w$W.log" || tail -5 "$OUT/issue_cost_w$W.log"; }
  has ops && { echo "===== bench ops w$W"; tail -40 "$OUT/bench_ops_w$W.log" 2>/dev/null; }
  has e2e && { echo "===== bench e2e w$W"; tail -30 "$OUT/bench_e2e_w$W.log" 2>/dev/null; }
  has train_tests && { echo "===== gpu training tests w$W"; tail -15 "$OUT/gpu_train_tests_w$W.log" 2>/dev/null; }
  has train && { echo "===== bench train w$W"; tail -25 "$OUT/bench_train_w$W.log" 2>/dev/null; }
done
exit 0
