// DeviceOps: the GPU side of the seam of kernel_body.h — each operation one
// instruction (or inline PTX), and the __global__ entry point every kernel is.
// The host-side fake has the same operations in fake/fake_kernels.cc.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/kernels/kernel_body.h"

namespace jo::cuda::kernel {

struct DeviceOps {
  template <int kBytes>
  __device__ __forceinline__ Vec<kBytes> Load(const void* p) const {
    Vec<kBytes> v;
    if constexpr (kBytes == 16) {
      const uint4 t = *static_cast<const uint4*>(p);
      v.word[0] = t.x, v.word[1] = t.y, v.word[2] = t.z, v.word[3] = t.w;
    } else if constexpr (kBytes == 8) {
      const uint2 t = *static_cast<const uint2*>(p);
      v.word[0] = t.x, v.word[1] = t.y;
    } else if constexpr (kBytes == 4) {
      v.word[0] = *static_cast<const uint32_t*>(p);
    } else {
      v.word[0] = *static_cast<const uint16_t*>(p);
    }
    return v;
  }

  template <int kBytes>
  __device__ __forceinline__ void Store(void* p, const Vec<kBytes>& v) const {
    if constexpr (kBytes == 16) {
      *static_cast<uint4*>(p) = make_uint4(v.word[0], v.word[1], v.word[2], v.word[3]);
    } else if constexpr (kBytes == 8) {
      *static_cast<uint2*>(p) = make_uint2(v.word[0], v.word[1]);
    } else if constexpr (kBytes == 4) {
      *static_cast<uint32_t*>(p) = v.word[0];
    } else {
      *static_cast<uint16_t*>(p) = static_cast<uint16_t>(v.word[0]);
    }
  }

  template <Elem kElem>
  __device__ __forceinline__ float ToFloat(uint32_t bits) const {
    if constexpr (kElem == Elem::kF32) {
      return __uint_as_float(bits);
    } else if constexpr (kElem == Elem::kBF16) {
      return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(bits)));
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
  }

  template <Elem kElem>
  __device__ __forceinline__ uint32_t FromFloat(float value) const {
    if constexpr (kElem == Elem::kF32) {
      return __float_as_uint(value);
    } else if constexpr (kElem == Elem::kBF16) {
      return __bfloat16_as_ushort(__float2bfloat16_rn(value));
    } else {
      return __half_as_ushort(__float2half_rn(value));
    }
  }

  // multimem.* exist from sm_90 on (PTX ISA, "multimem.ld_reduce, multimem.st,
  // multimem.red"). The build compiles the multimem kernels for sm_90 and
  // compute_90 only, and the launcher refuses any variant compiled for less
  // (cudaFuncGetAttributes ptxVersion), so the __trap() below is never
  // reached; it is what the fake models when a test forces such a variant.
  template <Elem kElem, int kBytes>
  __device__ __forceinline__ void MultimemStore(void* mc, const Vec<kBytes>& v) const {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JO_MC_ST(type)                                                                           \
  if constexpr (kBytes == 16)                                                                    \
    asm volatile("multimem.st.relaxed.sys.global.v4." type " [%0], {%1, %2, %3, %4};" ::"l"(mc), \
                 "r"(v.word[0]), "r"(v.word[1]), "r"(v.word[2]), "r"(v.word[3])                  \
                 : "memory");                                                                    \
  else if constexpr (kBytes == 8)                                                                \
    asm volatile("multimem.st.relaxed.sys.global.v2." type " [%0], {%1, %2};" ::"l"(mc),         \
                 "r"(v.word[0]), "r"(v.word[1])                                                  \
                 : "memory");                                                                    \
  else                                                                                           \
    asm volatile("multimem.st.relaxed.sys.global." type " [%0], %1;" ::"l"(mc), "r"(v.word[0])   \
                 : "memory");
    if constexpr (kElem == Elem::kF8) {
      // Bits, not values: the integer forms (no vector qualifier: two .b64 for 16 bytes).
      if constexpr (kBytes == 4) {
        asm volatile("multimem.st.relaxed.sys.global.b32 [%0], %1;" ::"l"(mc), "r"(v.word[0])
                     : "memory");
      } else {
        for (int half = 0; half < kBytes / 8; ++half) {
          const unsigned long long bits =
              (static_cast<unsigned long long>(v.word[2 * half + 1]) << 32) | v.word[2 * half];
          asm volatile("multimem.st.relaxed.sys.global.b64 [%0], %1;" ::"l"(static_cast<char*>(mc) +
                                                                            8 * half),
                       "l"(bits)
                       : "memory");
        }
      }
    } else if constexpr (kElem == Elem::kF32) {
      JO_MC_ST("f32")
    } else if constexpr (kElem == Elem::kBF16) {
      JO_MC_ST("bf16x2")
    } else {
      JO_MC_ST("f16x2")
    }
#undef JO_MC_ST
#else
    (void)mc;
    (void)v;
    __trap();
#endif
  }

