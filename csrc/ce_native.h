// torch_ce: what the host sources of the torch_ce_native library share (ce_gather.cu,
// ce_flags.cu, ce_reduce_scatter.cu; ce_ops.cu registers their ops): the CUDA runtime
// error check, the CUDA major version guard, and the gathers' event pool and batch check
// that the reduce-scatter uses too (defined in ce_gather.cu). Host code only: the host C++
// compiler builds every file that includes this (no kernel is defined there).
#pragma once

#include <c10/util/Exception.h>

#include <cuda_runtime_api.h>

// NOTE [building without nvcc]: headers of another CUDA major version than the
// runtime's give another cudaMemcpyBatchAsync ABI. setup.py refuses them first
// (naming both versions); this catches a different cuda_runtime_api.h found first.
#if defined(TORCH_CE_RUNTIME_CUDA_MAJOR) && \
    (CUDART_VERSION / 1000 != TORCH_CE_RUNTIME_CUDA_MAJOR)
#error "torch_ce: cuda_runtime_api.h is not of torch's CUDA major version (torch.version.cuda)"
#endif

#define CE_CUDA_CHECK(expr, what)                                         \
  do {                                                                    \
    cudaError_t err__ = (expr);                                           \
    TORCH_CHECK(err__ == cudaSuccess, "torch_ce: ", what, ": ",          \
                cudaGetErrorString(err__), " (cudaError ",                \
                static_cast<int>(err__), ")");                            \
  } while (0)

namespace torch_ce_native {

// The copy streams' pool of events, per device (ce_gather.cu says who owns one when).
cudaEvent_t take_event(int device);
void give_event(int device, cudaEvent_t e);

// Whether cudaMemcpyBatchAsync serves (torch_ce_copy::batch_supported, asked once).
bool batch_ok();

}  // namespace torch_ce_native
