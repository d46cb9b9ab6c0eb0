# Sourced by the comparison scripts: wheels on the path, this tree installed (once per
# machine), the earlier tree in .base built in place (whenever its libraries are missing: a
# carried .base replaces the one on a warm machine, built libraries included).
set -u; export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
if ! ls .base/torch_ce/_ce_torch*.so > /dev/null 2>&1; then
  (cd .base && TORCH_CE_CUDA_ARCH=90 python3 setup.py build_ext --inplace > /tmp/base_build.log 2>&1; echo "base build rc=$?" >> /tmp/base_build.log) &
fi
if [ ! -f /tmp/new_installed ]; then
  TORCH_CE_CUDA_ARCH=90 python3 -m pip install --no-build-isolation --no-deps -e . > /tmp/install.log 2>&1 || { tail -30 /tmp/install.log; exit 1; }
  touch /tmp/new_installed
fi
wait
python3 -c "import torch, torch_ce.runtime.gather as G; print('torch', torch.__version__, 'this tree:', G.kernel_path('cuda'))"
(cd .base && PYTHONPATH=$PWD:$PYTHONPATH python3 -c "import torch_ce, torch_ce.native as N; print('.base from', torch_ce.__file__, 'C++ kernels', N.load())")
