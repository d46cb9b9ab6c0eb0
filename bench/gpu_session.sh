#!/usr/bin/env bash
# One call on a 1-GPU machine for everything one GPU can check (run from the repository
# root, .whl/ carried with the nvidia-cuda-crt wheel of torch's CUDA version):
#   1. bench/gpu_build_check.sh: the no-nvcc install and its 1-GPU tests (the loopback
#      gathers, padded slabs, cast slots, strided Shard(1) reads, both row kernels), the
#      nvcc build of a copy, the two builds' gathers bit for bit, a mismatched-header
#      build refused, CPU cost per gather of both builds;
#   2. the nvcc build installed in place, the same 1-GPU tests on it;
#   3. the new copy shapes' costs on loopback (bench/compare/uneven_cost.py, dim1_cost.py);
#   4. `torch-ce bench ops` on one GPU: must exit non-zero with one line.
# Logs go to $OUT/session.tar.gz (the device tool returns at most 8 files); a table last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/torch_ce_session}
L=$OUT/logs; mkdir -p "$L"
PY=python3
export TESTS="test/test_build.py test/test_native_cuda.py test/test_rows_cuda.py test/test_rows_triton_cuda.py test/test_uneven_cuda.py test/test_dim1_cuda.py"
OUT=$L bash bench/gpu_build_check.sh > "$L/build_check.log" 2>&1
echo "== 1. build check"; sed -n '/== 4. summary/,$p' "$L/build_check.log"; grep "1-GPU tests" "$L/build_check.log"
cp "$L/no_nvcc.json" "$L/nvcc.json" "$OUT/" 2>/dev/null

echo "== 2. nvcc build in place"
timeout 300 $PY -m pip install -v --no-build-isolation --no-deps -e . > "$L/install_nvcc.log" 2>&1
echo "install rc=$?"; grep -E "^ *torch_ce: (nvcc|host)" "$L/install_nvcc.log" | cut -c1-200
timeout 300 $PY -m pytest -q -s -p no:cacheprovider $TESTS > "$L/tests_nvcc.log" 2>&1
echo "1-GPU tests (nvcc build) rc=$?: $(tail -1 "$L/tests_nvcc.log")"
grep -E "^(FAILED|ERROR)" "$L/tests_nvcc.log" | head -20

echo "== 3. copy shapes on loopback"
timeout 150 $PY bench/compare/uneven_cost.py > "$L/uneven_cost.log" 2>&1; echo "uneven_cost rc=$?"
tail -12 "$L/uneven_cost.log" | cut -c1-300
timeout 200 $PY bench/compare/dim1_cost.py --json "$OUT/dim1_cost.json" > "$L/dim1_cost.log" 2>&1; echo "dim1_cost rc=$?"
grep -E "^\[dim1" "$L/dim1_cost.log" | cut -c1-200 | tail -40

echo "== 4. bench ops on one GPU"
mkdir -p /tmp/ops1
timeout 60 $PY -m torch_ce.cli bench ops --out /tmp/ops1 > "$L/bench_ops_1gpu.log" 2>&1; echo "bench ops rc=$? (expect non-zero)"
cat "$L/bench_ops_1gpu.log" | tail -3; echo "files written: $(ls /tmp/ops1 | wc -l)"

tar -czf "$OUT/session.tar.gz" -C "$OUT" logs && rm -rf "$L"
