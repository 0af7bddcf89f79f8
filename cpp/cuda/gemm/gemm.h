// GEMMs of the CUDA executor on cuBLASLt.
//
// LAYOUT MAPPING (the one place it is decided). The program IR is row-major:
//   D[b] (m x n, ld d_ld) = A[b] (m x k, ld a_ld) @ W (k x n, ld w_ld) (+ C[b])
// cuBLASLt is column-major. A row-major M x N block with leading dim ld is
// the column-major N x M block with the same ld, so we ask cuBLASLt for the
// transposed product, with no transpose flags at all:
//   Dᵀ (n x m) = Wᵀ (n x k) · Aᵀ (k x m) (+ Cᵀ)
//   cuBLASLt "A" := W  as a column-major n x k matrix, ld w_ld, batch stride 0
//   cuBLASLt "B" := A  as a column-major k x m matrix, ld a_ld, batch stride a_bs
//   cuBLASLt "C" := C  as a column-major n x m matrix, ld c_ld, batch stride c_bs
//   cuBLASLt "D" := D  as a column-major n x m matrix, ld d_ld, batch stride d_bs
// Every layout sets ORDER=COL, BATCH_COUNT and STRIDED_BATCH_OFFSET
// explicitly; the matmul descriptor sets TRANSA=TRANSB=N, compute type
// CUBLAS_COMPUTE_32F and scale type CUDA_R_32F (f32 accumulation for
// bf16/f16 too); alpha = 1, beta = 1 when accumulating, else 0. The
// preference sets the workspace size and, per matrix, the alignment its pointer,
// leading dimension and batch stride all share (what cuBLASLt requires of them).
// The host-side fake (cpp/cuda/fake) implements exactly these attributes and
// refuses any other, so a change here must be mirrored there.
//
// Batches laid out back to back are folded into one taller GEMM by the
// executor first; the batched form (stride 0 for W) remains for the others.
//
// FP8 (x and w both float8: e4m3 x e4m3, e4m3 x e5m2 or e5m2 x e4m3; cuBLAS
// docs, cublasLtMatmul, "To use tensor- or block-scaled FP8 kernels" and its
// type table): on Ada (sm_89), Hopper (sm_90) and Blackwell GeForce (sm_12x)
// "A must be transposed and B non-transposed (The TN format)", i.e. both
// operands K-major. B := A (k x m, contiguous along k) already is; A := W must
// be too, so an fp8 W arrives K-major: the call's w operand is laid out
// [n, k] row-major (the native primitive asks XLA for that layout of an fp8 w
// on GPUs, docs/gpu-internals.md §6), described as the column-major k x n matrix with
// ld k and TRANSA = T. TN is taken on every GPU (sm_100 would also take NN).
// Compute type CUBLAS_COMPUTE_32F, scale type CUDA_R_32F, C and D of the
// output type (bf16, f16 or f32: the table's C = D rows);
// CUBLASLT_MATMUL_DESC_B_SCALE_POINTER := x's (the chunk's shard's) scale and
// A_SCALE_POINTER := w's, device float32 pointers set before every matmul (a
// shard's GEMM names its own); CUBLASLT_MATMUL_DESC_FAST_ACCUM = 0, so the
// tensor cores' sums are "periodically promoted to a higher precision"
// (fast accumulation would be faster and less accurate). That is not float32
// accumulation: between promotions (an interval cuBLASLt does not document)
// the FP8 tensor cores of compute capability 8.9 and 9.0 keep about 14 bits,
// truncating, per step of 16 or 32 products (cpp/cuda/fake/fp8_accumulator.h
// cites the sources and is what the fake computes; the selftest's bound,
// _selftest.fp8_accumulation, derives its FP8 term from it). Every pointer,
// leading dimension and batch stride 16-byte aligned,
// k a multiple of 16 ("pointers and matrix dimension must support 16-byte
// alignment"), compute capability 8.9 or newer: refused at prepare otherwise.
//
// MXFP8 (block_scaled: e4m3 x e4m3 with 1x32 e8m0 block scales): both
// CUBLASLT_MATMUL_DESC_A_SCALE_MODE and B_SCALE_MODE := VEC32_UE8M0 and the scale
// pointers name e8m0 tensors in cuBLAS's 128x4-tiled layout ("1D Block Scaling
// Factors Layout", docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout):
// per operand, the outer dimension (W's n, the program's a's m) in tiles of 128, K/32
// blocks in tiles of 4, a tile 512 contiguous bytes, tiles in row-of-tiles order. So 128
// whole rows of an operand's scales are one contiguous run, as they are in the row-major
// [rows, k/32] layout: a sub-chunk's scale rows travel as bytes whichever layout they hold,
// and the tiled bytes of a 128-row group sit where its row-major bytes would. What is not
// padded here is refused at prepare: m, n and k multiples of 128 (no padded tile), one
// matrix per cuBLASLt call (a batched block-scaled GEMM names no scale batch stride: the
// executor runs its batches one by one), the scale pointers 16-byte aligned (the layout
// section's rule), compute capability 10.x (Blackwell data-centre GPUs: the block-scaled
// tcgen05 MMA; Hopper has no block-scaled cuBLASLt GEMM; 12.x is not taken, never seen).
//
// C and D may differ only with identical layouts (cuBLASLt's out-of-place
// rule); the executor copies C into D first otherwise.
//
// Handles, descriptors and heuristic results are cached per device and shape.
// Set-ups of a device are serialised by a lock the enqueue path never takes
// (gemm.cc, DeviceCache). Device memory — the workspaces and the warm-up's
// buffers — is the caller's (GemmBuffers): allocating or freeing waits for the
// device and for every peer that maps its memory, so it is made where no peer
// can be waiting for this rank (the rank's pool, clique_state.h), never here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"

