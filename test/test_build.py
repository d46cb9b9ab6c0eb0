"""The CUDA library (csrc/ce_ops.cu) is built where nvcc exists and does exact copies; the
torch kernels (csrc/ce_torch.cpp) exist exactly where torch is a CUDA build.

The build checks run on CPU-only machines with nvcc (dev, CI), so a broken build
shows there; the copy checks need a GPU.
"""

import os
import shutil
import subprocess

import pytest
import torch

from torch_ce.runtime import _cuda_lib

SYMBOLS = (
    "torch_ce_runtime_version",
    "torch_ce_batch_supported",
    "torch_ce_memcpy_batch",
    "torch_ce_memcpy_peer_fallback",
)


def _find_nvcc():
    """Same lookup as setup.py: $CUDA_HOME/bin/nvcc, PATH, /usr/local/cuda/bin/nvcc."""
    cuda_home = os.environ.get("CUDA_HOME")
    for path in (
        os.path.join(cuda_home, "bin", "nvcc") if cuda_home else None,
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


_build_expected = _find_nvcc() is not None and os.environ.get("TORCH_CE_SKIP_CUDA_BUILD", "0") in ("", "0")
requires_build = pytest.mark.skipif(
    not _build_expected, reason="no nvcc, or TORCH_CE_SKIP_CUDA_BUILD set: the library is not built"
)
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_build
def test_library_is_built():
    path = _cuda_lib.library_path()
    assert path is not None, "nvcc is available but torch_ce/_ce_ops*.so was not built"
    assert _cuda_lib.is_built()
    assert os.path.basename(path).startswith("_ce_ops") and path.endswith(".so")


@requires_build
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_library_exports_symbols():
    # nm, not ctypes: on a machine without a GPU the CUDA runtime need not be loadable.
    path = _cuda_lib.library_path()
    assert path is not None
    out = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
    missing = [s for s in SYMBOLS if s not in exported]
    assert not missing, f"{path} does not export {missing}"


def test_unbuilt_library_is_reported(monkeypatch):
    monkeypatch.setattr(_cuda_lib, "library_path", lambda: None)
    monkeypatch.setattr(_cuda_lib, "_lib", None)
    assert not _cuda_lib.is_built()
    assert not _cuda_lib.batch_supported()
    with pytest.raises(RuntimeError, match="pip install --no-build-isolation -e ."):
        _cuda_lib.load()


# Odd sizes and offsets exercise the copy engines' unaligned paths.
_SIZES = (1, 7, 4096, 12345, (1 << 20) + 3, 4 << 20)


def _buffers(offset=0):
    srcs = [torch.randint(0, 256, (n + offset,), dtype=torch.uint8, device="cuda")[offset:] for n in _SIZES]
    dsts = [torch.zeros(n + offset, dtype=torch.uint8, device="cuda")[offset:] for n in _SIZES]
    return srcs, dsts


def _copy_and_check(copy, **kwargs):
    for offset in (0, 3):
        srcs, dsts = _buffers(offset)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        copy(
            [d.data_ptr() for d in dsts],
            [s.data_ptr() for s in srcs],
            [s.numel() for s in srcs],
            stream.cuda_stream,
            **kwargs,
        )
        torch.cuda.current_stream().wait_stream(stream)
        for s, d in zip(srcs, dsts):
            assert torch.equal(s, d)


@requires_gpu
@requires_build
def test_runtime_version():
    assert _cuda_lib.runtime_version() >= 12000


@requires_gpu
@requires_build
@pytest.mark.parametrize("prefer_overlap", [True, False])
def test_memcpy_batch_exact(prefer_overlap):
    if not _cuda_lib.batch_supported():
        pytest.skip(f"cudaMemcpyBatchAsync needs CUDA >= 12.8 (runtime {_cuda_lib.runtime_version()})")
    _copy_and_check(_cuda_lib.memcpy_batch, prefer_overlap=prefer_overlap)


@requires_gpu
@requires_build
def test_memcpy_peer_fallback_exact():
    _copy_and_check(_cuda_lib.memcpy_peer_fallback)


@requires_gpu
@requires_build
def test_memcpy_batch_rejects_legacy_stream():
    if not _cuda_lib.batch_supported():
        pytest.skip("cudaMemcpyBatchAsync unavailable")
    srcs, dsts = _buffers()
    with pytest.raises(RuntimeError, match="legacy default stream"):
        _cuda_lib.memcpy_batch([dsts[0].data_ptr()], [srcs[0].data_ptr()], [srcs[0].numel()], 0)


@requires_gpu
@requires_build
def test_empty_batch_is_noop():
    _cuda_lib.memcpy_batch([], [], [], torch.cuda.Stream().cuda_stream)
    _cuda_lib.memcpy_peer_fallback([], [], [], torch.cuda.Stream().cuda_stream)


def test_torch_kernels_follow_the_torch_build():
    """csrc/ce_torch.cpp links torch's CUDA libraries: built and loaded with a CUDA torch
    (and nvcc), absent with a CPU torch, where the Python kernel serves every gather."""
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


def test_loopback_needs_matching_tensors():
    from torch_ce.runtime import native

    class _Group:
        group_name = "unused"

    with pytest.raises(ValueError, match="one shape and dtype"):
        native.register_loopback(torch.zeros(4), torch.zeros(5), _Group())
    with pytest.raises(ValueError, match="one shape and dtype"):
        native.register_loopback(torch.zeros(4, 4).t(), torch.zeros(4, 4), _Group())
