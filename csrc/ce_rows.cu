// torch_ce: the CUDA kernel of magi::ce_gather_rows (declared in ce_rows.h;
// called from ce_gather.cu's torch_ce_native::gather_rows).
//
// # NOTE [row kernel]
// An embedding lookup of a sharded table needs only the rows its ids name
// (NOTE [row gathers] in torch_ce/passes/rows.py). Which rows, and so which
// peer and offset each read comes from, is in device memory (the ids): a
// copy-engine batch would need those addresses on the host, i.e. a device to
// host sync before every lookup. So this is an SM kernel on the current
// stream: one block per output row (grid-stride), its threads load the row
// from peer_ptrs[owner] + local_row * row_bytes (symmetric memory: every
// peer's window is mapped for peer access) in the widest aligned vectors (16
// bytes when the row size, the output and every peer's slot allow it) and
// store them to the output. It moves the looked-up rows only (Llama3-8B, 4096
// tokens: 4096 x 8 KiB = 32 MiB instead of a 1 GiB gather), so the SMs it
// takes are few and briefly held; no wait, no c10d work: the consumer is on
// the same stream.

#include "ce_rows.h"

#include <stdio.h>

namespace torch_ce_rows {
namespace {

struct PeerTable {
  const char* ptr[kMaxPeers];
};

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1 << 16;

template <typename V, typename I>
__global__ void rows_kernel(PeerTable peers, const I* __restrict__ ids,
                            int64_t n, int64_t rows_per_rank,
                            int64_t total_rows, int64_t row_bytes,
                            char* __restrict__ out) {
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t id = static_cast<int64_t>(ids[i]);
    if (id < 0 || id >= total_rows) {
      if (threadIdx.x == 0)
        printf("torch_ce: ce_gather_rows: index %lld out of range [0, %lld)\n",
               static_cast<long long>(id), static_cast<long long>(total_rows));
      __trap();
    }
    const int64_t owner = id / rows_per_rank;
    const V* src = reinterpret_cast<const V*>(
        peers.ptr[owner] + (id - owner * rows_per_rank) * row_bytes);
    V* dst = reinterpret_cast<V*>(out + i * row_bytes);
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = src[v];
  }
}

template <typename V>
cudaError_t launch_as(const PeerTable& peers, const void* ids, bool ids_int64,
                      int64_t n, int64_t rows_per_rank, int64_t total_rows,
                      int64_t row_bytes, void* out, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(n < kMaxBlocks ? n : kMaxBlocks);
  char* o = static_cast<char*>(out);
  if (ids_int64)
    rows_kernel<V, int64_t><<<blocks, kThreads, 0, stream>>>(
        peers, static_cast<const int64_t*>(ids), n, rows_per_rank, total_rows,
        row_bytes, o);
  else
    rows_kernel<V, int32_t><<<blocks, kThreads, 0, stream>>>(
        peers, static_cast<const int32_t*>(ids), n, rows_per_rank, total_rows,
        row_bytes, o);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_gather_rows(const void* const* peer_ptrs, int group_size,
                               const void* ids, bool ids_int64, int64_t n,
                               int64_t rows_per_rank, int64_t row_bytes,
                               void* out, cudaStream_t stream) {
  if (group_size < 1 || group_size > kMaxPeers || rows_per_rank < 1 ||
      row_bytes < 1 || n < 0)
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  PeerTable peers{};
  // The widest vector every address and the row size are multiples of.
  uintptr_t align = static_cast<uintptr_t>(row_bytes) |
                    reinterpret_cast<uintptr_t>(out);
  for (int r = 0; r < group_size; ++r) {
    peers.ptr[r] = static_cast<const char*>(peer_ptrs[r]);
    align |= reinterpret_cast<uintptr_t>(peer_ptrs[r]);
  }
  const int64_t total = rows_per_rank * group_size;
  if (align % 16 == 0)
    return launch_as<uint4>(peers, ids, ids_int64, n, rows_per_rank, total,
                            row_bytes, out, stream);
  if (align % 8 == 0)
    return launch_as<uint2>(peers, ids, ids_int64, n, rows_per_rank, total,
                            row_bytes, out, stream);
  if (align % 4 == 0)
    return launch_as<uint32_t>(peers, ids, ids_int64, n, rows_per_rank, total,
                               row_bytes, out, stream);
  if (align % 2 == 0)
    return launch_as<uint16_t>(peers, ids, ids_int64, n, rows_per_rank, total,
                               row_bytes, out, stream);
  return launch_as<uint8_t>(peers, ids, ids_int64, n, rows_per_rank, total,
                            row_bytes, out, stream);
}

}  // namespace torch_ce_rows