namespace jo::cuda {

struct GemmArgs {
  DType a_type = DType::kF32;    // the program's a (x's dtype)
  DType w_type = DType::kF32;    // W's: a_type, or both fp8
  DType out_type = DType::kF32;  // C's and D's: a_type or f32; any of f32/bf16/f16 for fp8
  // f32 only: CUBLAS_COMPUTE_32F_FAST_TF32 ("allows the library to use Tensor
  // Cores with automatic down-conversion and TF32 compute for 32-bit input and
  // output matrices", cublas docs, cublasComputeType_t) instead of
  // CUBLAS_COMPUTE_32F, which keeps full float32 products.
  bool tf32 = false;
  int64_t batch = 1, m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t a_bs = 0, a_ld = 0;
  const void* w = nullptr;
  int64_t w_ld = 0;  // fp8: K-major W, [n, k] row-major: w_ld >= k
  // fp8: device pointers to the float32 dequantization scales of a and W; block_scaled:
  // to their e8m0 block scale tensors, each in the 128x4-tiled layout (above).
  const void* a_scale = nullptr;
  const void* w_scale = nullptr;
  bool block_scaled = false;
  const void* c = nullptr;  // nullptr: beta = 0
  int64_t c_bs = 0, c_ld = 0;
  void* d = nullptr;
  int64_t d_bs = 0, d_ld = 0;
};

// The cuBLASLt workspace of one stream (cuBLAS's recommendation for Hopper).
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

// The device memory a GEMM uses, the caller's: the workspace of the stream the
// matmul runs on, and the warm-up's workspace and operands (WarmUpBytes).
struct GemmBuffers {
  void* workspace = nullptr;       // kGemmWorkspaceBytes
  void* warm_workspace = nullptr;  // kGemmWorkspaceBytes
  void* warm = nullptr;            // 256-byte aligned
  size_t warm_bytes = 0;
};

// What the warm-up of a GEMM of these shapes needs in GemmBuffers::warm: its
// operands in the call's own layouts, C apart from D when `args.c` is set (an
// out-of-place call; the pointers are not read), each placed at the alignment
// the call's matrix has.
size_t WarmUpBytes(const GemmArgs& args);

// Makes everything the GEMM needs (handle, plan) and enqueues nothing on the
// call's streams: the executor's prepare phase, so that enqueueing cannot fail
// half-way for want of a plan. A new plan runs once on a private stream
// (a warm-up: cuBLASLt loads its kernel at its first matmul on a device,
// which with lazy loading may wait for the device), in the call's form — out
// of place when the call is, every matrix at the alignment the call's has —
// on `buffers.warm`; then `*warmed` is set, and the call must JoinWarmUps
// before it returns.
Status PrepareLtMatmul(int device, const GemmArgs& args, const GemmBuffers& buffers,
                       const ErrorContext& ctx, bool* warmed);

// Orders `stream` after every warm-up of the device so far: a handler leaves no
// work behind that is not joined into XLA's stream. Only enqueues
// (cudaStreamWaitEvent).
Status JoinWarmUps(int device, cudaStream_t stream, const ErrorContext& ctx);

// Runs the GEMM on `stream` of the current device with `workspace` (kGemmWorkspaceBytes, the
// stream's); PrepareLtMatmul must have made its plan (an Internal error otherwise). Takes only
// the cache's look-up lock, which no set-up holds across a call that may wait for the device:
// a thread enqueueing never waits for another thread's set-up (gemm.cc, DeviceCache).
Status LtMatmul(int device, const GemmArgs& args, cudaStream_t stream, void* workspace,
                const ErrorContext& ctx);

// Frees every cached handle and plan (tests and process exit).
void ReleaseGemmCaches();

// Whether a GEMM of these operand types is an FP8 one (then both are fp8).
bool IsFp8Gemm(const GemmArgs& args);

// cublasLtGetVersion() of the loaded library.
size_t CublasLtVersion();

}  // namespace jo::cuda
