// Device kernels of the CUDA executor (see kernels.h). Skeleton: `Config` holds the launch
// geometry, `Globals` the runtime arguments, one role function per kernel, one launcher each.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda/kernels.h"

namespace jo::cuda {
namespace {

struct Config {
  static constexpr int kThreads = 256;
  static constexpr int64_t kMaxBlocks = 1024;  // grid-stride beyond this
};

struct Globals {
  void* dst;
  const void* src;
  int64_t batch, m, n;  // n counts elements (AddBlock) or element pairs (16-bit multimem)
  int64_t s_bs, s_ld, d_bs, d_ld;
};

template <typename T>
__device__ float ToFloat(T v);
template <>
__device__ float ToFloat<float>(float v) {
  return v;
}
template <>
__device__ float ToFloat<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ float ToFloat<__half>(__half v) {
  return __half2float(v);
}
template <typename T>
__device__ T FromFloat(float v);
template <>
__device__ float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __half FromFloat<__half>(float v) {
  return __float2half_rn(v);
}

// Element `i` of the block -> (source offset, destination offset).
__device__ inline void Locate(const Globals& g, int64_t i, int64_t* s, int64_t* d) {
  const int64_t j = i % g.n;
  const int64_t row = (i / g.n) % g.m;
  const int64_t b = i / (g.n * g.m);
  *s = b * g.s_bs + row * g.s_ld + j;
  *d = b * g.d_bs + row * g.d_ld + j;
}

template <typename T>
__global__ void __launch_bounds__(Config::kThreads) AddBlockKernel(Globals g) {
  const int64_t total = g.batch * g.m * g.n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t s, d;
    Locate(g, i, &s, &d);
    T* dst = static_cast<T*>(g.dst);
    const T* src = static_cast<const T*>(g.src);
    dst[d] = FromFloat<T>(ToFloat<T>(dst[d]) + ToFloat<T>(src[s]));
  }
}

// Multicast role functions. `Word` is what one multimem instruction moves:
// float (f32) or a packed pair (bf16x2 / f16x2) as uint32. Strides are in words.
enum class McType { kF32, kBF16x2, kF16x2 };

template <McType kType>
__device__ inline void McStoreWord(void* mc, uint32_t bits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (kType == McType::kF32)
    asm volatile("multimem.st.relaxed.sys.global.f32 [%0], %1;" ::"l"(mc),
                 "f"(__uint_as_float(bits))
                 : "memory");
  else if constexpr (kType == McType::kBF16x2)
    asm volatile("multimem.st.relaxed.sys.global.bf16x2 [%0], %1;" ::"l"(mc), "r"(bits) : "memory");
  else
    asm volatile("multimem.st.relaxed.sys.global.f16x2 [%0], %1;" ::"l"(mc), "r"(bits) : "memory");
#else
  (void)mc;
  (void)bits;
  __trap();  // unreachable: the launcher refuses devices below sm_90
#endif
}

template <McType kType>
__device__ inline uint32_t McLoadReduceWord(const void* mc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t bits;
  if constexpr (kType == McType::kF32) {
    float v;
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.f32 %0, [%1];"
                 : "=f"(v)
                 : "l"(mc)
                 : "memory");
    bits = __float_as_uint(v);
  } else if constexpr (kType == McType::kBF16x2) {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.bf16x2 %0, [%1];"
                 : "=r"(bits)
                 : "l"(mc)
                 : "memory");
  } else {
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.f16x2 %0, [%1];"
                 : "=r"(bits)
                 : "l"(mc)
                 : "memory");
  }
  return bits;
#else
  (void)mc;
  __trap();
  return 0;
#endif
}

template <McType kType>
__global__ void __launch_bounds__(Config::kThreads) McStoreKernel(Globals g) {
  const int64_t total = g.batch * g.m * g.n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t s, d;
    Locate(g, i, &s, &d);
    McStoreWord<kType>(static_cast<uint32_t*>(g.dst) + d, static_cast<const uint32_t*>(g.src)[s]);
  }
}

