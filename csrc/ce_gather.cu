// torch_ce: the gathers of the torch_ce_native library (NOTE [native gather path]): the
// C++ slot registry, the CUDA kernels of magi::ce_all_gather[_coalesced] and
// magi::ce_all_gather_dim, the Python kernel's ways back, the row gather's launch (its
// kernel: ce_rows.cu), FSDP2's peer copies, and the copy streams and events the
// reduce-scatter shares (ce_native.h). Host code only; ce_ops.cu registers the ops.
//
// # NOTE [native gather path]
// The one CUDA gather of bound shards. A Python kernel cost ~80 us of CPU per
// gather and wait_tensor on its Python Work another ~45 us (measured,
// bench/results): at 1024 tokens the forward was CPU-bound. Here a gather of bound
// shards is: one registry lookup per member, the outputs allocated on the
// current stream, one event so the copy streams start after that allocation,
// the peer reads in one cudaMemcpyBatchAsync on the peer-copy stream (in the
// order of NOTE [peer order] in ce_copy.h: rotated, so no peer's link serves
// every reader at once), this rank's own rows on a second (local-copy) stream
// so the DtoD copy runs beside the peer reads instead of inside their batch,
// and a C++ c10d Work per bucket whose wait() is one cudaStreamWaitEvent.
//
// The registry here mirrors the Python one (torch_ce/runtime/windows.py, whose
// register() and release_all() are the only writers). Anything the fast path
// does not serve (a member that is unbound or refused, a group that differs by
// name, a dead group, a 0-d shard, or any bucket while prefetched outputs are
// parked in Python) is handed, whole, to the Python kernel
// (torch_ce::gather_python), which raises the clear errors, runs the
// collective fallbacks and owns the park; its bound members come back here
// through torch_ce_native::gather_bound. While a CUDA graph is being captured
// the copies go out one cudaMemcpyAsync each (capturable; same order, so a
// chunked plan is one graph node per piece) and the outputs are
// not record_stream'd (a block with a pending stream use stays allocated in
// the graph's pool after capture, which CUDA-graph trees reject): the
// consumer's wait_tensor joins the copy streams back before any use or free of
// the outputs.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ce_copy.h"
#include "ce_gather.h"
#include "ce_native.h"
#include "ce_rows.h"

namespace torch_ce_native {
namespace {

// One bound shard: where every rank's copy lives (group-rank order).
struct Slot {
  std::vector<void*> peer_ptrs;  // [rank] is this rank's own copy
  int64_t rank;
  int64_t nbytes;
  c10::ScalarType dtype;
  std::vector<int64_t> shape;
  std::string group_name;
  // NOTE [the version net] in torch_ce/runtime/versions.py: the version counters a
  // write to the weight moves (its local shard's, its DTensor parameter's), their
  // values when the slot was last consistent, and poisoned (inside
  // updating_weights, or after it failed). A change hands the bucket to the Python
  // kernel, which raises StaleWeightError naming the weight.
  std::vector<c10::VariableVersion> watch;
  std::vector<uint32_t> expect;
  bool poisoned = false;

  bool stale() const {
    if (poisoned) return true;
    for (size_t k = 0; k < watch.size(); ++k)
      if (watch[k].current_version() != expect[k]) return true;
    return false;
  }
};

std::mutex g_mu;
std::unordered_map<uintptr_t, std::shared_ptr<const Slot>> g_slots;
std::atomic<bool> g_split_local{true};
// NOTE [peer order] in ce_copy.h; set from the environment by runtime/native.py.
std::atomic<int> g_peer_order{torch_ce_copy::kRotated};
std::atomic<size_t> g_peer_chunk{0};  // bytes; 0: whole slabs
// Set while prefetched outputs are parked in Python (NOTE [cross-call prefetch] in
// torch_ce/runtime/prefetch.py): every bucket then goes to the Python kernel,
// which owns the park.
std::atomic<bool> g_prefetch_pending{false};
// NOTE [strided reads] in ce_copy.h: how a Shard(d) gather hands its blocks over.
std::atomic<int> g_dim_strategy{torch_ce_copy::kDim3DBatch};

// Two copy streams per device: peer reads, and this rank's own rows.
struct DeviceStreams {
  cudaStream_t peer = nullptr;
  cudaStream_t local = nullptr;
};
std::unordered_map<int, DeviceStreams> g_streams;

// Events: "ready" events are reused at once (a wait snapshots the event);
// a bucket's "done" event belongs to its Work until the Work dies.
std::unordered_map<int, std::vector<cudaEvent_t>> g_free_events;

}  // namespace

cudaEvent_t take_event(int device) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto& v = g_free_events[device];
    if (!v.empty()) {
      cudaEvent_t e = v.back();
      v.pop_back();
      return e;
    }
  }
  cudaEvent_t e = nullptr;
  CE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming),
                "cudaEventCreateWithFlags");
  return e;
}

