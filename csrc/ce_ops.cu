// torch_ce: the CUDA kernels of magi::ce_all_gather[_coalesced], in C++, and the
// copy-engine reduce-scatter's stream flags and native launch and completion (NOTE
// [native reduce-scatter path]; its reduction kernel is csrc/ce_reduce.cu). Host code
// only: the host C++ compiler builds this file too (no kernel is defined here).
//
// Built by setup.py into torch_ce/runtime/_ce_torch*.so, only against a CUDA
// build of torch, and loaded with torch.ops.load_library
// (torch_ce/runtime/native.py): by nvcc together with ce_rows.cu, or, without
// nvcc, by the host C++ compiler alone against CUDA runtime headers of torch's
// CUDA version (NOTE [building without nvcc] in torch_ce/runtime/toolchain.py;
// the row gather then runs a Triton kernel). On a CPU torch, setup.py compiles
// it (object only, not installed) so a broken source still fails the install.
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
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cuda_runtime_api.h>
#if __has_include(<cuda.h>)
#include <cuda.h>  // only to check MemOp's layout (the host-compiler build may lack it)
#define TORCH_CE_HAVE_CUDA_H 1
#endif

// NOTE [building without nvcc]: headers of another CUDA major version than the
// runtime's give another cudaMemcpyBatchAsync ABI. setup.py refuses them first
// (naming both versions); this catches a different cuda_runtime_api.h found first.
#if defined(TORCH_CE_RUNTIME_CUDA_MAJOR) && \
    (CUDART_VERSION / 1000 != TORCH_CE_RUNTIME_CUDA_MAJOR)
#error "torch_ce: cuda_runtime_api.h is not of torch's CUDA major version (torch.version.cuda)"
#endif

#include <atomic>
#include <cstddef>
#include <memory>
#include <chrono>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ce_copy.h"
#include "ce_reduce.h"
#include "ce_rows.h"

namespace {

#define CE_CUDA_CHECK(expr, what)                                         \
  do {                                                                    \
    cudaError_t err__ = (expr);                                           \
    TORCH_CHECK(err__ == cudaSuccess, "torch_ce: ", what, ": ",          \
                cudaGetErrorString(err__), " (cudaError ",                \
                static_cast<int>(err__), ")");                            \
  } while (0)

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

bool batch_ok() {
  static const bool ok = torch_ce_copy::batch_supported();
  return ok;
}

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

// # NOTE [stream flags]
// The copy-engine reduce-scatter's signals (NOTE [copy-engine reduce-scatter] in
// torch_ce/runtime/reduce_scatter.py). A flag is a 32-bit word in a workspace:
// written by the GPU front end in stream order (cuStreamWriteValue32) and waited
// on by it (cuStreamWaitValue32: the stream waits, no SM kernel spins). torch has the write (symm_mem's
// stream_write_value32_) but no wait, so both are here, through the driver
// entry points (no link against libcuda). Both are capturable: a captured wait
// is waited again at each replay.
//
// A data flag holds the call's tag (a nonzero 31-bit value of the call's sequence
// number and shapes, NOTE [reduce-scatter workspaces]), so the wait is EQ on the tag: a
// push of another call never satisfies it (the watchdog then names both calls from the
// words it reads).
//
// Ordering (issue 46; docs/DESIGN.md "Flag waits observe the data"): the wait adds
// CU_STREAM_WAIT_VALUE_FLUSH where the device reports
// CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES (``stream_flags_info``; an H200 reports 0).
// Without it the writer's side orders it: its flag write has the default flags (a
// memory barrier before the write, not CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER), on the
// stream that pushed, after the pushes, so the pushed data is visible before the flag.
//
// A dead peer (NOTE [reduce-scatter watchdog]): a stream wait has no timeout. The
// watchdog releases it with ``host_write_words``, which writes from the host on a
// stream of its own, by the path measured to release a blocked wait (below).
using StreamWaitValue32Fn = int (*)(cudaStream_t, unsigned long long, unsigned int, unsigned int);
using StreamWriteValue32Fn = int (*)(cudaStream_t, unsigned long long, unsigned int, unsigned int);
using DeviceGetAttributeFn = int (*)(int*, int, int);
using MemsetD32AsyncFn = int (*)(unsigned long long, unsigned int, size_t, cudaStream_t);
using MemsetD16AsyncFn = int (*)(unsigned long long, unsigned short, size_t, cudaStream_t);

void* driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
#if CUDART_VERSION >= 12050
  cudaError_t err = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q);
#else
  cudaError_t err = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &q);
#endif
  TORCH_CHECK(err == cudaSuccess && q == cudaDriverEntryPointSuccess && fn != nullptr,
              "torch_ce: the CUDA driver has no ", name, " (", cudaGetErrorString(err), ")");
  return fn;
}

// CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 (92) and CAN_FLUSH_REMOTE_WRITES (98),
// by number: cuda.h is not included (the host-compiler build has only the runtime's headers).
constexpr int kAttrStreamMemOpsV1 = 92;
constexpr int kAttrCanFlushRemoteWrites = 98;
constexpr unsigned int kWaitEq = 0x1;      // CU_STREAM_WAIT_VALUE_EQ
constexpr unsigned int kWaitFlush = 1u << 30;  // CU_STREAM_WAIT_VALUE_FLUSH

int device_attribute(int attr, int device) {
  static auto fn = reinterpret_cast<DeviceGetAttributeFn>(driver_entry("cuDeviceGetAttribute"));
  int v = -1;
  int rc = fn(&v, attr, device);
  return rc == 0 ? v : -1;
}

