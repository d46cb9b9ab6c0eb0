// torch_ce: the copy-engine reduce-scatter's reduction kernel (declared in
// ce_reduce.h; called from ce_reduce_scatter.cu's native completion, NOTE [native
// reduce-scatter path]).
//
// # NOTE [reduction kernel]
// A copy engine cannot add: after the data waits a call has W slices of every
// member of its bucket (this rank's own chunk, read in place from the input, and
// W - 1 peers' slices in its receive half) and one output per member. The
// memory-bound minimum is one pass that reads each slice once and writes the
// output once; W - 1 ``add`` kernels (plus casts for bf16) read and write the
// output W - 1 times. So one launch per call (per kMaxSegs members): block row
// ``blockIdx.y`` is a member, its blocks grid-stride over the member's elements in
// 16-byte vectors (4 fp32 or 8 bf16; where the member's own chunk, output and
// offset in the slices are 16-byte aligned, else element by element), each thread
// loading the W sources of its vector (fp32: four at once, so their loads overlap;
// bf16: one at a time, which measured faster) and accumulating them in group index
// order in fp32.
//
// Numerics: those of reduce_scatter.reference._reduce on CUDA (the reference and the host
// transport's twin), bit for bit: the sum is left to right in group index order,
// each step one fp32 rounding (__fadd_rn: no contraction into a fused
// multiply-add); ``avg`` multiplies the sum by fp32(1 / W), which is what torch's
// CUDA ``div_`` by a Python scalar computes (a * reciprocal(b)); ``premul_sum(f)``
// rounds each product source * fp32(f) before adding it (__fmul_rn), as the
// reference's separate multiply and add kernels do; bf16 sources widen exactly
// and the fp32 result rounds once to nearest even. No atomics: every output
// element has one writer, so results are deterministic run to run.

#include "ce_reduce.h"

#include <cuda_bf16.h>

#include <atomic>

namespace torch_ce_reduce {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocksX = 1024;
// Sources whose loads a thread issues before adding them: 1 or 4, or -1 (the default) by
// dtype, 4 for fp32 and 1 for bf16 (bench/compare/reduce_kernel_probe.py on an H100: four
// in flight took world 3 fp32 at 16 MiB from 0.75 to 0.88 of the copy's bandwidth and bf16
// from 0.74 down to 0.56-0.65; docs/perf-notes.md section 23).
std::atomic<int> g_batch{-1};
std::atomic<bool> g_even{false};  // the grid spread evenly over the rounds, else (the default) the block cap

template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kVec = 4;  // 16 bytes
  __device__ static float load(const void* p, int64_t k) {
    return static_cast<const float*>(p)[k];
  }
  __device__ static void store(void* p, int64_t k, float v) { static_cast<float*>(p)[k] = v; }
  __device__ static void load_vec(const void* p, int64_t u, float (&v)[kVec]) {
    const float4 x = static_cast<const float4*>(p)[u];
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
  }
  __device__ static void store_vec(void* p, int64_t u, const float (&v)[kVec]) {
    static_cast<float4*>(p)[u] = make_float4(v[0], v[1], v[2], v[3]);
  }
};

__device__ inline float widen(unsigned short bits) {
  return __uint_as_float(static_cast<unsigned int>(bits) << 16);
}

__device__ inline unsigned short narrow(float v) {  // round to nearest even (NaN kept)
  return __bfloat16_as_ushort(__float2bfloat16_rn(v));
}

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kVec = 8;  // 16 bytes
  __device__ static float load(const void* p, int64_t k) {
    return widen(static_cast<const unsigned short*>(p)[k]);
  }
  __device__ static void store(void* p, int64_t k, float v) {
    static_cast<unsigned short*>(p)[k] = narrow(v);
  }
  __device__ static void load_vec(const void* p, int64_t u, float (&v)[kVec]) {
    const uint4 x = static_cast<const uint4*>(p)[u];
    const unsigned int w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      v[2 * q] = __uint_as_float(w[q] << 16);
      v[2 * q + 1] = __uint_as_float(w[q] & 0xFFFF0000u);
    }
  }
  __device__ static void store_vec(void* p, int64_t u, const float (&v)[kVec]) {
    unsigned int w[4];
#pragma unroll
    for (int q = 0; q < 4; ++q)
      w[q] = static_cast<unsigned int>(narrow(v[2 * q])) |
             (static_cast<unsigned int>(narrow(v[2 * q + 1])) << 16);
    static_cast<uint4*>(p)[u] = make_uint4(w[0], w[1], w[2], w[3]);
  }
};

// One source's contribution to the accumulator: the reference's order of roundings.
__device__ inline float first(float x, int op, float scale) {
  return op == kPremulSum ? __fmul_rn(x, scale) : x;
}
__device__ inline float add(float acc, float x, int op, float scale) {
  return __fadd_rn(acc, op == kPremulSum ? __fmul_rn(x, scale) : x);
}
__device__ inline float finish(float acc, int op, float scale) {
  return op == kAvg ? __fmul_rn(acc, scale) : acc;
}