void give_event(int device, cudaEvent_t e) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_free_events[device].push_back(e);
}

namespace {

DeviceStreams streams_for(int device) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_streams.find(device);
    if (it != g_streams.end()) return it->second;
  }
  // High priority: the gathers gate compute. Created once and kept for the
  // life of the process, like torch's own stream pool.
  int least = 0, greatest = 0;
  CE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                "cudaDeviceGetStreamPriorityRange");
  DeviceStreams ds;
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&ds.peer, cudaStreamNonBlocking,
                                             greatest),
                "cudaStreamCreateWithPriority");
  CE_CUDA_CHECK(cudaStreamCreateWithPriority(&ds.local, cudaStreamNonBlocking,
                                             greatest),
                "cudaStreamCreateWithPriority");
  std::lock_guard<std::mutex> lk(g_mu);
  auto ins = g_streams.emplace(device, ds);
  if (!ins.second) {  // another thread won the race; keep its streams
    cudaStreamDestroy(ds.peer);
    cudaStreamDestroy(ds.local);
  }
  return ins.first->second;
}

}  // namespace

bool batch_ok() {
  static const bool ok = torch_ce_copy::batch_supported();
  return ok;
}

namespace {

// c10d work of one bucket: wait() orders the caller's current stream after the
// copies. Copies of static, published windows cannot hang, so no timeout.
class CopyEngineWork : public c10d::Work {
 public:
  CopyEngineWork(cudaEvent_t done, int device)
      : c10d::Work(-1, c10d::OpType::ALLGATHER), done_(done), device_(device) {}

  ~CopyEngineWork() override { give_event(device_, done_); }

  bool wait(std::chrono::milliseconds /*timeout*/) override {
    auto cur = c10::cuda::getCurrentCUDAStream(device_);
    CE_CUDA_CHECK(cudaStreamWaitEvent(cur.stream(), done_, 0),
                  "cudaStreamWaitEvent");
    return true;
  }

  bool isCompleted() override {
    cudaError_t err = cudaEventQuery(done_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it
      return false;
    }
    CE_CUDA_CHECK(err, "cudaEventQuery");
    return true;
  }

  bool isSuccess() const override { return true; }

  void synchronize() override {
    CE_CUDA_CHECK(cudaEventSynchronize(done_), "cudaEventSynchronize");
  }

 private:
  cudaEvent_t done_;
  int device_;
};

std::vector<at::Tensor> gather_python(at::TensorList shards,
                                      int64_t group_size,
                                      c10::string_view group_name) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torch_ce::gather_python",
                                                     "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(shards.vec());
  stack.emplace_back(group_size);
  stack.emplace_back(std::string(group_name));
  op.callBoxed(&stack);
  return stack.at(0).toTensorVector();
}

// The slots of every member if the native path can serve the whole bucket.
bool resolve(at::TensorList shards, int64_t group_size,
             c10::string_view group_name,
             std::vector<std::shared_ptr<const Slot>>& slots) {
  if (shards.empty() || group_size < 2) return false;
  slots.reserve(shards.size());
  {
    std::lock_guard<std::mutex> lk(g_mu);
    for (const auto& s : shards) {
      if (!s.is_cuda() || s.dim() == 0 || !s.is_contiguous()) return false;
      auto it = g_slots.find(reinterpret_cast<uintptr_t>(s.data_ptr()));
      if (it == g_slots.end()) return false;
      const Slot& slot = *it->second;
      if (slot.dtype != s.scalar_type() ||
          static_cast<int64_t>(slot.peer_ptrs.size()) != group_size ||
          slot.group_name != group_name || !s.sizes().equals(slot.shape) ||
          s.device() != shards[0].device() || slot.stale())
        return false;
      slots.push_back(it->second);
    }
  }
  // A destroyed group: let the Python kernel say so.
  try {
    (void)c10d::resolve_process_group(std::string(group_name));
  } catch (const std::exception&) {
    return false;
  }
  return true;
}

