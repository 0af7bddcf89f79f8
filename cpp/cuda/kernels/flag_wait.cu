// The bounded flag wait (flag_wait_body.h): one thread polls until the body says the wait is
// over (the flag reached), or traps once it gave up after the call's timeout. Compiled like the
// AddBlock kernels (JO_ADD_KERNEL_ARCHS, cpp/cuda/CMakeLists.txt: sm_80, sm_90 and sm_100
// cubins, each from its own virtual architecture, and compute_90 PTX, which a newer GPU would
// JIT-compile — refused there: PrepareKernel's `clocked` check).
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