// The wait's flags for ``device``: EQ, and FLUSH where the device can flush remote writes.
unsigned int wait_flags(int device) {
  static std::mutex mu;
  static std::vector<int> cached;
  std::lock_guard<std::mutex> lk(mu);
  if (device >= static_cast<int>(cached.size())) cached.resize(device + 1, -1);
  if (cached[device] < 0) {
    cached[device] = static_cast<int>(kWaitEq | (device_attribute(kAttrCanFlushRemoteWrites, device) == 1 ? kWaitFlush : 0u));
  }
  return static_cast<unsigned int>(cached[device]);
}

std::vector<int64_t> stream_flags_info() {
  int device = c10::cuda::current_device();
  return {device_attribute(kAttrStreamMemOpsV1, device), device_attribute(kAttrCanFlushRemoteWrites, device),
          static_cast<int64_t>(wait_flags(device))};
}

void stream_wait_value32(int64_t addr, int64_t value) {
  static auto fn = reinterpret_cast<StreamWaitValue32Fn>(driver_entry("cuStreamWaitValue32"));
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  // EQ on the value (a tag, or 1 for a free flag); FLUSH where the device supports it.
  int rc = fn(stream, static_cast<unsigned long long>(addr), static_cast<unsigned int>(value),
              wait_flags(c10::cuda::current_device()));
  TORCH_CHECK(rc == 0, "torch_ce: cuStreamWaitValue32 failed (CUresult ", rc, ")");
}

void stream_write_value32(int64_t addr, int64_t value) {
  static auto fn = reinterpret_cast<StreamWriteValue32Fn>(driver_entry("cuStreamWriteValue32"));
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  // CU_STREAM_WRITE_VALUE_DEFAULT (0): ordered after the stream's earlier work,
  // with a memory barrier before it: its writes (the pushed slices) visible before the flag.
  int rc = fn(stream, static_cast<unsigned long long>(addr), static_cast<unsigned int>(value), 0u);
  TORCH_CHECK(rc == 0, "torch_ce: cuStreamWriteValue32 failed (CUresult ", rc, ")");
}

// The watchdog's writes (NOTE [reduce-scatter watchdog]): ``count`` words of ``width``
// bytes (4 or 2) at ``addr`` set to ``value`` from the host, on a non-blocking stream of
// this library's own (default priority), not waited for. ``method``: 2 cuMemsetD32Async /
// cuMemsetD16Async, 3 cuStreamWriteValue32 (one 32-bit word). Measured on an H200 (run 59,
// bench/compare/rs_release_probe.py): both release a stream blocked in cuStreamWaitValue32
// while the legacy default stream waits behind it; a synchronous cuMemsetD32 or
// cuMemcpyHtoD does not (they queue behind the legacy stream, or block the caller).
// Returns the CUresult.
int64_t host_write_words(int64_t addr, int64_t value, int64_t count, int64_t width, int64_t method) {
  TORCH_CHECK(width == 4 || width == 2, "torch_ce: host_write_words: width 4 or 2");
  TORCH_CHECK(method == 2 || (method == 3 && width == 4 && count == 1),
              "torch_ce: host_write_words: method 2, or 3 for one 32-bit word; got ", method);
  auto dptr = static_cast<unsigned long long>(addr);
  static std::mutex mu;
  static std::vector<cudaStream_t> own;
  cudaStream_t stream = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu);
    int device = c10::cuda::current_device();
    if (device >= static_cast<int>(own.size())) own.resize(device + 1, nullptr);
    if (own[device] == nullptr) {
      CE_CUDA_CHECK(cudaStreamCreateWithFlags(&own[device], cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    }
    stream = own[device];
  }
  if (method == 3) {
    static auto fn = reinterpret_cast<StreamWriteValue32Fn>(driver_entry("cuStreamWriteValue32"));
    return fn(stream, dptr, static_cast<unsigned int>(value), 0u);
  }
  if (width == 4) {
    static auto fn = reinterpret_cast<MemsetD32AsyncFn>(driver_entry("cuMemsetD32Async"));
    return fn(dptr, static_cast<unsigned int>(value), static_cast<size_t>(count), stream);
  }
  static auto fn = reinterpret_cast<MemsetD16AsyncFn>(driver_entry("cuMemsetD16Async"));
  return fn(dptr, static_cast<unsigned short>(value), static_cast<size_t>(count), stream);
}


// # NOTE [poison word]
// Under CUDA_DEVICE_MAX_CONNECTIONS=1 every stream shares one hardware queue, so the
// watchdog's writes on a stream of its own queue behind the wait they should release
// (run 60). Only a host store releases it there (run 59), so the workspace's flags,
// headers and a poison word per half move to host memory that every rank of the group
// maps (a /dev/shm segment per rank, registered here: cudaHostRegister, mapped, so the
// device reads it over PCIe and cuStreamWaitValue32 / cuStreamWriteValue32 take its
// address). The release is then a host store, but the NaN fill the watchdog enqueues for
// device-flag workspaces would run after the reduction it must precede (one queue: in
// submission order). So the reduction kernel, already enqueued behind the waits, reads the
// poison word of its half at each block's start: the watchdog stores the call's tag there
// before it stores the awaited flags (x86 store order), and the kernel writes NaN. The
// waits see the flags by polling host memory: the writer's cuStreamWriteValue32 keeps its
// memory barrier (NOTE [stream flags]), so its pushes into the peer's device memory are
// visible before the flag in host memory.
//
// Registered memory must be page aligned (mmap's is). Returns the device address of
// ``addr`` (UVA: the same number where the device can use host pointers for registered
// memory; the caller checks).
int64_t host_register(int64_t addr, int64_t nbytes) {
  void* p = reinterpret_cast<void*>(addr);
  CE_CUDA_CHECK(cudaHostRegister(p, static_cast<size_t>(nbytes), cudaHostRegisterMapped | cudaHostRegisterPortable),
                "cudaHostRegister");
  void* d = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&d, p, 0);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaHostUnregister(p);
    CE_CUDA_CHECK(err, "cudaHostGetDevicePointer");
  }
  return reinterpret_cast<int64_t>(d);
}

