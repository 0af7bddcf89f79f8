// The bounded flag wait (flag_wait_body.h): one thread polls until the body says the wait is
// over (the flag reached, or given up after the call's timeout: the loop always ends). Compiled
// like the AddBlock kernels, for sm_80 and sm_90 with compute_90 PTX (cpp/cuda/CMakeLists.txt).
#include "cuda/kernels/device_ops.cuh"
#include "cuda/kernels/flag_wait_body.h"
#include "cuda/kernels/flag_wait_table.h"

namespace jo::cuda::kernel {

__global__ void __launch_bounds__(1) FlagWaitEntry(fw::Args a) {
  DeviceOps ops;
  fw::State state;
  while (!fw::Poll(ops, a, state)) __nanosleep(256);
}

const void* FlagWaitKernel() { return reinterpret_cast<const void*>(&FlagWaitEntry); }

}  // namespace jo::cuda::kernel
