// torch_ce: the gathers' ops (NOTE [native gather path] in ce_gather.cu, which defines
// them), declared for ce_ops.cu, which registers them: the C++ slot registry, the magi
// gathers' CUDA kernels, the row gather's launch, FSDP2's peer copies and the knobs
// runtime/native.py pushes.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torch_ce_native {

// The slot registry (the Python one's mirror: torch_ce/runtime/windows.py).
void register_slot(int64_t key, std::vector<int64_t> peer_ptrs, int64_t rank,
                   int64_t nbytes, c10::ScalarType dtype,
                   std::vector<int64_t> shape, std::string group_name);
void unregister_slot(int64_t key);
void clear_slots();
int64_t slot_count();
bool watch_slot(int64_t key, at::TensorList watched, bool poisoned);
int64_t stale_count(at::TensorList shards);

// The Python kernel's ways back, and the row gather.
std::vector<at::Tensor> gather_bound(at::TensorList shards, int64_t group_size);
std::vector<at::Tensor> gather_bound_dim(at::TensorList shards,
                                         int64_t group_size,
                                         c10::IntArrayRef dims);
at::Tensor gather_rows(const at::Tensor& shard, const at::Tensor& ids,
                       int64_t group_size);
void peer_copy_into(const at::Tensor& out, at::TensorList srcs, at::IntArrayRef rows);

// Knobs and what the library says about itself.
void set_split_local_copy(bool split);
void set_peer_order(int64_t order, int64_t chunk_bytes);
void set_prefetch_pending(bool pending);
void set_dim_strategy(int64_t strategy);
int64_t dim_strategy();
std::string build_info();

// The magi ops' CUDA kernels.
at::Tensor ce_all_gather_cuda(const at::Tensor& shard, int64_t group_size,
                              c10::string_view group_name);
std::vector<at::Tensor> ce_all_gather_coalesced_cuda(
    at::TensorList shards, int64_t group_size, c10::string_view group_name);
at::Tensor ce_all_gather_dim_cuda(const at::Tensor& shard, int64_t group_size,
                                  c10::string_view group_name,
                                  int64_t gather_dim);

}  // namespace torch_ce_native