// The copies of a bucket whose members all resolved to ``slots``.
std::vector<at::Tensor> gather_slots(
    at::TensorList shards, int64_t group_size,
    const std::vector<std::shared_ptr<const Slot>>& slots) {
  const int device = shards[0].device().index();
  const c10::cuda::CUDAGuard guard(shards[0].device());  // events and streams live there
  const auto cur = c10::cuda::getCurrentCUDAStream(device);
  const DeviceStreams ds = streams_for(device);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(cur.stream(), &cap),
                "cudaStreamIsCapturing");
  const bool capturing = cap != cudaStreamCaptureStatusNone;
  const bool split = g_split_local.load(std::memory_order_relaxed);

  std::vector<at::Tensor> outs;
  outs.reserve(shards.size());
  std::vector<char*> bases;
  std::vector<size_t> bytes;
  std::vector<void*> peer_dst, local_dst;
  std::vector<const void*> peer_src, local_src;
  std::vector<size_t> peer_size, local_size;
  for (size_t i = 0; i < shards.size(); ++i) {
    const Slot& slot = *slots[i];
    std::vector<int64_t> sizes = slot.shape;
    sizes[0] *= group_size;
    outs.push_back(at::empty(sizes, shards[i].options()));
    bases.push_back(static_cast<char*>(outs.back().data_ptr()));
    bytes.push_back(static_cast<size_t>(slot.nbytes));
    if (split) {
      local_dst.push_back(bases.back() + slot.rank * slot.nbytes);
      local_src.push_back(slot.peer_ptrs[slot.rank]);
      local_size.push_back(bytes.back());
    }
  }
  // Every member of a bucket has the same rank (one group).
  const auto plan = torch_ce_copy::read_plan(
      static_cast<int>(slots[0]->rank), static_cast<int>(group_size),
      bytes.data(), bytes.size(), g_peer_chunk.load(std::memory_order_relaxed),
      g_peer_order.load(std::memory_order_relaxed), !split);
  peer_dst.reserve(plan.size());
  peer_src.reserve(plan.size());
  peer_size.reserve(plan.size());
  for (const auto& p : plan) {
    peer_dst.push_back(bases[p.member] + p.source * bytes[p.member] + p.offset);
    peer_src.push_back(static_cast<const char*>(slots[p.member]->peer_ptrs[p.source]) +
                       p.offset);
    peer_size.push_back(p.size);
  }

  // The outputs were allocated on the current stream: the copies start after.
  cudaEvent_t ready = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(ready, cur.stream()), "cudaEventRecord");
  CE_CUDA_CHECK(cudaStreamWaitEvent(ds.peer, ready, 0), "cudaStreamWaitEvent");
  if (!local_dst.empty())
    CE_CUDA_CHECK(cudaStreamWaitEvent(ds.local, ready, 0),
                  "cudaStreamWaitEvent");
  give_event(device, ready);

  auto submit = [&](std::vector<void*>& d, std::vector<const void*>& s,
                    std::vector<size_t>& z, cudaStream_t st) {
    if (d.empty()) return;
    if (!capturing && batch_ok()) {
      CE_CUDA_CHECK(torch_ce_copy::batch(d.data(), s.data(), z.data(),
                                         d.size(), /*prefer_overlap=*/true, st),
                    "cudaMemcpyBatchAsync");
    } else {
      size_t failed = 0;
      CE_CUDA_CHECK(torch_ce_copy::per_copy(d.data(), s.data(), z.data(),
                                            d.size(), st, &failed),
                    "cudaMemcpyAsync");
    }
  };
  submit(peer_dst, peer_src, peer_size, ds.peer);
  if (!local_dst.empty()) {
    submit(local_dst, local_src, local_size, ds.local);
    cudaEvent_t local_done = take_event(device);
    CE_CUDA_CHECK(cudaEventRecord(local_done, ds.local), "cudaEventRecord");
    CE_CUDA_CHECK(cudaStreamWaitEvent(ds.peer, local_done, 0),
                  "cudaStreamWaitEvent");
    give_event(device, local_done);
  }
  cudaEvent_t done = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(done, ds.peer), "cudaEventRecord");
  auto work = c10::make_intrusive<CopyEngineWork>(done, device);
  const auto peer_stream = c10::cuda::getStreamFromExternal(ds.peer, device);
  for (auto& out : outs) {
    // Outside capture the allocator must not hand an output to other work
    // while the copies may still write it (an output dropped unwaited).
    if (!capturing)
      c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(),
                                                    peer_stream);
    c10d::register_work(out, work);
  }
  return outs;
}

}  // namespace

