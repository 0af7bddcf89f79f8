file(REMOVE_RECURSE
  "libjo_cuda_kernels.a"
)
