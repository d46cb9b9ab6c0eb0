#!/usr/bin/env bash
# Device-machine runs (2 x H200): build the extension, run the GPU tests, then both
# benchmarks. Everything is logged under $OUT; a short summary is printed last.
# Usage there: bash bench/run_gpu.sh   (with .whl/ carried for torchtitan's modules)
# STEPS picks what runs (default "tests titan issue ops e2e"), so the work can be split
# over calls that each fit the 10-minute limit; E2E_ARGS passes options to bench e2e.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/torch_ce_out}
# An explicitly empty STEPS (STEPS="") runs nothing but the install: only an unset STEPS
# means the default (run 20 lost a device budget to STEPS="" running everything).
STEPS=" ${STEPS-tests titan issue ops e2e} "
mkdir -p "$OUT"
has() { [[ "$STEPS" == *" $1 "* ]]; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
TORCH_CE_CUDA_ARCH=90 timeout ${INSTALL_TIMEOUT:-90} python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/torch_ce_install.log 2>&1 \
  || { tail -40 /tmp/torch_ce_install.log; exit 1; }
python3 -c "import torch_ce, torch_ce.runtime._cuda_lib as L, torch_ce.runtime.native as N, torch; print('torch', torch.__version__, 'lib', L.library_path(), 'batch', L.batch_supported(), 'rt', L.runtime_version(), 'C++ kernels', N.loaded())"
if has tests; then
  TESTS=${TESTS:-"test/test_build.py test/test_ops_cuda.py test/test_native_cuda.py test/test_compile_cuda.py test/test_refusals_cuda.py test/test_prefetch_cuda.py"}
  TESTS=$(for t in $TESTS; do [ -f "$t" ] && echo "$t"; done)
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -s -p no:cacheprovider $TESTS > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests rc=$?"
fi
if has titan; then
  timeout ${TITAN_TIMEOUT:-60} torchrun --nproc_per_node 2 test/gpu/run_torchtitan_gpu.py >> "$OUT/gpu_tests.log" 2>&1
  echo "torchtitan gpu rc=$?"
fi
if has issue; then
  timeout ${ISSUE_TIMEOUT:-60} torchrun --nproc_per_node ${NPROC:-2} bench/issue_cost.py > "$OUT/issue_cost.log" 2>&1
  echo "issue cost rc=$?"
fi
if has ops; then
  timeout ${OPS_TIMEOUT:-90} python3 -m torch_ce.cli bench ops --out "$OUT" > "$OUT/bench_ops.log" 2>&1
  echo "bench ops rc=$?"
fi
if has e2e; then
  # SM clocks and power beside the timed loops (perf-notes section 9: is the GPU slowing
  # under sustained load?); each variant's wall-clock start/end is in the e2e JSON.
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv -lms 200 > "$OUT/gpu_clocks.csv" 2>/dev/null &
  SMI=$!
  timeout ${E2E_TIMEOUT:-160} python3 -m torch_ce.cli bench e2e --out "$OUT" --trace ${E2E_ARGS:-} > "$OUT/bench_e2e.log" 2>&1
  echo "bench e2e rc=$?"
  kill $SMI 2>/dev/null
fi
if has tests || has titan; then
  echo "===== gpu tests"; grep -E "passed|failed|FAIL|PASS|error|Error|^\{|bytes" "$OUT/gpu_tests.log" | cut -c1-400 | tail -30
fi
has issue && { echo "===== issue cost"; grep "\[issue\]" "$OUT/issue_cost.log" || tail -5 "$OUT/issue_cost.log"; }
has ops && { echo "===== bench ops"; tail -25 "$OUT/bench_ops.log" 2>/dev/null; }
has e2e && { echo "===== bench e2e"; tail -30 "$OUT/bench_e2e.log" 2>/dev/null; }
exit 0
