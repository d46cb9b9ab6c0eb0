#!/usr/bin/env bash
# The build on a GPU machine without nvcc, against the build with nvcc (one GPU is enough).
# Usage there, from the repository root, with .whl/ carried (it holds the
# nvidia-cuda-crt wheel of torch's CUDA version; see below):
#   bash bench/gpu_build_check.sh
# Everything is logged under $OUT; a short table is printed last. TESTS overrides the
# 1-GPU test files run on the no-nvcc build.
#  1. nvcc hidden (PATH without it, CUDA_HOME unset): install the crt/ headers' wheel from
#     .whl/ and torch_ce as the README's GPU install does, run the 1-GPU tests, print
#     explain()'s gather kernel line.
#  2. nvcc present: build a copy of the tree (/tmp/ce_nvcc) with nvcc; both builds gather
#     the same seeded loopback data (bench/build_check.py) and must agree bit for bit.
#  3. CUDA headers of another version (triton's bundle, CUDA 12.8) against torch's runtime:
#     the build must fail before compiling, naming both versions.
#  4. CPU cost per gather (op + wait_tensor) of both builds, on loopback slots.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/torch_ce_build_check}
PY=${PY:-python3}
ROOT=$(pwd)
mkdir -p "$OUT"
say() { echo "== $*"; }
fail=0

# nvcc, wherever it is, and a PATH that hides it (a shadow of each dir that holds nvcc,
# with every other tool of that dir, so g++ stays reachable).
NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
HIDDEN=""
i=0
IFS=: read -ra DIRS <<< "$PATH"
for d in "${DIRS[@]}"; do
  if [ -x "$d/nvcc" ]; then
    i=$((i + 1)); s=/tmp/no_nvcc_path/$i; rm -rf "$s"; mkdir -p "$s"
    for f in "$d"/*; do case "${f##*/}" in nvcc*) ;; *) ln -s "$f" "$s/" ;; esac; done
    d=$s
  fi
  HIDDEN=${HIDDEN:+$HIDDEN:}$d
done
nonvcc() { env -u CUDA_HOME -u CUDA_PATH PATH="$HIDDEN" "$@"; }

T_START=$(date +%s)
say "machine"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY - <<'EOF'
import glob, os, re, torch
print("python", os.path.realpath(__import__("sys").executable), "torch", torch.__version__, "CUDA", torch.version.cuda)
site = os.path.dirname(os.path.dirname(torch.__file__))
inc = glob.glob(os.path.join(site, "nvidia", "cu*", "include"))
for d in inc:
    print("torch's CUDA wheels:", d, "cuda_runtime_api.h:", os.path.isfile(os.path.join(d, "cuda_runtime_api.h")),
          "crt/host_defines.h:", os.path.isfile(os.path.join(d, "crt", "host_defines.h")))
try:
    import triton
    t = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    v = re.search(r"define CUDART_VERSION\s+(\d+)", open(os.path.join(t, "cuda_runtime_api.h")).read())
    print("triton", triton.__version__, "bundles CUDA headers", v and v.group(1), "at", t)
except Exception as e:
    print("triton:", e)
EOF
echo "nvcc: ${NVCC:-none} ($([ -n "$NVCC" ] && "$NVCC" --version | tail -1)); hidden: $(nonvcc sh -c 'command -v nvcc || echo yes')"

say "1. install without nvcc"
if ls .whl/nvidia_cuda_crt-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps .whl/nvidia_cuda_crt-*.whl > "$OUT/crt_install.log" 2>&1
  echo "crt wheel install rc=$? ($(ls .whl/nvidia_cuda_crt-*.whl))"
else
  echo "no .whl/nvidia_cuda_crt-*.whl carried: the install needs the crt/ headers from somewhere else"
fi
t0=$(date +%s)
nonvcc timeout 240 $PY -m pip install -v --no-build-isolation --no-deps -e . > "$OUT/install_no_nvcc.log" 2>&1
rc=$?
echo "install rc=$rc in $(( $(date +%s) - t0 )) s"; grep -E "^ *torch_ce: (host-compiler|nvcc|skipping|cannot)" "$OUT/install_no_nvcc.log" | cut -c1-300
[ $rc -eq 0 ] || { tail -30 "$OUT/install_no_nvcc.log"; fail=1; }
grep -q "host-compiler build" "$OUT/install_no_nvcc.log" || { echo "FAIL: not a host-compiler build"; fail=1; }
grep -qE "headers from the CUDA [0-9]+ wheels" "$OUT/install_no_nvcc.log" || echo "WARN: the headers did not come from torch's CUDA wheels"

# Steps 2 and 3 build in the background while the tests run.
rm -rf /tmp/ce_nvcc /tmp/ce_mis; mkdir -p /tmp/ce_nvcc /tmp/ce_mis
tar --exclude=./.whl --exclude=./.git --exclude='*.so' --exclude=./build -cf - . | (cd /tmp/ce_nvcc && tar xf -)
tar --exclude=./.whl --exclude=./.git --exclude='*.so' --exclude=./build -cf - . | (cd /tmp/ce_mis && tar xf -)
( cd /tmp/ce_nvcc && CUDA_HOME=$(dirname "$(dirname "$NVCC")") PATH="$(dirname "$NVCC"):$PATH" \
    timeout 300 $PY setup.py build_ext --inplace > "$OUT/build_nvcc.log" 2>&1; echo "rc=$?" >> "$OUT/build_nvcc.log" ) &
