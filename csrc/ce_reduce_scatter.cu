// torch_ce: the copy-engine reduce-scatter's native launch and completion (declared in
// ce_reduce_scatter.h; registered by ce_ops.cu): workspaces and calls behind integer
// handles, the pushes, the flag waits and writes (MemOps, ce_flags.h), the reduction's
// launch (its kernel: ce_reduce.cu; without nvcc the Python op torch_ce::rs_reduce_fallback)
// and the calls' stages for the watchdog. Host code only.
//
// # NOTE [native reduce-scatter path]
// The copy-engine reduce-scatter's launch and completion (NOTE [copy-engine
// reduce-scatter] in torch_ce/runtime/reduce_scatter/__init__.py), when
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
//   rs_query      the call's stage for the watchdog (RsStage in ce_reduce_scatter.h: 0
//                 launched, 1 completion being enqueued, 2 done event recorded, 3
//                 done): the watchdog starts the call's deadline when it first sees 1,
//                 exactly when the Python path would have watched it.
//
// The stage moves to 1 before the first wait of the completion is enqueued, so a
// host thread that then blocks (lazy module loading behind a blocked wait) is
// released by the watchdog as on the Python path.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/custom_class.h>

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <iterator>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "ce_copy.h"
#include "ce_flags.h"
#include "ce_native.h"
#include "ce_reduce.h"
#include "ce_reduce_scatter.h"

namespace torch_ce_native {
namespace {

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

}  // namespace

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

namespace {

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
  std::atomic<RsStage> stage{RsStage::kLaunched};
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
    if (call_->stage.load() < RsStage::kRecorded) return false;
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
    if (call_->stage.load() >= RsStage::kRecorded)
      CE_CUDA_CHECK(cudaEventSynchronize(call_->done), "cudaEventSynchronize");
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
    call->stage.store(RsStage::kCompleting);  // the watchdog's deadline starts: before any wait is enqueued
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
    call->stage.store(RsStage::kRecorded);
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
  const RsStage stage = call->stage.load();
  if (stage < RsStage::kRecorded) return static_cast<int64_t>(stage);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(call->ws->device));
  cudaError_t err = cudaEventQuery(call->done);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return static_cast<int64_t>(RsStage::kRecorded);
  }
  CE_CUDA_CHECK(err, "cudaEventQuery");
  return static_cast<int64_t>(RsStage::kDone);
}

// Handles: Python holds a workspace or a call as an integer, not as a custom-class
// object: converting a torch.ScriptObject argument or result costs ~15 us per op call on
// an H200's host (bench/compare/rs_host_breakdown.py), several times the C++ work
// of a call. Ids come from one counter; rs_forget drops either kind (Python's
// native.Handle calls it when its last reference goes). A call's c10d work holds the
// call itself, so forgetting the id never ends a call early. Calls still here at exit give
// their events back to ce_gather.cu's pool as these maps are destroyed: that pool is built
// first, so destroyed after them (setup.py links ce_gather.cu before this file, and static
// constructors run in link order).
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

}  // namespace

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
    int64_t stage = static_cast<int64_t>(RsStage::kCompleting);
    if (c) {
      try {
        stage = rs_query(c);
      } catch (const std::exception&) {
        stage = static_cast<int64_t>(RsStage::kCompleting);
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

}  // namespace torch_ce_native
