// torch_ce: the row gather of embedding lookups (NOTE [row kernel] in ce_rows.cu).
//
// Free of torch headers: ce_gather.cu (host C++) calls the launcher, ce_rows.cu
// (compiled by nvcc as CUDA) defines it.
#pragma once

#include <cuda_runtime_api.h>

#include <stdint.h>

namespace torch_ce_rows {

// Peers a row gather reads (one per rank of the group; a kernel argument, so
// no device copy of the table is needed).
constexpr int kMaxPeers = 64;

// out[i] = row (ids[i] % rows_per_rank) of peer_ptrs[ids[i] / rows_per_rank],
// row_bytes each, for i < n, on `stream`. `ids` is int64 or int32 (device
// memory, contiguous); an id outside [0, group_size * rows_per_rank) traps
// (a device-side error, as CUDA's embedding asserts). Returns the launch's
// error (cudaErrorInvalidValue for a group above kMaxPeers).
cudaError_t launch_gather_rows(const void* const* peer_ptrs, int group_size,
                               const void* ids, bool ids_int64, int64_t n,
                               int64_t rows_per_rank, int64_t row_bytes,
                               void* out, cudaStream_t stream);

}  // namespace torch_ce_rows
