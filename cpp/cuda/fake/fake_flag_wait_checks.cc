// The misuse suite of the bounded flag-wait kernel (FlagWaitMisuseChecks, fake_checks.h;
// cuda/kernels/flag_wait_body.h): the launches the fake refuses, each with what it cites, and
// the kernel's own behaviour — a flag raised on another stream ends the wait with the record
// untouched (control); a flag never raised ends it after timeout_ns on the GPUs' clock with the
// record written and a trap (the device's sticky error: its later work never runs); two waits
// of one rank that give up together leave one record and one trap; a device that would run the
// kernel JIT-compiled (its %globaltimer unspecified) is refused before any launch.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>

#include "cuda/base/driver.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_harness.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/kernels/flag_wait_body.h"
#include "cuda/kernels/flag_wait_table.h"
#include "cuda/kernels/kernels.h"

namespace jo::fake {

std::map<std::string, std::string> FlagWaitMisuseChecks() {
  namespace fw = cuda::kernel::fw;
  std::map<std::string, std::string> out;
  enum class How {
    kControl,
    kNeverRaised,
    kDeviceRecord,
    kTwoThreads,
    kNoTimeout,
    kHostFlag,
    kTwoGiveUp
  };
  auto run = [&](const std::string& name, How how) {
    Config config;
    config.devices = 1;
    config.grace_ms = 3000;
    ResetExecutorAndFake(config);
    cudaSetDevice(0);
    const cuda::DriverApi* drv = nullptr;
    if (!cuda::LoadDriver(&drv).ok()) return;
    auto* flag = static_cast<uint32_t*>(Malloc(0, sizeof(uint32_t)));
    fw::Fault* pinned = nullptr;
    (void)cudaMallocHost(reinterpret_cast<void**>(&pinned), sizeof(fw::Fault));
    *pinned = fw::Fault{};
    fw::Args a;
    static uint32_t host_word = 0;  // pageable host memory: no device reaches it
    a.flag = how == How::kHostFlag ? &host_word : flag;
    a.value = 1;
    a.flag_id = 7;
    a.writer = 3;
    a.timeout_ns = how == How::kNoTimeout ? 0 : 1000000000;  // 1 s of the GPUs' clock
    a.fault =
        how == How::kDeviceRecord ? static_cast<fw::Fault*>(Malloc(0, sizeof(fw::Fault))) : pinned;
    cudaStream_t waiting = StreamOn(0), raising = StreamOn(0);
    void* params[] = {&a};
    const dim3 threads(how == How::kTwoThreads ? 2 : 1);
    (void)cudaLaunchKernel(cuda::kernel::FlagWaitKernel(), dim3(1), threads, params, 0, waiting);
    // A second wait of the rank, on another stream, for another flag never raised: it gives up
    // at the same time, loses the claim, and ends with the first one's trap.
    fw::Args second = a;
    second.flag = static_cast<uint32_t*>(Malloc(0, sizeof(uint32_t)));
    second.flag_id = 9;
    void* second_params[] = {&second};
    if (how == How::kTwoGiveUp)
      (void)cudaLaunchKernel(cuda::kernel::FlagWaitKernel(), dim3(1), threads, second_params, 0,
                             StreamOn(0));
    // Work behind the wait on its stream: it never runs once the device trapped.
    auto* after = static_cast<uint32_t*>(Malloc(0, sizeof(uint32_t)));
    (void)drv->cuStreamWriteValue32(reinterpret_cast<CUstream>(waiting),
                                    reinterpret_cast<CUdeviceptr>(after), 5,
                                    CU_STREAM_WRITE_VALUE_DEFAULT);
    if (how != How::kNeverRaised && how != How::kTwoGiveUp)
      (void)drv->cuStreamWriteValue32(reinterpret_cast<CUstream>(raising),
                                      reinterpret_cast<CUdeviceptr>(flag), 1,
                                      CU_STREAM_WRITE_VALUE_DEFAULT);
    const bool drained = Drain();
    std::string got;
    for (const std::string& e : Errors()) got += (got.empty() ? "" : "; ") + e;
    if (!drained || pinned->code != 0)
      got += std::string(got.empty() ? "" : "; ") + (drained ? "" : "not drained; ") +
             "record: code " + std::to_string(pinned->code) + " flag " +
             std::to_string(pinned->flag) + " writer " + std::to_string(pinned->writer) + " seen " +
             std::to_string(pinned->seen) + " value " + std::to_string(pinned->value);
    if (how == How::kControl || how == How::kNeverRaised || how == How::kTwoGiveUp) {
      // the write behind the wait (the fake's device memory is the host's: read in place)
      got += std::string(got.empty() ? "" : "; ") + "after: " + std::to_string(*after);
    }
    out[name] = got;
    (void)cudaFreeHost(pinned);
  };
  run("a flag raised on another stream (control)", How::kControl);
  run("a flag never raised", How::kNeverRaised);
  run("a fault record in device memory", How::kDeviceRecord);
  run("a launch of two threads", How::kTwoThreads);
  run("a timeout of 0", How::kNoTimeout);
  run("a flag in pageable host memory", How::kHostFlag);
  run("two waits of one rank that give up together", How::kTwoGiveUp);
  // A device that would JIT-compile the kernel (an sm_120 GPU: this build has sm_80, sm_90 and
  // sm_100 cubins and compute_90 PTX): refused at set-up, before any launch.
  {
    Config config;
    config.devices = 1;
    config.cc_major = 12;
    ResetExecutorAndFake(config);
    cudaSetDevice(0);
    cuda::ErrorContext ctx;
    ctx.op = "flag wait";
    const Status status =
        cuda::PrepareKernel(cuda::kernel::FlagWaitKernel(), nullptr, ctx, "the bounded flag wait");
    out["a device that would JIT-compile it"] = status.ok() ? "" : status.message();
  }
  ResetExecutorAndFake(Config());
  return out;
}

}  // namespace jo::fake