void host_unregister(int64_t addr) {
  cudaError_t err = cudaHostUnregister(reinterpret_cast<void*>(addr));
  if (err != cudaSuccess) (void)cudaGetLastError();  // already gone (teardown): nothing to undo
}

// # NOTE [native reduce-scatter path]
// The copy-engine reduce-scatter's launch and completion (NOTE [copy-engine
// reduce-scatter] in torch_ce/runtime/reduce_scatter.py), when
// ``config.rs_native`` is set: the same protocol as the Python _Cuda path, word for
// word and in the same order, in one C++ call per phase. Python keeps what is
// decided once per group or per call signature (the workspace round and growth,
// the half, the sequence number, the tag, the "owed completion first" rule) and the
// watchdog; what it did per call in Python is here:
//
//   rs_workspace  once per workspace: every flag, header and slice address as plain
//                 integers (wherever the flags live: device or host-mapped memory),
//                 the copy and reduce streams (the Python ones, so the workspace's
//                 bounded syncs still see them)
//   rs_launch     the outputs (unless given), the copy stream after the current
//                 one, for each peer j from i + 1 on: wait free[h, j] == 1 (EQ),
//                 reset it, the bucket's members into j's recv[h, i] (one
//                 cudaMemcpyAsync each: capturable; outside a capture a bucket of
//                 three or more members is one cudaMemcpyBatchAsync, CUDA >= 12.8),
//                 write seq, numel, then the tag (default flags: a memory barrier
//                 before each write); an event after the pushes; the c10d work on
//                 the outputs (``register_work``). A peer's wait and reset are one
//                 cuStreamBatchMemOp, its three writes another (MemOps)
//   rs_complete   once (idempotent): the reduce stream after the pushes, for each
//                 peer wait data[h, j] == tag (EQ), reset it (all peers' in one
//                 cuStreamBatchMemOp); the reduction (one
//                 kernel, NOTE [reduction kernel] in ce_reduce.cu; without nvcc the
//                 Python op torch_ce::rs_reduce_fallback: the Triton kernel); free[h, i]
//                 = 1 in each peer; the done event. The work's first wait() runs it
//                 (as Python's CompletionWork did), every wait() makes its stream wait
//                 the done event.
//   rs_query      the call's stage for the watchdog (0 launched, 1 completion being
//                 enqueued, 2 done event recorded, 3 done): the watchdog starts the
//                 call's deadline when it first sees 1, exactly when the Python path
//                 would have watched it.
//
// The stage moves to 1 before the first wait of the completion is enqueued, so a
// host thread that then blocks (lazy module loading behind a blocked wait) is
// released by the watchdog as on the Python path.
// Host-time probe of the native reduce-scatter's pieces, seconds per piece (bench/compare/
// rs_host_breakdown.py reads it): off unless rs_timing(1) turned it on; one relaxed load
// per piece when off.
std::atomic<bool> g_rs_timing{false};
double g_rs_t[12] = {};
inline double rs_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
inline void rs_mark(int piece, double& t0) {
  if (!g_rs_timing.load(std::memory_order_relaxed)) return;
  const double t1 = rs_now();
  g_rs_t[piece] += t1 - t0;
  t0 = t1;
}
// mode 0: read; 1: reset and on; 2: off. Returns the seconds per piece: launch (setup and
// outputs, ready event, free waits and resets, memcpys, header and tag writes, pushed
// event, work registration), completion (pushed event wait, data waits and resets, the
// reduction's launch, free writes, done event and the current stream's wait).
std::vector<double> rs_timing(int64_t mode) {
  if (mode == 1) {
    for (double& v : g_rs_t) v = 0.0;
    g_rs_timing.store(true);
  } else if (mode == 2) {
    g_rs_timing.store(false);
  }
  return std::vector<double>(std::begin(g_rs_t), std::end(g_rs_t));
}

// A call's flag waits and writes as batches: cuStreamBatchMemOp enqueues its operations
// in array order, each as its single call would (a wait EQ, FLUSH where the device has it;
// a write with the default memory barrier before it), for one driver call per group, not
// one per word (each ~1 us of host time on an H200's host, run 66's probe). The layout is
// cuda.h's CUstreamBatchMemOpParams (a 48-byte union), written out because the host-
// compiler build has only the runtime's headers; an nvcc build checks it against cuda.h.
struct MemOp {
  uint32_t operation;  // 1 CU_STREAM_MEM_OP_WAIT_VALUE_32, 2 CU_STREAM_MEM_OP_WRITE_VALUE_32
  uint32_t pad0;
  uint64_t address;
  uint64_t value;  // the low 32 bits: cuuint32_t value
  uint32_t flags;
  uint32_t pad1;
  uint64_t alias;
  uint64_t pad2;
};
static_assert(sizeof(MemOp) == 48, "CUstreamBatchMemOpParams is 48 bytes");
#ifdef TORCH_CE_HAVE_CUDA_H
static_assert(sizeof(CUstreamBatchMemOpParams) == sizeof(MemOp) &&
                  offsetof(CUstreamBatchMemOpParams, waitValue.address) == offsetof(MemOp, address) &&
                  offsetof(CUstreamBatchMemOpParams, waitValue.value) == offsetof(MemOp, value) &&
                  offsetof(CUstreamBatchMemOpParams, waitValue.flags) == offsetof(MemOp, flags) &&
                  offsetof(CUstreamBatchMemOpParams, writeValue.address) == offsetof(MemOp, address) &&
                  offsetof(CUstreamBatchMemOpParams, writeValue.value) == offsetof(MemOp, value) &&
                  offsetof(CUstreamBatchMemOpParams, writeValue.flags) == offsetof(MemOp, flags) &&
                  CU_STREAM_MEM_OP_WAIT_VALUE_32 == 1 && CU_STREAM_MEM_OP_WRITE_VALUE_32 == 2,
              "torch_ce: MemOp does not match cuda.h's CUstreamBatchMemOpParams");
