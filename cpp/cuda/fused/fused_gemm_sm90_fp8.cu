// The sm_90a fused GEMM's FP8 instantiations, one line per (x, w -> y) triple of kinds.h's
// JO_FUSED_FP8 rows (a family per file: fused_gemm_sm90.cu says why).
#include "cuda/fused/fused_gemm_fp8.cuh"

JO_FUSED_GEMM_FP8_INSTANCE(E4M3_BF16, cutlass::float_e4m3_t, cutlass::float_e4m3_t,
                           cutlass::bfloat16_t)
JO_FUSED_GEMM_FP8_INSTANCE(E4M3_F16, cutlass::float_e4m3_t, cutlass::float_e4m3_t, cutlass::half_t)
JO_FUSED_GEMM_FP8_INSTANCE(E4M3_F32, cutlass::float_e4m3_t, cutlass::float_e4m3_t, float)
JO_FUSED_GEMM_FP8_INSTANCE(E5M2E4M3_BF16, cutlass::float_e5m2_t, cutlass::float_e4m3_t,
                           cutlass::bfloat16_t)
