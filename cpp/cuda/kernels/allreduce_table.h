// The one-launch all-reduce kernels as launch handles (allreduce_body.h): one
// per (element type, access width) and transport. Defined by the GPU build
// (allreduce.cu: p2p, for sm_80 and newer; allreduce_multimem.cu: multicast,
// sm_90 and compute_90 only, as every multimem kernel) and by the fake
// (fake/fake_allreduce.cc: host kernels that run the same body per thread).
// nullptr: no such kernel (widths: 16 and 4 bytes, and 2 for 16-bit elements
// over p2p).
#pragma once

#include "cuda/kernels/kernel_body.h"

namespace jo::cuda::kernel {

const void* AllReducePeerKernel(Elem elem, int bytes);
const void* AllReduceMulticastKernel(Elem elem, int bytes);

}  // namespace jo::cuda::kernel
