// The host-side parts of kernels.h shared by the GPU build and the fake build.
#include <cstdint>

#include "cuda/kernels.h"

namespace jo::cuda {

bool MulticastBlockOk(const BlockArgs& a) {
  if (a.dtype == DType::kF32) return true;
  const auto even = [](int64_t v) { return v % 2 == 0; };
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; };
  return even(a.n) && even(a.src_ld) && even(a.dst_ld) && even(a.src_batch_stride) &&
         even(a.dst_batch_stride) && aligned(a.src) && aligned(a.dst);
}

}  // namespace jo::cuda
