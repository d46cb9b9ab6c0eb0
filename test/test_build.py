"""The one compiled piece, csrc/ce_torch.cpp: built and loaded against a CUDA torch,
compile-checked (not installed) against a CPU torch with nvcc, absent without nvcc.

The install itself runs the compile check on CPU machines with nvcc (dev, CI), so a broken
source fails there; these tests check that the check can fail, and what is loaded.
"""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _setup_module():
    """setup.py's helpers (its ``setup()`` call runs only as __main__)."""
    spec = importlib.util.spec_from_file_location("torch_ce_setup", os.path.join(ROOT, "setup.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _setup_module()
_build_expected = S.find_nvcc() is not None and os.environ.get("TORCH_CE_SKIP_CUDA_BUILD", "0") in ("", "0")
requires_nvcc = pytest.mark.skipif(S.find_nvcc() is None, reason="needs nvcc")


def _check(tmp_path, text: str) -> None:
    src = tmp_path / "tu.cpp"
    src.write_text(text)
    flags, _ = S.torch_flags()
    cwd = os.getcwd()
    os.chdir(ROOT)  # the check includes csrc/ relative to the source tree, as setup.py does
    try:
        S.compile_check(S.find_nvcc(), str(src), flags, str(tmp_path / "build"))
    finally:
        os.chdir(cwd)


@requires_nvcc
def test_compile_check_accepts_the_copy_header_with_torch_cuda_headers(tmp_path):
    """ce_copy.h and torch's c10/cuda headers (with the shim a CPU wheel needs) compile
    through nvcc: what the install's check of ce_torch.cpp stands on."""
    _check(tmp_path, '#include <c10/cuda/CUDAStream.h>\n#include "ce_copy.h"\n'
                     "bool f() { return torch_ce_copy::batch_supported(); }\n")
    assert (tmp_path / "build" / "ce_torch_check.o").stat().st_size > 0


@requires_nvcc
def test_compile_check_fails_on_a_broken_source(tmp_path):
    with pytest.raises(SystemExit, match="compiling .* with nvcc failed"):
        _check(tmp_path, '#include "ce_copy.h"\n'
                         "int f() { return torch_ce_copy::no_such_function(); }\n")


def test_torch_kernels_follow_the_torch_build():
    """csrc/ce_torch.cpp links torch's CUDA libraries: built and loaded with a CUDA torch
    (and nvcc), absent with a CPU torch, where CUDA gathers stay on the collective."""
    from torch_ce.runtime import native

    if torch.version.cuda is None or not _build_expected:
        assert native.library_path() is None
        assert not native.load() and native.slot_count() == 0
        native.set_split_local_copy(False)  # a no-op without the kernels, never an error
    else:
        assert native.library_path() is not None, "csrc/ce_torch.cpp was not built"
        assert native.load() == (os.environ.get("TORCH_CE_NATIVE", "1") != "0")
    # The Python kernel is reachable under its own name either way.
    assert torch.ops.torch_ce.gather_python.default is not None

