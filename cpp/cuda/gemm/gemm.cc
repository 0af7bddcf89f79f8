#include "cuda/gemm/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "cuda/gemm/block_scales.h"

namespace jo::cuda {
namespace {

// A dtype's cuBLASLt matrix type (core/kinds.h, the cublaslt column).
cudaDataType_t LtType(DType dtype) {
  switch (dtype) {
#define JO_LT_TYPE(e, id, name, short_name, bytes, fp8, out, fused, elem, ffi, nccl, cublaslt) \
  case DType::e:                                                                               \
    return cublaslt;
    JO_DTYPES(JO_LT_TYPE)
#undef JO_LT_TYPE
  }
  return CUDA_R_32F;
}

// FP8 GEMMs need compute capability 8.9 or newer (cuBLAS docs, cublasLtMatmul:
// the FP8 requirements name Ada 8.9, Hopper 9.0 and Blackwell; FP8 tensor cores
// begin with Ada).
constexpr int kFp8MinArch = 89;

// The alignment we promise cuBLASLt for one matrix: the largest power of two
// (<= 256) dividing its pointer, its leading dimension and, when batched, its
// batch stride, in bytes. The promise covers them all: an algorithm's minimum
// alignment is "required for buffer pointer, leading dimension, and possibly
// other strides" (cublasLt.h, CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES), and
// batch b's matrix starts at pointer + b * stride.
uint32_t Alignment(const void* p, int64_t ld, int64_t batch, int64_t batch_stride, int64_t es) {
  const uint64_t v = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)) |
                     static_cast<uint64_t>(ld * es) |
                     static_cast<uint64_t>(batch > 1 ? batch_stride * es : 0);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

// The four promises, in cuBLASLt's A, B, C, D order (the layout mapping of gemm.h).
struct Alignments {
  uint32_t a, b, c, d;
};
Alignments AlignmentsOf(const GemmArgs& g, const void* c, int64_t c_bs, int64_t c_ld) {
  const int64_t ws = DTypeSize(g.w_type), as = DTypeSize(g.a_type), os = DTypeSize(g.out_type);
  return {Alignment(g.w, g.w_ld, g.batch, 0, ws), Alignment(g.a, g.a_ld, g.batch, g.a_bs, as),
          Alignment(c, c_ld, g.batch, c_bs, os), Alignment(g.d, g.d_ld, g.batch, g.d_bs, os)};
}

std::string TypesName(const GemmArgs& g) {
  return std::string(DTypeName(g.a_type)) + " x " + DTypeName(g.w_type) + " -> " +
         DTypeName(g.out_type);
}

template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtHandle {
  T value = nullptr;
  LtHandle() = default;
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  ~LtHandle() {
    if (value != nullptr) (void)Destroy(value);  // teardown: nothing left to report to
  }
};

using Desc = LtHandle<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = LtHandle<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Pref = LtHandle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;
using Handle = LtHandle<cublasLtHandle_t, cublasLtDestroy>;

size_t RoundUp256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// One cuBLASLt matmul of one shape, ready to run: its descriptors and the
// algorithm the heuristic chose.
struct MatmulPlan {
  Desc desc;
  Layout a, b, c, d;
  Pref pref;
  cublasLtMatmulHeuristicResult_t heuristic{};
};

// types (x2, +1 with TF32; x2, +1 block-scaled), batch, m, n, k, lds, strides, beta != 0,
// alignments.
using MatmulKey =
    std::tuple<int, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
               int64_t, int64_t, int64_t, bool, uint32_t, uint32_t, uint32_t, uint32_t>;

// Two locks, so that the enqueue path never waits for a set-up that waits for the device
// (docs/gpu-internals.md §1): `set_up_mu` serialises the device's set-ups (PrepareLtMatmul) and is
// held across their calls that may wait for the device (cublasLtCreate, the heuristic, the
// warm-up's matmul and its lazy kernel load); the enqueue path (LtMatmul, JoinWarmUps) never takes
// it. `mu` guards what both paths share: the plans, the handle and the warm-up event; it is held
// only for look-ups and insertions and, on the enqueue path, across the non-blocking calls that use
// what it guards (a plan's FP8 scale update and its matmul, cudaStreamWaitEvent), never across a
// call that may wait for the device. cuBLASLt's handle is shared by both paths ("The library is
// thread safe and its functions can be called from multiple host threads, even with the same
// handle", cuBLAS docs, "Thread Safety"); a plan is used only once it is in `plans`, and never
// changed by a set-up after that. No device memory here: the callers' (GemmBuffers).
struct DeviceCache {
  std::mutex set_up_mu;
  std::mutex mu;
  // Written under both locks (so read under either).
  Handle handle;
  cudaEvent_t warmed = nullptr;  // recorded after the last warm-up (under mu)
  // Under mu.
  std::map<MatmulKey, std::unique_ptr<MatmulPlan>> plans;
  // Under set_up_mu only. Where each new plan runs once at set-up (WarmUp): a private stream.
  int arch = -1;  // compute capability as 10 * major + minor, once asked
  cudaStream_t warm_stream = nullptr;
  DeviceCache() = default;
  DeviceCache(const DeviceCache&) = delete;
  DeviceCache& operator=(const DeviceCache&) = delete;
  ~DeviceCache() {
    if (warmed != nullptr) (void)cudaEventDestroy(warmed);
    if (warm_stream != nullptr) (void)cudaStreamDestroy(warm_stream);
  }
};

std::mutex g_mu;
std::map<int, std::unique_ptr<DeviceCache>>& Caches() {
  static auto* caches = new std::map<int, std::unique_ptr<DeviceCache>>();
  return *caches;
}

DeviceCache& CacheOf(int device) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& slot = Caches()[device];
  if (!slot) slot = std::make_unique<DeviceCache>();
  return *slot;
}

