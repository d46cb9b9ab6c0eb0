#!/usr/bin/env bash
# One call on a 1-GPU machine (torch 2.11+cu130 there), from the repository root, .whl/
# carried (expecttest and the examples' torchtitan modules: README's GPU install):
#
#   bash bench/gpu_suite.sh xdist    the GPU install (nvcc), the 1-GPU tests (loopback
#                                    slots: kernels, row gathers, padded / cast / strided
#                                    reads, graph_trainer's CUDA-graph capture), then the
#                                    whole default suite under `pytest -n 14`
#   bash bench/gpu_suite.sh serial [FILE...]   the GPU install, then the default suite (or
#                                    the test files named) serially: the whole suite is longer
#                                    than one device call there, so it runs as lists of files,
#                                    one list a call on one warm machine (docs/perf-notes.md
#                                    section 19 gives three that fit)
#
# Logs go to $OUT (each step's own file); a short table last.
set -u
export PYTHONUNBUFFERED=1
MODE=${1:-xdist}
OUT=${OUT:-/tmp/torch_ce_gpu_suite}
mkdir -p "$OUT"
PY=python3
START=$(date +%s)
BUDGET_S=${BUDGET_S:-570}  # the device call's limit, less the transfers
left() { echo $(( BUDGET_S - ($(date +%s) - START) - 35 )); }  # for the next step, SIGINT's grace kept
ONE_GPU="test/test_build.py test/test_native_cuda.py test/test_rows_cuda.py test/test_rows_triton_cuda.py test/test_uneven_cuda.py test/test_dim1_cuda.py"
for t in test/test_graph_trainer_cuda.py; do [ -f "$t" ] && ONE_GPU="$ONE_GPU $t"; done

if [ -d .whl ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
t0=$(date +%s)
# a warm machine keeps the editable install and its built kernels: built once per machine
if $PY -c "import torch_ce.runtime.native as n, sys; sys.exit(n.library_path() is None)" 2>/dev/null; then
    echo "install: kept from the last call (warm machine)"
else
    timeout 300 $PY -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install_$MODE.log" 2>&1
    echo "install rc=$? ($(( $(date +%s) - t0 )) s): $(grep -E '^ *torch_ce: (nvcc|host)' "$OUT/install_$MODE.log" | head -1 | cut -c1-160)"
fi
$PY -c "import torch, torch_ce; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print(torch_ce.explain().table().splitlines()[1])"

if [ "$MODE" = xdist ]; then
    t0=$(date +%s)
    timeout -s INT -k 20 200 $PY -m pytest -q -p no:cacheprovider -rfEs $ONE_GPU > "$OUT/tests_1gpu.log" 2>&1
    echo "1-GPU tests rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/tests_1gpu.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/tests_1gpu.log" | head -20
    t0=$(date +%s)
    timeout -s INT -k 30 $(left) $PY -m pytest -q -n 14 -p no:cacheprovider -rfE --durations=25 test > "$OUT/suite_xdist.log" 2>&1
    echo "default suite, -n 14: rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$OUT/suite_xdist.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/suite_xdist.log" | head -30
else
    FILES="${*:2}"; LOG="$OUT/suite_serial_named.log"
    [ -n "$FILES" ] || { FILES=test; LOG="$OUT/suite_serial.log"; }
    t0=$(date +%s)
    timeout -s INT -k 30 $(left) $PY -m pytest -q -p no:cacheprovider -rfE --durations=25 $FILES > "$LOG" 2>&1
    echo "default suite, serial, $(wc -w <<<"$FILES") path(s): rc=$? ($(( $(date +%s) - t0 )) s): $(tail -1 "$LOG")"
    grep -E "^(FAILED|ERROR)" "$LOG" | head -30
fi
