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

// An e8m0 block scale (OCP MX v1.0, §5.4.1: 2^(e - 127), 0xff NaN) as f32: exact
// (2^-127 is a float32 subnormal).
float E8m0ToF32(uint8_t bits);
// Multiplies a contiguous f32 block (rows x cols) in place by its block scales:
// element (i, j) by the e8m0 scale at scales[i * ld + j / kScaleBlock] (a's
// blocks run along its rows) or, `along_rows`, at scales[(i / kScaleBlock) *
// ld + j] (w's run down its columns). Exact wherever f32 holds the product.
void ApplyBlockScales(float* block, int64_t rows, int64_t cols, const uint8_t* scales, int64_t ld,
                      bool along_rows);

}  // namespace jo
