// The fused GEMM on e5m2 x e4m3 -> bf16 (one instantiation per file: they compile in parallel).
#include "cuda/fused/fused_gemm_fp8.cuh"

JO_FUSED_GEMM_FP8_INSTANCE(E5M2E4M3_BF16, cutlass::float_e5m2_t, cutlass::float_e4m3_t,
                           cutlass::bfloat16_t)