// FSDP2's all-gather hook (torch_ce/fsdp2/comm.py): the peers' chunks copied into the
// output FSDP2 allocated, row ``rows[i]`` of ``out`` (viewed as [world, chunk]) from
// ``srcs[i]``, on the peer copy stream, after the current stream (FSDP2's all-gather
// stream, whose copy-in precedes) and before anything it enqueues next. One host call
// where Python's stream switches and event waits cost a few microseconds each.
void peer_copy_into(const at::Tensor& out, at::TensorList srcs, at::IntArrayRef rows) {
  TORCH_CHECK(out.is_cuda() && out.is_contiguous(), "torch_ce: peer_copy_into: a contiguous CUDA output");
  TORCH_CHECK(srcs.size() == rows.size(), "torch_ce: peer_copy_into: one row per source");
  if (srcs.empty()) return;
  const int device = out.device().index();
  const c10::cuda::CUDAGuard guard(out.device());
  const auto cur = c10::cuda::getCurrentCUDAStream(device);
  const DeviceStreams ds = streams_for(device);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(cur.stream(), &cap), "cudaStreamIsCapturing");
  const bool capturing = cap != cudaStreamCaptureStatusNone;
  const size_t esize = out.element_size();
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<size_t> size;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& x = srcs[i];
    const size_t nbytes = static_cast<size_t>(x.numel()) * x.element_size();
    TORCH_CHECK(x.is_contiguous() && x.scalar_type() == out.scalar_type(),
                "torch_ce: peer_copy_into: sources are contiguous, of the output's dtype");
    TORCH_CHECK(rows[i] >= 0 && static_cast<size_t>(rows[i] + 1) * nbytes <= out.numel() * esize,
                "torch_ce: peer_copy_into: row ", rows[i], " is outside the output");
    dst.push_back(static_cast<char*>(out.data_ptr()) + rows[i] * nbytes);
    src.push_back(x.data_ptr());
    size.push_back(nbytes);
  }
  cudaEvent_t ready = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(ready, cur.stream()), "cudaEventRecord");
  CE_CUDA_CHECK(cudaStreamWaitEvent(ds.peer, ready, 0), "cudaStreamWaitEvent");
  give_event(device, ready);
  if (!capturing && batch_ok()) {
    CE_CUDA_CHECK(torch_ce_copy::batch(dst.data(), src.data(), size.data(), dst.size(),
                                       /*prefer_overlap=*/true, ds.peer),
                  "cudaMemcpyBatchAsync");
  } else {
    size_t failed = 0;
    CE_CUDA_CHECK(torch_ce_copy::per_copy(dst.data(), src.data(), size.data(), dst.size(), ds.peer, &failed),
                  "cudaMemcpyAsync");
  }
  cudaEvent_t done = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(done, ds.peer), "cudaEventRecord");
  CE_CUDA_CHECK(cudaStreamWaitEvent(cur.stream(), done, 0), "cudaStreamWaitEvent");
  give_event(device, done);
  if (!capturing)  // the output stays out of other hands while the copies may write it
    c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(ds.peer, device));
}

std::vector<at::Tensor> ce_all_gather_coalesced_cuda(
    at::TensorList shards, int64_t group_size, c10::string_view group_name) {
  std::vector<std::shared_ptr<const Slot>> slots;
  if (g_prefetch_pending.load(std::memory_order_relaxed) ||
      !resolve(shards, group_size, group_name, slots))
    return gather_python(shards, group_size, group_name);
  return gather_slots(shards, group_size, slots);
}

