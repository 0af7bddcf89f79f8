// The fused GEMM's host side (fused_gemm.h): argument checks, the tile order,
// the once-per-device preparation and the dispatch to an instantiation.
#include "cuda/fused/fused_gemm.h"

#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace jo::cuda {
namespace {

constexpr int64_t kMaxInt32 = 0x7fffffff;
constexpr int64_t kMaxTmaStrideBytes = int64_t{1} << 40;  // cuTensorMapEncodeTiled

Status Bad(const std::string& what) {
  return Status(Code::kInvalidArgument, "fused GEMM: " + what);
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

const char* OrderErrorText(fused::OrderError e) {
  switch (e) {
    case fused::OrderError::kOk:
      return "ok";
    case fused::OrderError::kBadBlocks:
      return "the row blocks are not valid (shards, chunks >= 1, shard_rows >= chunks, at most "
             "512 blocks)";
    case fused::OrderError::kBadSequence:
      return "the sequence must list every block exactly once";
    case fused::OrderError::kTooManyRuns:
      return "the tile order needs more runs than TileOrder::kMaxRuns (64); use fewer chunks";
    case fused::OrderError::kNotConsecutive:
      return "internal: the tiles of one key are not consecutive";
  }
  return "unknown";
}

// A row-major operand: its rows must be `cols` long, its strides TMA-encodable.
Status CheckMatrix(const char* name, const void* ptr, int64_t ld, int64_t batch_stride,
                   int64_t rows, int64_t cols, int64_t batch, int64_t elem) {
  const std::string n(name);
  if (ptr == nullptr) return Bad(n + " is null");
  if (!Aligned(ptr, 16)) return Bad(n + " must be 16-byte aligned (TMA)");
  if (ld < cols) return Bad("ld" + n + " (" + std::to_string(ld) + ") < its row length");
  if (ld * elem % 16 != 0 || ld * elem >= kMaxTmaStrideBytes)
    return Bad("ld" + n + " must be a multiple of 16 bytes below 2^40 (TMA)");
  if (batch > 1 && (batch_stride * elem % 16 != 0 || batch_stride * elem >= kMaxTmaStrideBytes ||
                    batch_stride < rows * ld))
    return Bad(n + "'s batch stride must be >= rows x ld" + n +
               " and a multiple of 16 bytes below 2^40 (TMA)");
  return OkStatus();
}

std::mutex g_prepared_mu;
std::map<std::pair<int, DType>, bool>& Prepared() {
  static auto* prepared = new std::map<std::pair<int, DType>, bool>();
  return *prepared;
}

}  // namespace

Status CheckFusedGemm(FusedGemmArgs* args) {
  const FusedGemmArgs& a = *args;
  if (!Row(a.dtype).fused)
    return Bad(std::string("dtype ") + DTypeName(a.dtype) +
               " is not one the fused GEMM is compiled for (" +
               kinds::Names(kDTypes, [](const DTypeRow& d) { return d.fused; }) + ")");
  if (a.batch < 1 || a.m < 1 || a.n < 1 || a.k < 1 || a.batch > kMaxInt32 || a.m > kMaxInt32 ||
      a.n > kMaxInt32 || a.k > kMaxInt32)
    return Bad("batch, m, n and k must be in [1, 2^31)");
  if (!a.blocks.valid() || a.blocks.rows() != a.m)
    return Bad("the row blocks (" + std::to_string(a.blocks.shards) + " shards of " +
               std::to_string(a.blocks.shard_rows) + " rows in " + std::to_string(a.blocks.chunks) +
               " chunks) must cover the m = " + std::to_string(a.m) +
               " rows, with at least one row per chunk");
  const int64_t elem = DTypeSize(a.dtype);
  JO_CHECK(CheckMatrix("a", a.a, a.lda, a.a_batch_stride, a.m, a.k, a.batch, elem));
  JO_CHECK(CheckMatrix("b", a.b, a.ldb, 0, a.k, a.n, 1, elem));
  JO_CHECK(CheckMatrix("d", a.d, a.ldd, a.d_batch_stride, a.m, a.n, a.batch, elem));
  if (a.wait_flags != nullptr) {
    if (!Aligned(a.wait_flags, 4)) return Bad("wait_flags must be 4-byte aligned");
    if (a.fault == nullptr || !Aligned(a.fault, 4))
      return Bad("waiting needs a fault record (device memory, 4-byte aligned)");
    if (a.timeout_ns <= 0) return Bad("waiting needs timeout_ns > 0: no wait may be unbounded");
    if (a.ready_shard < -1 || a.ready_shard >= a.blocks.shards)
      return Bad("ready_shard must be -1 or a shard index");
  }
  if (a.release_flags != nullptr) {
    if (!Aligned(a.release_flags, 4)) return Bad("release_flags must be 4-byte aligned");
    if (a.counters == nullptr || !Aligned(a.counters, 4))
      return Bad("releasing needs counters of Launch::CounterBytes(blocks) (4-byte aligned)");
  }
  if (a.sm_count < 2)
    return Bad("sm_count must be >= 2: the SMs the kernel holds, in clusters of 2");
  if (a.sequence == nullptr) return Bad("no block sequence (arrival or departure order)");
  const fused::OrderError e = fused::MakeTileOrder(
      fused::Tiling{a.blocks, fused::kTileRows}, a.sequence, a.blocks.count(), a.key, &args->order);
  if (e != fused::OrderError::kOk) return Bad(OrderErrorText(e));
  return OkStatus();
}

Status PrepareFusedGemm(DType dtype, const ErrorContext& ctx) {
  if (!Row(dtype).fused)
    return Bad(std::string("dtype ") + DTypeName(dtype) +
               " is not one the fused GEMM is compiled for (" +
               kinds::Names(kDTypes, [](const DTypeRow& d) { return d.fused; }) + ")");
  int device = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(g_prepared_mu);
    if (Prepared().count({device, dtype}) != 0) return OkStatus();
  }
  const bool bf16 = dtype == DType::kBF16;
  const void* kernel = bf16 ? fused_kernel::FunctionBF16() : fused_kernel::FunctionF16();
  // It references the kernel: with lazy loading, that loads it here, at set-up.
  cudaFuncAttributes attr{};
  const cudaError_t code = cudaFuncGetAttributes(&attr, kernel);
  if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    int major = 0, minor = 0;
    (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    (void)cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    return Status(Code::kInvalidArgument, ctx.Describe() +
                                              ": the fused GEMM is sm_90a code and runs on compute "
                                              "capability 9.0 GPUs only (H100, H200, GH200); GPU " +
                                              std::to_string(device) + " is " +
                                              std::to_string(major) + "." + std::to_string(minor) +
                                              ": take the chunked path (jo.config(fused=False))");
  }
  if (code != cudaSuccess) return CudaFailure(code, "cudaFuncGetAttributes", &ctx);
  JO_CUDA_CHECK(&ctx, cudaFuncSetAttribute(
                          kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          bf16 ? fused_kernel::SharedBytesBF16() : fused_kernel::SharedBytesF16()));
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  Prepared()[{device, dtype}] = true;
  return OkStatus();
}

void ForgetFusedGemmPreparation() {
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  Prepared().clear();
}

Status LaunchFusedGemm(const FusedGemmArgs& args, cudaStream_t stream, const ErrorContext& ctx) {
  int device = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(g_prepared_mu);
    if (Prepared().count({device, args.dtype}) == 0)
      return Status(Code::kInternal, ctx.Describe() +
                                         ": the fused GEMM was not prepared on device " +
                                         std::to_string(device) + " (PrepareFusedGemm)");
  }
  if (args.dtype == DType::kBF16) return fused_kernel::LaunchBF16(args, stream, ctx);
  return fused_kernel::LaunchF16(args, stream, ctx);
}

}  // namespace jo::cuda
