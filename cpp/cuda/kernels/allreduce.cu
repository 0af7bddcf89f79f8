// The one-launch all-reduce over p2p (allreduce_body.h): compiled like the
// AddBlock kernels, for sm_80 and sm_90 with compute_90 PTX (cpp/cuda/CMakeLists.txt).
#include "cuda/kernels/allreduce_kernel.cuh"
#include "cuda/kernels/allreduce_table.h"

namespace jo::cuda::kernel {

const void* AllReducePeerKernel(Elem elem, int bytes) { return AllReduceFor<false>(elem, bytes); }

}  // namespace jo::cuda::kernel
