// The one-launch all-reduce's __global__ entry point (allreduce_body.h): each
// block runs the body's phases in order, a __syncthreads() after each; a phase
// that waits is run again until it is done (its wait gives up on its own after
// the call's timeout, so the loop always ends).
#pragma once

#include "cuda/kernels/allreduce_body.h"
#include "cuda/kernels/device_ops.cuh"

namespace jo::cuda::kernel {

template <class Body>
__global__ void __launch_bounds__(ar::kThreads) AllReduceKernel(ar::Args a) {
  __shared__ ar::BlockShared shared;
  ar::ThreadState state;
  DeviceOps ops;
  const Thread t{blockIdx.x, 0, 0, gridDim.x, 1, 1, threadIdx.x, blockDim.x};
  for (int phase = 0; phase < Body::kPhases; ++phase) {
    while (!Body::Run(phase, ops, a, shared, state, t)) __nanosleep(64);
    __syncthreads();
  }
}

template <Elem kElem, bool kMulticast>
const void* PickAllReduce(int bytes) {
  switch (bytes) {
    case 16:
      return reinterpret_cast<const void*>(
          &AllReduceKernel<ar::AllReduceBody<kElem, 16, kMulticast>>);
    case 4:
      return reinterpret_cast<const void*>(
          &AllReduceKernel<ar::AllReduceBody<kElem, 4, kMulticast>>);
    case 2:
      if constexpr (!kMulticast && ElemBytes(kElem) == 2)
        return reinterpret_cast<const void*>(
            &AllReduceKernel<ar::AllReduceBody<kElem, 2, kMulticast>>);
      return nullptr;
  }
  return nullptr;
}

template <bool kMulticast>
const void* AllReduceFor(Elem elem, int bytes) {
  switch (elem) {
    case Elem::kF32:
      return PickAllReduce<Elem::kF32, kMulticast>(bytes);
    case Elem::kBF16:
      return PickAllReduce<Elem::kBF16, kMulticast>(bytes);
    case Elem::kF16:
      return PickAllReduce<Elem::kF16, kMulticast>(bytes);
    case Elem::kF8:  // sums never run in fp8
      return nullptr;
  }
  return nullptr;
}

}  // namespace jo::cuda::kernel