#endif
using StreamBatchMemOpFn = int (*)(cudaStream_t, unsigned int, MemOp*, unsigned int);

// An A/B knob (rs_memop_batching; bench/compare/rs_host_breakdown.py measures both): off,
// MemOps enqueues each operation with its single call, as before the batches.
std::atomic<bool> g_rs_memop_batch{true};

// mode 0: read; 1: batches; 2: one call per operation. Returns whether batches are on.
bool rs_memop_batching(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "torch_ce: rs_memop_batching: mode ", mode, " is not 0, 1 or 2");
  if (mode != 0) g_rs_memop_batch.store(mode == 1);
  return g_rs_memop_batch.load();
}

class MemOps {
 public:
  MemOps(cudaStream_t stream, int device)
      : stream_(stream), wait_flags_(wait_flags(device)) {}
  void wait(uint64_t addr, uint32_t value) { add(1u, addr, value, wait_flags_); }
  // A write with the default memory barrier before it (the stream's earlier writes visible
  // first).
  void write(uint64_t addr, uint32_t value) { add(2u, addr, value, 0u); }
  // Everything added so far, in order, into the stream.
  void enqueue() {
    if (n_ == 0) return;
    const unsigned int n = n_;
    n_ = 0;
    if (!g_rs_memop_batch.load(std::memory_order_relaxed)) {
      static auto wait = reinterpret_cast<StreamWaitValue32Fn>(driver_entry("cuStreamWaitValue32"));
      static auto write = reinterpret_cast<StreamWriteValue32Fn>(driver_entry("cuStreamWriteValue32"));
      for (unsigned int k = 0; k < n; ++k) {
        const MemOp& o = ops_[k];
        int rc = (o.operation == 1u ? wait : write)(stream_, static_cast<unsigned long long>(o.address),
                                                    static_cast<unsigned int>(o.value), o.flags);
        TORCH_CHECK(rc == 0, "torch_ce: cuStream", o.operation == 1u ? "Wait" : "Write",
                    "Value32 failed (CUresult ", rc, ")");
      }
      return;
    }
    static auto fn = reinterpret_cast<StreamBatchMemOpFn>(driver_entry("cuStreamBatchMemOp"));
    int rc = fn(stream_, n, ops_, 0u);
    TORCH_CHECK(rc == 0, "torch_ce: cuStreamBatchMemOp of ", n, " operations failed (CUresult ", rc, ")");
  }

 private:
  static constexpr unsigned int kMax = 128;  // the driver takes fewer than 256 per call
  void add(uint32_t op, uint64_t addr, uint32_t value, unsigned int flags) {
    if (n_ == kMax) enqueue();
    ops_[n_++] = MemOp{op, 0u, addr, value, flags, 0u, 0u, 0u};
  }
  cudaStream_t stream_;
  unsigned int wait_flags_;
  unsigned int n_ = 0;
  MemOp ops_[kMax];
};

// Address tables, each [half * world + peer].
enum RsTable : int {
  kOwnData = 0,   // this rank's data[h, j]
  kOwnFree,       // this rank's free[h, j]
  kPeerData,      // peer j's data[h, i]
  kPeerFree,      // peer j's free[h, i]
  kPeerSeq,       // peer j's head[h, i, 0]
  kPeerNumel,     // peer j's head[h, i, 1]
  kPeerRecv,      // peer j's recv[h, i]
  kOwnRecv,       // this rank's recv[h, j]
  kTables
};

struct RsWorkspace : torch::CustomClassHolder {
  int64_t world = 0, self = 0, cap = 0, esize = 0, device = 0;
  c10::ScalarType dtype = at::kFloat;
  std::vector<uint64_t> addr;  // kTables x 2 x world
  uint64_t poison[2] = {0, 0};  // per half: the poison word (host-mapped flags), or 0
  cudaStream_t copy = nullptr, reduce = nullptr;

  uint64_t at(int table, int64_t half, int64_t peer) const {
    return addr[(table * 2 + half) * world + peer];
  }
};

struct RsCall : torch::CustomClassHolder {
  c10::intrusive_ptr<RsWorkspace> ws;
  int64_t half = 0, seq = 0, numel = 0, tag = 0, op = 0;
  double factor = 1.0;
  std::vector<at::Tensor> flats, outs;  // held until the call dies (the watchdog's Python Call and the work)
  std::vector<int64_t> ns;
  cudaEvent_t pushed = nullptr, done = nullptr;
  std::atomic<int> stage{0};
  std::mutex mu;
  bool completed = false;

  ~RsCall() override {
    if (pushed) give_event(static_cast<int>(ws->device), pushed);
    if (done) give_event(static_cast<int>(ws->device), done);
  }
};