Status MakeLayout(Layout* layout, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                  int32_t batch, int64_t batch_stride, const ErrorContext& ctx) {
  JO_CUBLAS_CHECK(&ctx,
                  cublasLtMatrixLayoutCreate(&layout->value, type, static_cast<uint64_t>(rows),
                                             static_cast<uint64_t>(cols), ld));
  const int32_t order = CUBLASLT_ORDER_COL;
  JO_CUBLAS_CHECK(&ctx, cublasLtMatrixLayoutSetAttribute(
                            layout->value, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order)));
  JO_CUBLAS_CHECK(
      &ctx, cublasLtMatrixLayoutSetAttribute(layout->value, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                             &batch, sizeof(batch)));
  JO_CUBLAS_CHECK(&ctx, cublasLtMatrixLayoutSetAttribute(
                            layout->value, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            &batch_stride, sizeof(batch_stride)));
  return OkStatus();
}

// Sets the FP8 scale pointers of a plan's descriptor: cuBLASLt's A is W, its B the
// program's a (gemm.h). A host-side update of the descriptor, read by the next
// cublasLtMatmul.
Status SetScales(const MatmulPlan& plan, const void* a_scale, const void* w_scale,
                 const ErrorContext& ctx) {
  JO_CUBLAS_CHECK(
      &ctx, cublasLtMatmulDescSetAttribute(plan.desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                           &w_scale, sizeof(w_scale)));
  JO_CUBLAS_CHECK(
      &ctx, cublasLtMatmulDescSetAttribute(plan.desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                           &a_scale, sizeof(a_scale)));
  return OkStatus();
}

