// torch_ce: the order of one bucket's reads, and the two ways its copies reach
// the copy engines.
//
// Used by the torch kernels (ce_gather.cu; ce_reduce_scatter.cu's pushes);
// header-only and free of torch headers, so the copy calls read on their own
// (and read_plan compiles and runs on a machine without a GPU: test/test_build.py).
#pragma once

#include <cuda_runtime_api.h>

#include <stddef.h>
#include <string.h>

#include <vector>

namespace torch_ce_copy {

// # NOTE [peer order]
// Which rank a gather reads when. Every rank gathers the same bucket at about
// the same time, so the order is what decides how many readers one rank's
// NVLink egress serves at once. In a fixed order (0, 1, ..., W-1) every rank
// reads rank 0 first, then rank 1: W-1 readers share one egress (~477 GB/s
// per direction on an H200) while the others idle; at W = 4 that read at
// 208-217 GB/s where the rotated order below read at 346-355 GB/s
// (shared/probes/rotation_probe.py, 256 MiB per peer). At W = 2 both orders
// are the same. Rotated, rank r reads r+1, r+2, ..., r-1 (mod W): at step k
// every rank reads a different peer (r+k is a permutation of the ranks), so
// every egress serves exactly one reader. NCCL rotates its peers likewise.
//
// Peer-major, not member-major. A bucket's reads go out peer by peer (all
// members from r+1, then all from r+2, ...). Both are one-reader-per-egress
// while the ranks run in step, since every rank's bucket has the same member
// sizes. They differ when the ranks do not start together (there is no
// barrier: each rank issues when its own stream gets there). A rank that is
// d bytes behind a peer reads from the same egress as that peer only near a
// step boundary: peer-major steps last a whole bucket per peer, so the
// overlap is ~d / (bucket bytes) of the time, and only for the pair whose
// offsets differ by one; member-major steps last one member's slab, so past
// one slab of skew the two ranks' peers line up at random, and with many
// members that is ~1/(W-1) of the time for every pair: back towards the
// fixed order's pile-up.
//
// Chunked interleave (chunk > 0, off by default until measured): each peer
// read is cut into `chunk`-byte pieces and the pieces go out round-robin over
// the peers (piece 0 from r+1, r+2, ..., r-1, then piece 1, ...). If the copy
// engines run several entries of one batch at once, a rank then reads W-1
// different peers at every instant, and a late rank still spreads its reads;
// if they run the entries one after the other it is member-major with short
// steps, and the extra entries cost submission time. Which holds is what the
// GPU run measures (docs/perf-notes.md section 10).
//
// The knob (TORCH_CE_PEER_ORDER, runtime/native.py) picks one of three orders;
// the last two exist for A/B runs:
//   rotated         rotated, peer-major (the default)
//   rotated-member  rotated, member-major
//   fixed           0, 1, ..., W-1, member-major: the first order
// The own rows (source == rank) come last in a rotated order ((r + W) mod W)
// and at their place in the fixed one; the gather normally copies them on a
// second stream (NOTE [native gather path]) and leaves them out of the plan.
enum PeerOrder : int { kFixed = 0, kRotated = 1, kRotatedMember = 2 };

// The source rank of step k (0 <= k < world) of rank `rank`'s reads, own rows
// included.
inline int source_at(int rank, int world, int k, int order) {
  return order == kFixed ? k : (rank + 1 + k) % world;
}

// One copy of a read plan: bytes [offset, offset + size) of `member`'s slab
// from `source`.
struct Piece {
  int source;
  size_t member;
  size_t offset;
  size_t size;
};

// The copies of one bucket of `members` slabs of `bytes[m]` each, in submission
// order (NOTE [peer order]): whole slabs when chunk == 0, else pieces of at
// most `chunk` bytes round-robin over the sources. The own slab is included
// only when `own` is true. The same plan on every rank but for the sources.
inline std::vector<Piece> read_plan(int rank, int world, const size_t* bytes,
                                    size_t members, size_t chunk, int order,
                                    bool own) {
  std::vector<int> sources;
  for (int k = 0; k < world; ++k) {
    const int s = source_at(rank, world, k, order);
    if (s != rank || own) sources.push_back(s);
  }
  std::vector<Piece> plan;
  if (chunk == 0 && order == kRotated) {  // peer-major
    for (int s : sources)
      for (size_t m = 0; m < members; ++m) plan.push_back({s, m, 0, bytes[m]});
    return plan;
  }
  for (size_t m = 0; m < members; ++m) {  // member-major, or chunk-major
    const size_t step = chunk == 0 ? bytes[m] : chunk;
    size_t off = 0;
    do {
      const size_t n = bytes[m] - off < step ? bytes[m] - off : step;
      for (int s : sources) plan.push_back({s, m, off, n});
      off += n;
    } while (off < bytes[m]);
  }
  return plan;
}

// True if cudaMemcpyBatchAsync is usable: compiled against and running on
// CUDA >= 12.8 (where it appeared).
inline bool batch_supported() {
#if CUDART_VERSION >= 12080
  int version = 0;
  if (cudaRuntimeGetVersion(&version) != cudaSuccess) return false;
  return version >= 12080;
#else
  return false;
#endif
}

// Every copy in one cudaMemcpyBatchAsync: one driver call per bucket, no SM
// kernel. One attribute set covers all copies:
// - srcAccessOrder = Stream: a source is read when the stream reaches the copy,
//   never earlier. Sources are weights in symmetric windows, published (one
//   barrier at bind time) before any read; an inference weight is never written
//   afterwards, a training graph's staging slot only between two step fences
//   that the current stream (and so this copy stream) has waited on
//   (NOTE [training: staged windows and step fences] in runtime/staging.py).
// - flags = PreferOverlapWithCompute (a hint): the copies run beside the
//   matmuls that consume the previous gather (measured without it: no
//   difference, docs/perf-notes.md section 12; the gather always sets it).
// - location hints stay zero: they only matter for managed/pageable memory.
// The stream must not be the legacy default stream (the API rejects it).
inline cudaError_t batch(void* const* dsts, const void* const* srcs,
                         const size_t* sizes, size_t count,
                         bool prefer_overlap, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attrs;
  memset(&attrs, 0, sizeof(attrs));
  attrs.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attrs.flags = prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
  size_t attrs_idx = 0;  // attrs[0] applies from copy 0 to the end
#if CUDART_VERSION >= 13000
  // CUDA 13 dropped the failIdx out-parameter.
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attrs, &attrs_idx, 1,
                              stream);
#else
  size_t fail_idx = 0;
  return cudaMemcpyBatchAsync(const_cast<void**>(dsts),
                              const_cast<void**>(srcs),
                              const_cast<size_t*>(sizes), count, &attrs,
                              &attrs_idx, 1, &fail_idx, stream);
#endif
#else
  (void)dsts; (void)srcs; (void)sizes; (void)prefer_overlap; (void)stream;
  return cudaErrorNotSupported;
#endif
}