c10::intrusive_ptr<RsWorkspace> rs_workspace(std::vector<int64_t> addrs, int64_t world, int64_t self,
                                             int64_t cap, c10::ScalarType dtype, int64_t device,
                                             int64_t copy_stream, int64_t reduce_stream) {
  TORCH_CHECK(world >= 2 && self >= 0 && self < world && cap > 0, "torch_ce: rs_workspace: world ", world,
              ", index ", self, ", cap ", cap);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "torch_ce: rs_workspace: dtype ", dtype);
  const int64_t n_addr = kTables * 2 * world;
  TORCH_CHECK(static_cast<int64_t>(addrs.size()) == n_addr || static_cast<int64_t>(addrs.size()) == n_addr + 2,
              "torch_ce: rs_workspace: ", addrs.size(), " addresses, expected ", n_addr,
              " (and two poison words)");
  auto ws = c10::make_intrusive<RsWorkspace>();
  ws->world = world;
  ws->self = self;
  ws->cap = cap;
  ws->dtype = dtype;
  ws->esize = static_cast<int64_t>(c10::elementSize(dtype));
  ws->device = device;
  for (int64_t k = 0; k < n_addr; ++k) ws->addr.push_back(static_cast<uint64_t>(addrs[k]));
  if (static_cast<int64_t>(addrs.size()) == n_addr + 2) {
#ifndef TORCH_CE_REDUCE_KERNEL
    TORCH_CHECK(false, "torch_ce: rs_workspace: host-mapped flags need the reduction kernel (an nvcc build): ",
                "only it reads the poison word");
#endif
    ws->poison[0] = static_cast<uint64_t>(addrs[n_addr]);
    ws->poison[1] = static_cast<uint64_t>(addrs[n_addr + 1]);
  }
  ws->copy = reinterpret_cast<cudaStream_t>(copy_stream);
  ws->reduce = reinterpret_cast<cudaStream_t>(reduce_stream);
  return ws;
}

constexpr int64_t kOpSum = 0, kOpAvg = 1, kOpPremul = 2;

class RsWork : public c10d::Work {
 public:
  explicit RsWork(c10::intrusive_ptr<RsCall> call)
      : c10d::Work(-1, c10d::OpType::REDUCE_SCATTER), call_(std::move(call)) {}

  bool wait(std::chrono::milliseconds /*timeout*/) override;

  bool isCompleted() override {
    if (call_->stage.load() < 2) return false;
    cudaError_t err = cudaEventQuery(call_->done);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    CE_CUDA_CHECK(err, "cudaEventQuery");
    return true;
  }

  bool isSuccess() const override { return true; }

  void synchronize() override {
    if (call_->stage.load() >= 2) CE_CUDA_CHECK(cudaEventSynchronize(call_->done), "cudaEventSynchronize");
  }

 private:
  c10::intrusive_ptr<RsCall> call_;
};