Status MakeMatmulPlan(cublasLtHandle_t handle, const GemmArgs& g, const void* c, int64_t c_bs,
                      int64_t c_ld, const ErrorContext& ctx, MatmulPlan* plan) {
  const bool fp8 = IsFp8Gemm(g);
  const int32_t batch = static_cast<int32_t>(g.batch);
  const bool all_f32 =
      g.a_type == DType::kF32 && g.w_type == DType::kF32 && g.out_type == DType::kF32;
  const cublasComputeType_t compute =
      g.tf32 && all_f32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  JO_CUBLAS_CHECK(&ctx, cublasLtMatmulDescCreate(&plan->desc.value, compute, CUDA_R_32F));
  // FP8: "A must be transposed and B non-transposed" (gemm.h): W arrives K-major.
  const int32_t transa = fp8 ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t no_transpose = CUBLAS_OP_N;
  JO_CUBLAS_CHECK(
      &ctx, cublasLtMatmulDescSetAttribute(plan->desc.value, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                           sizeof(transa)));
  JO_CUBLAS_CHECK(&ctx,
                  cublasLtMatmulDescSetAttribute(plan->desc.value, CUBLASLT_MATMUL_DESC_TRANSB,
                                                 &no_transpose, sizeof(no_transpose)));
  if (fp8) {
    if (g.block_scaled) {  // both operands' scales 1x32 e8m0 blocks (gemm.h)
      const int32_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
      JO_CUBLAS_CHECK(
          &ctx, cublasLtMatmulDescSetAttribute(plan->desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                                               &mode, sizeof(mode)));
      JO_CUBLAS_CHECK(
          &ctx, cublasLtMatmulDescSetAttribute(plan->desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                                               &mode, sizeof(mode)));
    }
    JO_CHECK(SetScales(*plan, g.a_scale, g.w_scale, ctx));
    const int8_t fast_accum = 0;  // keep the periodic promotion (gemm.h)
    JO_CUBLAS_CHECK(
        &ctx, cublasLtMatmulDescSetAttribute(plan->desc.value, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                             &fast_accum, sizeof(fast_accum)));
  }
  // See the layout mapping in gemm.h: A_lt = W (n x k; fp8: k x n, transposed), B_lt = A
  // (k x m), C/D (n x m).
  const cudaDataType_t out = LtType(g.out_type);
  if (fp8) {
    JO_CHECK(MakeLayout(&plan->a, LtType(g.w_type), g.k, g.n, g.w_ld, batch, 0, ctx));
  } else {
    JO_CHECK(MakeLayout(&plan->a, LtType(g.w_type), g.n, g.k, g.w_ld, batch, 0, ctx));
  }
  JO_CHECK(MakeLayout(&plan->b, LtType(g.a_type), g.k, g.m, g.a_ld, batch, g.a_bs, ctx));
  JO_CHECK(MakeLayout(&plan->c, out, g.n, g.m, c_ld, batch, c_bs, ctx));
  JO_CHECK(MakeLayout(&plan->d, out, g.n, g.m, g.d_ld, batch, g.d_bs, ctx));
  JO_CUBLAS_CHECK(&ctx, cublasLtMatmulPreferenceCreate(&plan->pref.value));
  const uint64_t ws = kGemmWorkspaceBytes;
  JO_CUBLAS_CHECK(&ctx,
                  cublasLtMatmulPreferenceSetAttribute(
                      plan->pref.value, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const Alignments al = AlignmentsOf(g, c, c_bs, c_ld);
  const uint32_t align[4] = {al.a, al.b, al.c, al.d};
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    JO_CUBLAS_CHECK(&ctx, cublasLtMatmulPreferenceSetAttribute(plan->pref.value, align_attr[i],
                                                               &align[i], sizeof(align[i])));
  int found = 0;
  JO_CUBLAS_CHECK(&ctx, cublasLtMatmulAlgoGetHeuristic(
                            handle, plan->desc.value, plan->a.value, plan->b.value, plan->c.value,
                            plan->d.value, plan->pref.value, 1, &plan->heuristic, &found));
  if (found < 1)
    return Status(Code::kInternal, ctx.Describe() + ": cuBLASLt has no algorithm for " +
                                       TypesName(g) + " batch=" + std::to_string(g.batch) +
                                       " m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
                                       " k=" + std::to_string(g.k));
  return OkStatus();
}

// What an FP8 GEMM needs beyond its plan (gemm.h): both operands fp8 and not both e5m2 (the
// cuBLAS FP8 type table), compute capability >= 8.9, every matrix 16-byte aligned and k a
// multiple of 16. At set-up: an InvalidArgument naming the rule, before anything is enqueued.
Status CheckFp8Gemm(DeviceCache& cache, int device, const GemmArgs& g, const Alignments& al,
                    const ErrorContext& ctx) {
  const auto bad = [&](const std::string& text) {
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": FP8 GEMM " + TypesName(g) + " m=" + std::to_string(g.m) +
                      " n=" + std::to_string(g.n) + " k=" + std::to_string(g.k) + ": " + text);
  };
  if (!IsFp8(g.a_type) || !IsFp8(g.w_type))
    return bad("cuBLASLt's FP8 GEMMs take two fp8 operands, not an fp8 one with a " +
               std::string(DTypeName(IsFp8(g.a_type) ? g.w_type : g.a_type)) +
               " one (cuBLAS docs, cublasLtMatmul, the FP8 type table); the CUDA executor does "
               "not convert operands: pass both as fp8, or use impl='xla'");
  if (g.a_type == DType::kF8E5M2 && g.w_type == DType::kF8E5M2)
    return bad(
        "cuBLASLt has no float8_e5m2 x float8_e5m2 GEMM (cuBLAS docs, cublasLtMatmul, "
        "the FP8 type table: e4m3 x e4m3, e4m3 x e5m2, e5m2 x e4m3); make one operand "
        "float8_e4m3fn, or use impl='xla'");
  if (cache.arch < 0) {
    int major = 0, minor = 0;
    JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    cache.arch = major * 10 + minor;
  }
  if (cache.arch < kFp8MinArch)
    return bad("GPU " + std::to_string(device) + " is sm_" + std::to_string(cache.arch) +
               "; FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell). "
               "Use bfloat16 operands, or impl='xla'");
  const int64_t out_bytes = DTypeSize(g.out_type);
  if (g.k % 16 != 0 || (g.n * out_bytes) % 16 != 0 || al.a < 16 || al.b < 16 || al.c < 16 ||
      al.d < 16)
    return bad(
        "cuBLASLt's FP8 GEMMs need every pointer, leading dimension and batch stride "
        "16-byte aligned, so k a multiple of 16 and the output columns a multiple of " +
        std::to_string(16 / out_bytes) +
        " (cuBLAS docs, cublasLtMatmul: \"pointers and matrix dimension must support "
        "16-byte alignment\"); got alignments " +
        std::to_string(al.a) + ", " + std::to_string(al.b) + ", " + std::to_string(al.c) + ", " +
        std::to_string(al.d) + " bytes (W, x, C, D)");
  if (g.a_scale == nullptr || g.w_scale == nullptr) return bad("a scale pointer is missing");
  if (!g.block_scaled) return OkStatus();
  // MXFP8 (gemm.h): Blackwell data-centre GPUs only, whole 128x4 tiles, one matrix a call.
  if (cache.arch / 10 != 10)
    return bad("GPU " + std::to_string(device) + " is sm_" + std::to_string(cache.arch) +
               "; block-scaled (MXFP8) GEMMs are cuBLASLt's VEC32_UE8M0 mode on compute "
               "capability 10.x (B200, GB200: the block-scaled tcgen05 MMA); Hopper has no "
               "block-scaled cuBLASLt GEMM. Use impl='xla' or impl='ring', or float32 "
               "per-tensor scales");
  if (g.m % kScaleTileRows != 0 || g.n % kScaleTileRows != 0 || g.k % kScaleTileRows != 0)
    return bad(
        "cuBLASLt's block scales are 128x4-tiled (cuBLAS docs, \"1D Block Scaling Factors "
        "Layout\": 128 rows by 4 blocks of 32 along k); the CUDA executor moves and reads "
        "whole tiles only, so every block-scaled GEMM's rows (a sub-chunk's: rows per shard / "
        "chunks), its output columns and k must be multiples of 128. Change the shapes or "
        "chunks, or use impl='xla'");
  if (g.batch != 1) return Internal(ctx.Describe() + ": a batched block-scaled GEMM (gemm.h)");
  if (reinterpret_cast<uintptr_t>(g.a_scale) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(g.w_scale) % 16 != 0)
    return bad(
        "a block scale tensor is not 16-byte aligned (cuBLAS docs, \"1D Block Scaling "
        "Factors Layout\")");
  return OkStatus();
}

// Elements a row-major block (batch x rows x cols, leading dim ld, batch stride bs) spans.
size_t Span(int64_t batch, int64_t bs, int64_t rows, int64_t ld, int64_t cols) {
  return static_cast<size_t>((batch - 1) * bs + (rows - 1) * ld + cols);
}

// Where a warm-up's operands go in GemmBuffers::warm: W, the program's a, C (out of place only),
// D and the two FP8 scales, each region 256-byte aligned with room for the offset that gives
// its matrix the call's alignment (PlaceAt).
struct WarmLayout {
  size_t w = 0, a = 0, c = 0, d = 0, scales = 0, bytes = 0;
};
WarmLayout WarmLayoutOf(const GemmArgs& g, bool out_of_place, int64_t c_bs, int64_t c_ld) {
  const bool fp8 = IsFp8Gemm(g);
  const size_t w_es = static_cast<size_t>(DTypeSize(g.w_type));
  const size_t a_es = static_cast<size_t>(DTypeSize(g.a_type));
  const size_t out_es = static_cast<size_t>(DTypeSize(g.out_type));
  WarmLayout l;
  size_t at = 0;
  const auto region = [&](size_t bytes) {
    const size_t begin = at;
    at += RoundUp256(bytes) + 256;  // + the offset PlaceAt may add
    return begin;
  };
  l.w = region((fp8 ? Span(1, 0, g.n, g.w_ld, g.k) : Span(1, 0, g.k, g.w_ld, g.n)) * w_es);
  l.a = region(Span(g.batch, g.a_bs, g.m, g.a_ld, g.k) * a_es);
  if (out_of_place) l.c = region(Span(g.batch, c_bs, g.m, c_ld, g.n) * out_es);
  l.d = region(Span(g.batch, g.d_bs, g.m, g.d_ld, g.n) * out_es);
  // The scales: two float32, or the block scale tensors (one byte per 32 of k, each padded
  // to a 16-byte start).
  l.scales =
      fp8 ? region(g.block_scaled
                       ? static_cast<size_t>(((g.batch * g.m + g.n) * g.k / 32 + 32 + 15) / 16 * 16)
                       : 8)
          : at;
  l.bytes = at;
  return l;
}

// A pointer into a 256-byte aligned region whose alignment is exactly `align` (<= 256): what
// the call's matrix has, so that a warm-up runs the kernel the call will.
std::byte* PlaceAt(std::byte* region, uint32_t align) { return region + (align % 256); }

// Runs a new plan once, at set-up, on a private stream and the caller's warm-up buffers (their
// contents do not matter): cuBLASLt loads an algorithm's kernel at its first matmul on a
// device, and with lazy loading (CUDA's default) loading "might require context
// synchronization" (CUDA programming guide, "Lazy Loading", potential hazards) — which must not
// happen once the call has enqueued work that other ranks' work may wait for. NCCL loads its
// kernels at init for the same reason (ncclInitKernelsForDevice). The warm-up has the call's
// form: out of place (C apart from D) when the call is, and every matrix at the alignment the
// call's has (pointer, leading dimension and batch stride as the call's): what selects the
// kernel cuBLASLt runs for an algorithm is not documented, so nothing of the call's form may
// differ. Requires cache.set_up_mu, not cache.mu.
Status WarmUp(DeviceCache& cache, const MatmulPlan& plan, const GemmArgs& g, const void* c,
              int64_t c_bs, int64_t c_ld, bool accumulate, const Alignments& al,
              const GemmBuffers& buffers, const ErrorContext& ctx) {
  const bool fp8 = IsFp8Gemm(g);
  const bool out_of_place = c != g.d;
  const WarmLayout layout = WarmLayoutOf(g, out_of_place, c_bs, c_ld);
  if (buffers.warm == nullptr || buffers.warm_workspace == nullptr ||
      buffers.warm_bytes < layout.bytes)
    return Internal(ctx.Describe() + ": the GEMM's warm-up buffers (" +
                    std::to_string(buffers.warm_bytes) + " bytes) are smaller than its " +
                    std::to_string(layout.bytes) + " bytes (the rank's pool, clique_state.h)");
  if (cache.warm_stream == nullptr)
    JO_CUDA_CHECK(&ctx, cudaStreamCreateWithFlags(&cache.warm_stream, cudaStreamNonBlocking));
  if (cache.warmed == nullptr) {
    cudaEvent_t warmed = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&warmed, cudaEventDisableTiming));
    std::lock_guard<std::mutex> lock(cache.mu);
    cache.warmed = warmed;
  }
  std::byte* base = static_cast<std::byte*>(buffers.warm);
  std::byte* w = PlaceAt(base + layout.w, al.a);  // cuBLASLt's A is W (the layout mapping)
  std::byte* a = PlaceAt(base + layout.a, al.b);
  std::byte* d = PlaceAt(base + layout.d, al.d);
  std::byte* c_place = out_of_place ? PlaceAt(base + layout.c, al.c) : d;
  if (fp8) {  // valid device pointers (their values do not matter); the call sets its own
    std::byte* scales = base + layout.scales;
    // The program's a's scales first, W's after them (16-byte aligned: gemm.h).
    const size_t a_bytes =
        g.block_scaled ? static_cast<size_t>((g.batch * g.m * g.k / 32 + 15) / 16 * 16) : 4;
    JO_CHECK(SetScales(plan, scales, scales + a_bytes, ctx));
  }
  const float alpha = 1.0f;
  const float beta = accumulate ? 1.0f : 0.0f;
  JO_CUBLAS_CHECK(&ctx, cublasLtMatmul(cache.handle.value, plan.desc.value, &alpha, w, plan.a.value,
                                       a, plan.b.value, &beta, c_place, plan.c.value, d,
                                       plan.d.value, &plan.heuristic.algo, buffers.warm_workspace,
                                       plan.heuristic.workspaceSize, cache.warm_stream));
  std::lock_guard<std::mutex> lock(cache.mu);  // JoinWarmUps waits for the newest record
  JO_CUDA_CHECK(&ctx, cudaEventRecord(cache.warmed, cache.warm_stream));
  return OkStatus();
}

