// What every thread of the executor's kernels does: ONE source, compiled by
// nvcc for the GPU (kernels.cu, kernels_multimem.cu) and by the host compiler
// for the fake (fake/fake_kernels.cc, which runs it for every thread of the
// grid). The index math, the access widths and the offsets below therefore
// run in CI exactly as they run on a GPU.
//
// A kernel walks a batched-strided block (batch x rows x cols) in ACCESSES of
// `Body::kBytes` bytes (16, 8, 4 or 2): the launcher (kernels_common.cc) has
// chosen the widest width every address divides and expressed the block in
// accesses. Blocks cover batches (z) and rows (y) grid-stride, threads cover
// the accesses of a row (x) grid-stride: no division per element.
//
// What only a GPU has is a call on `ops`, the one seam between the two builds:
//   Load / Store            a plain global access of kBytes (one vector instruction)
//   ToFloat / FromFloat     f32 / bf16 / f16 <-> f32 (round to nearest even)
//   MultimemStore           multimem.st         through a multicast address
//   MultimemLoadReduce      multimem.ld_reduce  through a multicast address (.acc::f32)
//   FenceProxyAlias         fence.proxy.alias   (multicast vs unicast aliases of one memory)
//   FenceReleaseSys         fence.acq_rel.sys
// DeviceOps (device_ops.cuh) is inline PTX; FakeOps (fake/fake_kernels.cc)
// models each on the host.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JO_KERNEL_FN __host__ __device__ __forceinline__
#else
#define JO_KERNEL_FN inline
#endif

namespace jo::cuda::kernel {

// Threads per block of every kernel (one dimension).
inline constexpr int kThreads = 128;

// The element type of a block. Multimem works on element pairs for the
// 16-bit types (.bf16x2 / .f16x2), so their multimem accesses are >= 4 bytes.
// kF8 is either fp8 format, only ever moved as bits (an all-gather's McStore
// of fp8 shards, through the integer .b32 / .b64 forms): no kernel adds or
// reduces fp8.
enum class Elem : int { kF32 = 0, kBF16 = 1, kF16 = 2, kF8 = 3 };

JO_KERNEL_FN constexpr int ElemBytes(Elem e) {
  return e == Elem::kF32 ? 4 : e == Elem::kF8 ? 1 : 2;
}

// One access: kBytes / 4 32-bit words (a 2-byte access uses the low half of
// word[0]). NVIDIA GPUs are little-endian (CUDA Programming Guide, "Compute
// Capabilities"): element i of a word holding two 16-bit elements is its
// low half for i = 0.
template <int kBytes>
struct Vec {
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "access width");
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  uint32_t word[kWords];
};

// The bits of element `i` of an access (zero-extended for 16-bit elements).
template <Elem kElem, int kBytes>
JO_KERNEL_FN uint32_t GetLane(const Vec<kBytes>& v, int i) {
  if constexpr (kElem == Elem::kF32) {
    return v.word[i];
  } else {
    return (v.word[i / 2] >> (16 * (i % 2))) & 0xffffu;
  }
}

template <Elem kElem, int kBytes>
JO_KERNEL_FN void SetLane(Vec<kBytes>* v, int i, uint32_t bits) {
  if constexpr (kElem == Elem::kF32) {
    v->word[i] = bits;
  } else {
    const int shift = 16 * (i % 2);
    v->word[i / 2] = (v->word[i / 2] & ~(0xffffu << shift)) | ((bits & 0xffffu) << shift);
  }
}

// Where one thread is: blockIdx, gridDim, threadIdx.x and blockDim.x on a GPU.
struct Thread {
  uint32_t block_x, block_y, block_z;
  uint32_t grid_x, grid_y, grid_z;
  uint32_t thread, threads;
};

// A batched-strided block in accesses. `dst` and `src` point at the first
// access; strides and leading dims count accesses.
struct Geometry {
  void* dst;
  const void* src;
  int64_t batch, rows, cols;
  int64_t src_batch_stride, src_ld;
  int64_t dst_batch_stride, dst_ld;
  // The SMs the grid is sized to (0: the whole device). The kernel does not read it: the
  // launch states it, for the fake's model of the SMs a persistent kernel leaves free.
  int32_t sms = 0;
};

