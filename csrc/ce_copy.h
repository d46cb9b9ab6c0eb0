// torch_ce: the two ways one bucket of copies reaches the copy engines.
//
// Used by the torch kernels (ce_torch.cpp); header-only and free of torch
// headers, so the copy calls read on their own.
#pragma once

#include <cuda_runtime_api.h>

#include <stddef.h>
#include <string.h>

namespace torch_ce_copy {

// True if cudaMemcpyBatchAsync is usable: compiled against and running on
// CUDA >= 12.8 (where it appeared).
inline bool batch_supported() {
#if CUDART_VERSION >= 12080
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return false;
  return version >= 12080;
#else
  return false;
#endif
}

// Every copy in one cudaMemcpyBatchAsync: one driver call per bucket, no SM
// kernel. One attribute set covers all copies:
// - srcAccessOrder = Stream: the sources are static weights in symmetric
//   windows, published (one barrier at bind time) before any read, and never
//   written afterwards; stream order is all the ordering they need.
// - flags = PreferOverlapWithCompute (a hint): the copies run beside the
//   matmuls that consume the previous gather.
// - location hints stay zero: they only matter for managed/pageable memory.
// The stream must not be the legacy default stream (the API rejects it).
inline cudaError_t batch(void* const* dsts, const void* const* srcs,
                         const size_t* sizes, size_t count,
                         bool prefer_overlap, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attrs;
  memset(&attrs, 0, sizeof(attrs));
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attrs.flags = prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
  size_t attrs_idx = 0;  // attrs[0] applies from copy 0 to the end
#if CUDART_VERSION >= 13000
  // CUDA 13 dropped the failIdx out-parameter.
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attrs, &attrs_idx, 1,
                              stream);
#else
  size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts),
                              const_cast<void**>(srcs),
                              const_cast<size_t*>(sizes), count, &attrs,
                              &attrs_idx, 1, &fail_idx, stream);
#endif
#else
  (void)dsts; (void)srcs; (void)sizes; (void)prefer_overlap; (void)stream;
  return cudaErrorNotSupported;
#endif
}

// One cudaMemcpyAsync per copy: any CUDA version, any stream, and capturable
// in CUDA graphs. On error, *failed (if given) is the index of the failing copy.
inline cudaError_t per_copy(void* const* dsts, const void* const* srcs,
                            const size_t* sizes, size_t count,
                            cudaStream_t stream, size_t* failed) {
  for (size_t i = 0; i < count; ++i) {
    cudaError_t err =
        cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) {
      if (failed != nullptr) *failed = i;
      return err;
    }
  }
  return cudaSuccess;
}

}  // namespace torch_ce_copy
