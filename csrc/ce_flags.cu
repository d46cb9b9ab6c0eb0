// torch_ce: stream flags (declared in ce_flags.h; registered by ce_ops.cu): the driver's
// stream waits and writes, what the device supports, the watchdog's host writes, host
// memory mapped for the flags (NOTE [poison word]), the batches of flag operations
// (MemOps) the native reduce-scatter enqueues (NOTE [native reduce-scatter path] in
// ce_reduce_scatter.cu), and FSDP2's training gather (NOTE [FSDP2 step words on CUDA]).
// Host code only.
//
// # NOTE [stream flags]
// The copy-engine reduce-scatter's signals (NOTE [copy-engine reduce-scatter] in
// torch_ce/runtime/reduce_scatter/__init__.py). A flag is a 32-bit word in a workspace:
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
// Ordering (docs/DESIGN.md "Flag waits observe the data"): the wait adds
// CU_STREAM_WAIT_VALUE_FLUSH where the device reports
// CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES (``stream_flags_info``; an H200 reports 0).
// Without it the writer's side orders it: its flag write has the default flags (a
// memory barrier before the write, not CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER), on the
// stream that pushed, after the pushes, so the pushed data is visible before the flag.
//
// A dead peer (NOTE [reduce-scatter watchdog]): a stream wait has no timeout. The
// watchdog releases it with ``host_write_words``, which writes from the host on a
// stream of its own, by the path measured to release a blocked wait (below).

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime_api.h>
#if __has_include(<cuda.h>)
#include <cuda.h>  // only to check MemOp's layout (the host-compiler build may lack it)
#define TORCH_CE_HAVE_CUDA_H 1
#endif

#include <atomic>
#include <cstddef>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "ce_flags.h"
#include "ce_native.h"

namespace torch_ce_native {
namespace {

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

}  // namespace

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
// cuMemsetD16Async, 3 cuStreamWriteValue32 (one 32-bit word). Measured on an H200
// (bench/compare/rs_release_probe.py): both release a stream blocked in cuStreamWaitValue32
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
// watchdog's writes on a stream of its own queue behind the wait they should release. Only
// a host store releases it there (measured: bench/compare/rs_release_probe.py), so the
// workspace's flags, headers and a poison word per half move to host memory that every
// rank of the group maps (a /dev/shm segment per rank, registered here: cudaHostRegister,
// mapped, so the device reads it over PCIe and cuStreamWaitValue32 / cuStreamWriteValue32
// take its address). The release is then a host store, but the NaN fill the watchdog
// enqueues for device-flag workspaces would run after the reduction it must precede (one
// queue: in submission order). So the reduction kernel, already enqueued behind the waits,
// reads the poison word of its half at each block's start: the watchdog stores the call's
// tag there before it stores the awaited flags (x86 store order), and the kernel writes
// NaN. The waits see the flags by polling host memory: the writer's cuStreamWriteValue32
// keeps its memory barrier (NOTE [stream flags]), so its pushes into the peer's device
// memory are visible before the flag in host memory.
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

// mode 0: read; 1: batches; 2: one call per operation. Returns whether batches are on.
bool rs_memop_batching(int64_t mode) {
  TORCH_CHECK(mode >= 0 && mode <= 2, "torch_ce: rs_memop_batching: mode ", mode, " is not 0, 1 or 2");
  if (mode != 0) g_rs_memop_batch.store(mode == 1);
  return g_rs_memop_batch.load();
}

void MemOps::enqueue() {
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

// # NOTE [FSDP2 step words on CUDA]
// The step-word protocol of a training group's gathers (NOTE [FSDP2 training: step words]
// in torch_ce/fsdp2/signals.py) as stream operations, so no host thread waits. Each rank's
// two words (ready, done) are 32-bit words in host memory every rank of the group maps
// and registers (a host window of the group, torch_ce/fsdp2/step_words.py), written by
// their owner's stream (cuStreamWriteValue32, with its memory barrier: the staged chunk is
// visible before ``ready`` says so; the peer copies are complete before ``done`` does) and
// waited on by the peers' streams (cuStreamWaitValue32 GEQ, cyclic). Call k, on the
// current stream (FSDP2's all-gather stream: its copy-in first, its copy-out after):
//   4. of call k-1: done = k - 1 (its peer copies are complete: they are before it)
//   1. wait until every peer's done >= k - 1 (none still reads this rank's call k-1 bytes)
//   2. buffer <- input (this rank's chunk, a copy-engine copy); ready = k
//   3. per peer (the caller's order): wait until its ready >= k; its buffer -> out's row
// Step 4 of a call is written at the head of the next, in one batch with step 1's waits:
// one driver call fewer per call (each ~2 us of host time). It delays nothing a peer
// needs: a peer waits for this rank's done >= k - 1 only in its own call k, which cannot
// finish before this rank's call k has staged its chunk anyway, and this rank writes
// that done before it waits on anything of call k. After a group's last call nothing
// waits, so nothing needs its done. GEQ, not EQ: the watchdog releases every
// wait of a group at once by storing the highest call enqueued into the peers' words (a
// host store: it releases a stream wait under one hardware queue too). Not capturable:
// the call numbers are the host's.
namespace {

// A training group's fixed arguments, registered once (``step_group``): an op call with
// tensor and integer lists costs several microseconds of argument conversion per call.
struct StepGroup {
  std::vector<const void*> srcs;  // the peers' staging buffers, in the caller's peer order
  std::vector<int64_t> rows;      // their rows of the output
  std::vector<uint64_t> ready, done;  // their words' addresses
  uint64_t my_ready = 0, my_done = 0;
  size_t nbytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};
std::mutex g_step_mu;
std::unordered_map<int64_t, StepGroup> g_step;
int64_t g_step_next = 1;

}  // namespace

int64_t step_group(at::TensorList srcs, at::IntArrayRef rows, at::IntArrayRef peer_ready,
                   at::IntArrayRef peer_done, int64_t my_ready, int64_t my_done) {
  TORCH_CHECK(!srcs.empty() && srcs.size() == rows.size() && srcs.size() == peer_ready.size() &&
                  srcs.size() == peer_done.size(),
              "torch_ce: step_group: one row, ready word and done word per peer buffer");
  StepGroup g;
  g.nbytes = static_cast<size_t>(srcs[0].numel()) * srcs[0].element_size();
  g.dtype = srcs[0].scalar_type();
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor& x = srcs[i];
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == g.dtype &&
                    static_cast<size_t>(x.numel()) * x.element_size() == g.nbytes && rows[i] >= 0,
                "torch_ce: step_group: peer buffers are contiguous CUDA tensors of one dtype and size");
    g.srcs.push_back(x.data_ptr());
    g.rows.push_back(rows[i]);
    g.ready.push_back(static_cast<uint64_t>(peer_ready[i]));
    g.done.push_back(static_cast<uint64_t>(peer_done[i]));
  }
  g.my_ready = static_cast<uint64_t>(my_ready);
  g.my_done = static_cast<uint64_t>(my_done);
  std::lock_guard<std::mutex> lk(g_step_mu);
  const int64_t id = g_step_next++;
  g_step.emplace(id, std::move(g));
  return id;
}

