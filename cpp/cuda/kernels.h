// The device kernels of the CUDA executor, seen from the host.
//
// Three block operations the copy engine and cuBLASLt cannot do:
//   AddBlock   d += a                       (second accumulator of a bidirectional RS)
//   McStore    a -> every rank's workspace   through the multicast address (multimem.st)
//   McReduce   d <- sum over ranks           through the multicast address (multimem.ld_reduce)
// All three work on a batched-strided block (batch x m x n; strides and
// leading dims in elements, as in the program IR) with f32 arithmetic.
// McStore/McReduce exist for sm_90 only (NVLS); the launchers refuse other
// devices with a clear status. bf16/f16 multimem instructions only come in
// pairs (.bf16x2/.f16x2, checked with ptxas): the block must then have an
// even width, even strides and 4-byte aligned addresses.
//
// kernels.cu implements the launchers on the GPU; the host-side fake build
// (cpp/cuda/fake/) links host equivalents instead — in that build only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "core/program.h"
#include "core/status.h"
#include "cuda/check.h"

namespace jo::cuda {

struct BlockArgs {
  DType dtype = DType::kF32;
  void* dst = nullptr;        // McStore: the multicast address
  const void* src = nullptr;  // McReduce: the multicast address
  int64_t batch = 0, m = 0, n = 0;
  int64_t src_batch_stride = 0, src_ld = 0;
  int64_t dst_batch_stride = 0, dst_ld = 0;
};

// Whether a multicast block satisfies the pairing rule above.
bool MulticastBlockOk(const BlockArgs& args);

Status LaunchAddBlock(const BlockArgs& args, cudaStream_t stream, const ErrorContext& ctx);
Status LaunchMcStore(const BlockArgs& args, cudaStream_t stream, const ErrorContext& ctx);
Status LaunchMcReduce(const BlockArgs& args, cudaStream_t stream, const ErrorContext& ctx);

// "kernels: sm_80 sm_90a (multimem)" for build_info().
const char* KernelsDescription();

}  // namespace jo::cuda