template <typename T, int kBatch>
__global__ void __launch_bounds__(kThreads) reduce_kernel(Args a, unsigned int vec_mask_lo,
                                                          unsigned int vec_mask_hi) {
  using E = Elem<T>;
  constexpr int V = E::kVec;
  const int s = blockIdx.y;
  const Seg seg = a.seg[s];
  const bool vec = (s < 32 ? (vec_mask_lo >> s) : (vec_mask_hi >> (s - 32))) & 1u;
  const int64_t nvec = vec ? seg.n / V : 0;
  const int64_t units = nvec + (seg.n - nvec * V);  // vectors, then the tail's elements
  const char* base = static_cast<const char*>(a.recv_half) + seg.off * static_cast<int64_t>(sizeof(T));
  // The poison word (host-mapped flags only): one load per block, over PCIe.
  __shared__ int poisoned;
  if (threadIdx.x == 0)
    poisoned = a.poison != nullptr && *static_cast<const volatile int*>(a.poison) == a.tag;
  __syncthreads();
  const bool bad = poisoned != 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; u < units; u += stride) {
    if (u < nvec) {
      // Up to kBatch sources' vectors loaded before any is added: their loads are in
      // flight together (a loop of load-then-add keeps one 16-byte load per thread in
      // flight, latency-bound where a grid-stride round leaves threads idle). The adds
      // stay left to right in group index order.
      float acc[V];
      for (int j0 = 0; j0 < a.world; j0 += kBatch) {
        float x[kBatch][V];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int j = j0 + b;
          if (j < a.world) {
            const void* src = j == a.self ? seg.own : static_cast<const void*>(base + j * a.slice_bytes);
            E::load_vec(src, u, x[b]);
          }
        }
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int j = j0 + b;
          if (j < a.world) {
#pragma unroll
            for (int q = 0; q < V; ++q) acc[q] = j == 0 ? first(x[b][q], a.op, a.scale) : add(acc[q], x[b][q], a.op, a.scale);
          }
        }
      }
#pragma unroll
      for (int q = 0; q < V; ++q) acc[q] = bad ? __int_as_float(0x7FC00000) : finish(acc[q], a.op, a.scale);
      E::store_vec(seg.out, u, acc);
    } else {
      const int64_t k = nvec * V + (u - nvec);
      float acc = 0.f;
      for (int j = 0; j < a.world; ++j) {
        const void* src = j == a.self ? seg.own : static_cast<const void*>(base + j * a.slice_bytes);
        const float x = E::load(src, k);
        acc = j == 0 ? first(x, a.op, a.scale) : add(acc, x, a.op, a.scale);
      }
      E::store(seg.out, k, bad ? __int_as_float(0x7FC00000) : finish(acc, a.op, a.scale));
    }
  }
}

}  // namespace

cudaError_t launch_reduce(const Args& args, bool bf16, cudaStream_t stream) {
  if (args.world < 2 || args.self < 0 || args.self >= args.world || args.nseg < 0 ||
      args.nseg > kMaxSegs || args.op < kSum || args.op > kPremulSum)
    return cudaErrorInvalidValue;
  if (args.nseg == 0) return cudaSuccess;
  const int64_t esize = bf16 ? 2 : 4;
  const int64_t vbytes = 16;
  const int vlen = static_cast<int>(vbytes / esize);
  unsigned int lo = 0, hi = 0;
  int64_t most = 1;
  const uintptr_t shared = reinterpret_cast<uintptr_t>(args.recv_half) |
                           static_cast<uintptr_t>(args.slice_bytes);
  for (int s = 0; s < args.nseg; ++s) {
    const Seg& g = args.seg[s];
    if (g.n < 0) return cudaErrorInvalidValue;
    const uintptr_t align = shared | reinterpret_cast<uintptr_t>(g.own) |
                            reinterpret_cast<uintptr_t>(g.out) |
                            static_cast<uintptr_t>(g.off * esize);
    const bool vec = align % vbytes == 0;
    if (vec) (s < 32 ? lo : hi) |= 1u << (s % 32);
    const int64_t units = vec ? g.n / vlen + g.n % vlen : g.n;
    if (units > most) most = units;
  }
  // The block cap (the default), or (``even``) as many grid-stride rounds as the cap
  // needs with the blocks that spread the member's units evenly over them: a guess for
  // world 3's 16 MiB (perf-notes section 23) that the measurements did not bear out (the
  // loads in flight were the cause).
  const int64_t per_round = kThreads * kMaxBlocksX;
  const int64_t rounds = (most + per_round - 1) / per_round;
  int64_t bx = (most + kThreads * rounds - 1) / (kThreads * rounds);
  if (!g_even.load(std::memory_order_relaxed)) {
    bx = (most + kThreads - 1) / kThreads;
    if (bx > kMaxBlocksX) bx = kMaxBlocksX;
  }
  const dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(args.nseg));
  const int batch = g_batch.load(std::memory_order_relaxed);
  const bool batch4 = batch == 4 || (batch == -1 && !bf16);
  if (bf16 && batch4)
    reduce_kernel<__nv_bfloat16, 4><<<grid, kThreads, 0, stream>>>(args, lo, hi);
  else if (bf16)
    reduce_kernel<__nv_bfloat16, 1><<<grid, kThreads, 0, stream>>>(args, lo, hi);
  else if (batch4)
    reduce_kernel<float, 4><<<grid, kThreads, 0, stream>>>(args, lo, hi);
  else
    reduce_kernel<float, 1><<<grid, kThreads, 0, stream>>>(args, lo, hi);
  return cudaGetLastError();
}

bool set_tuning(int batch, bool even) {
  if (batch != 1 && batch != 4 && batch != -1) return false;
  g_batch.store(batch);
  g_even.store(even);
  return true;
}

void tuning(int* batch, bool* even) {
  *batch = g_batch.load();
  *even = g_even.load();
}

}  // namespace torch_ce_reduce
