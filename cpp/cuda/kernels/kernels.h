// The device kernels of the CUDA executor, seen from the host.
//
// Four block operations the copy engine and cuBLASLt cannot do:
//   AddBlock   d += a                       (second accumulator of a bidirectional RS)
//   Reduce     d <- a_0 + ... + a_{N-1}     (the fused GEMM + RS's sum of N partials, one pass)
//   McStore    a -> every rank's workspace   through the multicast address (multimem.st)
//   McReduce   d <- sum over ranks           through the multicast address (multimem.ld_reduce)
// All work on a batched-strided block (batch x m x n; strides and leading
// dims in elements, as in the program IR) with f32 arithmetic, in the widest
// accesses (16, 8, 4 or 2 bytes) the block's addresses allow, on a grid sized
// to the block or to an SM budget (`sms`: the SMs a fused GEMM beside it left
// free; 0: the whole device).
//
// What each thread does is kernel_body.h, one source for the GPU and the fake.
// The launchers (kernels_common.cc, also shared) choose the access width and
// grid and launch with cudaLaunchKernel; the multimem ones first check, once
// per device and kernel, that the variant of the kernel this GPU runs was
// compiled with multimem (cudaFuncGetAttributes: ptxVersion >= 90) — never the
// compute capability, which says nothing about the code the driver loaded.
// bf16/f16 multimem instructions only come in pairs (.bf16x2/.f16x2): such a
// block needs an even width, even strides and 4-byte aligned addresses.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"

namespace jo::cuda {

struct BlockArgs {
  DType dtype = DType::kF32;
  void* dst = nullptr;        // McStore: the multicast address
  const void* src = nullptr;  // McReduce: the multicast address
  int64_t batch = 0, m = 0, n = 0;
  int64_t src_batch_stride = 0, src_ld = 0;
  int64_t dst_batch_stride = 0, dst_ld = 0;
  int32_t sms = 0;  // the SMs the grid is sized to (0: the whole device)
};

// A Reduce: the destination block (dst, its strides, batch x m x n) and its
// sources, summed in their order (at most kernel::kMaxReduceSources).
struct ReduceArgs {
  DType dtype = DType::kF32;  // of the destination and every source
  void* dst = nullptr;
  int64_t batch = 0, m = 0, n = 0;
  int64_t dst_batch_stride = 0, dst_ld = 0;
  struct Source {
    const void* ptr = nullptr;
    int64_t batch_stride = 0, ld = 0;
  };
  std::vector<Source> sources;
  int32_t sms = 0;  // the SMs the grid is sized to (0: the whole device)
};

// Blocks of kernel::kThreads threads one SM holds at once (2048 resident threads per SM on
// compute capability 8.0 to 9.0: CUDA programming guide, "Compute Capabilities"): a grid of
// sms x kBlocksPerSm blocks fits on `sms` SMs.
inline constexpr int64_t kBlocksPerSm = 16;

// Whether a multicast block satisfies the pairing rule above.
bool MulticastBlockOk(const BlockArgs& args);

// Set-up of a launch (before the call enqueues anything): the checks (the
// multicast pairing rule; multimem code in the variant the device runs) and
// loading the kernel the launch will run (lazy loading would otherwise load it
// at the launch, which may wait for the device). Nothing is enqueued.
enum class BlockKernel { kAdd, kMcStore, kMcReduce };
Status PrepareBlockKernel(BlockKernel kind, const BlockArgs& args, const ErrorContext& ctx);
Status PrepareReduce(const ReduceArgs& args, const ErrorContext& ctx);
// The same for any kernel of this build: loads it once per device and, for a multimem kernel
// (`multimem` names it; null for another), checks the variant the device runs has multimem;
// for a kernel whose waits are bounded by %globaltimer (`clocked` names it), that the device
// runs a cubin of it, not PTX it JIT-compiles (PTX ISA, "Special Registers": the value of
// %globaltimer is unspecified "when JIT-compiled to other targets"), so the bound holds.
Status PrepareKernel(const void* kernel, const char* multimem, const ErrorContext& ctx,
                     const char* clocked = nullptr);

Status LaunchAddBlock(const BlockArgs& args, cudaStream_t stream, const ErrorContext& ctx);
Status LaunchMcStore(const BlockArgs& args, cudaStream_t stream, const ErrorContext& ctx);
Status LaunchMcReduce(const BlockArgs& args, cudaStream_t stream, const ErrorContext& ctx);
Status LaunchReduce(const ReduceArgs& args, cudaStream_t stream, const ErrorContext& ctx);

// The grid of a launch (blocks of kernel::kThreads): x over the accesses of a row, z over
// batches, y over rows, at most 2048 blocks, and at most sms x kBlocksPerSm when `sms` > 0.
dim3 BlockGrid(int64_t cols, int64_t rows, int64_t batch, int32_t sms);

// The width of the accesses the launchers use for a block (bytes; 0: none
// fits — a multicast block breaking the pairing rule).
int AccessBytes(const BlockArgs& args, bool multimem);

// Forgets which kernels each device was found to run (tests: the fake's
// devices change between cases; a real device's never do).
void ForgetKernelVerdicts();

// What the build put in the fatbinary for each kernel family ("add",
// "multimem"): cubins as "sm_XY", PTX as "compute_XY" (CMakeLists.txt).
const std::map<std::string, std::vector<std::string>>& KernelImages();

// "add: sm_80 sm_90 compute_90; multimem: sm_90 compute_90" for build_info().
std::string KernelsDescription();

}  // namespace jo::cuda
