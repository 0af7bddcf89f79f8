file(REMOVE_RECURSE
  "libjo_cuda_exec.a"
)
