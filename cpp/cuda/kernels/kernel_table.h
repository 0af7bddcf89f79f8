// The executor's kernels as launch handles: what cudaLaunchKernel and
// cudaFuncGetAttributes take. One kernel per (body, element type, access
// width); the launcher (kernels_common.cc) picks one and launches it.
//
// Defined by the GPU build (kernels.cu, kernels_multimem.cu: the __global__
// functions) and by the fake build (fake/fake_kernels.cc: host kernels that
// run the same bodies over the grid). nullptr: no such kernel (a width the
// body does not have).
#pragma once

#include "cuda/kernels/kernel_body.h"

namespace jo::cuda::kernel {

// AddBlock: bytes in {16, 8, 4} and, for 16-bit elements, 2.
const void* AddKernel(Elem elem, int bytes);
// Reduce (d <- the sum of N blocks): bytes in {16, 8, 4} and, for 16-bit elements, 2.
const void* ReduceKernel(Elem elem, int bytes);
// Multimem kernels: bytes in {16, 8, 4}.
const void* McStoreKernel(Elem elem, int bytes);
const void* McReduceKernel(Elem elem, int bytes);

}  // namespace jo::cuda::kernel
