// The sm_100a fused GEMM's instantiations, one line per configuration
// (fused_gemm_kernel_sm100.cuh; a family per file: fused_gemm_sm90.cu says why).
#include "cuda/fused/fused_gemm_kernel_sm100.cuh"

JO_FUSED_GEMM_SM100_INSTANCE(BF16)
JO_FUSED_GEMM_SM100_INSTANCE(F16)