std::tuple<c10::intrusive_ptr<RsCall>, std::vector<at::Tensor>> rs_launch(
    const c10::intrusive_ptr<RsWorkspace>& ws, at::TensorList inputs, at::TensorList outs, int64_t half,
    int64_t seq, int64_t numel, int64_t tag, int64_t op, double factor, bool register_work) {
  const int64_t w = ws->world, i = ws->self;
  TORCH_CHECK(!inputs.empty() && (half == 0 || half == 1) && op >= kOpSum && op <= kOpPremul,
              "torch_ce: rs_launch: bad arguments");
  TORCH_CHECK(outs.empty() || outs.size() == inputs.size(), "torch_ce: rs_launch: one output per input");
  double t0 = g_rs_timing.load(std::memory_order_relaxed) ? rs_now() : 0.0;
  const int device = static_cast<int>(ws->device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const auto cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
  auto call = c10::make_intrusive<RsCall>();
  call->ws = ws;
  call->half = half;
  call->seq = seq;
  call->numel = numel;
  call->tag = tag;
  call->op = op;
  call->factor = factor;
  int64_t total = 0;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const at::Tensor& x = inputs[k];
    TORCH_CHECK(x.is_cuda() && x.scalar_type() == ws->dtype && x.device().index() == device && x.dim() >= 1 &&
                    x.size(0) % w == 0,
                "torch_ce: rs_launch: input ", k, " does not match the workspace (device, dtype, rows)");
    call->flats.push_back(x.is_contiguous() ? x : x.contiguous());  // read by pointer: any shape
    call->ns.push_back(call->flats.back().numel() / w);
    total += call->ns.back();
    if (outs.empty()) {
      std::vector<int64_t> sizes(x.sizes().begin(), x.sizes().end());
      sizes[0] /= w;
      call->outs.push_back(at::empty(sizes, x.options()));
    } else {
      TORCH_CHECK(outs[k].is_contiguous() && outs[k].numel() == call->ns.back() &&
                      outs[k].scalar_type() == ws->dtype,
                  "torch_ce: rs_launch: output ", k, " is not contiguous, or not of the input's chunk");
      call->outs.push_back(outs[k]);
    }
  }
  TORCH_CHECK(total <= ws->cap, "torch_ce: rs_launch: ", total, " elements per rank, the workspace holds ", ws->cap);
  rs_mark(0, t0);
  // The copy stream after the current one (the gradient is ready, the outputs allocated).
  cudaEvent_t ready = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(ready, cur.stream()), "cudaEventRecord");
  CE_CUDA_CHECK(cudaStreamWaitEvent(ws->copy, ready, 0), "cudaStreamWaitEvent");
  give_event(device, ready);
  rs_mark(1, t0);
  const auto esize = ws->esize;
  MemOps ops(ws->copy, device);
  // A bucket of kBatchMembers or more members: one cudaMemcpyBatchAsync per peer (CUDA >=
  // 12.8, not while capturing: per-copy memcpys are what a graph takes, as in the gathers).
  // Fewer go one cudaMemcpyAsync each: a batch of two cost as much host time as two single
  // copies (~14-17 against ~7-8 us each, perf-notes section 4).
  constexpr size_t kBatchMembers = 3;
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(cur.stream(), &cap), "cudaStreamIsCapturing");
  const bool batched = call->flats.size() >= kBatchMembers && cap == cudaStreamCaptureStatusNone && batch_ok();
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (int64_t k = 1; k < w; ++k) {
    const int64_t j = (i + k) % w;
    const uint64_t free_flag = ws->at(kOwnFree, half, j);
    ops.wait(free_flag, 1u);
    ops.write(free_flag, 0u);
    ops.enqueue();
    rs_mark(2, t0);
    char* dst = reinterpret_cast<char*>(ws->at(kPeerRecv, half, j));
    if (batched) {  // every member's chunk in one driver call (the gathers' batch, ce_copy.h)
      dsts.clear();
      srcs.clear();
      sizes.clear();
      for (size_t m = 0; m < call->flats.size(); ++m) {
        const int64_t n = call->ns[m];
        if (n > 0) {
          dsts.push_back(dst);
          srcs.push_back(static_cast<const char*>(call->flats[m].data_ptr()) + j * n * esize);
          sizes.push_back(static_cast<size_t>(n * esize));
        }
        dst += n * esize;
      }
      CE_CUDA_CHECK(torch_ce_copy::batch(dsts.data(), srcs.data(), sizes.data(), dsts.size(),
                                         /*prefer_overlap=*/true, ws->copy),
                    "cudaMemcpyBatchAsync");
    } else {
      for (size_t m = 0; m < call->flats.size(); ++m) {
        const int64_t n = call->ns[m];
        if (n > 0)
          CE_CUDA_CHECK(cudaMemcpyAsync(dst, static_cast<const char*>(call->flats[m].data_ptr()) + j * n * esize,
                                        static_cast<size_t>(n * esize), cudaMemcpyDeviceToDevice, ws->copy),
                        "cudaMemcpyAsync");
        dst += n * esize;
      }
    }
    rs_mark(3, t0);
    ops.write(ws->at(kPeerSeq, half, j), static_cast<uint32_t>(seq));
    ops.write(ws->at(kPeerNumel, half, j), static_cast<uint32_t>(numel));
    ops.write(ws->at(kPeerData, half, j), static_cast<uint32_t>(tag));  // publishes the slice
    ops.enqueue();
    rs_mark(4, t0);
  }
  call->pushed = take_event(device);
  CE_CUDA_CHECK(cudaEventRecord(call->pushed, ws->copy), "cudaEventRecord");
  rs_mark(5, t0);
  if (register_work) {
    auto work = c10::make_intrusive<RsWork>(call);
    for (auto& o : call->outs) c10d::register_work(o, work);
  }
  rs_mark(6, t0);
  return std::make_tuple(call, call->outs);
}

#ifndef TORCH_CE_REDUCE_KERNEL
// The reduction of a call without the CUDA kernel: the Python op (the Triton kernel).
void reduce_fallback(const RsCall& call, const at::Tensor& recv_half, const std::vector<at::Tensor>& owns,
                     const std::vector<int64_t>& offs) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("torch_ce::rs_reduce_fallback", "");
  std::vector<c10::IValue> stack;
  stack.emplace_back(owns);
  stack.emplace_back(call.outs);
  stack.emplace_back(recv_half);
  stack.emplace_back(call.ws->self);
  stack.emplace_back(offs);
  stack.emplace_back(call.op);
  stack.emplace_back(call.factor);
  op.callBoxed(&stack);
}
#endif

void rs_reduce(RsCall& call) {
  const RsWorkspace& ws = *call.ws;
  const int64_t w = ws.world, i = ws.self, h = call.half;
  const int64_t slice_bytes = static_cast<int64_t>(ws.at(kOwnRecv, h, 1) - ws.at(kOwnRecv, h, 0));
  TORCH_CHECK(slice_bytes == ws.cap * ws.esize, "torch_ce: rs_complete: the receive slices are not ",
              "back to back (", slice_bytes, " bytes apart, expected ", ws.cap * ws.esize, ")");
  // avg: fp32(1 / W), torch's CUDA div_ by a scalar (1.0 / W in double, rounded to fp32: the
  // same value as the fp32 division for every W up to 4096); premul: the factor rounded to fp32.
  const float scale = call.op == kOpAvg ? static_cast<float>(1.0 / static_cast<double>(w))
                                        : static_cast<float>(call.factor);
#ifdef TORCH_CE_REDUCE_KERNEL
  torch_ce_reduce::Args a{};
  a.recv_half = reinterpret_cast<const void*>(ws.at(kOwnRecv, h, 0));
  a.slice_bytes = slice_bytes;
  a.world = static_cast<int>(w);
  a.self = static_cast<int>(i);
  a.op = static_cast<int>(call.op);
  a.scale = scale;
  a.poison = reinterpret_cast<const int*>(ws.poison[h]);  // NOTE [poison word]
  a.tag = static_cast<int>(call.tag);
  int64_t off = 0;
  for (size_t m = 0; m < call.flats.size(); ++m) {
    if (a.nseg == torch_ce_reduce::kMaxSegs) {
      CE_CUDA_CHECK(torch_ce_reduce::launch_reduce(a, ws.dtype == at::kBFloat16, ws.reduce), "reduction kernel launch");
      a.nseg = 0;
    }
    const int64_t n = call.ns[m];
    auto& s = a.seg[a.nseg++];
    s.own = static_cast<const char*>(call.flats[m].data_ptr()) + i * n * ws.esize;
    s.out = call.outs[m].data_ptr();
    s.n = n;
    s.off = off;
    off += n;
  }
  CE_CUDA_CHECK(torch_ce_reduce::launch_reduce(a, ws.dtype == at::kBFloat16, ws.reduce), "reduction kernel launch");
  (void)scale;
#else
  (void)scale;
  auto opts = at::TensorOptions().dtype(ws.dtype).device(at::kCUDA, static_cast<c10::DeviceIndex>(ws.device));
  at::Tensor recv_half = at::from_blob(reinterpret_cast<void*>(ws.at(kOwnRecv, h, 0)), {w, ws.cap}, opts);
  std::vector<at::Tensor> owns;
  std::vector<int64_t> offs;
  int64_t off = 0;
  for (size_t m = 0; m < call.flats.size(); ++m) {
    const int64_t n = call.ns[m];
    owns.push_back(call.flats[m].view(-1).narrow(0, i * n, n));
    offs.push_back(off);
    off += n;
  }
  const c10::cuda::CUDAStreamGuard sg(
      c10::cuda::getStreamFromExternal(ws.reduce, static_cast<c10::DeviceIndex>(ws.device)));
  reduce_fallback(call, recv_half, owns, offs);
#endif
}

