// The misuse suite of the bounded flag-wait kernel (FlagWaitMisuseChecks, fake_checks.h;
// cuda/kernels/flag_wait_body.h): the launches the fake refuses, each with what it cites, and
// the kernel's own behaviour — a flag raised on another stream ends the wait with the record
// untouched (control), a flag never raised ends it after timeout_ns on the GPUs' clock with
// the record written.
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
    kGaveUpBefore
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
    if (how == How::kGaveUpBefore) pinned->code = pinned->claim = 1;  // an earlier wait gave up
    fw::Args a;
    static uint32_t host_word = 0;  // pageable host memory: no device reaches it
    a.flag = how == How::kHostFlag ? &host_word : flag;
    a.value = 1;
    a.flag_id = 7;
    a.writer = 3;
    // 1 s of the GPUs' clock; a rank that gave up before: far past the fake's grace, so only
    // ending at once drains
    a.timeout_ns = how == How::kNoTimeout      ? 0
                   : how == How::kGaveUpBefore ? int64_t{1} << 50
                                               : 1000000000;
    a.fault =
        how == How::kDeviceRecord ? static_cast<fw::Fault*>(Malloc(0, sizeof(fw::Fault))) : pinned;
    cudaStream_t waiting = StreamOn(0), raising = StreamOn(0);
    void* params[] = {&a};
    const dim3 threads(how == How::kTwoThreads ? 2 : 1);
    (void)cudaLaunchKernel(cuda::kernel::FlagWaitKernel(), dim3(1), threads, params, 0, waiting);
    if (how != How::kNeverRaised && how != How::kGaveUpBefore)
      (void)drv->cuStreamWriteValue32(reinterpret_cast<CUstream>(raising),
                                      reinterpret_cast<CUdeviceptr>(flag), 1,
                                      CU_STREAM_WRITE_VALUE_DEFAULT);
    const bool drained = Drain();
    const auto errors = Errors();
    std::string got = errors.empty() ? "" : errors.front();
    if (errors.empty() && (!drained || pinned->code != 0))
      got = std::string(drained ? "" : "not drained; ") + "record: code " +
            std::to_string(pinned->code) + " flag " + std::to_string(pinned->flag) + " writer " +
            std::to_string(pinned->writer) + " seen " + std::to_string(pinned->seen) + " value " +
            std::to_string(pinned->value);
    out[name] = got;
    (void)cudaFreeHost(pinned);
  };
  run("a flag raised on another stream (control)", How::kControl);
  run("a flag never raised", How::kNeverRaised);
  run("a fault record in device memory", How::kDeviceRecord);
  run("a launch of two threads", How::kTwoThreads);
  run("a timeout of 0", How::kNoTimeout);
  run("a flag in pageable host memory", How::kHostFlag);
  run("a flag never raised, on a rank that gave up before", How::kGaveUpBefore);
  ResetExecutorAndFake(Config());
  return out;
}

}  // namespace jo::fake
