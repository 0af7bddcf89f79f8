// What the fused GEMM's instantiations (fused_gemm_sm90.cu, fused_gemm_sm90_fp8.cu and
// fused_gemm_sm100.cu, or the fake's model of them: fake/fake_fused_gemm.cc) are handed: one launch
// whose arguments fused_gemm.cc has checked, with its tile order made. Apart from fused_gemm.h so
// that the CUTLASS instantiations, the slowest objects of the build, depend on nothing but this,
// the tile mapping and the status types.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/fused_tiles.h"
#include "core/status.h"
#include "cuda/base/check.h"

namespace jo::cuda {

// What a wait that ran out of time saw (written by the kernel, zero before).
struct FusedGemmFault {
  uint32_t timed_out = 0;  // 1: a wait gave up (its claim); the results of the launch are wrong
  uint32_t flag = 0;       // the flag (block) it waited for
  uint32_t seen = 0;       // the flag's value when it gave up
  uint32_t epoch = 0;      // the value it waited for
  uint32_t recorded = 0;   // 1 once the fields above are written (after a system fence): what a
                           // reader of a record the kernel may still write (a trapping launch's,
                           // page-locked host memory) looks at first
};

namespace fused_kernel {

// The FP8 dequantization of a launch with 8-bit operands (ignored by the
// 16-bit instantiations): D[l][i][j] = (A[l] @ B)[i][j] * (x[shard(i)] * w),
// shard(i) = i / shard_rows (RowBlocks: shard s holds rows s*shard_rows..), the
// product of the two scales rounded to float32 first, then the product with the
// float32 accumulator, rounded once to D's type. Each row takes its own
// shard's scale, so a tile whose rows straddle two shards is scaled right.
struct Fp8Scales {
  // x's dequantization scales (float32, device memory): shard s's at
  // x[s * x_stride]. All-gather: the shards' scale slots (x_stride 1); a
  // launch whose rows share one scale (GEMM + reduce-scatter: the rows are
  // this rank's x): x_stride 0.
  const float* x = nullptr;
  int64_t x_stride = 1;
  const float* w = nullptr;  // w's dequantization scale (float32, one element)
  // CUTLASS's FP8 mainloop adds the tensor cores' partial sums into float32
  // registers every `promotion_interval` wgmma instructions (each 32 deep in
  // K for 8-bit operands): 4, CUTLASS's default, is every 128 elements of K. A
  // multiple of 4 (the wgmmas per 128-deep K tile); a value past k / 32 never
  // promotes before the end (fast accumulation's numerics, not its speed).
  uint32_t promotion_interval = 4;
};

// D[l] (m x n) = A[l] (m x k) @ B (k x n), row-major, B shared by every l
// (fused_gemm.h says what each flag argument means). Leading dimensions and
// batch strides in elements; TMA needs every pointer 16-byte aligned and
// every stride a multiple of 16 bytes. FP8 (both operands 8-bit): B is given
// K-major, as FP8 wgmma requires — B^T (n x k) row-major, ldb its row stride
// (>= k) — and D is scaled by `scales`.
struct Launch {
  int64_t batch = 1, m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t lda = 0, a_batch_stride = 0;
  const void* b = nullptr;
  int64_t ldb = 0;
  void* d = nullptr;
  int64_t ldd = 0, d_batch_stride = 0;
  fused::RowBlocks blocks;               // the rows of A and D: blocks.rows() == m
  fused::TileOrder order;                // the tiles' order (made by CheckFusedGemm)
  const uint32_t* wait_flags = nullptr;  // null: no waits
  int32_t ready_shard = -1;              // its blocks are not waited for (-1: none)
  uint32_t* release_flags = nullptr;     // null: no releases
  uint32_t epoch = 0;
  int64_t timeout_ns = 0;           // > 0 when waiting
  FusedGemmFault* fault = nullptr;  // required when waiting
  // A wait that gives up records why and traps (a replayable call, whose later work no host
  // gate stops: docs/gpu-internals.md §8): the fault record must then be page-locked host
  // memory, which stays readable after the trap, and is not zeroed per launch.
  bool trap = false;
  uint32_t* counters = nullptr;  // CounterBytes(blocks), zeroed by the launch (releases only)
  int32_t sm_count = 0;          // persistent CTAs (clusters of 2): the SMs it holds
  Fp8Scales scales;              // FP8 only

  // The counters' size: a tile counter per block.
  static size_t CounterBytes(int32_t blocks) {
    return static_cast<size_t>(blocks) * sizeof(uint32_t);
  }
};

// The sm100 instantiations compute one MMA tile with two CTAs (2-SM MMA, 256
// rows): the tile order is made over tiles of kSm100MmaPair * fused::kTileRows
// rows (fused_tiles.h CtaTileAt); the flags are still waited for and released
// per CTA tile of fused::kTileRows rows.
inline constexpr int32_t kSm100MmaPair = 2;

// One instantiation per element type (FP8: per A x B -> D triple), defined by
// its line in its kernel family's .cu file. Function<Name>: the kernel, as cudaFuncGetAttributes
// and cudaFuncSetAttribute take it; SharedBytes<Name>: the dynamic shared memory it needs;
// Launch<Name>: enqueues the launch on `stream` (the counters' zero-fill, then the kernel).
#define JO_FUSED_GEMM_DECLARE(Name) \
  const void* Function##Name();     \
  int SharedBytes##Name();          \
  Status Launch##Name(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx);
JO_FUSED_GEMM_DECLARE(BF16)
JO_FUSED_GEMM_DECLARE(F16)
JO_FUSED_GEMM_DECLARE(E4M3_BF16)      // e4m3 x e4m3 -> bf16
JO_FUSED_GEMM_DECLARE(E4M3_F16)       // e4m3 x e4m3 -> f16
JO_FUSED_GEMM_DECLARE(E4M3_F32)       // e4m3 x e4m3 -> f32
JO_FUSED_GEMM_DECLARE(E5M2E4M3_BF16)  // e5m2 x e4m3 -> bf16: dy @ w^T, the backward's dx
// sm_100a (B200, GB200): bf16 and f16 (fused_gemm_kernel_sm100.cuh). The
// launch refuses an order not made over kSm100MmaPair-tile MMA tiles.
JO_FUSED_GEMM_DECLARE(Sm100BF16)
JO_FUSED_GEMM_DECLARE(Sm100F16)
#undef JO_FUSED_GEMM_DECLARE

}  // namespace fused_kernel
}  // namespace jo::cuda
