// Conversion of every dtype of core/kinds.h (JO_DTYPES) to and from f32, for
// whatever computes on the host in f32 (the host executor, the CUDA fake):
// every GEMM and reduction in f32 (round-to-nearest-even on the way back, as
// the accelerators do). Every value of each narrower dtype is exact in f32.
#pragma once

#include <cstdint>

#include "core/program.h"

namespace jo {

float LoadElement(DType dtype, const void* base, int64_t index);
void StoreElement(DType dtype, void* base, int64_t index, float value);

// Row-major block (rows x cols, leading dim ld) <-> contiguous f32.
void ToF32(DType dtype, const void* src, int64_t ld, int64_t rows, int64_t cols, float* dst);
void FromF32(DType dtype, const float* src, int64_t rows, int64_t cols, void* dst, int64_t ld);

}  // namespace jo
