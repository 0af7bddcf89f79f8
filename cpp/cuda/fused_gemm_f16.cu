// The fused GEMM on f16 (one instantiation per file: they compile in parallel).
#include "cuda/fused_gemm_kernel.cuh"

namespace jo::cuda::fused_kernel {

Status PrepareF16(const ErrorContext& ctx) { return PrepareAs<cutlass::half_t>(ctx); }

Status LaunchF16(const FusedGemmArgs& args, const fused::TileOrder& order, int32_t sm_count,
                 cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchAs<cutlass::half_t>(args, order, sm_count, stream, ctx);
}

}  // namespace jo::cuda::fused_kernel