// One cudaMemcpyAsync per copy: any CUDA version, any stream, and capturable
// in CUDA graphs. On error, *failed (if given) is the index of the failing copy.
inline cudaError_t per_copy(void* const* dsts, const void* const* srcs,
                            const size_t* sizes, size_t count,
                            cudaStream_t stream, size_t* failed) {
  for (size_t i = 0; i < count; ++i) {
    cudaError_t err =
        cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (err != cudaSuccess) {
      if (failed != nullptr) *failed = i;
      return err;
    }
  }
  return cudaSuccess;
}

// # NOTE [strided reads]
// A Shard(d) weight, d >= 1 (NOTE [Shard(1) reads] in torch_ce/passes/gate.py),
// gathered into its final layout: peer s's shard is `height` = prod(shape[:d])
// rows of `width` = prod(shape[d:]) * itemsize contiguous bytes, and lands at
// out + s * width with a pitch of W * width. One Block per (peer, member);
// three ways to hand the blocks to the copy engines, picked by DimStrategy
// (set_dim_strategy, an A/B knob: bench/compare/dim1_cost.py measures them):
//   kDimRows     every row of every block one entry of the one
//                cudaMemcpyBatchAsync (height * (W - 1) entries per member):
//                the copy engines take each short row as a copy of its own, so
//                it ran 7-17x slower than the others on one H200 (perf-notes)
//   kDim2D       one cudaMemcpy2DAsync per block (W - 1 calls per member; any
//                CUDA version; what CUDA-graph capture and runtimes without the
//                batch call use)
//   kDim3DBatch  the default: one cudaMemcpy3DBatchAsync of one 2-D op per
//                block, one submission like the Shard(0) batch (CUDA >= 12.8;
//                kDim2D where it is missing); as fast as kDim2D, ~1 us less CPU
// A block whose rows are contiguous on both sides (height 1) is one plain copy
// in every strategy.
enum DimStrategy : int { kDimRows = 0, kDim2D = 1, kDim3DBatch = 2 };

