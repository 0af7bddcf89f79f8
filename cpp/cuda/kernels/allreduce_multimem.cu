// The one-launch all-reduce over multicast (allreduce_body.h): multimem, so
// compiled like the other multimem kernels, for sm_90 and compute_90 only.
#include "cuda/kernels/allreduce_kernel.cuh"
#include "cuda/kernels/allreduce_table.h"

namespace jo::cuda::kernel {

const void* AllReduceMulticastKernel(Elem elem, int bytes) {
  return AllReduceFor<true>(elem, bytes);
}

}  // namespace jo::cuda::kernel
