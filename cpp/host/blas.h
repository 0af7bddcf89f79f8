// GEMM through the real BLAS (scipy-openblas32's sgemm).
#pragma once

#include <cstdint>

namespace jo::host {

// Row-major d = alpha * a (m x k) @ b (k x n) + beta * d, f32, explicit leading dims.
void Sgemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* d, int64_t ldd);

// Keeps BLAS single-threaded: every device thread already runs its own GEMMs.
void ConfigureBlas();
const char* BlasName();

}  // namespace jo::host