template <McType kType>
__global__ void __launch_bounds__(Config::kThreads) McReduceKernel(Globals g) {
  const int64_t total = g.batch * g.m * g.n;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t s, d;
    Locate(g, i, &s, &d);
    static_cast<uint32_t*>(g.dst)[d] =
        McLoadReduceWord<kType>(static_cast<const uint32_t*>(g.src) + s);
  }
}

unsigned Blocks(int64_t total) {
  int64_t blocks = (total + Config::kThreads - 1) / Config::kThreads;
  if (blocks > Config::kMaxBlocks) blocks = Config::kMaxBlocks;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks);
}

Globals MakeGlobals(const BlockArgs& a, int64_t words_per_elem_div) {
  // words_per_elem_div = 2 packs bf16/f16 pairs into one 32-bit word.
  return Globals{a.dst,
                 a.src,
                 a.batch,
                 a.m,
                 a.n / words_per_elem_div,
                 a.src_batch_stride / words_per_elem_div,
                 a.src_ld / words_per_elem_div,
                 a.dst_batch_stride / words_per_elem_div,
                 a.dst_ld / words_per_elem_div};
}

Status CheckMulticastDevice(const char* what, const BlockArgs& a, const ErrorContext& ctx) {
  int device = 0, major = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9)
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": " + what + " needs an sm_90 (Hopper) or newer GPU; device " +
                      std::to_string(device) + " is sm_" + std::to_string(major) + "x");
  if (!MulticastBlockOk(a))
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": " + what +
                      " on 16-bit data needs an even row width, even "
                      "strides and 4-byte aligned addresses (multimem works on element pairs); use "
                      "transport='p2p' or 'nccl' for this shape");
  return OkStatus();
}

Status LaunchMc(const char* what, const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx,
                void (*f32)(Globals), void (*bf16)(Globals), void (*f16)(Globals)) {
  JO_CHECK(CheckMulticastDevice(what, a, ctx));
  const bool pairs = a.dtype != DType::kF32;
  const Globals g = MakeGlobals(a, pairs ? 2 : 1);
  void (*kernel)(Globals) = a.dtype == DType::kF32 ? f32 : a.dtype == DType::kBF16 ? bf16 : f16;
  kernel<<<Blocks(g.batch * g.m * g.n), Config::kThreads, 0, stream>>>(g);
  JO_CUDA_CHECK(&ctx, cudaGetLastError());
  return OkStatus();
}

}  // namespace

Status LaunchAddBlock(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  const Globals g = MakeGlobals(a, 1);
  const unsigned blocks = Blocks(g.batch * g.m * g.n);
  switch (a.dtype) {
    case DType::kF32:
      AddBlockKernel<float><<<blocks, Config::kThreads, 0, stream>>>(g);
      break;
    case DType::kBF16:
      AddBlockKernel<__nv_bfloat16><<<blocks, Config::kThreads, 0, stream>>>(g);
      break;
    case DType::kF16:
      AddBlockKernel<__half><<<blocks, Config::kThreads, 0, stream>>>(g);
      break;
  }
  JO_CUDA_CHECK(&ctx, cudaGetLastError());
  return OkStatus();
}

Status LaunchMcStore(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchMc("multicast store (multimem.st)", a, stream, ctx, McStoreKernel<McType::kF32>,
                  McStoreKernel<McType::kBF16x2>, McStoreKernel<McType::kF16x2>);
}

Status LaunchMcReduce(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchMc("multicast load-reduce (multimem.ld_reduce)", a, stream, ctx,
                  McReduceKernel<McType::kF32>, McReduceKernel<McType::kBF16x2>,
                  McReduceKernel<McType::kF16x2>);
}

const char* KernelsDescription() {
  return "sm_80 (add), sm_90a (add, multimem.st, multimem.ld_reduce)";
}

}  // namespace jo::cuda