namespace {

// # NOTE [strided reads] (the torch side; the copies are in ce_copy.h)
// magi::ce_all_gather_dim: a Shard(d) shard gathered into the weight's final
// layout. Same streams, events, Work and peer order as gather_slots (whole
// blocks: the chunked interleave does not apply), but each peer's shard is a
// strided Block (height rows of width bytes, pitch W * width in the output)
// instead of one contiguous slab. Under capture the blocks go out as one
// cudaMemcpy2DAsync each (capturable; a row-per-entry plan would be one graph
// node per row).
std::vector<at::Tensor> gather_slots_dim(
    at::TensorList shards, int64_t group_size, c10::IntArrayRef dims,
    const std::vector<std::shared_ptr<const Slot>>& slots) {
  const int device = shards[0].device().index();
  const c10::cuda::CUDAGuard guard(shards[0].device());
  const auto cur = c10::cuda::getCurrentCUDAStream(device);
  const DeviceStreams ds = streams_for(device);
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(cur.stream(), &cap),
                "cudaStreamIsCapturing");
  const bool capturing = cap != cudaStreamCaptureStatusNone;
  const bool split = g_split_local.load(std::memory_order_relaxed);
  const int order = g_peer_order.load(std::memory_order_relaxed);
  const int64_t rank = slots[0]->rank;  // one group

  std::vector<at::Tensor> outs;
  outs.reserve(shards.size());
  std::vector<torch_ce_copy::Block> members, peer_blocks, local_blocks;
  for (size_t i = 0; i < shards.size(); ++i) {
    const Slot& slot = *slots[i];
    const int64_t d = dims[i];
    TORCH_CHECK(d >= 0 && d < static_cast<int64_t>(slot.shape.size()),
                "torch_ce: ce_all_gather_dim: gather_dim ", d, " outside a ",
                slot.shape.size(), "-d shard");
    std::vector<int64_t> sizes = slot.shape;
    sizes[d] *= group_size;
    outs.push_back(at::empty(sizes, shards[i].options()));
    size_t height = 1;
    for (int64_t k = 0; k < d; ++k) height *= static_cast<size_t>(slot.shape[k]);
    const size_t width = height ? static_cast<size_t>(slot.nbytes) / height : 0;
    // The member's block of source 0; source s is `s * width` further in the output.
    members.push_back({outs.back().data_ptr(), nullptr,
                       static_cast<size_t>(group_size) * width, width, width,
                       height});
  }
  auto block = [&](size_t m, int s) {
    torch_ce_copy::Block b = members[m];
    b.dst = static_cast<char*>(b.dst) + static_cast<size_t>(s) * b.width;
    b.src = slots[m]->peer_ptrs[s];
    return b;
  };
  std::vector<int> sources;
  for (int k = 0; k < group_size; ++k) {
    const int s = torch_ce_copy::source_at(static_cast<int>(rank),
                                           static_cast<int>(group_size), k, order);
    if (s != rank || !split) sources.push_back(s);
  }
  if (order == torch_ce_copy::kRotated) {  // peer-major (NOTE [peer order])
    for (int s : sources)
      for (size_t m = 0; m < members.size(); ++m) peer_blocks.push_back(block(m, s));
  } else {
    for (size_t m = 0; m < members.size(); ++m)
      for (int s : sources) peer_blocks.push_back(block(m, s));
  }
  if (split)
    for (size_t m = 0; m < members.size(); ++m)
      local_blocks.push_back(block(m, static_cast<int>(rank)));