NVCC_JOB=$!
TRITON_INC=$($PY -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends', 'nvidia', 'include'))")
( cd /tmp/ce_mis && nonvcc env TORCH_CE_CUDA_INCLUDE="$TRITON_INC" timeout 120 $PY setup.py build_ext --inplace > "$OUT/build_mismatch.log" 2>&1
  echo "rc=$?" >> "$OUT/build_mismatch.log"
  # The source's own guard, should a wrong cuda_runtime_api.h come first anyway.
  INC=$($PY -c "from torch.utils import cpp_extension as c; print(' '.join('-I' + d for d in c.include_paths()))")
  timeout 120 g++ -std=c++17 -fsyntax-only -DTORCH_CE_RUNTIME_CUDA_MAJOR=13 -Icsrc $INC -I"$TRITON_INC" -x c++ csrc/ce_ops.cu > "$OUT/guard_mismatch.log" 2>&1
  echo "rc=$?" >> "$OUT/guard_mismatch.log" ) &
MIS_JOB=$!

TESTS=${TESTS:-"test/test_build.py test/test_native_cuda.py test/test_rows_cuda.py test/test_rows_triton_cuda.py"}
nonvcc timeout 330 $PY -m pytest -q -s -p no:cacheprovider $TESTS > "$OUT/tests_no_nvcc.log" 2>&1
rc=$?
echo "1-GPU tests (no-nvcc build) rc=$rc: $(tail -1 "$OUT/tests_no_nvcc.log")"
[ $rc -eq 0 ] || { grep -E "^(FAILED|ERROR)|Error" "$OUT/tests_no_nvcc.log" | head -20; fail=1; }
nonvcc $PY - <<'EOF' 2>&1 | tee "$OUT/explain_no_nvcc.txt"
import torch_ce
from torch_ce.runtime import native
for dev, path in torch_ce.explain().kernel_paths.items():
    print(f"explain(): gather kernel ({dev}): {path}")
print("build command:", native.build_command())
EOF

say "2. nvcc build, bit-identical gathers"
wait $NVCC_JOB
tail -1 "$OUT/build_nvcc.log"; grep -E "^torch_ce: (nvcc|host)" "$OUT/build_nvcc.log" | cut -c1-200
nonvcc timeout 120 $PY bench/build_check.py --label no_nvcc --expect-root "$ROOT" --out "$OUT/no_nvcc.json" 2>&1 | tail -3
(cd /tmp/ce_nvcc && PYTHONPATH=/tmp/ce_nvcc timeout 120 $PY bench/build_check.py --label nvcc \
   --expect-root /tmp/ce_nvcc --out "$OUT/nvcc.json" 2>&1 | tail -3)

say "3. mismatched headers"
wait $MIS_JOB
grep -E "torch_ce: cannot build" "$OUT/build_mismatch.log" | cut -c1-600
tail -1 "$OUT/build_mismatch.log"
grep -m1 "#error" "$OUT/guard_mismatch.log" | cut -c1-200; tail -1 "$OUT/guard_mismatch.log"

say "4. summary"
OUT=$OUT FAIL=$fail $PY - <<'EOF'
import json, os, re
out = os.environ["OUT"]
ok = os.environ["FAIL"] == "0"
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        print(f"{name}: missing ({e})")
        return None
a, b = load("no_nvcc.json"), load("nvcc.json")
mis = open(os.path.join(out, "build_mismatch.log")).read()
m = re.search(r"torch_ce: cannot build.*", mis)
mis_ok = "rc=0" not in mis and m is not None and "CUDA 12." in m.group(0) and "CUDA 13." in m.group(0)
print(f"mismatched headers refused at build time naming both versions: {mis_ok}")
ok &= mis_ok
if a and b:
    same = a["digests"] == b["digests"] and a["rows_digests"] == b["rows_digests"]
    exact = all(a["exact"] + b["exact"] + a["rows_exact"] + b["rows_exact"])
    print(f"gathers exact in both builds: {exact}; bit-identical across builds: {same}")
    print(f"no-nvcc: {a['kernel_path']}\nnvcc:    {b['kernel_path']}")
    print(f"{'us per call (CPU)':<28} {'no nvcc':>9} {'nvcc':>9} {'ratio':>7}")
    for k in a["cpu_us"]:
        print(f"{k:<28} {a['cpu_us'][k]:9.1f} {b['cpu_us'][k]:9.1f} {a['cpu_us'][k] / b['cpu_us'][k]:7.2f}")
    for k in a["device_us"]:
        print(f"{k + ' (device)':<28} {a['device_us'][k]:9.1f} {b['device_us'][k]:9.1f} {a['device_us'][k] / b['device_us'][k]:7.2f}"
              f"   ({a['row_path']} vs {b['row_path']} row kernel)")
    r = a["cpu_us"]["op + wait_tensor"] / b["cpu_us"]["op + wait_tensor"]
    print(f"op + wait_tensor within 10%: {abs(r - 1) <= 0.10} ({r:.3f})")
    ok &= same and exact
print("OVERALL", "PASS" if ok else "FAIL")
EOF
echo "wall $(( $(date +%s) - T_START )) s"
