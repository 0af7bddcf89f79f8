// The AddBlock and Reduce kernels (kernel_body.h), compiled for sm_80 and sm_90 with
// compute_90 PTX for newer GPUs (cpp/cuda/CMakeLists.txt).
#include "cuda/kernels/device_ops.cuh"
#include "cuda/kernels/kernel_table.h"

namespace jo::cuda::kernel {
namespace {

template <Elem kElem>
const void* Add(int bytes) {
  switch (bytes) {
    case 16:
      return reinterpret_cast<const void*>(&Kernel<AddBody<kElem, 16>>);
    case 8:
      return reinterpret_cast<const void*>(&Kernel<AddBody<kElem, 8>>);
    case 4:
      return reinterpret_cast<const void*>(&Kernel<AddBody<kElem, 4>>);
    case 2:
      if constexpr (ElemBytes(kElem) == 2)
        return reinterpret_cast<const void*>(&Kernel<AddBody<kElem, 2>>);
      return nullptr;
  }
  return nullptr;
}

template <Elem kElem>
const void* Reduce(int bytes) {
  switch (bytes) {
    case 16:
      return reinterpret_cast<const void*>(&ReduceEntry<ReduceBody<kElem, 16>>);
    case 8:
      return reinterpret_cast<const void*>(&ReduceEntry<ReduceBody<kElem, 8>>);
    case 4:
      return reinterpret_cast<const void*>(&ReduceEntry<ReduceBody<kElem, 4>>);
    case 2:
      if constexpr (ElemBytes(kElem) == 2)
        return reinterpret_cast<const void*>(&ReduceEntry<ReduceBody<kElem, 2>>);
      return nullptr;
  }
  return nullptr;
}

}  // namespace

const void* ReduceKernel(Elem elem, int bytes) {
  switch (elem) {
    case Elem::kF32:
      return Reduce<Elem::kF32>(bytes);
    case Elem::kBF16:
      return Reduce<Elem::kBF16>(bytes);
    case Elem::kF16:
      return Reduce<Elem::kF16>(bytes);
    case Elem::kF8:  // nothing sums fp8 (kernel_body.h)
      return nullptr;
  }
  return nullptr;
}

const void* AddKernel(Elem elem, int bytes) {
  switch (elem) {
    case Elem::kF32:
      return Add<Elem::kF32>(bytes);
    case Elem::kBF16:
      return Add<Elem::kBF16>(bytes);
    case Elem::kF16:
      return Add<Elem::kF16>(bytes);
    case Elem::kF8:  // nothing adds fp8 (kernel_body.h)
      return nullptr;
  }
  return nullptr;
}

}  // namespace jo::cuda::kernel