  template <Elem kElem, int kBytes>
  __device__ __forceinline__ Vec<kBytes> MultimemLoadReduce(const void* mc) const {
    Vec<kBytes> v;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JO_MC_LD(acc, type)                                                                     \
  if constexpr (kBytes == 16)                                                                   \
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add" acc ".v4." type                    \
                 " {%0, %1, %2, %3}, [%4];"                                                     \
                 : "=r"(v.word[0]), "=r"(v.word[1]), "=r"(v.word[2]), "=r"(v.word[3])           \
                 : "l"(mc)                                                                      \
                 : "memory");                                                                   \
  else if constexpr (kBytes == 8)                                                               \
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add" acc ".v2." type " {%0, %1}, [%2];" \
                 : "=r"(v.word[0]), "=r"(v.word[1])                                             \
                 : "l"(mc)                                                                      \
                 : "memory");                                                                   \
  else                                                                                          \
    asm volatile("multimem.ld_reduce.relaxed.sys.global.add" acc "." type " %0, [%1];"          \
                 : "=r"(v.word[0])                                                              \
                 : "l"(mc)                                                                      \
                 : "memory");
    if constexpr (kElem == Elem::kF32) {
      JO_MC_LD("", "f32")
    } else if constexpr (kElem == Elem::kBF16) {
      JO_MC_LD(".acc::f32", "bf16x2")
    } else {
      JO_MC_LD(".acc::f32", "f16x2")
    }
#undef JO_MC_LD
#else
    (void)mc;
    v.word[0] = 0;
    __trap();
#endif
    return v;
  }

  __device__ __forceinline__ void FenceProxyAlias() const {
    asm volatile("fence.proxy.alias;" ::: "memory");
  }
  __device__ __forceinline__ void FenceReleaseSys() const {
    asm volatile("fence.acq_rel.sys;" ::: "memory");
  }

  // The one-launch all-reduce's flags (allreduce_body.h): a release store and an acquire load at
  // system scope (PTX ISA, "ld", "st": .acquire / .release with .sys, sm_70+), a relaxed
  // system-scope store (the fault record, in page-locked host memory), a first-writer claim of
  // the rank's broken word (atomicCAS: the kernels of one GPU only, device scope), and the GPU's
  // nanosecond clock (PTX ISA, "Special Registers": %globaltimer).
  __device__ __forceinline__ uint64_t LoadAcquireSys(const uint64_t* p) const {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ __forceinline__ void StoreReleaseSys(uint64_t* p, uint64_t v) const {
    asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
  // The bounded flag wait's (flag_wait_body.h): 32-bit flags, acquire at system scope.
  __device__ __forceinline__ uint32_t LoadAcquireSys32(const uint32_t* p) const {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ __forceinline__ void StoreRelaxedSys(uint32_t* p, uint32_t v) const {
    asm volatile("st.relaxed.sys.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  }
  __device__ __forceinline__ bool Claim(uint32_t* word) const {
    return atomicCAS(word, 0u, 1u) == 0u;
  }
  // A wait that gave up (flag_wait_body.h): "Abort execution and generate an interrupt to the
  // host CPU" (PTX ISA, "trap"); the error is sticky, the context's later work never runs.
  __device__ __forceinline__ void Trap() const { __trap(); }
  __device__ __forceinline__ void FenceSys() const { __threadfence_system(); }
  __device__ __forceinline__ int64_t GlobalNs() const {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return static_cast<int64_t>(t);
  }
};

// Every kernel: one block-walking body, run by each thread with its coordinates.
template <class Body>
__global__ void __launch_bounds__(kThreads) Kernel(Geometry g) {
  DeviceOps ops;
  RunThread<Body>(ops, g,
                  Thread{blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z,
                         threadIdx.x, blockDim.x});
}

// The reduction kernel (ReduceBody): the same per-thread walk over the destination, its
// sources in the parameters.
template <class Body>
__global__ void __launch_bounds__(kThreads) ReduceEntry(ReduceGeometry g) {
  DeviceOps ops;
  RunReduceThread<Body>(ops, g,
                        Thread{blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z,
                               threadIdx.x, blockDim.x});
}

}  // namespace jo::cuda::kernel
