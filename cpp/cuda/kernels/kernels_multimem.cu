// The multimem kernels (kernel_body.h: McStore, McReduce), compiled for sm_90
// and compute_90 only (cpp/cuda/CMakeLists.txt): multimem needs sm_90, not the
// arch-specific sm_90a, and compute_90 PTX is what a newer GPU (sm_100, ...)
// JIT-compiles — a variant without multimem does not exist in the binary.
#include <type_traits>

#include "cuda/kernels/device_ops.cuh"
#include "cuda/kernels/kernel_table.h"

namespace jo::cuda::kernel {
namespace {

template <template <Elem, int> class Body, Elem kElem>
const void* Pick(int bytes) {
  switch (bytes) {
    case 16:
      return reinterpret_cast<const void*>(&Kernel<Body<kElem, 16>>);
    case 8:
      return reinterpret_cast<const void*>(&Kernel<Body<kElem, 8>>);
    case 4:
      return reinterpret_cast<const void*>(&Kernel<Body<kElem, 4>>);
  }
  return nullptr;
}

template <template <Elem, int> class Body>
const void* For(Elem elem, int bytes) {
  switch (elem) {
    case Elem::kF32:
      return Pick<Body, Elem::kF32>(bytes);
    case Elem::kBF16:
      return Pick<Body, Elem::kBF16>(bytes);
    case Elem::kF16:
      return Pick<Body, Elem::kF16>(bytes);
    case Elem::kF8:  // stored as bits only (kernel_body.h)
      if constexpr (std::is_same_v<Body<Elem::kF8, 4>, McStoreBody<Elem::kF8, 4>>)
        return Pick<Body, Elem::kF8>(bytes);
      return nullptr;
  }
  return nullptr;
}

}  // namespace

const void* McStoreKernel(Elem elem, int bytes) { return For<McStoreBody>(elem, bytes); }
const void* McReduceKernel(Elem elem, int bytes) { return For<McReduceBody>(elem, bytes); }

}  // namespace jo::cuda::kernel
