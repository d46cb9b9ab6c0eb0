"""Build and install torch_ce.

Two compiled pieces, both built with nvcc:
- csrc/ce_ops.cu: a plain C ABI over the CUDA runtime (no torch headers) ->
  torch_ce/_ce_ops*.so, loaded with ctypes (torch_ce/_cuda_lib.py). Built
  wherever nvcc exists, GPU or not, so a broken build fails CI.
- csrc/ce_torch.cpp: the C++ kernels of the magi gathers (NOTE [native gather
  path]) -> torch_ce/_ce_torch*.so, loaded with torch.ops.load_library
  (torch_ce/native.py). It links torch's CUDA libraries, so it is built only
  against a CUDA build of torch; elsewhere the Python kernels serve.
Without nvcc the package still installs and works (host transport, passes, fake
impls); only the copy-engine transport is missing.

Environment:
  TORCH_CE_SKIP_CUDA_BUILD=1   do not build the CUDA library
  TORCH_CE_CUDA_ARCH=90        compute capabilities to build for ("90;100", "9.0 10.0");
                               SASS for each, plus PTX for the highest
  CUDA_HOME                    where to look for bin/nvcc first

Install (torch must already be installed; it is not a build requirement):
  pip install --no-build-isolation -e .     # editable: the .so lands in torch_ce/
  pip install --no-build-isolation .
"""

import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

CUDA_SOURCE = "csrc/ce_ops.cu"
TORCH_SOURCE = "csrc/ce_torch.cpp"


def find_nvcc():
    """$CUDA_HOME/bin/nvcc, then nvcc on PATH, then /usr/local/cuda/bin/nvcc."""
    candidates = []
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home:
        candidates.append(os.path.join(cuda_home, "bin", "nvcc"))
    candidates.append(shutil.which("nvcc"))
    candidates.append("/usr/local/cuda/bin/nvcc")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def gencode_flags(arch_list):
    """'90;100' -> SASS for sm_90 and sm_100, PTX for compute_100 (forward compatible)."""
    archs = [a.replace(".", "") for a in re.split(r"[;,\s]+", arch_list.strip()) if a]
    if not archs or not all(re.fullmatch(r"\d+[af]?", a) for a in archs):
        raise SystemExit(f"torch_ce: bad TORCH_CE_CUDA_ARCH={arch_list!r} (expected e.g. '90' or '90;100')")
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    top = max(archs, key=lambda a: int(re.match(r"\d+", a).group()))
    flags += ["-gencode", f"arch=compute_{top},code=compute_{top}"]
    return flags


def note(msg):
    print(f"torch_ce: {msg}", file=sys.stderr, flush=True)


class NvccBuildExt(build_ext):
    """Builds the CUDA library with nvcc directly (a plain shared library, not a
    Python extension module), or skips it with a note when asked to or when nvcc
    is missing. A failing nvcc fails the install."""

    def run(self):
        reason = None
        if os.environ.get("TORCH_CE_SKIP_CUDA_BUILD", "0") not in ("", "0"):
            reason = "TORCH_CE_SKIP_CUDA_BUILD is set"
        elif find_nvcc() is None:
            reason = "nvcc not found ($CUDA_HOME/bin, PATH, /usr/local/cuda/bin)"
        if reason:
            note(f"skipping the CUDA library build: {reason}. The copy-engine "
                 "transport will be unavailable; everything else works.")
            self.extensions = []
            return
        self._torch_flags = torch_flags()
        if self._torch_flags is None:
            self.extensions = [e for e in self.extensions if not e.name.endswith("_ce_torch")]
        super().run()

    def build_extension(self, ext):
        nvcc = find_nvcc()
        out = os.path.abspath(self.get_ext_fullpath(ext.name))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        sources = [os.path.abspath(s) for s in ext.sources]
        cmd = [nvcc, "-O2", "-shared", "-Xcompiler", "-fPIC", "-Icsrc",
               *gencode_flags(os.environ.get("TORCH_CE_CUDA_ARCH", "90")),
               "--cudart", "shared", "-o", out, *sources]
        if ext.name.endswith("_ce_torch"):
            cmd[1:1] = self._torch_flags
        note(" ".join(cmd))
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(f"torch_ce: building {ext.sources[0]} with nvcc failed ({e}). "
                             "Fix the build, or set TORCH_CE_SKIP_CUDA_BUILD=1 to install "
                             "without the copy-engine transport.") from e


def torch_flags():
    """Compile and link flags for the torch kernels, or None (with a note) when the
    installed torch is not a CUDA build: its CUDA libraries are what they link."""
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as e:
        note(f"skipping {TORCH_SOURCE}: torch is not importable ({e})")
        return None
    if torch.version.cuda is None:
        note(f"skipping {TORCH_SOURCE}: torch {torch.__version__} is a CPU build; "
             "the magi gathers use their Python kernels")
        return None
    incs = cpp_extension.include_paths(device_type="cuda")
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return ["-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *[f"-I{d}" for d in incs], f"-L{lib_dir}", "-Xlinker", f"-rpath={lib_dir}",
            "-lc10", "-lc10_cuda", "-ltorch", "-ltorch_cpu", "-ltorch_cuda"]


setup(
    name="torch_ce",
    version="0.1.0",
    description="Copy-engine all-gathers for FSDP weights in compiled PyTorch inference graphs",
    packages=find_packages(include=["torch_ce", "torch_ce.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11"],
    extras_require={"test": ["pytest", "expecttest"], "plot": ["matplotlib"]},
    entry_points={"console_scripts": ["torch-ce = torch_ce.cli:main"]},
    ext_modules=[
        Extension("torch_ce.runtime._ce_ops", sources=[CUDA_SOURCE], depends=["csrc/ce_copy.h"]),
        Extension("torch_ce.runtime._ce_torch", sources=[TORCH_SOURCE], depends=["csrc/ce_copy.h"]),
    ],
    cmdclass={"build_ext": NvccBuildExt},
    zip_safe=False,
)
