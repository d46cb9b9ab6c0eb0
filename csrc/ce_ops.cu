// torch_ce copy-engine transport: a thin C ABI over the CUDA runtime.
//
// Built by setup.py into torch_ce/_ce_ops*.so and loaded with ctypes
// (torch_ce/_cuda_lib.py). It uses no torch headers, so it does not depend on
// torch's C++ ABI; it links the shared cudart that torch has already loaded.
//
// Every function returns 0 on success or the cudaError_t value, and on error
// writes "<function>: <cudaGetErrorString>" into errbuf (if given).

#include <cuda_runtime_api.h>

#include "ce_copy.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define TORCH_CE_API extern "C" __attribute__((visibility("default")))

namespace {

void set_error(char* errbuf, size_t errlen, const char* fmt, ...) {
  if (errbuf == nullptr || errlen == 0) return;
  va_list args;
  va_start(args, fmt);
  vsnprintf(errbuf, errlen, fmt, args);
  va_end(args);
}

int report(cudaError_t err, const char* func, char* errbuf, size_t errlen) {
  set_error(errbuf, errlen, "%s: %s (cudaError %d)", func,
            cudaGetErrorString(err), static_cast<int>(err));
  return static_cast<int>(err);
}

}  // namespace

TORCH_CE_API int torch_ce_runtime_version(void) {
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return -1;
  return version;
}

// Batched copies need both the headers we were compiled with and the runtime
// we run on to be CUDA >= 12.8 (where cudaMemcpyBatchAsync appeared).
TORCH_CE_API int torch_ce_batch_supported(void) {
  return torch_ce_copy::batch_supported() ? 1 : 0;
}

// One gather bucket = one cudaMemcpyBatchAsync (see ce_copy.h for the
// attributes): every (member x peer) read of the bucket goes to the copy
// engines in a single submission.
TORCH_CE_API int torch_ce_memcpy_batch(void* const* dsts,
                                       const void* const* srcs,
                                       const size_t* sizes, size_t count,
                                       int prefer_overlap_with_compute,
                                       void* stream, char* errbuf,
                                       size_t errlen) {
  const char* func = "cudaMemcpyBatchAsync";
  if (count == 0) return 0;
  // The batch API rejects the legacy default stream; say so instead of
  // returning a bare cudaErrorInvalidValue.
  if (stream == nullptr || stream == static_cast<void*>(cudaStreamLegacy)) {
    set_error(errbuf, errlen,
              "%s: the legacy default stream (0) is not supported; "
              "pass a non-default stream (e.g. torch.cuda.Stream())",
              func);
    return static_cast<int>(cudaErrorInvalidValue);
  }
#if CUDART_VERSION >= 12080
  cudaError_t err = torch_ce_copy::batch(dsts, srcs, sizes, count,
                                         prefer_overlap_with_compute != 0,
                                         static_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) return report(err, func, errbuf, errlen);
  return 0;
#else
  set_error(errbuf, errlen,
            "%s: needs CUDA >= 12.8, torch_ce was compiled against CUDART %d",
            func, CUDART_VERSION);
  return static_cast<int>(cudaErrorNotSupported);
#endif
}

// Per-copy fallback: one cudaMemcpyAsync per entry. Works on any CUDA version
// and any stream, and is capturable in CUDA graphs, so it serves when the
// batched API is unavailable or a graph is being captured.
TORCH_CE_API int torch_ce_memcpy_peer_fallback(void* const* dsts,
                                               const void* const* srcs,
                                               const size_t* sizes,
                                               size_t count, void* stream,
                                               char* errbuf, size_t errlen) {
  size_t failed = 0;
  cudaError_t err = torch_ce_copy::per_copy(
      dsts, srcs, sizes, count, static_cast<cudaStream_t>(stream), &failed);
  if (err != cudaSuccess) {
    char func[64];
    snprintf(func, sizeof(func), "cudaMemcpyAsync (copy %zu of %zu)", failed,
             count);
    return report(err, func, errbuf, errlen);
  }
  return 0;
}
