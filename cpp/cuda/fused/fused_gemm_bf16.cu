// The fused GEMM on bf16 (one instantiation per file: they compile in parallel).
#include "cuda/fused/fused_gemm_kernel.cuh"

JO_FUSED_GEMM_INSTANCE(BF16, cutlass::bfloat16_t)
