// The CUDA executor: enqueues one rank's Program on the GPU.
//
// A thin mapping, one op to one (or one per batch) API call (docs/gpu.md):
//   Gemm        cuBLASLt matmul on the op's stream (gemm.h has the layout mapping)
//   Add         AddBlock kernel
//   Copy        cudaMemcpyAsync / cudaMemcpy2DAsync (to the peer's mapping: copy engine)
//   Send/Recv   ncclSend / ncclRecv, ops of one `group` inside ncclGroupStart/End
//   McStore     multimem.st kernel through the multicast address
//   McReduce    multimem.ld_reduce kernel through the multicast address
//   Signal      cuStreamWriteValue32(peer's flag, epoch)   (default: with a memory fence)
//   Wait        cuStreamWaitValue32(own flag, epoch, GEQ)  (cyclic 32-bit comparison)
//   Record      cudaEventRecord          StreamWait   cudaStreamWaitEvent
// Program stream 0 is XLA's stream; streams 1.. are the rank's own
// (high-priority, non-blocking). They are forked from XLA's stream with an
// event at the start and joined back into it at the end, so XLA sees one
// ordinary op on its stream. Nothing here blocks the host.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "core/call.h"
#include "core/program.h"
#include "core/status.h"
#include "cuda/check.h"
#include "cuda/cuda_clique.h"

namespace jo::cuda {

struct RunArgs {
  const Program* program = nullptr;
  int device = -1;
  cudaStream_t stream = nullptr;  // XLA's stream (program stream 0)
  int64_t epoch = 0;
  const Generation* gen = nullptr;
  RankResources* resources = nullptr;
  ncclComm_t comm = nullptr;
  CallBuffers io;
  ErrorContext ctx;
  std::chrono::milliseconds timeout{0};  // for host-side NCCL progress (AwaitNccl)
};

Status EnqueueProgram(const RunArgs& args);

}  // namespace jo::cuda
