// The bounded flag wait (flag_wait_body.h) as a launch handle: defined by the GPU build
// (flag_wait.cu, with the AddBlock kernels' architectures) and by the fake
// (fake/fake_flag_wait.cc: a host kernel that runs the same polls).
#pragma once

namespace jo::cuda::kernel {

const void* FlagWaitKernel();

}  // namespace jo::cuda::kernel
