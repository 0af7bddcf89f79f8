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

// One instantiation (fused_gemm_launch.h): the kernel, its shared memory, its launch.
struct Instance {
  FusedKernel kernel;
  FusedTypes types;
  const void* (*function)();
  int (*shared_bytes)();
  Status (*launch)(const fused_kernel::Launch&, cudaStream_t, const ErrorContext&);
};

// Every instantiation built; FusedServes (core/kinds.h) accepts exactly the sm90
// triples, sm100 serves the 16-bit ones (tests/cuda/test_fused_sass.py finds each
// kernel in the built module).
#define JO_INSTANCE(kernel, a, b, d, Name) \
  {FusedKernel::kernel,                    \
   {DType::a, DType::b, DType::d},         \
   fused_kernel::Function##Name,           \
   fused_kernel::SharedBytes##Name,        \
   fused_kernel::Launch##Name}
const Instance kInstances[] = {
    JO_INSTANCE(kSm90, kBF16, kBF16, kBF16, BF16),
    JO_INSTANCE(kSm90, kF16, kF16, kF16, F16),
    JO_INSTANCE(kSm90, kF8E4M3, kF8E4M3, kBF16, E4M3_BF16),
    JO_INSTANCE(kSm90, kF8E4M3, kF8E4M3, kF16, E4M3_F16),
    JO_INSTANCE(kSm90, kF8E4M3, kF8E4M3, kF32, E4M3_F32),
    JO_INSTANCE(kSm90, kF8E5M2, kF8E4M3, kBF16, E5M2E4M3_BF16),
    JO_INSTANCE(kSm100, kBF16, kBF16, kBF16, Sm100BF16),
    JO_INSTANCE(kSm100, kF16, kF16, kF16, Sm100F16),
};
#undef JO_INSTANCE

const Instance* Find(const FusedTypes& t, FusedKernel kernel) {
  for (const Instance& i : kInstances)
    if (i.kernel == kernel && i.types.a == t.a && i.types.b == t.b && i.types.d == t.d) return &i;
  return nullptr;
}

bool Compiled(const FusedTypes& t) {
  return Find(t, FusedKernel::kSm90) != nullptr || Find(t, FusedKernel::kSm100) != nullptr;
}

std::string TypesName(const FusedTypes& t) {
  return std::string(DTypeName(t.a)) + " x " + DTypeName(t.b) + " -> " + DTypeName(t.d);
}

Status NotCompiled(const FusedTypes& t) {
  return Bad(TypesName(t) + " is not one the fused GEMM is compiled for (" + FusedServedNames() +
             "): take the chunked path");
}

std::mutex g_prepared_mu;
std::map<std::pair<int, const void*>, bool>& Prepared() {  // (device, kernel function)
  static auto* prepared = new std::map<std::pair<int, const void*>, bool>();
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

Status NotThisGpu(FusedKernel kernel, int device, int major, int minor, const ErrorContext& ctx) {
  return Status(Code::kInvalidArgument,
                ctx.Describe() +
                    ": the fused GEMM is sm_90a code for compute capability 9.0 "
                    "(H100, H200, GH200) and sm_100a code for 10.0 (B200, GB200; "
                    "bfloat16 and float16); GPU " +
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
  if (!Compiled(a.types)) return NotCompiled(a.types);
  const bool fp8 = IsFp8(a.types.a);
  if (a.batch < 1 || a.m < 1 || a.n < 1 || a.k < 1 || a.batch > kMaxInt32 || a.m > kMaxInt32 ||
      a.n > kMaxInt32 || a.k > kMaxInt32)
    return Bad("batch, m, n and k must be in [1, 2^31)");
  if (!a.blocks.valid() || a.blocks.rows() != a.m)
    return Bad("the row blocks (" + std::to_string(a.blocks.shards) + " shards of " +
               std::to_string(a.blocks.shard_rows) + " rows in " + std::to_string(a.blocks.chunks) +
               " chunks) must cover the m = " + std::to_string(a.m) +
               " rows, with at least one row per chunk");
  JO_CHECK(CheckMatrix("a", a.a, a.lda, a.a_batch_stride, a.m, a.k, a.batch, DTypeSize(a.types.a)));
  if (fp8)  // K-major: B^T, n x k
    JO_CHECK(CheckMatrix("b", a.b, a.ldb, 0, a.n, a.k, 1, DTypeSize(a.types.b)));
  else
    JO_CHECK(CheckMatrix("b", a.b, a.ldb, 0, a.k, a.n, 1, DTypeSize(a.types.b)));
  JO_CHECK(CheckMatrix("d", a.d, a.ldd, a.d_batch_stride, a.m, a.n, a.batch, DTypeSize(a.types.d)));
  if (fp8) {
    const fused_kernel::Fp8Scales& s = a.scales;
    if (a.k * DTypeSize(a.types.a) % 16 != 0 || a.n * DTypeSize(a.types.d) % 16 != 0)
      return Bad("FP8: k and n must fill whole 16-byte rows (TMA): k a multiple of 16, n of " +
                 std::to_string(16 / DTypeSize(a.types.d)));
    if (s.x == nullptr || !Aligned(s.x, 4) || s.w == nullptr || !Aligned(s.w, 4))
      return Bad("FP8 needs scales.x and scales.w: float32 device pointers, 4-byte aligned");
    if (s.x_stride != 0 && s.x_stride != 1)
      return Bad("scales.x_stride must be 1 (a scale per shard) or 0 (one for every row)");
    // CUTLASS's FP8 mainloop: the interval counts wgmmas, 4 per 128-deep K tile, and
    // promotes when the count equals it (0 would never promote before the end).
    if (s.promotion_interval == 0 || s.promotion_interval % 4 != 0)
      return Bad(
          "scales.promotion_interval must be a positive multiple of 4 (wgmmas of 32 "
          "elements of K; 4: every 128 elements), got " +
          std::to_string(s.promotion_interval));
  }
  if (a.wait_flags != nullptr) {
    if (!Aligned(a.wait_flags, 4)) return Bad("wait_flags must be 4-byte aligned");
    if (a.fault == nullptr || !Aligned(a.fault, 4))
      return Bad(a.trap ? "a trapping launch needs a fault record (page-locked host memory, "
                          "4-byte aligned)"
                        : "waiting needs a fault record (device memory, 4-byte aligned)");
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
  if (a.kernel != FusedKernel::kNone && Find(a.types, a.kernel) == nullptr)  // kNone: at prepare
    return Bad(std::string("the ") + KernelName(a.kernel) + " kernel is not compiled for " +
               TypesName(a.types) +
               " (sm_100a: bfloat16 and float16 only): take the chunked path "
               "(jo.config(fused=False))");
  // The order is over the kernel's MMA tiles (sm100: two CTA tiles, fused_tiles.h CtaTileAt).
  const fused::OrderError e =
      fused::MakeTileOrder(fused::Tiling{a.blocks, MmaPairOf(a.kernel) * fused::kTileRows},
                           a.sequence, a.blocks.count(), a.key, &args->order);
  if (e != fused::OrderError::kOk) return Bad(OrderErrorText(e));
  return OkStatus();
}

Status PrepareFusedGemm(const FusedTypes& types, FusedKernel kernel, const ErrorContext& ctx) {
  if (!Compiled(types)) return NotCompiled(types);
  int device = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  const Instance* instance = Find(types, kernel);
  if (instance != nullptr) {
    std::lock_guard<std::mutex> lock(g_prepared_mu);
    if (Prepared().count({device, instance->function()}) != 0) return OkStatus();
  }
  int major = 0, minor = 0;
  JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (kernel != FusedKernelFor(major, minor) || instance == nullptr)
    return NotThisGpu(kernel, device, major, minor, ctx);
  const void* function = instance->function();
  // It references the kernel: with lazy loading, that loads it here, at set-up.
  cudaFuncAttributes attr{};
  const cudaError_t code = cudaFuncGetAttributes(&attr, function);
  if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();
    return NotThisGpu(kernel, device, major, minor, ctx);
  }
  if (code != cudaSuccess) return CudaFailure(code, "cudaFuncGetAttributes", &ctx);
  JO_CUDA_CHECK(&ctx, cudaFuncSetAttribute(function, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           instance->shared_bytes()));
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  Prepared()[{device, function}] = true;
  return OkStatus();
}

void ForgetFusedGemmPreparation() {
  std::lock_guard<std::mutex> lock(g_prepared_mu);
  Prepared().clear();
}

Status LaunchFusedGemm(const FusedGemmArgs& args, cudaStream_t stream, const ErrorContext& ctx) {
  const Instance* instance = Find(args.types, args.kernel);
  if (instance == nullptr) return NotCompiled(args.types);
  int device = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(g_prepared_mu);
    if (Prepared().count({device, instance->function()}) == 0)
      return Status(Code::kInternal, ctx.Describe() +
                                         ": the fused GEMM was not prepared on device " +
                                         std::to_string(device) + " for " +
                                         KernelName(args.kernel) + " (PrepareFusedGemm)");
  }
  return instance->launch(args, stream, ctx);
}

}  // namespace jo::cuda
