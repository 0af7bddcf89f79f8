// The fused GEMM on e4m3 x e4m3 -> f16 (one instantiation per file: they compile in parallel).
#include "cuda/fused/fused_gemm_fp8.cuh"

JO_FUSED_GEMM_FP8_INSTANCE(E4M3_F16, cutlass::float_e4m3_t, cutlass::float_e4m3_t, cutlass::half_t)
