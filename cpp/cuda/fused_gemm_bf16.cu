// The fused GEMM on bf16 (one instantiation per file: they compile in parallel).
#include "cuda/fused_gemm_kernel.cuh"

namespace jo::cuda::fused_kernel {

Status PrepareBF16(const ErrorContext& ctx) { return PrepareAs<cutlass::bfloat16_t>(ctx); }

Status LaunchBF16(const FusedGemmArgs& args, const fused::TileOrder& order, int32_t sm_count,
                  cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchAs<cutlass::bfloat16_t>(args, order, sm_count, stream, ctx);
}

}  // namespace jo::cuda::fused_kernel
