"""ctypes loader for the copy-engine library (csrc/ce_ops.cu -> _ce_ops*.so).

The library is a plain C ABI over the CUDA runtime with no torch headers, so it
is loaded with ctypes rather than as a torch extension. It links the shared
libcudart that torch (CUDA build) has already loaded, so torch is imported
before it; it is loaded lazily, on first use, so importing torch_ce never needs
CUDA. Pointers and streams are passed as ints (``tensor.data_ptr()``,
``torch.cuda.Stream().cuda_stream``).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from collections.abc import Sequence

__all__ = [
    "library_path",
    "is_built",
    "load",
    "batch_supported",
    "runtime_version",
    "memcpy_batch",
    "memcpy_peer_fallback",
]

_BUILD_HINT = (
    "build it with `pip install --no-build-isolation -e .` from the torch_ce "
    "source tree with nvcc on PATH (or CUDA_HOME set), without TORCH_CE_SKIP_CUDA_BUILD"
)
_ERRLEN = 512

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


_path_cache: list = []  # [path or None] once looked up: the hot path must not glob
_batch_cache: list = []  # [bool] once known


def library_path() -> str | None:
    """Path of the built library next to this file, or None if it was not built."""
    if _path_cache and _path_cache[0] is not None:
        return _path_cache[0]
    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ce_ops*.so")))
    path = found[0] if found else None
    _path_cache[:] = [path]
    return path


def is_built() -> bool:
    return library_path() is not None


def load() -> ctypes.CDLL:
    """Load the library once and declare its signatures; raise RuntimeError if impossible."""
    global _lib
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if path is None:
            raise RuntimeError(f"torch_ce: the CUDA library (_ce_ops*.so) is not built; {_BUILD_HINT}")
        import torch  # noqa: F401  (loads libcudart that the library links against)

        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise RuntimeError(
                f"torch_ce: cannot load {path}: {e}. It needs the CUDA runtime that a CUDA "
                f"build of torch loads (libcudart); or rebuild it: {_BUILD_HINT}"
            ) from e
        vp, sz, ci, cp = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p
        lib.torch_ce_runtime_version.argtypes = []
        lib.torch_ce_runtime_version.restype = ci
        lib.torch_ce_batch_supported.argtypes = []
        lib.torch_ce_batch_supported.restype = ci
        # (dsts, srcs, sizes, count, prefer_overlap, stream, errbuf, errlen)
        lib.torch_ce_memcpy_batch.argtypes = [vp, vp, vp, sz, ci, vp, cp, sz]
        lib.torch_ce_memcpy_batch.restype = ci
        # (dsts, srcs, sizes, count, stream, errbuf, errlen)
        lib.torch_ce_memcpy_peer_fallback.argtypes = [vp, vp, vp, sz, vp, cp, sz]
        lib.torch_ce_memcpy_peer_fallback.restype = ci
        _lib = lib
        return lib


def runtime_version() -> int:
    """cudaRuntimeGetVersion() (e.g. 13000), or -1 if the runtime cannot say."""
    return int(load().torch_ce_runtime_version())


def batch_supported() -> bool:
    """True if cudaMemcpyBatchAsync is usable: built, loadable, compiled and running on CUDA >= 12.8."""
    if _batch_cache:
        return _batch_cache[0]
    if not is_built():
        return False
    try:
        ok = bool(load().torch_ce_batch_supported())
    except RuntimeError:
        return False
    _batch_cache[:] = [ok]
    return ok


def _arrays(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int]):
    n = len(dsts)
    if isinstance(dsts, ctypes.Array) and isinstance(srcs, ctypes.Array) and isinstance(sizes, ctypes.Array):
        return n, dsts, srcs, sizes  # prebuilt by the caller (the gather hot path)
    if len(srcs) != n or len(sizes) != n:
        raise ValueError(f"torch_ce: dsts, srcs and sizes differ in length ({n}, {len(srcs)}, {len(sizes)})")
    return n, (ctypes.c_void_p * n)(*dsts), (ctypes.c_void_p * n)(*srcs), (ctypes.c_size_t * n)(*sizes)


def memcpy_batch(
    dsts: Sequence[int],
    srcs: Sequence[int],
    sizes: Sequence[int],
    stream: int,
    prefer_overlap: bool = True,
) -> None:
    """All copies in one cudaMemcpyBatchAsync on ``stream`` (one submission per gather bucket).

    Sources are read in stream order; ``stream`` must not be the legacy default stream (0).
    While a CUDA graph is being captured, use memcpy_peer_fallback instead.
    """
    lib = _lib or load()
    n, d, s, z = _arrays(dsts, srcs, sizes)
    if n == 0:
        return
    err = ctypes.create_string_buffer(_ERRLEN)
    rc = lib.torch_ce_memcpy_batch(d, s, z, n, 1 if prefer_overlap else 0, stream or None, err, _ERRLEN)
    if rc != 0:
        raise RuntimeError(f"torch_ce.memcpy_batch: {err.value.decode(errors='replace')}")


def memcpy_peer_fallback(dsts: Sequence[int], srcs: Sequence[int], sizes: Sequence[int], stream: int) -> None:
    """One cudaMemcpyAsync per copy on ``stream``: for runtimes without the batch API and graph capture."""
    lib = _lib or load()
    n, d, s, z = _arrays(dsts, srcs, sizes)
    if n == 0:
        return
    err = ctypes.create_string_buffer(_ERRLEN)
    rc = lib.torch_ce_memcpy_peer_fallback(d, s, z, n, stream or None, err, _ERRLEN)
    if rc != 0:
        raise RuntimeError(f"torch_ce.memcpy_peer_fallback: {err.value.decode(errors='replace')}")
