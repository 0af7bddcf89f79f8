// The fake's bounded flag wait (cuda/kernels/flag_wait_body.h): the SAME body as the GPU's one
// thread runs, one poll each time the fake's GPU looks at the kernel, with the GPU-only
// operations modelled here. The kernel needs a free SM to start (a persistent kernel beside it
// may hold them all: the fake's SM model, fake_queues.cc), and its clock is the GPUs' (the time
// the fake lets pass while stuck): a flag not reached timeout_ns after the first poll gives up,
// writes the fault record and traps (the device's sticky error), as the body says. Checked at
// launch: one block of one thread, the flag in device memory the device may touch, the fault
// record in page-locked host memory (the watchdog reads it from the host while the kernel may
// still run).
#include <cuda_runtime_api.h>

#include <atomic>
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

// The record is page-locked host memory the watchdog reads from another thread while the
// kernel may write it: atomic accesses (relaxed, and the fence a release fence), so that the
// fake, like the GPU, has no data race there.
class WaitOps {
 public:
  uint32_t LoadAcquireSys32(const uint32_t* p) const {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
  }
  void StoreRelaxedSys(uint32_t* p, uint32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
  void FenceReleaseSys() const { std::atomic_thread_fence(std::memory_order_release); }
  void FenceSys() const { std::atomic_thread_fence(std::memory_order_seq_cst); }
  bool Claim(uint32_t* word) const {
    uint32_t expected = 0;
    return __atomic_compare_exchange_n(word, &expected, 1u, false, __ATOMIC_RELAXED,
                                       __ATOMIC_RELAXED);
  }
  int64_t GlobalNs() const { return S().gpu_ns; }
  void Trap() { trapped = true; }

  bool trapped = false;
};

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
  task.done = [state, a, device, what = task.what] {
    WaitOps ops;
    const bool over = fw::Poll(ops, a, *state);
    // __trap(): a sticky error, the device's queued work dropped (fake_kernels.cc).
    if (ops.trapped)
      PoisonWhenPolled(device, cudaErrorIllegalInstruction,
                       what + " gave up after its timeout, recorded why and trapped");
    return over;
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
