// torch_ce: the torch_ce_native library's ops registered with torch: the schemas of
// torch_ce_native::*, and the CUDA kernels of magi::ce_all_gather[_coalesced] and
// magi::ce_all_gather_dim. Schemas and bindings only; the code is by concern:
//   ce_gather.cu          the gathers (NOTE [native gather path]): the slot registry,
//                         batched peer reads, Shard(d) blocks, the row gather's launch
//                         (its kernel: ce_rows.cu), FSDP2's peer copies
//   ce_reduce_scatter.cu  the copy-engine reduce-scatter's native launch and completion
//                         (NOTE [native reduce-scatter path]; its reduction kernel:
//                         ce_reduce.cu), behind integer handles
//   ce_flags.cu           stream flags (NOTE [stream flags]): driver stream waits and
//                         writes, their batches, the watchdog's host writes, host-mapped
//                         flag memory (NOTE [poison word]), FSDP2's training gather
//                         (NOTE [FSDP2 step words on CUDA])
// with ce_native.h (what they share) and a header each declaring what is registered here.
// Host code only: the host C++ compiler builds these files too (no kernel is defined in
// them).
//
// Built by setup.py into torch_ce/runtime/_ce_torch*.so, only against a CUDA
// build of torch, and loaded with torch.ops.load_library
// (torch_ce/runtime/native.py): by nvcc together with ce_rows.cu and ce_reduce.cu,
// or, without nvcc, by the host C++ compiler alone against CUDA runtime headers of
// torch's CUDA version (NOTE [building without nvcc] in torch_ce/runtime/toolchain.py;
// the row gather then runs a Triton kernel, the reduction too). On a CPU torch,
// setup.py compiles them (objects only, not installed) so a broken source still
// fails the install.

#include <torch/library.h>

#include "ce_flags.h"
#include "ce_gather.h"
#include "ce_native.h"  // its CUDA version guard fires in every host source
#include "ce_reduce_scatter.h"

using namespace torch_ce_native;

TORCH_LIBRARY(torch_ce_native, m) {
  m.def("register_slot(int key, int[] peer_ptrs, int rank, int nbytes, "
        "ScalarType dtype, int[] shape, str group_name) -> ()",
        &register_slot);
  m.def("unregister_slot(int key) -> ()", &unregister_slot);
  m.def("clear_slots() -> ()", &clear_slots);
  m.def("gather_bound(Tensor[] shards, int group_size) -> Tensor[]",
        &gather_bound);
  m.def("gather_rows(Tensor shard, Tensor ids, int group_size) -> Tensor",
        &gather_rows);
  m.def("slot_count() -> int", &slot_count);
  m.def("set_split_local_copy(bool split) -> ()", &set_split_local_copy);
  m.def("set_peer_order(int order, int chunk_bytes) -> ()", &set_peer_order);
  m.def("set_prefetch_pending(bool pending) -> ()", &set_prefetch_pending);
  m.def("build_info() -> str", &build_info);
  m.def("gather_bound_dim(Tensor[] shards, int group_size, int[] dims) -> Tensor[]",
        &gather_bound_dim);
  m.def("set_dim_strategy(int strategy) -> ()", &set_dim_strategy);
  m.def("dim_strategy() -> int", &dim_strategy);
  m.def("watch_slot(int key, Tensor[] watched, bool poisoned) -> bool");
  m.def("stale_count(Tensor[] shards) -> int", &stale_count);
  m.def("stream_wait_value32(int addr, int value) -> ()", &stream_wait_value32);
  m.def("stream_write_value32(int addr, int value) -> ()", &stream_write_value32);
  m.def("stream_flags_info() -> int[]", &stream_flags_info);
  m.def("host_write_words(int addr, int value, int count, int width, int method) -> int", &host_write_words);
  m.def("host_register(int addr, int nbytes) -> int", &host_register);
  m.def("host_unregister(int addr) -> ()", &host_unregister);
  // NOTE [native reduce-scatter path]
  m.def("rs_workspace(int[] addrs, int world, int index, int cap, ScalarType dtype, int device, "
        "int copy_stream, int reduce_stream) -> int",
        &rs_workspace_h);
  m.def("rs_launch(int ws, Tensor[] inputs, Tensor[] outs, int half, int seq, int numel, int tag, int op, "
        "float factor, bool register_work) -> (int, Tensor[])",
        &rs_launch_h);
  m.def("rs_complete(int call, bool wait_current) -> ()", &rs_complete_h);
  m.def("rs_stream_wait(int call, int stream) -> ()", &rs_stream_wait_h);
  m.def("rs_register(int call) -> ()", &rs_register_h);
  m.def("rs_query(int call) -> int", &rs_query_h);
  m.def("rs_stages(int[] calls) -> int[]", &rs_stages);
  m.def("rs_memop_batching(int mode) -> bool", &rs_memop_batching);
  m.def("rs_reduce_tuning(int batch, int even) -> int[]", &rs_reduce_tuning);
  m.def("rs_forget(int handle) -> ()", &rs_forget);
  m.def("rs_handle_count() -> int", &rs_handle_count);
  m.def("rs_has_kernel() -> bool", &rs_has_kernel);
  m.def("relax_thread_capture_mode() -> int", &relax_thread_capture_mode);
  m.def("rs_timing(int mode) -> float[]", &rs_timing);
  m.def("peer_copy_into(Tensor(a!) out, Tensor[] srcs, int[] rows) -> ()", &peer_copy_into);
  // NOTE [FSDP2 step words on CUDA]
  m.def("step_group(Tensor[] srcs, int[] rows, int[] peer_ready, int[] peer_done, int my_ready, "
        "int my_done) -> int", &step_group);
  m.def("step_forget(int group) -> ()", &step_forget);
  m.def("step_gather(Tensor(a!) out, Tensor input, Tensor(b!) buffer, int group, int call) -> ()",
        &step_gather);
}

TORCH_LIBRARY_IMPL(torch_ce_native, CompositeImplicitAutograd, m) {
  m.impl("watch_slot", TORCH_FN(watch_slot));
}

TORCH_LIBRARY_IMPL(magi, CUDA, m) {
  m.impl("ce_all_gather", TORCH_FN(ce_all_gather_cuda));
  m.impl("ce_all_gather_coalesced", TORCH_FN(ce_all_gather_coalesced_cuda));
  m.impl("ce_all_gather_dim", TORCH_FN(ce_all_gather_dim_cuda));
}