  cudaEvent_t ready = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(ready, cur.stream()), "cudaEventRecord");
  CE_CUDA_CHECK(cudaStreamWaitEvent(ds.peer, ready, 0), "cudaStreamWaitEvent");
  if (!local_blocks.empty())
    CE_CUDA_CHECK(cudaStreamWaitEvent(ds.local, ready, 0),
                  "cudaStreamWaitEvent");
  give_event(device, ready);

  int strategy = capturing ? torch_ce_copy::kDim2D
                           : g_dim_strategy.load(std::memory_order_relaxed);
  if (strategy != torch_ce_copy::kDim2D && !batch_ok())
    strategy = torch_ce_copy::kDim2D;
  auto submit = [&](const std::vector<torch_ce_copy::Block>& blocks,
                    cudaStream_t st) {
    if (blocks.empty()) return;
    if (strategy == torch_ce_copy::kDim2D) {
      size_t failed = 0;
      CE_CUDA_CHECK(torch_ce_copy::copy_2d(blocks.data(), blocks.size(), st,
                                           &failed),
                    "cudaMemcpy2DAsync");
    } else if (strategy == torch_ce_copy::kDim3DBatch) {
      CE_CUDA_CHECK(torch_ce_copy::batch_3d(blocks.data(), blocks.size(),
                                            true, st),
                    "cudaMemcpy3DBatchAsync");
    } else {
      std::vector<void*> d;
      std::vector<const void*> s;
      std::vector<size_t> z;
      torch_ce_copy::rows_of(blocks.data(), blocks.size(), d, s, z);
      CE_CUDA_CHECK(torch_ce_copy::batch(d.data(), s.data(), z.data(),
                                         d.size(), true, st),
                    "cudaMemcpyBatchAsync");
    }
  };
  submit(peer_blocks, ds.peer);
  if (!local_blocks.empty()) {
    submit(local_blocks, ds.local);
    cudaEvent_t local_done = take_event(device);
    CE_CUDA_CHECK(cudaEventRecord(local_done, ds.local), "cudaEventRecord");
    CE_CUDA_CHECK(cudaStreamWaitEvent(ds.peer, local_done, 0),
                  "cudaStreamWaitEvent");
    give_event(device, local_done);
  }
  cudaEvent_t done = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(done, ds.peer), "cudaEventRecord");
  auto work = c10::make_intrusive<CopyEngineWork>(done, device);
  const auto peer_stream = c10::cuda::getStreamFromExternal(ds.peer, device);
  for (auto& out : outs) {
    if (!capturing)
      c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(),
                                                    peer_stream);
    c10d::register_work(out, work);
  }
  return outs;
}