// What a GEMM's plan is looked up by: C as cuBLASLt sees it (beta = 0: C is not read, and
// described as D, cuBLASLt's in-place form), and the plan's key.
struct GemmShape {
  bool accumulate = false;
  const void* c = nullptr;
  int64_t c_bs = 0, c_ld = 0;
  Alignments al{};
  MatmulKey key;
};

Status ShapeOf(const GemmArgs& g, const ErrorContext& ctx, GemmShape* out) {
  out->accumulate = g.c != nullptr;
  out->c = out->accumulate ? g.c : g.d;
  out->c_bs = out->accumulate ? g.c_bs : g.d_bs;
  out->c_ld = out->accumulate ? g.c_ld : g.d_ld;
  if (out->c != g.d && (out->c_bs != g.d_bs || out->c_ld != g.d_ld))
    return Internal(ctx.Describe() + ": GEMM with C != D needs identical C and D layouts");
  if (g.batch > INT32_MAX) return Internal(ctx.Describe() + ": GEMM batch exceeds int32");
  out->al = AlignmentsOf(g, out->c, out->c_bs, out->c_ld);
  const int types = (static_cast<int>(g.a_type) * 8 + static_cast<int>(g.w_type)) * 8 +
                    static_cast<int>(g.out_type);
  out->key = MatmulKey{(types * 2 + (g.tf32 ? 1 : 0)) * 2 + (g.block_scaled ? 1 : 0),
                       g.batch,
                       g.m,
                       g.n,
                       g.k,
                       g.a_bs,
                       g.a_ld,
                       g.w_ld,
                       out->c_bs,
                       out->c_ld,
                       g.d_bs,
                       g.d_ld,
                       0,
                       out->accumulate,
                       out->al.a,
                       out->al.b,
                       out->al.c,
                       out->al.d};
  return OkStatus();
}

}  // namespace