void step_forget(int64_t group) {
  std::lock_guard<std::mutex> lk(g_step_mu);
  g_step.erase(group);
}

void step_gather(const at::Tensor& out, const at::Tensor& input, const at::Tensor& buffer, int64_t group,
                 int64_t call) {
  const StepGroup* g = nullptr;
  {
    std::lock_guard<std::mutex> lk(g_step_mu);
    auto it = g_step.find(group);
    TORCH_CHECK(it != g_step.end(), "torch_ce: step_gather: group ", group, " is not registered");
    g = &it->second;  // stable: unordered_map nodes do not move; forgotten only by its owner
  }
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && input.is_contiguous() && buffer.is_contiguous(),
              "torch_ce: step_gather: contiguous CUDA tensors");
  TORCH_CHECK(call >= 1 && call < (int64_t{1} << 31), "torch_ce: step_gather: call ", call, " out of range");
  const size_t nbytes = g->nbytes;
  TORCH_CHECK(static_cast<size_t>(input.numel()) * input.element_size() == nbytes &&
                  static_cast<size_t>(buffer.numel()) * buffer.element_size() == nbytes &&
                  input.scalar_type() == g->dtype && out.scalar_type() == g->dtype,
              "torch_ce: step_gather: the input and the staging buffer are the group's chunk");
  const size_t out_bytes = static_cast<size_t>(out.numel()) * out.element_size();
  const int device = out.device().index();
  const c10::cuda::CUDAGuard guard(out.device());
  // On the current stream itself (FSDP2's all-gather stream): its copy-in is before, its
  // copy-out after, and FSDP2's next gather behind (it runs them in one order on every
  // rank); no event, and the output is not used on another stream.
  cudaStream_t s = c10::cuda::getCurrentCUDAStream(device).stream();
  cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
  CE_CUDA_CHECK(cudaStreamIsCapturing(s, &cap), "cudaStreamIsCapturing");
  TORCH_CHECK(cap == cudaStreamCaptureStatusNone,
              "torch_ce: an FSDP2 training gather cannot be captured in a CUDA graph (its step "
              "numbers are the host's)");
  for (int64_t r : g->rows)
    TORCH_CHECK(static_cast<size_t>(r + 1) * nbytes <= out_bytes, "torch_ce: step_gather: row ", r,
                " is outside the output");
  const auto k = static_cast<uint32_t>(call);
  MemOps ops(s, device);
  if (k > 1) {
    ops.write(g->my_done, k - 1);  // 4. of call k-1
    for (uint64_t a : g->done) ops.wait_geq(a, k - 1);  // 1.
    ops.enqueue();
  }
  CE_CUDA_CHECK(cudaMemcpyAsync(buffer.data_ptr(), input.data_ptr(), nbytes, cudaMemcpyDeviceToDevice, s),
                "cudaMemcpyAsync");  // 2.
  ops.write(g->my_ready, k);
  char* base = static_cast<char*>(out.data_ptr());
  for (size_t i = 0; i < g->srcs.size(); ++i) {  // 3.
    ops.wait_geq(g->ready[i], k);
    ops.enqueue();
    CE_CUDA_CHECK(cudaMemcpyAsync(base + g->rows[i] * nbytes, g->srcs[i], nbytes, cudaMemcpyDefault, s),
                  "cudaMemcpyAsync");
  }
}

}  // namespace torch_ce_native