at::Tensor gather_dim_python(const at::Tensor& shard, int64_t group_size,
                             c10::string_view group_name, int64_t gather_dim) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow(
          "torch_ce::gather_dim_python", "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(shard);
  stack.emplace_back(group_size);
  stack.emplace_back(std::string(group_name));
  stack.emplace_back(gather_dim);
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

at::Tensor ce_all_gather_dim_cuda(const at::Tensor& shard, int64_t group_size,
                                  c10::string_view group_name,
                                  int64_t gather_dim) {
  std::vector<std::shared_ptr<const Slot>> slots;
  if (g_prefetch_pending.load(std::memory_order_relaxed) || gather_dim < 0 ||
      gather_dim >= shard.dim() ||
      !resolve({shard}, group_size, group_name, slots))
    return gather_dim_python(shard, group_size, group_name, gather_dim);
  return gather_slots_dim({shard}, group_size, {gather_dim}, slots)[0];
}

namespace {

// The slots of a bucket the Python kernel hands back (it checked the group and
// took any parked outputs): every member must be in the registry and match its
// slot, whatever the group's name and the park's state. `what` names the caller.
std::vector<std::shared_ptr<const Slot>> registered_slots(at::TensorList shards,
                                                          int64_t group_size,
                                                          const char* what) {
  TORCH_CHECK(!shards.empty(), "torch_ce: ", what, ": empty bucket");
  std::vector<std::shared_ptr<const Slot>> slots;
  slots.reserve(shards.size());
  std::lock_guard<std::mutex> lk(g_mu);
  for (const auto& s : shards) {
    TORCH_CHECK(s.is_cuda() && s.device() == shards[0].device() && s.dim() > 0,
                "torch_ce: ", what, ": members must be CUDA tensors of one device, "
                "at least 1-d");
    auto it = g_slots.find(reinterpret_cast<uintptr_t>(s.data_ptr()));
    TORCH_CHECK(it != g_slots.end(), "torch_ce: ", what,
                ": a member is not in the C++ slot registry (registered only "
                "through windows.register)");
    const Slot& slot = *it->second;
    TORCH_CHECK(slot.dtype == s.scalar_type() && s.sizes().equals(slot.shape) &&
                    s.is_contiguous() &&
                    static_cast<int64_t>(slot.peer_ptrs.size()) == group_size,
                "torch_ce: ", what, ": a member does not match its slot (dtype, "
                "shape, contiguity or group size)");
    slots.push_back(it->second);
  }
  return slots;
}

}  // namespace

// The Python kernel's way back for a bound CUDA Shard(d) shard it handled.
std::vector<at::Tensor> gather_bound_dim(at::TensorList shards,
                                         int64_t group_size,
                                         c10::IntArrayRef dims) {
  TORCH_CHECK(!shards.empty() && dims.size() == shards.size(),
              "torch_ce: gather_bound_dim: one gather dim per member");
  return gather_slots_dim(shards, group_size, dims,
                          registered_slots(shards, group_size, "gather_bound_dim"));
}

void set_dim_strategy(int64_t strategy) {
  TORCH_CHECK(strategy >= torch_ce_copy::kDimRows &&
                  strategy <= torch_ce_copy::kDim3DBatch,
              "torch_ce: set_dim_strategy: unknown strategy ", strategy);
  g_dim_strategy.store(static_cast<int>(strategy), std::memory_order_relaxed);
}

int64_t dim_strategy() {
  return g_dim_strategy.load(std::memory_order_relaxed);
}

// The Python kernel's way back for the bound CUDA members of a bucket it
// handled (registered_slots says what it checks).
std::vector<at::Tensor> gather_bound(at::TensorList shards,
                                     int64_t group_size) {
  return gather_slots(shards, group_size, registered_slots(shards, group_size, "gather_bound"));
}

// magi::ce_gather_rows of a bound CUDA shard (the Python kernel checked the group
// and handles the fallbacks): [*ids.shape, *shape[1:]] rows read by the kernel
// of NOTE [row kernel] in ce_rows.cu, on the current stream.
at::Tensor gather_rows(const at::Tensor& shard, const at::Tensor& ids,
                       int64_t group_size) {
  std::shared_ptr<const Slot> slot;
  {
    std::lock_guard<std::mutex> lk(g_mu);
    auto it = g_slots.find(reinterpret_cast<uintptr_t>(shard.data_ptr()));
    TORCH_CHECK(it != g_slots.end(),
                "torch_ce: gather_rows: the shard is not in the C++ slot registry "
                "(registered only through windows.register)");
    slot = it->second;
  }
  TORCH_CHECK(shard.is_cuda() && shard.is_contiguous() && shard.dim() >= 1 &&
                  slot->dtype == shard.scalar_type() && shard.sizes().equals(slot->shape) &&
                  static_cast<int64_t>(slot->peer_ptrs.size()) == group_size,
              "torch_ce: gather_rows: the shard does not match its slot "
              "(dtype, shape, contiguity or group size)");
  TORCH_CHECK(group_size <= torch_ce_rows::kMaxPeers, "torch_ce: gather_rows: group of ",
              group_size, " ranks (at most ", torch_ce_rows::kMaxPeers, ")");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt,
              "torch_ce: gather_rows: ids must be int64 or int32, got ", ids.scalar_type());
  TORCH_CHECK(ids.device() == shard.device(), "torch_ce: gather_rows: ids on ",
              ids.device(), ", shard on ", shard.device());
  const c10::cuda::CUDAGuard guard(shard.device());
  const at::Tensor flat = ids.contiguous();
  std::vector<int64_t> sizes(ids.sizes().begin(), ids.sizes().end());
  sizes.insert(sizes.end(), slot->shape.begin() + 1, slot->shape.end());
  at::Tensor out = at::empty(sizes, shard.options());
  const int64_t rows = slot->shape[0];
  if (flat.numel() == 0 || rows == 0) return out;
  const auto cur = c10::cuda::getCurrentCUDAStream(shard.device().index());
#ifdef TORCH_CE_ROW_KERNEL
  CE_CUDA_CHECK(torch_ce_rows::launch_gather_rows(
                    slot->peer_ptrs.data(), static_cast<int>(group_size),
                    flat.data_ptr(), flat.scalar_type() == at::kLong, flat.numel(),
                    rows, slot->nbytes / rows, out.data_ptr(), cur.stream()),
                "row gather kernel launch");
#else
  (void)cur;
  TORCH_CHECK(false, "torch_ce: gather_rows: built without nvcc, so without the CUDA row "
              "kernel (csrc/ce_rows.cu); the Triton row kernel serves (runtime/rows_triton.py)");
#endif
  return out;
}

at::Tensor ce_all_gather_cuda(const at::Tensor& shard, int64_t group_size,
                              c10::string_view group_name) {
  return ce_all_gather_coalesced_cuda({shard}, group_size, group_name)[0];
}