// Set-up, under the device's set_up_mu: everything that may wait for the device runs here,
// with cache.mu taken only to look up and insert. Allocates nothing (GemmBuffers).
Status PrepareLtMatmul(int device, const GemmArgs& g, const GemmBuffers& buffers,
                       const ErrorContext& ctx, bool* warmed) {
  GemmShape shape;
  JO_CHECK(ShapeOf(g, ctx, &shape));
  if (buffers.workspace == nullptr)
    return Internal(ctx.Describe() + ": a GEMM without a workspace (the rank's pool)");
  DeviceCache& cache = CacheOf(device);
  std::lock_guard<std::mutex> set_up(cache.set_up_mu);
  if (IsFp8Gemm(g)) JO_CHECK(CheckFp8Gemm(cache, device, g, shape.al, ctx));
  if (cache.handle.value == nullptr) {
    cublasLtHandle_t handle = nullptr;
    JO_CUBLAS_CHECK(&ctx, cublasLtCreate(&handle));
    std::lock_guard<std::mutex> lock(cache.mu);
    cache.handle.value = handle;
  }
  {
    std::lock_guard<std::mutex> lock(cache.mu);
    if (cache.plans.count(shape.key) > 0) return OkStatus();
  }
  auto fresh = std::make_unique<MatmulPlan>();
  JO_CHECK(
      MakeMatmulPlan(cache.handle.value, g, shape.c, shape.c_bs, shape.c_ld, ctx, fresh.get()));
  JO_CHECK(WarmUp(cache, *fresh, g, shape.c, shape.c_bs, shape.c_ld, shape.accumulate, shape.al,
                  buffers, ctx));
  if (warmed != nullptr) *warmed = true;
  std::lock_guard<std::mutex> lock(cache.mu);
  cache.plans[shape.key] = std::move(fresh);
  return OkStatus();
}