struct Block {
  void* dst;
  const void* src;
  size_t dpitch;
  size_t spitch;
  size_t width;   // bytes per row
  size_t height;  // rows
};

// The blocks as 1-D copies, one per row (one per block where the rows are
// contiguous on both sides), appended to dsts/srcs/sizes.
inline void rows_of(const Block* blocks, size_t count, std::vector<void*>& dsts,
                    std::vector<const void*>& srcs, std::vector<size_t>& sizes) {
  for (size_t i = 0; i < count; ++i) {
    const Block& b = blocks[i];
    if (b.width == 0 || b.height == 0) continue;
    if (b.height == 1 || (b.dpitch == b.width && b.spitch == b.width)) {
      dsts.push_back(b.dst);
      srcs.push_back(b.src);
      sizes.push_back(b.width * b.height);
      continue;
    }
    for (size_t r = 0; r < b.height; ++r) {
      dsts.push_back(static_cast<char*>(b.dst) + r * b.dpitch);
      srcs.push_back(static_cast<const char*>(b.src) + r * b.spitch);
      sizes.push_back(b.width);
    }
  }
}

// One cudaMemcpy2DAsync per block: any CUDA version, capturable. On error,
// *failed (if given) is the index of the failing block.
inline cudaError_t copy_2d(const Block* blocks, size_t count,
                           cudaStream_t stream, size_t* failed) {
  for (size_t i = 0; i < count; ++i) {
    const Block& b = blocks[i];
    if (b.width == 0 || b.height == 0) continue;
    cudaError_t err = cudaMemcpy2DAsync(b.dst, b.dpitch, b.src, b.spitch,
                                        b.width, b.height, cudaMemcpyDefault,
                                        stream);
    if (err != cudaSuccess) {
      if (failed != nullptr) *failed = i;
      return err;
    }
  }
  return cudaSuccess;
}

// Every block one 2-D op (depth 1) of one cudaMemcpy3DBatchAsync, with the
// attributes of batch() above. Pointer operands count in bytes (element size
// 1): rowLength is the pitch, layerHeight the rows.
inline cudaError_t batch_3d(const Block* blocks, size_t count,
                            bool prefer_overlap, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  std::vector<cudaMemcpy3DBatchOp> ops;
  ops.reserve(count);
  for (size_t i = 0; i < count; ++i) {
    const Block& b = blocks[i];
    if (b.width == 0 || b.height == 0) continue;
    cudaMemcpy3DBatchOp op;
    memset(&op, 0, sizeof(op));
    op.src.type = cudaMemcpyOperandTypePointer;
    op.src.op.ptr.ptr = const_cast<void*>(b.src);
    op.src.op.ptr.rowLength = b.spitch;
    op.src.op.ptr.layerHeight = b.height;
    op.dst.type = cudaMemcpyOperandTypePointer;
    op.dst.op.ptr.ptr = b.dst;
    op.dst.op.ptr.rowLength = b.dpitch;
    op.dst.op.ptr.layerHeight = b.height;
    op.extent.width = b.width;
    op.extent.height = b.height;
    op.extent.depth = 1;
    op.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    op.flags = prefer_overlap ? cudaMemcpyFlagPreferOverlapWithCompute : 0;
    ops.push_back(op);
  }
  if (ops.empty()) return cudaSuccess;
#if CUDART_VERSION >= 13000
  return cudaMemcpy3DBatchAsync(ops.size(), ops.data(), 0, stream);
#else
  size_t fail_idx = 0;
  return cudaMemcpy3DBatchAsync(ops.size(), ops.data(), &fail_idx, 0, stream);
#endif
#else
  (void)blocks; (void)count; (void)prefer_overlap; (void)stream;
  return cudaErrorNotSupported;
#endif
}

}  // namespace torch_ce_copy
