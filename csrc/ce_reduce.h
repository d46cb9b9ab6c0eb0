// torch_ce: the copy-engine reduce-scatter's one reduction kernel (NOTE [reduction
// kernel] in ce_reduce.cu).
//
// Free of torch headers: ce_reduce_scatter.cu (host C++) calls the launcher, ce_reduce.cu
// (compiled by nvcc as CUDA) defines it. Built only with nvcc
// (TORCH_CE_REDUCE_KERNEL); without it the Triton kernel of
// torch_ce/runtime/reduce_scatter/reduce_triton.py serves.
#pragma once

#include <cuda_runtime_api.h>

#include <stdint.h>

namespace torch_ce_reduce {

// Members of a bucket one launch reduces (a kernel argument: no device table, so
// nothing is copied to the device per call and the launch is capturable). A bucket
// with more members takes ceil(members / kMaxSegs) launches.
constexpr int kMaxSegs = 48;

enum Op : int { kSum = 0, kAvg = 1, kPremulSum = 2 };

// One member of the bucket: its output (n elements), this rank's own chunk of its
// input (n elements, read in place) and where its elements start in every sender's
// receive slice (``off`` elements from the slice's start).
struct Seg {
  const void* own;
  void* out;
  int64_t n;
  int64_t off;
};

struct Args {
  const void* recv_half;  // recv[h, 0]: sender j's slice at recv_half + j * slice_bytes
  int64_t slice_bytes;
  int world;  // W >= 2
  int self;   // this rank's group index: its source is Seg::own
  int op;     // Op
  float scale;  // kAvg: 1 / W in fp32 (what torch's CUDA div_ by a scalar multiplies by);
                // kPremulSum: the factor rounded to fp32
  int nseg;
  // NOTE [poison word] in ce_flags.cu: where the reduce-scatter's flags are host-mapped,
  // the host word the watchdog sets to ``tag`` when it released this call's waits; the
  // kernel then writes NaN, never the sum of what was not pushed. Null: not read.
  const int* poison;
  int tag;
  Seg seg[kMaxSegs];
};

// out = the sum of the W sources in group index order, in fp32 (bf16: each source
// widened exactly, one rounding at the end); kAvg: times ``scale`` after the sum;
// kPremulSum: each source times ``scale`` (rounded) before it is added. No fused
// multiply-add anywhere: bit-identical to reduce_scatter.reference._reduce on CUDA. Every output
// NaN where ``poison`` holds ``tag`` when the block starts. ``bf16``:
// the elements are bfloat16, else float32. Returns the launch's error.
cudaError_t launch_reduce(const Args& args, bool bf16, cudaStream_t stream);

// An A/B knob (bench/compare/reduce_kernel_probe.py measures the four): how many sources'
// loads a thread issues before adding them (``batch``: 1 or 4, or -1, the default: 4 for
// fp32, 1 for bf16) and whether the grid spreads a member's vectors evenly over its rounds
// (``even``) or takes the block cap (the default). Results are the same bits either way
// (the same order of adds). Returns false (and changes nothing) for another batch.
bool set_tuning(int batch, bool even);
void tuning(int* batch, bool* even);

}  // namespace torch_ce_reduce
