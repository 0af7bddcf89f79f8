// The fused GEMM's host side (fused_gemm.h): argument checks, the tile order,
// the once-per-device preparation and the dispatch to an instantiation.
#include "cuda/fused/fused_gemm.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>
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
using PreparedKey = std::tuple<int, DType, FusedKernel>;  // device, dtype, kernel
std::map<PreparedKey, bool>& Prepared() {
  static auto* prepared = new std::map<PreparedKey, bool>();
  return *prepared;
}

const char* KernelName(FusedKernel kernel) {
  switch (kernel) {
    case FusedKernel::kSm90:
      return "sm_90a";
    case FusedKernel::kSm100:
      return "sm_100a";
    case FusedKernel::kNone:
      break;
  }
  return "none";
}

// The kernel for (kernel, dtype), or null when it has no such instantiation.
const void* FunctionOf(FusedKernel kernel, DType dtype) {
  if (kernel == FusedKernel::kSm90)
    return dtype == DType::kBF16 ? fused_kernel::FunctionBF16() : fused_kernel::FunctionF16();
  if (kernel == FusedKernel::kSm100 && dtype == DType::kBF16)
    return fused_kernel::FunctionSm100BF16();
  return nullptr;
}

int SharedBytesOf(FusedKernel kernel, DType dtype) {
  if (kernel == FusedKernel::kSm100) return fused_kernel::SharedBytesSm100BF16();
  return dtype == DType::kBF16 ? fused_kernel::SharedBytesBF16() : fused_kernel::SharedBytesF16();
}

Status NotThisGpu(FusedKernel kernel, int device, int major, int minor, const ErrorContext& ctx) {
  return Status(Code::kInvalidArgument,
                ctx.Describe() +
                    ": the fused GEMM is sm_90a code for compute capability 9.0 "
                    "(H100, H200, GH200) and sm_100a code for 10.0 (B200, GB200; "
                    "bfloat16 only); GPU " +
                    std::to_string(device) + " is " + std::to_string(major) + "." +
                    std::to_string(minor) + " (the call was prepared for " + KernelName(kernel) +
                    "): take the chunked path (jo.config(fused=False))");
}

}  // namespace

FusedKernel FusedKernelFor(int cc_major, int cc_minor) {
  if (cc_major == 9 && cc_minor == 0) return FusedKernel::kSm90;
  if (cc_major == 10 && cc_minor == 0) return FusedKernel::kSm100;
  return FusedKernel::kNone;
}

int32_t MmaPairOf(FusedKernel kernel) {
  return kernel == FusedKernel::kSm100 ? fused_kernel::kSm100MmaPair : 1;
}

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
  if (a.kernel == FusedKernel::kSm100 && a.dtype != DType::kBF16)
    return Bad(std::string("the sm_100a kernel is compiled for bfloat16 only, not ") +
               DTypeName(a.dtype) + ": take the chunked path (jo.config(fused=False))");
  // The order is over the kernel's MMA tiles (sm100: two CTA tiles, fused_tiles.h CtaTileAt).
  const fused::OrderError e =
      fused::MakeTileOrder(fused::Tiling{a.blocks, MmaPairOf(a.kernel) * fused::kTileRows},
                           a.sequence, a.blocks.count(), a.key, &args->order);
  if (e != fused::OrderError::kOk) return Bad(OrderErrorText(e));
  return OkStatus();
}

Status PrepareFusedGemm(DType dtype, FusedKernel kernel, const ErrorContext& ctx) {
  if (!Row(dtype).fused)
    return Bad(std::string("dtype ") + DTypeName(dtype) +
               " is not one the fused GEMM is compiled for (" +
               kinds::Names(kDTypes, [](const DTypeRow& d) { return d.fused; }) + ")");
  int device = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(g_prepared_mu);
    if (Prepared().count({device, dtype, kernel}) != 0) return OkStatus();
  }
  int major = 0, minor = 0;
  JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  const void* function = FunctionOf(kernel, dtype);
  if (kernel != FusedKernelFor(major, minor) || function == nullptr)
    return NotThisGpu(kernel, device, major, minor, ctx);
  // It references the kernel: with lazy loading, that loads it here, at set-up.
  cudaFuncAttributes attr{};
  const cudaError_t code = cudaFuncGetAttributes(&attr, function);
  if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    return NotThisGpu(kernel, device, major, minor, ctx);
  }
  if (code != cudaSuccess) return CudaFailure(code, "cudaFuncGetAttributes", &ctx);
  JO_CUDA_CHECK(&ctx, cudaFuncSetAttribute(function, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           SharedBytesOf(kernel, dtype)));
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  Prepared()[{device, dtype, kernel}] = true;
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
    if (Prepared().count({device, args.dtype, args.kernel}) == 0)
      return Status(Code::kInternal, ctx.Describe() +
                                         ": the fused GEMM was not prepared on device " +
                                         std::to_string(device) + " for " +
                                         KernelName(args.kernel) + " (PrepareFusedGemm)");
  }
  if (args.kernel == FusedKernel::kSm100) return fused_kernel::LaunchSm100BF16(args, stream, ctx);
  if (args.dtype == DType::kBF16) return fused_kernel::LaunchBF16(args, stream, ctx);
  return fused_kernel::LaunchF16(args, stream, ctx);
}

}  // namespace jo::cuda
