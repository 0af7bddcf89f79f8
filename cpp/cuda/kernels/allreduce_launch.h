// The one-launch all-reduce seen from the host (allreduce_body.h is what its
// threads do): prepared once a call's buffers are known (the checks, the
// access width, the layout in the area, the kernel loaded: nothing enqueued),
// then launched — one cudaLaunchKernel, its arguments fixed: the sequence
// number, the half of the area and every flag value come from the device.
// Shared by the GPU build and the fake (only the kernels behind
// allreduce_table.h differ).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/kernels/allreduce_body.h"

namespace jo::cuda {

struct AllReduceCall {
  DType dtype = DType::kF32;  // y's
  bool multicast = false;     // else p2p
  bool two_shot = false;
  int32_t nranks = 0, rank = 0;
  void* y = nullptr;  // in place
  int64_t bytes = 0;
  // Half 0 of every rank's area as this GPU addresses it (multicast: only the own one is used),
  // and of the multicast address (multicast).
  std::vector<std::byte*> area;
  std::byte* mc = nullptr;
  std::vector<uint32_t*> state;  // every rank's state words as this GPU addresses them
  kernel::ar::Fault* fault = nullptr;
  uint32_t signature = 0;
  int64_t timeout_ns = 0;
};

struct PreparedAllReduce {
  const void* kernel = nullptr;
  kernel::ar::Args args;
  int access = 0;  // bytes per access
};

// The access width a call uses (16, 4 or 2 bytes; 0: none fits — a multicast call needs whole
// 32-bit words).
int AllReduceAccessBytes(DType dtype, bool multicast, const void* y, int64_t bytes);

// Checks the call (ranks, the layout fits the area, the GPU has the SMs for the co-resident
// blocks) and loads its kernel on `device` (the current one): set-up, before anything of the
// call is enqueued.
Status PrepareAllReduce(const AllReduceCall& call, int device, const ErrorContext& ctx,
                        PreparedAllReduce* out);

// One cudaLaunchKernel of the prepared kernel on `stream`.
Status LaunchAllReduce(const PreparedAllReduce& prepared, cudaStream_t stream,
                       const ErrorContext& ctx);

}  // namespace jo::cuda
