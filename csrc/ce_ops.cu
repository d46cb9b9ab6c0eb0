// torch_ce copy-engine transport: a thin C ABI over the CUDA runtime.
//
// Built by setup.py into torch_ce/_ce_ops*.so and loaded with ctypes
// (torch_ce/_cuda_lib.py). It uses no torch headers, so it does not depend on
// torch's C++ ABI; it links the shared cudart that torch has already loaded.
//
// Every function returns 0 on success or the cudaError_t value, and on error
// writes "<function>: <cudaGetErrorString>" into errbuf (if given).

#include <cuda_runtime_api.h>

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
#if CUDART_VERSION >= 12080
  return torch_ce_runtime_version() >= 12080 ? 1 : 0;
#else
  return 0;
#endif
}

// One gather bucket = one cudaMemcpyBatchAsync: every (member x peer) read of
// the bucket goes to the copy engines in a single submission, so the CPU cost
// is one driver call per bucket (not one per copy), and no SM kernel runs.
//
// One attribute set covers all copies:
// - srcAccessOrder = Stream: the sources are static weights in symmetric
//   windows, published (one barrier at bind time) before any read, and never
//   written afterwards; ordinary stream order is all the ordering they need.
//   (DuringApiCall/Any are for ephemeral or host-malloc sources, not ours.)
// - flags = PreferOverlapWithCompute (a hint): the point of the transport is to
//   run beside the matmuls that consume the previous gather.
// - location hints stay zero: they only matter for managed/pageable memory.
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
  cudaMemcpyAttributes attrs;
  memset(&attrs, 0, sizeof(attrs));
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attrs.flags = prefer_overlap_with_compute
                    ? cudaMemcpyFlagPreferOverlapWithCompute
                    : 0;
  size_t attrs_idx = 0;  // attrs[0] applies from copy 0 to the end
  cudaStream_t s = static_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 13000
  // CUDA 13 dropped the failIdx out-parameter.
  cudaError_t err = cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attrs,
                                         &attrs_idx, 1, s);
#else
  size_t fail_idx = 0;
  cudaError_t err = cudaMemcpyBatchAsync(
      const_cast<void**>(dsts), const_cast<void**>(srcs),
      const_cast<size_t*>(sizes), count, &attrs, &attrs_idx, 1, &fail_idx, s);
#endif
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
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (size_t i = 0; i < count; ++i) {
    cudaError_t err =
        cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, s);
    if (err != cudaSuccess) {
      char func[64];
      snprintf(func, sizeof(func), "cudaMemcpyAsync (copy %zu of %zu)", i,
               count);
      return report(err, func, errbuf, errlen);
    }
  }
  return 0;
}
