// The fused GEMM: one persistent CUTLASS sm90 GEMM whose tiles wait for, or
// release, per-row-block flags (cuda/fused/fused_gemm_kernel.cuh), seen from the host.
//
//   D[l] (m x n) = A[l] (m x k) @ B (k x n)      row-major, f32 accumulation,
//                                                 l < batch, B shared by every l
//
// The rows of A and D are cut into the program's flagged row blocks
// (core/fused_tiles.h: block b = shard * chunks + sub, flag b):
//  * waits (all-gather + GEMM): before loading a tile of A, the kernel waits
//    until every flag covering the tile's rows has reached `epoch`
//    (wait_flags[b], compared cyclically as the stream waits compare:
//    (int32_t)(flag - epoch) >= 0) — except the blocks of `ready_shard`,
//    which are in place before the launch (the local shard);
//  * releases (GEMM + reduce-scatter): once every tile touching block b has
//    been stored, the kernel sets release_flags[b] = epoch (after the stores
//    are complete; a release at system scope), so a stream waiting on the flag
//    (cuStreamWaitValue32) can move the block on.
// Tiles run in the order `sequence` gives (fused_tiles.h, TileOrder): the
// blocks in the order they arrive (waits; key kLastArrival) or leave
// (releases; key kFirstDeparture).
//
// No wait is unbounded: a flag that has not reached the epoch `timeout_ns`
// after a tile started waiting is recorded in `*fault` (the first one only)
// and the kernel goes on without it — every later wait of the launch gives up
// at once — so the kernel always finishes; its results are then garbage and
// the caller must read `*fault` (device memory) and report.
//
// Two kernels, one flag protocol (fused_gemm_sync.cuh): sm_90a code for
// compute capability 9.0 (H100/H200/GH200; fused_gemm_kernel.cuh) and sm_100a
// code for 10.0 (B200/GB200; fused_gemm_kernel_sm100.cuh, bf16 and f16, 2-SM MMA:
// its tile order is over 256-row MMA tiles). Arch-specific code runs on
// exactly its architecture, so no other GPU can run either (docs/gpu-internals.md
// §5). Compiled in CI; never run on a GPU here.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "core/fused_tiles.h"
#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/fused/fused_gemm_launch.h"

namespace jo::cuda {

// Which fused GEMM kernel runs on a GPU: the sm90 one on compute capability
// 9.0, the sm100 one on 10.0, none elsewhere.
enum class FusedKernel { kNone, kSm90, kSm100 };
FusedKernel FusedKernelFor(int cc_major, int cc_minor);
// The kernel's MMA tile in CTA tiles of fused::kTileRows rows: its tile order's unit.
int32_t MmaPairOf(FusedKernel kernel);

// The element types of a fused GEMM: A's (x), B's (w) and D's (y). One sm90
// instantiation per triple core/kinds.h's FusedServes accepts: a 16-bit type
// for all three, or an FP8 pair with its output (JO_FUSED_FP8); sm100: the 16-bit ones.
struct FusedTypes {
  DType a = DType::kBF16, b = DType::kBF16, d = DType::kBF16;
};

// The fused GEMM's arguments: its launch (fused_gemm_launch.h), whose tile
// order CheckFusedGemm makes from `sequence` and `key`, the element types and
// the kernel (FusedKernelFor the device's compute capability).
// FP8: B is K-major (B^T, n x k row-major) and `scales` are set.
struct FusedGemmArgs : fused_kernel::Launch {
  FusedTypes types;
  FusedKernel kernel = FusedKernel::kSm90;
  const int32_t* sequence = nullptr;  // every block once, in arrival / departure order
  fused::OrderKey key = fused::OrderKey::kLastArrival;
};

// The device state a caller keeps for a fused GEMM of `blocks` row blocks:
// its fault record, then the launch's counters.
inline size_t FusedStateBytes(int32_t blocks) {
  return sizeof(FusedGemmFault) + fused_kernel::Launch::CounterBytes(blocks);
}

// Checks the arguments, without touching a GPU, and makes their tile order
// (`args->order`): once per call, at prepare; LaunchFusedGemm relies on both.
Status CheckFusedGemm(FusedGemmArgs* args);

// Loads `kernel` for `types` on the current device and gives it its shared
// memory; fails, naming the GPU, on one that cannot run it (`kernel` is not
// FusedKernelFor its compute capability, or has no instantiation for
// `types`). Call it at set-up, never while other work the GPU must finish
// depends on this thread: with lazy loading (the default since CUDA 12.2) a
// kernel's first use loads its module, which may wait for the device (CUDA
// programming guide, "Lazy Loading", potential hazards).
Status PrepareFusedGemm(const FusedTypes& types, FusedKernel kernel, const ErrorContext& ctx);

// Enqueues the fused GEMM of `args`, as CheckFusedGemm passed and completed
// them, on `stream` (after zeroing the counters, when it releases). Fails,
// enqueueing nothing, when PrepareFusedGemm has not run for this device, these
// types and kernel. Calls nothing that waits for the device: it runs on the enqueue path.
Status LaunchFusedGemm(const FusedGemmArgs& args, cudaStream_t stream, const ErrorContext& ctx);

// Forgets which devices PrepareFusedGemm prepared (tests: the fake's devices
// change between cases; a real device's never do).
void ForgetFusedGemmPreparation();

}  // namespace jo::cuda