size_t WarmUpBytes(const GemmArgs& g) {
  const bool out_of_place = g.c != nullptr;  // a set c: the call may be out of place
  return WarmLayoutOf(g, out_of_place, g.c_bs, g.c_ld).bytes;
}

// The enqueue path: cache.mu only, never set_up_mu.
Status LtMatmul(int device, const GemmArgs& g, cudaStream_t stream, void* ws,
                const ErrorContext& ctx) {
  GemmShape shape;
  JO_CHECK(ShapeOf(g, ctx, &shape));
  DeviceCache& cache = CacheOf(device);
  std::lock_guard<std::mutex> lock(cache.mu);
  const auto it = cache.plans.find(shape.key);
  if (it == cache.plans.end() || ws == nullptr)
    return Internal(ctx.Describe() +
                    ": GEMM enqueued without its set-up (PrepareLtMatmul, a workspace)");
  const MatmulPlan& plan = *it->second;
  // The scales of this GEMM (an all-gather's chunk names its shard's): a host-side update of
  // the descriptor, read by the matmul below (cache.mu is held across both).
  if (IsFp8Gemm(g)) JO_CHECK(SetScales(plan, g.a_scale, g.w_scale, ctx));
  const float alpha = 1.0f;
  const float beta = shape.accumulate ? 1.0f : 0.0f;
  JO_CUBLAS_CHECK(
      &ctx, cublasLtMatmul(cache.handle.value, plan.desc.value, &alpha, g.w, plan.a.value, g.a,
                           plan.b.value, &beta, shape.c, plan.c.value, g.d, plan.d.value,
                           &plan.heuristic.algo, ws, plan.heuristic.workspaceSize, stream));
  return OkStatus();
}

Status JoinWarmUps(int device, cudaStream_t stream, const ErrorContext& ctx) {
  DeviceCache& cache = CacheOf(device);
  std::lock_guard<std::mutex> lock(cache.mu);
  JO_ASSERT(cache.warmed != nullptr);
  JO_CUDA_CHECK(&ctx, cudaStreamWaitEvent(stream, cache.warmed, 0));
  return OkStatus();
}

void ReleaseGemmCaches() {
  // Destroyed after g_mu is released: CacheOf, which an enqueue takes, needs g_mu.
  std::map<int, std::unique_ptr<DeviceCache>> gone;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    gone.swap(Caches());
  }
}

size_t CublasLtVersion() { return cublasLtGetVersion(); }

bool IsFp8Gemm(const GemmArgs& g) { return IsFp8(g.a_type) || IsFp8(g.w_type); }

}  // namespace jo::cuda