void rs_complete(const c10::intrusive_ptr<RsCall>& call, bool wait_current) {
  const RsWorkspace& ws = *call->ws;
  const int device = static_cast<int>(ws.device);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lk(call->mu);
  double t0 = g_rs_timing.load(std::memory_order_relaxed) ? rs_now() : 0.0;
  if (!call->completed) {
    call->completed = true;
    call->stage.store(1);  // the watchdog's deadline starts: before any wait is enqueued
    const int64_t w = ws.world, i = ws.self, h = call->half;
    CE_CUDA_CHECK(cudaStreamWaitEvent(ws.reduce, call->pushed, 0), "cudaStreamWaitEvent");
    rs_mark(7, t0);
    MemOps ops(ws.reduce, device);
    for (int64_t k = 1; k < w; ++k) {  // every sender checked before anything is reduced
      const uint64_t flag = ws.at(kOwnData, h, (i + k) % w);
      ops.wait(flag, static_cast<uint32_t>(call->tag));
      ops.write(flag, 0u);
    }
    ops.enqueue();
    rs_mark(8, t0);
    rs_reduce(*call);
    rs_mark(9, t0);
    for (int64_t k = 1; k < w; ++k) ops.write(ws.at(kPeerFree, h, (i + k) % w), 1u);
    ops.enqueue();
    rs_mark(10, t0);
    call->done = take_event(device);
    CE_CUDA_CHECK(cudaEventRecord(call->done, ws.reduce), "cudaEventRecord");
    call->stage.store(2);
  }
  if (wait_current) {
    auto cur = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device));
    CE_CUDA_CHECK(cudaStreamWaitEvent(cur.stream(), call->done, 0), "cudaStreamWaitEvent");
  }
  rs_mark(11, t0);
}

bool RsWork::wait(std::chrono::milliseconds /*timeout*/) {
  rs_complete(call_, /*wait_current=*/true);  // the first wait enqueues it; every wait waits it
  return true;
}

// The call's c10d work on its outputs, after its launch (rs_launch's ``register_work``
// does it in the same call).
void rs_register(const c10::intrusive_ptr<RsCall>& call) {
  auto work = c10::make_intrusive<RsWork>(call);
  for (auto& o : call->outs) c10d::register_work(o, work);
}

// ``stream`` (a cudaStream_t as an integer) waits for the call's completion (enqueued first).
void rs_stream_wait(const c10::intrusive_ptr<RsCall>& call, int64_t stream) {
  rs_complete(call, false);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(call->ws->device));
  CE_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), call->done, 0),
                "cudaStreamWaitEvent");
}

int64_t rs_query(const c10::intrusive_ptr<RsCall>& call) {
  const int stage = call->stage.load();
  if (stage < 2) return stage;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(call->ws->device));
  cudaError_t err = cudaEventQuery(call->done);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return 2;
  }
  CE_CUDA_CHECK(err, "cudaEventQuery");
  return 3;
}

// Handles: Python holds a workspace or a call as an integer, not as a custom-class
// object: converting a torch.ScriptObject argument or result costs ~15 us per op call on
// an H200's host (run 64, bench/compare/rs_host_breakdown.py), several times the C++ work
// of a call. Ids come from one counter; rs_forget drops either kind (Python's
// native.Handle calls it when its last reference goes). A call's c10d work holds the
// call itself, so forgetting the id never ends a call early.
std::mutex g_rs_mu;
std::unordered_map<int64_t, c10::intrusive_ptr<RsWorkspace>> g_rs_workspaces;
std::unordered_map<int64_t, c10::intrusive_ptr<RsCall>> g_rs_calls;
int64_t g_rs_next = 1;

template <class T>
c10::intrusive_ptr<T> rs_find(const std::unordered_map<int64_t, c10::intrusive_ptr<T>>& m, int64_t id,
                              const char* what) {
  std::lock_guard<std::mutex> lk(g_rs_mu);
  auto it = m.find(id);
  TORCH_CHECK(it != m.end(), "torch_ce: no reduce-scatter ", what, " with handle ", id);
  return it->second;
}

