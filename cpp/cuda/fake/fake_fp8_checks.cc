// The misuse suite of cuBLASLt's FP8 rules (Fp8MisuseChecks, fake_checks.h): a
// valid FP8 GEMM (the layout the executor uses, cuda/gemm/gemm.h) with one thing
// changed per check, each against the rule of the cuBLAS documentation
// (docs.nvidia.com/cuda/cublas, "cublasLtMatmul()": the FP8 requirements and
// type table; cublasLtMatmulDescAttributes_t: the scale pointers) that the
// fake enforces (fake_cublaslt.cc). The control breaks nothing and must pass,
// with the right numbers.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/convert.h"
#include "core/program.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_harness.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/gemm/block_scales.h"

namespace jo::fake {
namespace {

// One FP8 GEMM as the executor makes it: D (n x m, column-major) = W^T-as-A (TRANSA=T,
// k x n, ld k) times X-as-B (k x m, ld k), C = D bf16, scales on the device; the fields are
// what a check may change.
struct Fp8Gemm {
  int32_t transa = CUBLAS_OP_T;
  cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cudaDataType_t a_type = CUDA_R_8F_E4M3;
  cudaDataType_t b_type = CUDA_R_8F_E5M2;
  cudaDataType_t out_type = CUDA_R_16BF;
  uint64_t k = 32;
  int64_t ld = 32;  // of A and B
  bool host_scale = false;
  int8_t fast_accum = 0;
  // MXFP8: A's and B's scale modes (VEC32_UE8M0: block scales in the 128x4-tiled layout),
  // and what a check breaks of their tensors.
  int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  size_t scale_misalign = 0;  // bytes added to B's block scale pointer
  bool short_scales = false;  // B's tensor only its 16 rows' bytes, not the padded tile's
  bool null_scales = false;   // no scale pointers
};

bool Blocks(const Fp8Gemm& g) {
  return g.a_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0 ||
         g.b_mode == CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
}

// The e8m0 exponent a check gives (outer row r, K block j) of A (0) or B (1), and where the
// 128x4-tiled layout keeps it (cuBLAS docs, "1D Block Scaling Factors Layout"; k below 128:
// one tile along K).
int BlockExponent(int operand, uint64_t r, uint64_t j) {
  return 127 + static_cast<int>((r * (operand == 0 ? 3 : 5) + j * 7) % 5) - 2;
}

constexpr uint64_t kM = 16, kN = 16;  // the GEMM's m (our n) and n (our m)

// Runs `g` on device 0 and, for the control, returns the largest error against the reference
// (alpha * scales * the f32 sum of the fp8 products, rounded to bf16).
double RunFp8Gemm(const Fp8Gemm& g) {
  cudaSetDevice(0);
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  cublasLtHandle_t h = nullptr;
  cublasLtCreate(&h);
  cublasLtMatmulDesc_t d = nullptr;
  cublasLtMatmulDescCreate(&d, g.compute, CUDA_R_32F);
  const int32_t transb = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &g.transa, sizeof(g.transa));
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb));
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &g.fast_accum,
                                 sizeof(g.fast_accum));
  // A: k x m stored (TRANSA=T; N: m x k), B: k x n, C/D: m x n.
  const bool t = g.transa == CUBLAS_OP_T;
  cublasLtMatrixLayout_t la, lb, lc, ld;
  cublasLtMatrixLayoutCreate(&la, g.a_type, t ? g.k : kM, t ? kM : g.k, t ? g.ld : 32);
  cublasLtMatrixLayoutCreate(&lb, g.b_type, g.k, kN, g.ld);
  cublasLtMatrixLayoutCreate(&lc, g.out_type, kM, kN, kM);
  cublasLtMatrixLayoutCreate(&ld, g.out_type, kM, kN, kM);
  const cublasLtMatmulHeuristicResult_t r = FirstAlgo(h, d, la, lb, lc, ld, 16);
  const size_t a_bytes = 64 * 64 * 2, b_bytes = 64 * 64 * 2;
  auto* a = static_cast<uint8_t*>(Malloc(0, a_bytes));
  auto* b = static_cast<uint8_t*>(Malloc(0, b_bytes));
  auto* dst = static_cast<uint16_t*>(Malloc(0, kM * kN * 4));
  auto* scales = static_cast<float*>(Malloc(0, 16));
  // Block scales: A's and B's tiled tensors, one padded tile each (512 bytes), at 16-byte
  // aligned starts; a short one holds only its 16 rows' bytes.
  auto* block_a = static_cast<uint8_t*>(Malloc(0, jo::cuda::kScaleTileBytes));
  auto* block_b =
      static_cast<uint8_t*>(Malloc(0, g.short_scales ? 16 : jo::cuda::kScaleTileBytes + 32));
  const bool blocks = Blocks(g);
  if (blocks) {
    const uint64_t k_tiles = ((g.k + 31) / 32 + 3) / 4;  // 1: one padded tile each
    for (uint64_t r = 0; r < 16; ++r)
      for (uint64_t j = 0; j < (g.k + 31) / 32; ++j) {
        block_a[jo::cuda::TiledScaleOffset(r, j, k_tiles)] =
            static_cast<uint8_t>(BlockExponent(0, r, j));
        if (!g.short_scales)
          block_b[g.scale_misalign + jo::cuda::TiledScaleOffset(r, j, k_tiles)] =
              static_cast<uint8_t>(BlockExponent(1, r, j));
      }
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &g.a_mode,
                                   sizeof(g.a_mode));
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &g.b_mode,
                                   sizeof(g.b_mode));
  }
  static float host_scales[2];
  const DType at = g.a_type == CUDA_R_8F_E5M2 ? DType::kF8E5M2 : DType::kF8E4M3;
  const DType bt = g.b_type == CUDA_R_8F_E4M3 ? DType::kF8E4M3 : DType::kF8E5M2;
  const bool fp8 = g.a_type != CUDA_R_16BF && g.b_type != CUDA_R_16BF;
  for (size_t i = 0; i < a_bytes; ++i) a[i] = static_cast<uint8_t>((i * 37 + 11) % 0x70);
  for (size_t i = 0; i < b_bytes; ++i) b[i] = static_cast<uint8_t>((i * 53 + 5) % 0x70);
  scales[0] = host_scales[0] = 0.75f;  // A's (W's)
  scales[1] = host_scales[1] = 2.5f;   // B's (x's)
  const void* sa = g.host_scale ? &host_scales[0] : &scales[0];
  const void* sb = g.host_scale ? &host_scales[1] : &scales[1];
  if (blocks) {
    sa = block_a;
    sb = block_b + g.scale_misalign;
  }
  if (g.null_scales) sa = sb = nullptr;
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa));
  cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb));
  const float one = 1.0f, zero = 0.0f;
  cublasLtMatmul(h, d, &one, a, la, b, lb, &zero, dst, lc, dst, ld, &r.algo, nullptr, 0, s);
  Drain();
  if (!fp8 || !t) return 0.0;
  double worst = 0.0;
  for (uint64_t i = 0; i < kM; ++i)
    for (uint64_t j = 0; j < kN; ++j) {
      double ref = 0.0;  // op(A)(i, p) = A[p + i * ld]; B(p, j) = B[p + j * ld]
      for (uint64_t q = 0; q < g.k; ++q)
        ref += static_cast<double>(LoadElement(at, a, static_cast<int64_t>(q + i * g.ld))) *
               LoadElement(bt, b, static_cast<int64_t>(q + j * g.ld));
      ref *= 0.75 * 2.5;
      if (blocks) {  // each block's products times its two scales
        ref = 0.0;
        for (uint64_t q = 0; q < g.k; ++q)
          ref += static_cast<double>(LoadElement(at, a, static_cast<int64_t>(q + i * g.ld))) *
                 LoadElement(bt, b, static_cast<int64_t>(q + j * g.ld)) *
                 std::ldexp(1.0, BlockExponent(0, i, q / 32) + BlockExponent(1, j, q / 32) - 254);
      }
      const double got = LoadElement(DType::kBF16, dst, static_cast<int64_t>(i + j * kM));
      worst = std::max(worst, std::fabs(got - ref) / (std::fabs(ref) + 1e-30));
    }
  return worst;
}

}  // namespace

