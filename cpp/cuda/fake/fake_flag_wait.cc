// The fake's bounded flag wait (cuda/kernels/flag_wait_body.h): the SAME body as the GPU's one
// thread runs, one poll each time the fake's GPU looks at the kernel, with the GPU-only
// operations modelled here. The kernel needs a free SM to start (a persistent kernel beside it
// may hold them all: the fake's SM model, fake_queues.cc), and its clock is the GPUs' (the time
// the fake lets pass while stuck): a flag not reached timeout_ns after the first poll gives up
// and writes the fault record, as the body says. Checked at launch: one block of one thread,
// the flag in device memory the device may touch, the fault record in page-locked host memory
// (the watchdog reads it with plain host loads while the kernel may still run).
#include <cuda_runtime_api.h>

#include <cstring>
#include <memory>
#include <string>

#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_kernels.h"
#include "cuda/kernels/flag_wait_body.h"
#include "cuda/kernels/flag_wait_table.h"

namespace jo::fake {
namespace {

namespace fw = cuda::kernel::fw;

class WaitOps {
 public:
  uint32_t LoadAcquireSys32(const uint32_t* p) const { return Read(p); }
  uint32_t LoadRelaxedSys32(const uint32_t* p) const { return Read(p); }
  void StoreRelaxedSys(uint32_t* p, uint32_t v) const { std::memcpy(p, &v, 4); }
  void FenceReleaseSys() const {}  // stores land in program order here
  bool Claim(uint32_t* word) const {
    if (Read(word) != 0) return false;
    StoreRelaxedSys(word, 1);
    return true;
  }
  int64_t GlobalNs() const { return S().gpu_ns; }

 private:
  static uint32_t Read(const uint32_t* p) {
    uint32_t v = 0;
    std::memcpy(&v, p, 4);
    return v;
  }
};

bool Pinned(const void* p, size_t bytes) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (const auto& [base, size] : S().pinned)
    if (at >= base && at + bytes <= base + size) return true;
  return false;
}

cudaError_t LaunchFlagWait(const std::string& name, int, dim3 grid, dim3 block, void** params,
                           size_t shared, cudaStream_t stream) {
  Lock lock(S().mu);
  const int device = stream->device;
  auto bad = [&](const std::string& what) {
    Fail("cudaLaunchKernel " + name + " on device " + std::to_string(device) + ": " + what);
    return cudaErrorInvalidValue;
  };
  if (grid.x != 1 || grid.y != 1 || grid.z != 1 || block.x != 1 || block.y != 1 || block.z != 1 ||
      shared != 0)
    return bad("launch configuration not the kernel's (one block of one thread)");
  const fw::Args a = *static_cast<const fw::Args*>(params[0]);  // copied at launch, as CUDA does
  if (a.flag == nullptr || reinterpret_cast<uintptr_t>(a.flag) % 4 != 0 ||
      !CheckAccess(a.flag, 4, device, (name + " flag").c_str()))
    return bad("the flag is not a 4-byte word of device memory this device may touch");
  if (a.fault == nullptr || !Pinned(a.fault, sizeof(fw::Fault)))
    return bad("the fault record is not in page-locked host memory (cudaMallocHost)");
  if (a.timeout_ns <= 0) return bad("timeout_ns <= 0: the wait would give up at once");
  FakeTask task;
  task.what = name + " (flag " + std::to_string(a.flag_id) + " from rank " +
              std::to_string(a.writer) + ") on device " + std::to_string(device);
  task.sms = true;
  task.ready = [] { return true; };
  // A fresh state per start: a replayed launch begins again from its copied arguments.
  auto state = std::make_shared<fw::State>();
  task.run = [state] { *state = fw::State{}; };
  task.done = [state, a] {
    WaitOps ops;
    return fw::Poll(ops, a, *state);
  };
  Push(stream, std::move(task));
  return cudaSuccess;
}

}  // namespace
}  // namespace jo::fake

namespace jo::cuda::kernel {

const void* FlagWaitKernel() {
  return fake::RegisterKernel("FlagWait", "FlagWait", "add", &fake::LaunchFlagWait);
}

}  // namespace jo::cuda::kernel
