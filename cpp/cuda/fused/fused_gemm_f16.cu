// The fused GEMM on f16 (one instantiation per file: they compile in parallel).
#include "cuda/fused/fused_gemm_kernel.cuh"

JO_FUSED_GEMM_INSTANCE(F16, cutlass::half_t)
