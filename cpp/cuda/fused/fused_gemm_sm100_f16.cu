// The fused GEMM on sm_100a, f16 (one instantiation per file: they compile in parallel).
#include "cuda/fused/fused_gemm_kernel_sm100.cuh"

JO_FUSED_GEMM_SM100_INSTANCE(F16)