std::map<std::string, std::string> Fp8MisuseChecks() {
  std::map<std::string, std::string> out;
  auto check = [&](const std::string& name, Fp8Gemm g, int arch = 90) {
    Config config;
    config.devices = 2;
    config.cc_major = arch / 10;
    config.cc_minor = arch % 10;
    ResetExecutorAndFake(config);
    const double error = RunFp8Gemm(g);
    const auto errors = Errors();
    out[name] = errors.empty() ? "" : errors.front();
    // The control also computes: within one bf16 rounding (2^-8) of the reference.
    if (errors.empty() && error > 1.0 / 256)
      out[name] = "wrong result: relative error " + std::to_string(error);
  };
  check("fp8 gemm as the executor makes it (control)", Fp8Gemm{});
  check("fp8 gemm on sm_89 (control)", Fp8Gemm{}, 89);
  // "A must be transposed and B non-transposed (The TN format) on Ada (compute capability
  // 8.9), Hopper (compute capability 9.0), and Blackwell GeForce (compute capability 12.x)".
  Fp8Gemm nn;
  nn.transa = CUBLAS_OP_N;
  check("fp8 gemm not in the TN format", nn);
  // FP8 kernels exist from compute capability 8.9 on.
  check("fp8 gemm on sm_80", Fp8Gemm{}, 80);
  // The FP8 type table has no CUDA_R_8F_E5M2 x CUDA_R_8F_E5M2 row ...
  Fp8Gemm e5m2;
  e5m2.a_type = CUDA_R_8F_E5M2;
  check("fp8 gemm e5m2 x e5m2", e5m2);
  // ... and no FP8 A with a bf16 B.
  Fp8Gemm mixed;
  mixed.b_type = CUDA_R_16BF;
  check("fp8 gemm with a bf16 operand", mixed);
  // "The compute type must be CUBLAS_COMPUTE_32F."
  Fp8Gemm tf32;
  tf32.compute = CUBLAS_COMPUTE_32F_FAST_TF32;
  check("fp8 gemm with TF32 compute", tf32);
  // "pointers and matrix dimension must support 16-byte alignment": k = 24 bytes of fp8.
  Fp8Gemm odd_k;
  odd_k.k = 24;
  check("fp8 gemm with k not a multiple of 16 bytes", odd_k);
  // The scale pointers are device pointers ("Device pointer to the scale factor value").
  Fp8Gemm host;
  host.host_scale = true;
  check("fp8 gemm with a host scale pointer", host);
  // The executor's choice, documented in cuda/gemm/gemm.h: no fast accumulation (promotion kept).
  Fp8Gemm fast;
  fast.fast_accum = 1;
  check("fp8 fast accumulation", fast);
  // "If set for an unsupported matrix data, scale, and compute type combination, calling
  // cublasLtMatmul() will return CUBLAS_INVALID_VALUE": scale pointers on a bf16 GEMM.
  check("scale pointers on a bf16 gemm", [] {
    Fp8Gemm g;
    g.a_type = g.b_type = CUDA_R_16BF;
    g.transa = CUBLAS_OP_N;
    g.ld = 32;
    return g;
  }());
  // MXFP8 (cuBLAS docs, cublasLtMatmul: "Scaling Modes Support Overview", "1D Block Scaling
  // Factors Layout"; cublasLt.h, cublasLtMatmulMatrixScale_t), the executor's GEMM on sm_100
  // with VEC32_UE8M0 on both matrices, k two blocks of 32.
  Fp8Gemm mx;
  mx.a_type = mx.b_type = CUDA_R_8F_E4M3;
  mx.a_mode = mx.b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  mx.k = mx.ld = 64;
  check("mxfp8 gemm as the executor makes it (control)", mx, 100);
  // Block-scaled MMA is Blackwell's (compute capability 10.0 on): Hopper has none.
  check("mxfp8 gemm on sm_90", mx, 90);
  // The MXFP8 row scales both matrices.
  Fp8Gemm one_side = mx;
  one_side.a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  check("mxfp8 block scales on B only", one_side, 100);
  // Block scales are for FP8 matrices (the scale pointers' rule, cublasLt.h).
  check(
      "mxfp8 block scales on a bf16 gemm",
      [&] {
        Fp8Gemm g = mx;
        g.a_type = g.b_type = CUDA_R_16BF;
        g.transa = CUBLAS_OP_N;
        g.null_scales = true;
        return g;
      }(),
      100);
  // "starting addresses must be 16-byte aligned".
  Fp8Gemm misaligned = mx;
  misaligned.scale_misalign = 4;
  check("mxfp8 block scales not 16-byte aligned", misaligned, 100);
  // The tensor covers the padded tiles: 128 rows by 4 blocks, not only the matrix's 16 rows.
  Fp8Gemm short_scales = mx;
  short_scales.short_scales = true;
  check("mxfp8 block scales without their padded tile", short_scales, 100);
  Fp8Gemm null_scales = mx;
  null_scales.null_scales = true;
  check("mxfp8 block scales without a scale pointer", null_scales, 100);
  return out;
}

}  // namespace jo::fake
