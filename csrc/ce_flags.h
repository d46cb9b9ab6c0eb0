// torch_ce: stream flags (NOTE [stream flags] in ce_flags.cu, which defines them): the
// flag ops ce_ops.cu registers, MemOps (the batches of flag waits and writes the native
// reduce-scatter and FSDP2's training gathers enqueue), and the training gather's call.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <stdint.h>

#include <vector>

namespace torch_ce_native {

// The flag ops: the driver's stream waits and writes on the current stream, what the
// device supports, the watchdog's host writes, and host memory mapped for the flags (NOTE
// [poison word] in ce_flags.cu).
std::vector<int64_t> stream_flags_info();
void stream_wait_value32(int64_t addr, int64_t value);
void stream_write_value32(int64_t addr, int64_t value);
int64_t host_write_words(int64_t addr, int64_t value, int64_t count, int64_t width, int64_t method);
int64_t host_register(int64_t addr, int64_t nbytes);
void host_unregister(int64_t addr);
// mode 0: read; 1: batches; 2: one call per operation. Returns whether batches are on.
bool rs_memop_batching(int64_t mode);

// The wait's flags for ``device``: EQ, and FLUSH where the device can flush remote writes.
unsigned int wait_flags(int device);

// FSDP2's training gathers on CUDA (NOTE [FSDP2 step words on CUDA] in ce_flags.cu): a
// group's peer buffers and word addresses registered once (an id), and one call: the
// step-word waits and writes, this rank's chunk staged, the peers' chunks copied into
// ``out``, all enqueued on the current stream.
int64_t step_group(at::TensorList srcs, at::IntArrayRef rows, at::IntArrayRef peer_ready,
                   at::IntArrayRef peer_done, int64_t my_ready, int64_t my_done);
void step_forget(int64_t group);
void step_gather(const at::Tensor& out, const at::Tensor& input, const at::Tensor& buffer, int64_t group,
                 int64_t call);

// A call's flag waits and writes as batches: cuStreamBatchMemOp enqueues its operations
// in array order, each as its single call would (a wait EQ, FLUSH where the device has it;
// a write with the default memory barrier before it), for one driver call per group, not
// one per word (each ~1 us of host time on an H200's host). The layout is
// cuda.h's CUstreamBatchMemOpParams (a 48-byte union), written out because the host-
// compiler build has only the runtime's headers; an nvcc build checks it against cuda.h
// (ce_flags.cu).
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

class MemOps {
 public:
  MemOps(cudaStream_t stream, int device)
      : stream_(stream), wait_flags_(wait_flags(device)) {}
  void wait(uint64_t addr, uint32_t value) { add(1u, addr, value, wait_flags_); }
  // A wait until the word is at least ``value`` (CU_STREAM_WAIT_VALUE_GEQ, cyclic: the
  // comparison bits of the EQ flags cleared), FLUSH as ``wait``.
  void wait_geq(uint64_t addr, uint32_t value) { add(1u, addr, value, wait_flags_ & ~0x3u); }
  // A write with the default memory barrier before it (the stream's earlier writes visible
  // first).
  void write(uint64_t addr, uint32_t value) { add(2u, addr, value, 0u); }
  // Everything added so far, in order, into the stream.
  void enqueue();

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

}  // namespace torch_ce_native