// The loop every kernel runs: each access of the block exactly once, by the
// thread whose (z, y, x) coordinates it falls on grid-stride.
template <class Body, class Ops>
JO_KERNEL_FN void RunThread(Ops& ops, const Geometry& g, const Thread& t) {
  constexpr int64_t kBytes = Body::kBytes;
  Body::Begin(ops);
  char* const dst = static_cast<char*>(g.dst);
  const char* const src = static_cast<const char*>(g.src);
  const int64_t first = static_cast<int64_t>(t.block_x) * t.threads + t.thread;
  const int64_t step = static_cast<int64_t>(t.grid_x) * t.threads;
  for (int64_t b = t.block_z; b < g.batch; b += t.grid_z) {
    for (int64_t r = t.block_y; r < g.rows; r += t.grid_y) {
      char* const d = dst + (b * g.dst_batch_stride + r * g.dst_ld) * kBytes;
      const char* const s = src + (b * g.src_batch_stride + r * g.src_ld) * kBytes;
      for (int64_t j = first; j < g.cols; j += step)
        Body::Access(ops, d + j * kBytes, s + j * kBytes);
    }
  }
  Body::End(ops);
}

// AddBlock: d += s, elementwise in f32 (the second accumulator of a
// bidirectional reduce-scatter).
template <Elem kElem, int kAccessBytes>
struct AddBody {
  static constexpr int kBytes = kAccessBytes;
  static_assert(kBytes >= ElemBytes(kElem), "an access holds whole elements");
  template <class Ops>
  JO_KERNEL_FN static void Begin(Ops&) {}
  template <class Ops>
  JO_KERNEL_FN static void End(Ops&) {}
  template <class Ops>
  JO_KERNEL_FN static void Access(Ops& ops, char* d, const char* s) {
    Vec<kBytes> dv = ops.template Load<kBytes>(d);
    const Vec<kBytes> sv = ops.template Load<kBytes>(s);
    for (int i = 0; i < kBytes / ElemBytes(kElem); ++i) {
      const float sum = ops.template ToFloat<kElem>(GetLane<kElem>(dv, i)) +
                        ops.template ToFloat<kElem>(GetLane<kElem>(sv, i));
      SetLane<kElem>(&dv, i, ops.template FromFloat<kElem>(sum));
    }
    ops.template Store<kBytes>(d, dv);
  }
};

// McStore: the own block -> every rank's workspace through the multicast
// address (d). Then, per thread, the release the consumers' flag relies on:
// a proxy fence (the peers read these bytes through their unicast mapping, an
// alias of the multicast one) and a system-scope fence, so that every store
// of the thread is performed at system scope before the kernel completes and
// the stream's fenced flag write (cuStreamWriteValue32) follows it.
template <Elem kElem, int kAccessBytes>
struct McStoreBody {
  static constexpr int kBytes = kAccessBytes;
  static_assert(kBytes >= 4, "multimem moves whole 32-bit words (element pairs for 16-bit types)");
  template <class Ops>
  JO_KERNEL_FN static void Begin(Ops&) {}
  template <class Ops>
  JO_KERNEL_FN static void End(Ops& ops) {
    ops.FenceProxyAlias();
    ops.FenceReleaseSys();
  }
  template <class Ops>
  JO_KERNEL_FN static void Access(Ops& ops, char* mc, const char* s) {
    ops.template MultimemStore<kElem, kBytes>(mc, ops.template Load<kBytes>(s));
  }
};

// McReduce: d <- the sum over every rank's workspace, read through the
// multicast address (s). The partials were written through unicast mappings
// (cuBLASLt, before the flags this kernel's stream waited for): a proxy fence
// first, as between any unicast and multicast access of the same memory.
template <Elem kElem, int kAccessBytes>
struct McReduceBody {
  static constexpr int kBytes = kAccessBytes;
  static_assert(kBytes >= 4, "multimem moves whole 32-bit words (element pairs for 16-bit types)");
  template <class Ops>
  JO_KERNEL_FN static void Begin(Ops& ops) {
    ops.FenceProxyAlias();
  }
  template <class Ops>
  JO_KERNEL_FN static void End(Ops&) {}
  template <class Ops>
  JO_KERNEL_FN static void Access(Ops& ops, char* d, const char* mc) {
    ops.template Store<kBytes>(d, ops.template MultimemLoadReduce<kElem, kBytes>(mc));
  }
};

