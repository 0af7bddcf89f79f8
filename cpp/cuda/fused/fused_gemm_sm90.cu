// The sm_90a fused GEMM's 16-bit instantiations, one line per element type. A kernel family
// per file, not one instantiation per file: a file's fixed cost (CUTLASS's headers through
// both front ends and the host compile) is most of an instantiation's, so one more line costs
// about a quarter of one more file (nvcc --time).
#include "cuda/fused/fused_gemm_kernel.cuh"

JO_FUSED_GEMM_INSTANCE(BF16, cutlass::bfloat16_t)
JO_FUSED_GEMM_INSTANCE(F16, cutlass::half_t)
