// torch_ce: the copy-engine reduce-scatter's native launch and completion (NOTE [native
// reduce-scatter path] in ce_reduce_scatter.cu, which defines them): a call's stages, and
// the ops ce_ops.cu registers. Python holds workspaces and calls as integer handles.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>
#include <vector>

namespace torch_ce_native {

// A call's stage, what rs_query and rs_stages return (as these integers). The Python side
// mirrors it (``Stage`` in torch_ce/runtime/reduce_scatter/call.py): the values may not
// change.
enum class RsStage : int {
  kLaunched = 0,    // launched: its completion not enqueued yet
  kCompleting = 1,  // its completion being enqueued: the watchdog's deadline starts here
  kRecorded = 2,    // its done event recorded
  kDone = 3,        // its done event passed
};

int64_t rs_workspace_h(std::vector<int64_t> addrs, int64_t world, int64_t self, int64_t cap,
                       c10::ScalarType dtype, int64_t device, int64_t copy_stream, int64_t reduce_stream);
std::tuple<int64_t, std::vector<at::Tensor>> rs_launch_h(int64_t ws, at::TensorList inputs, at::TensorList outs,
                                                         int64_t half, int64_t seq, int64_t numel, int64_t tag,
                                                         int64_t op, double factor, bool register_work);
void rs_complete_h(int64_t call, bool wait_current);
void rs_stream_wait_h(int64_t call, int64_t stream);
void rs_register_h(int64_t call);
int64_t rs_query_h(int64_t call);
std::vector<int64_t> rs_stages(std::vector<int64_t> ids);
void rs_forget(int64_t id);
int64_t rs_handle_count();
bool rs_has_kernel();
std::vector<int64_t> rs_reduce_tuning(int64_t batch, int64_t even);
std::vector<double> rs_timing(int64_t mode);
int64_t relax_thread_capture_mode();

}  // namespace torch_ce_native