void register_slot(int64_t key, std::vector<int64_t> peer_ptrs, int64_t rank,
                   int64_t nbytes, c10::ScalarType dtype,
                   std::vector<int64_t> shape, std::string group_name) {
  TORCH_CHECK(rank >= 0 && rank < static_cast<int64_t>(peer_ptrs.size()),
              "torch_ce: register_slot: rank ", rank, " outside the group of ",
              peer_ptrs.size());
  TORCH_CHECK(peer_ptrs[rank] == key,
              "torch_ce: register_slot: the key must be this rank's own copy");
  auto slot = std::make_shared<Slot>();
  for (int64_t p : peer_ptrs) slot->peer_ptrs.push_back(reinterpret_cast<void*>(p));
  slot->rank = rank;
  slot->nbytes = nbytes;
  slot->dtype = dtype;
  slot->shape = std::move(shape);
  slot->group_name = std::move(group_name);
  std::lock_guard<std::mutex> lk(g_mu);
  g_slots[static_cast<uintptr_t>(key)] = std::move(slot);
}

// The watch of the slot at ``key`` (NOTE [the version net]): copy-on-write, so a
// gather holding the old entry keeps it. Registered for CompositeImplicitAutograd so a
// DTensor parameter arrives as itself (its Python dispatch never runs): only its
// version counter is read. False: no slot at ``key``.
bool watch_slot(int64_t key, at::TensorList watched, bool poisoned) {
  std::lock_guard<std::mutex> lk(g_mu);
  auto it = g_slots.find(static_cast<uintptr_t>(key));
  if (it == g_slots.end()) return false;
  auto slot = std::make_shared<Slot>(*it->second);
  slot->watch.clear();
  slot->expect.clear();
  for (const auto& t : watched) {
    const c10::VariableVersion& vc = t.unsafeGetTensorImpl()->version_counter();
    if (!vc.enabled()) continue;  // an inference tensor: never written in place
    slot->watch.push_back(vc);
    slot->expect.push_back(vc.current_version());
  }
  slot->poisoned = poisoned;
  it->second = std::move(slot);
  return true;
}

// How many of ``shards`` resolve to a stale slot: the lookups and checks resolve()
// makes, alone (bench/version_net_cost.py times the net's share of a call with it).
int64_t stale_count(at::TensorList shards) {
  std::lock_guard<std::mutex> lk(g_mu);
  int64_t n = 0;
  for (const auto& s : shards) {
    auto it = g_slots.find(reinterpret_cast<uintptr_t>(s.data_ptr()));
    if (it != g_slots.end() && it->second->stale()) ++n;
  }
  return n;
}

void unregister_slot(int64_t key) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_slots.erase(static_cast<uintptr_t>(key));
}

void clear_slots() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_slots.clear();
}

int64_t slot_count() {
  std::lock_guard<std::mutex> lk(g_mu);
  return static_cast<int64_t>(g_slots.size());
}

void set_split_local_copy(bool split) {
  g_split_local.store(split, std::memory_order_relaxed);
}

void set_peer_order(int64_t order, int64_t chunk_bytes) {
  TORCH_CHECK(order >= torch_ce_copy::kFixed && order <= torch_ce_copy::kRotatedMember,
              "torch_ce: set_peer_order: unknown order ", order);
  TORCH_CHECK(chunk_bytes >= 0, "torch_ce: set_peer_order: negative chunk");
  g_peer_order.store(static_cast<int>(order), std::memory_order_relaxed);
  g_peer_chunk.store(static_cast<size_t>(chunk_bytes), std::memory_order_relaxed);
}

void set_prefetch_pending(bool pending) {
  g_prefetch_pending.store(pending, std::memory_order_relaxed);
}

// How this library was built, for explain(): the compiler, the CUDA headers'
// CUDART_VERSION, and whether the CUDA row kernel (ce_rows.cu) is in it.
std::string build_info() {
#ifdef TORCH_CE_BUILT_WITH_NVCC
  std::string tool = "nvcc";
#else
  std::string tool = "host C++ compiler";
#endif
#ifdef TORCH_CE_ROW_KERNEL
  const char* rows = "cuda";
#else
  const char* rows = "none";
#endif
  return tool + ";" + std::to_string(CUDART_VERSION) + ";" + rows;
}

}  // namespace torch_ce_native
