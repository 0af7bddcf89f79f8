// The fake's stream capture of several streams and its graph replay (fake_graphs.cc), one
// deliberate misuse per rule and the controls: GraphChecks in fake_checks.h.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <functional>
#include <map>
#include <string>

#include "cuda/base/driver.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_runtime.h"

namespace jo::fake {
namespace {

const cuda::DriverApi* Driver() {
  const cuda::DriverApi* drv = nullptr;
  (void)cuda::LoadDriver(&drv);
  return drv;
}

CUstream Cu(cudaStream_t s) { return reinterpret_cast<CUstream>(s); }
CUdeviceptr Ptr(void* p) { return reinterpret_cast<CUdeviceptr>(p); }

// A graph captured from two streams of device 0 and launched `launches` times, each with new
// data in `a`: s1 (forked from s0) copies a to b and raises a flag; s0 waits for the flag —
// recorded BEFORE s1's copy and raise, so a replay that ran the nodes on one stream in their
// recorded order would wait forever — then copies b to c and lowers the flag (the graph is
// the same every launch). After each launch c must be that launch's a. `join`: s1 is joined
// back into s0 before the capture ends (without: cudaErrorStreamCaptureUnjoined).
void TwoStreams(int launches, bool join) {
  const cuda::DriverApi* drv = Driver();
  cudaStream_t s0 = StreamOn(0), s1 = StreamOn(0);
  cudaEvent_t fork = nullptr, joined = nullptr;
  cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
  cudaEventCreateWithFlags(&joined, cudaEventDisableTiming);
  constexpr size_t kBytes = 16;
  auto* a = static_cast<float*>(Malloc(0, kBytes));
  void* b = Malloc(0, kBytes);
  auto* c = static_cast<float*>(Malloc(0, kBytes));
  void* flag = Malloc(0, 4);
  cudaStreamBeginCapture(s0, cudaStreamCaptureModeThreadLocal);
  cudaEventRecord(fork, s0);
  cudaStreamWaitEvent(s1, fork, 0);
  drv->cuStreamWaitValue32(Cu(s0), Ptr(flag), 1, CU_STREAM_WAIT_VALUE_GEQ);
  cudaMemcpyAsync(b, a, kBytes, cudaMemcpyDefault, s1);
  drv->cuStreamWriteValue32(Cu(s1), Ptr(flag), 1, CU_STREAM_WRITE_VALUE_DEFAULT);
  cudaMemcpyAsync(c, b, kBytes, cudaMemcpyDefault, s0);
  drv->cuStreamWriteValue32(Cu(s0), Ptr(flag), 0, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (join) {
    cudaEventRecord(joined, s1);
    cudaStreamWaitEvent(s0, joined, 0);
  }
  cudaGraph_t graph = nullptr;
  if (cudaStreamEndCapture(s0, &graph) != cudaSuccess) return;  // the fake recorded why
  cudaGraphExec_t exec = nullptr;
  if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) return;
  for (int i = 0; i < launches; ++i) {
    const float data[4] = {1.0f + i, 2.0f * i, -3.0f, 0.5f + i};
    std::memcpy(a, data, kBytes);
    std::memset(c, 0, kBytes);
    if (cudaGraphLaunch(exec, s0) != cudaSuccess || !Drain()) return;
    if (std::memcmp(c, data, kBytes) != 0)
      Fail("graph launch " + std::to_string(i) + ": c is not that launch's a");
  }
}

}  // namespace

std::map<std::string, std::string> GraphChecks() {
  std::map<std::string, std::string> out;
  auto check = [&](const std::string& name, int connections, const std::function<void()>& body) {
    Config config;
    config.devices = 2;
    config.connections = connections;
    Reset(config);
    cudaSetDevice(0);
    body();
    Drain();
    const auto errors = Errors();
    out[name] = errors.empty() ? "" : errors.front();
  };
  check("a graph of two streams launched three times (control)", 8, [] { TwoStreams(3, true); });
  check("a forked stream not joined back before the capture ends", 8, [] { TwoStreams(1, false); });
  // One work queue: the replay enqueues the nodes in their recorded order, as the capture's
  // streams would have been; s0's wait then blocks the queue ahead of the write it waits for.
  check("one work queue, a wait recorded ahead of its write", 1, [] { TwoStreams(1, true); });
  return out;
}

}  // namespace jo::fake
