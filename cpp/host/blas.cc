#include "host/blas.h"

#include <cblas.h>

namespace jo::host {

void Sgemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* d, int64_t ldd) {
  scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<blasint>(m),
                    static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
                    static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, d,
                    static_cast<blasint>(ldd));
}

void ConfigureBlas() { scipy_openblas_set_num_threads(1); }

const char* BlasName() { return "scipy-openblas32 sgemm"; }

}  // namespace jo::host