int64_t rs_workspace_h(std::vector<int64_t> addrs, int64_t world, int64_t self, int64_t cap,
                       c10::ScalarType dtype, int64_t device, int64_t copy_stream, int64_t reduce_stream) {
  auto ws = rs_workspace(std::move(addrs), world, self, cap, dtype, device, copy_stream, reduce_stream);
  std::lock_guard<std::mutex> lk(g_rs_mu);
  const int64_t id = g_rs_next++;
  g_rs_workspaces.emplace(id, std::move(ws));
  return id;
}

std::tuple<int64_t, std::vector<at::Tensor>> rs_launch_h(int64_t ws, at::TensorList inputs, at::TensorList outs,
                                                         int64_t half, int64_t seq, int64_t numel, int64_t tag,
                                                         int64_t op, double factor, bool register_work) {
  auto res = rs_launch(rs_find(g_rs_workspaces, ws, "workspace"), inputs, outs, half, seq, numel, tag, op, factor,
                       register_work);
  std::lock_guard<std::mutex> lk(g_rs_mu);
  const int64_t id = g_rs_next++;
  g_rs_calls.emplace(id, std::move(std::get<0>(res)));
  return std::make_tuple(id, std::move(std::get<1>(res)));
}

void rs_complete_h(int64_t call, bool wait_current) { rs_complete(rs_find(g_rs_calls, call, "call"), wait_current); }
void rs_stream_wait_h(int64_t call, int64_t stream) { rs_stream_wait(rs_find(g_rs_calls, call, "call"), stream); }
void rs_register_h(int64_t call) { rs_register(rs_find(g_rs_calls, call, "call")); }
int64_t rs_query_h(int64_t call) { return rs_query(rs_find(g_rs_calls, call, "call")); }

// The stages of several calls in one op call (the watchdog's tick: one crossing, one GIL
// release, however many calls it watches); an unknown id or a failed query reads 1 (begun,
// not done: its deadline runs).
std::vector<int64_t> rs_stages(std::vector<int64_t> ids) {
  std::vector<c10::intrusive_ptr<RsCall>> calls;
  calls.reserve(ids.size());
  {
    std::lock_guard<std::mutex> lk(g_rs_mu);
    for (int64_t id : ids) {
      auto it = g_rs_calls.find(id);
      calls.push_back(it == g_rs_calls.end() ? c10::intrusive_ptr<RsCall>() : it->second);
    }
  }
  std::vector<int64_t> out;
  out.reserve(ids.size());
  for (auto& c : calls) {
    int64_t stage = 1;
    if (c) {
      try {
        stage = rs_query(c);
      } catch (const std::exception&) {
        stage = 1;
      }
    }
    out.push_back(stage);
  }
  return out;
}

void rs_forget(int64_t id) {
  c10::intrusive_ptr<RsCall> call;  // released after the lock: its destructor returns events
  c10::intrusive_ptr<RsWorkspace> ws;
  std::lock_guard<std::mutex> lk(g_rs_mu);
  auto c = g_rs_calls.find(id);
  if (c != g_rs_calls.end()) {
    call = std::move(c->second);
    g_rs_calls.erase(c);
  }
  auto w = g_rs_workspaces.find(id);
  if (w != g_rs_workspaces.end()) {
    ws = std::move(w->second);
    g_rs_workspaces.erase(w);
  }
}

int64_t rs_handle_count() {
  std::lock_guard<std::mutex> lk(g_rs_mu);
  return static_cast<int64_t>(g_rs_calls.size() + g_rs_workspaces.size());
}

// The calling thread's stream-capture interaction mode set to relaxed; returns the old
// mode. The reduce-scatter watchdog (a Python thread) queries events of calls launched
// before a capture; under another thread's cudaStreamCaptureModeGlobal capture (the
// default of torch.cuda.graph) such a query from a thread in the default mode is an
// unsafe call that invalidates that capture. A relaxed thread may make it (CUDA runtime
// API, cudaThreadExchangeStreamCaptureMode).
int64_t relax_thread_capture_mode() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  CE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
  return static_cast<int64_t>(mode);
}

// Whether the library has the reduction kernel (nvcc build) or hands the reduction to
// torch_ce::rs_reduce_fallback.
bool rs_has_kernel() {
#ifdef TORCH_CE_REDUCE_KERNEL
  return true;
#else
  return false;
#endif
}

// The reduction kernel's A/B knob (ce_reduce.h set_tuning): ``batch`` 0 reads, 1 or 4 (or
// -1: by dtype) sets it with ``even``. Returns [batch, even] now; [] without the kernel.
std::vector<int64_t> rs_reduce_tuning(int64_t batch, int64_t even) {
#ifdef TORCH_CE_REDUCE_KERNEL
  if (batch != 0)
    TORCH_CHECK(torch_ce_reduce::set_tuning(static_cast<int>(batch), even != 0),
                "torch_ce: rs_reduce_tuning: batch ", batch, " is not 1, 4 or -1");
  int b = 0;
  bool e = false;
  torch_ce_reduce::tuning(&b, &e);
  return {b, e ? 1 : 0};
#else
  (void)batch;
  (void)even;
  return {};
#endif
}

}  // namespace

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
}

TORCH_LIBRARY_IMPL(torch_ce_native, CompositeImplicitAutograd, m) {
  m.impl("watch_slot", TORCH_FN(watch_slot));
}

TORCH_LIBRARY_IMPL(magi, CUDA, m) {
  m.impl("ce_all_gather", TORCH_FN(ce_all_gather_cuda));
  m.impl("ce_all_gather_coalesced", TORCH_FN(ce_all_gather_coalesced_cuda));
  m.impl("ce_all_gather_dim", TORCH_FN(ce_all_gather_dim_cuda));
}