// ---- Reduce: d <- the sum of N blocks, in one pass ----

// The most blocks one reduction sums: their addresses are the kernel's
// parameters (core/program.h kMaxReduceSources, which kernels_common.cc holds
// equal to it). 64 sources of 24 bytes keep the parameters far below the
// 4 KB CUDA allows every kernel.
inline constexpr int kMaxReduceSources = 64;

// One source of a reduction, in accesses.
struct ReduceSource {
  const void* ptr;
  int64_t batch_stride, ld;
};

// A batched-strided destination block and its `count` sources, all in
// accesses of the same width (the launcher picks one every address divides).
struct ReduceGeometry {
  void* dst;
  int64_t batch, rows, cols;
  int64_t dst_batch_stride, dst_ld;
  int32_t count;
  int32_t sms;  // as Geometry::sms
  ReduceSource src[kMaxReduceSources];
};

// Reduce: each access of d is the sum of the sources' accesses at the same
// (batch, row, column), in source order, accumulated in `Acc` (float: one
// rounding per add in float32) and rounded once to the element type. The
// accumulator is a parameter: FP8 GEMMs reduce 16-bit or float32 partials the
// same way.
template <Elem kElem, int kAccessBytes, class Acc = float>
struct ReduceBody {
  static constexpr int kBytes = kAccessBytes;
  static constexpr int kLanes = kBytes / ElemBytes(kElem);
  static_assert(kLanes >= 1 && kElem != Elem::kF8, "whole elements, never fp8 sums");
  template <class Ops>
  JO_KERNEL_FN static void Access(Ops& ops, const ReduceGeometry& g, char* d, int64_t b, int64_t r,
                                  int64_t j) {
    Acc sum[kLanes];
    for (int i = 0; i < kLanes; ++i) sum[i] = Acc(0);
    for (int32_t k = 0; k < g.count; ++k) {
      const ReduceSource& src = g.src[k];
      const Vec<kBytes> v = ops.template Load<kBytes>(
          static_cast<const char*>(src.ptr) + (b * src.batch_stride + r * src.ld + j) * kBytes);
      for (int i = 0; i < kLanes; ++i)
        sum[i] += static_cast<Acc>(ops.template ToFloat<kElem>(GetLane<kElem>(v, i)));
    }
    Vec<kBytes> out;
    for (int w = 0; w < Vec<kBytes>::kWords; ++w) out.word[w] = 0;
    for (int i = 0; i < kLanes; ++i)
      SetLane<kElem>(&out, i, ops.template FromFloat<kElem>(static_cast<float>(sum[i])));
    ops.template Store<kBytes>(d, out);
  }
};

// Every access of the destination exactly once, by the thread whose (z, y, x)
// coordinates it falls on grid-stride (as RunThread walks a block).
template <class Body, class Ops>
JO_KERNEL_FN void RunReduceThread(Ops& ops, const ReduceGeometry& g, const Thread& t) {
  constexpr int64_t kBytes = Body::kBytes;
  char* const dst = static_cast<char*>(g.dst);
  const int64_t first = static_cast<int64_t>(t.block_x) * t.threads + t.thread;
  const int64_t step = static_cast<int64_t>(t.grid_x) * t.threads;
  for (int64_t b = t.block_z; b < g.batch; b += t.grid_z)
    for (int64_t r = t.block_y; r < g.rows; r += t.grid_y) {
      char* const d = dst + (b * g.dst_batch_stride + r * g.dst_ld) * kBytes;
      for (int64_t j = first; j < g.cols; j += step) Body::Access(ops, g, d + j * kBytes, b, r, j);
    }
}

}  // namespace jo::cuda::kernel
