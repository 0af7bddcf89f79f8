// Host calls that wait for the GPU (fake_waits.h), each rule from its documentation:
//
//  * cudaMalloc and cudaFree wait for every queue of their device: "Managing memory
//    allocations using cudaMalloc and cudaFree causes the GPU to synchronize across all
//    executing CUDA streams" (CUDA programming guide, "Stream-Ordered Memory Allocator",
//    introduction; "Asynchronous Concurrent Execution", implicit synchronization: a device
//    memory allocation between two commands keeps them from running concurrently). NCCL
//    issue #549 and pull request #564 show the same for cuMemFree inside ncclCommAbort,
//    blocked behind a kernel that never ends. With peer access on, a device's memory is
//    mapped into its peers: "on success all allocations from peerContext will immediately be
//    accessible by the current context" (CUDA driver API, cuCtxEnablePeerAccess; the runtime's
//    cudaDeviceEnablePeerAccess "Enables direct access to memory allocations on a peer
//    device"), new ones included. Nothing in the references says that mapping a new
//    allocation into a peer, or unmapping a freed one, does not wait for that peer's work, so
//    the fake assumes it does: a cudaMalloc or cudaFree of device d's memory also waits for
//    every queue of every device with peer access to d. The VMM calls that give memory back
//    (cuMemUnmap, cuMemRelease) are modelled the same way: the driver API reference does
//    not promise that they do not wait, so the fake assumes they do.
//  * Lazy loading: "CUDA Runtime will only call cuModuleGetFunction() when a kernel is
//    used/referenced for the first time", and loading kernels "might require context
//    synchronization" (CUDA programming guide, "Lazy Loading", including "Potential
//    Hazards"); on by default since CUDA 12.2 on Linux, CUDA_MODULE_LOADING=EAGER loads
//    everything at context creation. So the first launch of a kernel on a device, the
//    first cudaFuncGetAttributes of it (which references it: NCCL's
//    ncclInitKernelsForDevice loads its kernels so), and cuBLASLt's first matmul with an
//    algorithm on a device wait for every queue of the device; later uses do not.
//  * A device-to-host cudaMemcpyAsync into pageable host memory (not page-locked:
//    cudaMallocHost) "will return only once the copy has completed" (CUDA runtime API, "API
//    synchronization behavior", Memcpy, asynchronous: "For transfers from device memory to
//    pageable host memory, the function will return only once the copy has completed"):
//    the copy is queued on its stream like any task, so the call waits for what is ahead of
//    it there and in its work queue. Into page-locked memory it is asynchronous.
//  * cudaMallocHost waits for every queue of the current device: a page-locked host memory
//    allocation is one of the operations between which commands of different streams cannot
//    run concurrently (CUDA programming guide, "Asynchronous Concurrent Execution", implicit
//    synchronization). cudaFreeHost is modelled the same way (assumed, as the VMM calls: the
//    reference does not promise it does not wait).
//  * ncclCommAbort frees the communicator's device memory (cudaFree: NCCL issue #549), so
//    once the communicator is marked aborted (its own kernels exit) it waits for every queue
//    of its device, kernels of other communicators included (NCCL pull request #564: "abort
//    or destroy all these communicators will cause system hang ... due to cuda implicit
//    synchronization").
//
// A wait lets the fake GPU run (as far as it can) and the other ranks' host threads
// (HostThread) go on enqueueing. When no rank's thread is left that is not waiting, time passes
// on the watchdog's virtual clock (up to Config::grace_ms, as while Drain waits): on a GPU the
// watchdog's thread goes on meanwhile and may release the GPU. It is a deadlock when the GPU
// cannot get the waited-for work done, no waiting thread's condition holds, no rank thread is
// left that is not waiting (each is waiting too, or gone) and the grace is spent: then nothing
// can ever enqueue what the GPU needs. The
// deadlock is recorded with the state of the queues, all work is dropped (a hung GPU: events
// report failure) and the call fails — never a hang of the test.
//
// The enqueue path: between a handler's first enqueue and its return only non-blocking calls
// may run (docs/gpu-internals.md §1, "What may run on the enqueue path"): anything else is refused.
#include "cuda/fake/fake_waits.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "cuda/fake/fake_internal.h"

namespace jo::fake {
namespace {

// Rank threads (HostThread) alive and how many of them are waiting for the GPU; the
// conditions every waiting thread waits for. Under S().mu.
int g_hosts = 0;
int g_hosts_waiting = 0;
int g_hosts_started = 0;  // since Reset: seeds each thread's jitter
std::map<const std::function<bool()>*, std::string> g_waiting;  // condition -> its wait
bool g_passing = false;          // a waiting rank's thread is letting time pass (WaitUntil)
std::atomic<int> g_in_waits{0};  // threads inside WaitUntil (ThreadsWaitingForGpu)
// (device, function) loaded so far. Under S().mu. Not per played process: the played
// processes share one OS process, whose caches (cuBLASLt plans, kernel verdicts) are per
// device ordinal, as a real process's are.
std::set<std::pair<int, std::string>> g_loaded;

thread_local bool t_host = false;
thread_local std::unique_ptr<std::mt19937_64> t_jitter;

// Host activity (work enqueued, a rank thread gone): what a waiting thread wakes up for.
std::mutex g_activity_mu;
std::condition_variable g_activity_cv;
uint64_t g_activity = 0;

uint64_t Activity() {
  std::lock_guard<std::mutex> lock(g_activity_mu);
  return g_activity;
}

// The calls allowed between a handler's first enqueue and its return: they enqueue, poll
// without waiting, or only answer from the host (docs/gpu-internals.md §1). Names as the fake
// counts them; every entry point of the fake counts itself first, so any other call is refused.
const std::set<std::string>& EnqueuePathCalls() {
  static const auto* calls = new std::set<std::string>{
      "cudaSetDevice", "cudaGetDevice", "cudaGetLastError", "cudaGetErrorName",
      "cudaGetErrorString", "cuGetErrorString", "ncclGetErrorString", "ncclGetLastError",
      "cublasLtGetStatusName", "cublasLtGetStatusString", "ncclGroupStart", "ncclGroupEnd",
      "cudaEventRecord", "cudaStreamWaitEvent", "cudaMemcpyAsync", "cudaMemcpy2DAsync",
      "cudaMemsetAsync", "cudaLaunchKernel", "cudaLaunchKernelEx", "AddBlock", "Reduce", "McStore",
      "McReduce", "AllReduce", "FlagWait", "cublasLtMatmul", "cublasLtMatmulDescSetAttribute",
      "cuStreamWriteValue32", "cuStreamWaitValue32", "cuStreamWaitValue32(FLUSH)", "ncclSend",
      "ncclRecv", "ncclCommGetAsyncError", "cudaEventQuery",
      // Listed, never observed: CUTLASS's
      // calls inside the fused launch, which
      // the fake replaces as a whole
      // (fake_fused_gemm.cc), and NVTX's
      // ranges (header-only, a tool's).
      "cudaGetDriverEntryPoint", "cudaGetDriverEntryPointByVersion", "cuTensorMapEncodeTiled",
      "nvtxRangePushA", "nvtxRangePop"};
  return *calls;
}

// Waits until `done` holds (see the top of this file); `what` names the call for a report.
// `settle`: the deadlock is reported only after kSettle without any host activity, for a
// thread that is not a rank's (an abort thread of the watchdog: its siblings, aborting the
// other communicators, are not HostThreads either and may not have reached the fake yet).
// When every rank's thread waits, a rank's wait first lets time pass, up to Config::grace_ms in
// steps of kStep (Config::pass_time: the watchdog's virtual clock, as in Drain): on a GPU the
// watchdog's thread runs while the ranks' threads wait, and may release the GPU.
constexpr std::chrono::milliseconds kSettle(2000);
constexpr std::chrono::milliseconds kStep(10);
bool WaitUntil(const std::function<bool()>& done, const std::string& what, bool settle = false) {
  struct Inside {
    Inside() { ++g_in_waits; }
    ~Inside() { --g_in_waits; }
  } inside;
  auto quiet_since = std::chrono::steady_clock::now();
  uint64_t last = Activity();
  std::chrono::milliseconds grace(0);
  {
    Lock lock(S().mu);
    if (t_host && S().config.pass_time) grace = std::chrono::milliseconds(S().config.grace_ms);
  }
  for (;;) {
    const uint64_t seen = Activity();
    if (seen != last) {
      last = seen;
      quiet_since = std::chrono::steady_clock::now();
    }
    const bool settled = !settle || std::chrono::steady_clock::now() - quiet_since >= kSettle;
    {
      std::unique_lock<std::recursive_mutex> lock(S().mu);
      if (RunUntil(done)) return true;
      bool another_can = g_passing;
      for (const auto& [condition, other] : g_waiting) another_can = another_can || (*condition)();
      const int others_running = g_hosts - g_hosts_waiting - (t_host ? 1 : 0);
      if (!another_can && others_running <= 0 && settled && grace.count() > 0) {
        const auto step = std::min(kStep, grace);
        grace -= step;
        g_passing = true;
        lock.unlock();
        PassTime(step);
        lock.lock();
        g_passing = false;
        lock.unlock();
        NoteHostActivity();
        continue;
      }
      if (!another_can && others_running <= 0 && settled) {
        std::string others;
        for (const auto& [condition, other] : g_waiting) others += "; also waiting: " + other;
        S().errors.push_back(what +
                             " would wait forever: deadlock: the GPU waits for work that "
                             "no host thread can enqueue any more (every rank's thread waits "
                             "for the GPU too, or is gone" +
                             others + "); " + DescribeStuckWork());
        DropAllWork();
        return false;
      }
      g_waiting[&done] = what;
      if (t_host) ++g_hosts_waiting;
    }
    {
      std::unique_lock<std::mutex> lock(g_activity_mu);
      g_activity_cv.wait_for(lock, std::chrono::milliseconds(1),
                             [&] { return g_activity != seen; });
    }
    Lock lock(S().mu);
    g_waiting.erase(&done);
    if (t_host) --g_hosts_waiting;
  }
}

}  // namespace

HostThread::HostThread() {
  Lock lock(S().mu);
  ++g_hosts;
  t_host = true;
  const uint64_t index = static_cast<uint64_t>(g_hosts_started++);
  if (S().config.host_jitter != 0)
    t_jitter = std::make_unique<std::mt19937_64>(S().config.host_jitter * 1000003 + index);
}

HostThread::~HostThread() {
  {
    Lock lock(S().mu);
    --g_hosts;
    t_host = false;
    t_jitter.reset();
  }
  NoteHostActivity();
}

int ThreadsWaitingForGpu() { return g_in_waits.load(); }

void NoteHostActivity() {
  {
    std::lock_guard<std::mutex> lock(g_activity_mu);
    ++g_activity;
  }
  g_activity_cv.notify_all();
}

void Jitter() {
  if (!t_jitter) return;
  switch ((*t_jitter)() % 4) {
    case 0:
      return;
    case 1:
      std::this_thread::yield();
      return;
    case 2:
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      return;
    default:
      std::this_thread::sleep_for(std::chrono::microseconds(300));
  }
}

bool LazyLoading() {
  Lock lock(S().mu);
  if (S().config.module_loading != 0) return S().config.module_loading == 1;
  const char* mode = std::getenv("CUDA_MODULE_LOADING");
  return mode == nullptr || std::strcmp(mode, "EAGER") != 0;  // lazy by default (CUDA 12.2+)
}

void ResetWaits() {
  Lock lock(S().mu);
  g_loaded.clear();
  g_hosts_started = 0;
}

std::function<bool()> DeviceWorkBefore(int device) {
  // Every task enqueued on the device before now (of this thread's played process).
  std::map<const CUstream_st*, int64_t> before;
  {
    Lock lock(S().mu);
    for (const auto& st : S().streams)
      if (st->process == t_process && st->device == device && st->completed < st->enqueued)
        before[st.get()] = st->enqueued;
  }
  return [before] {
    for (const auto& [st, count] : before)
      if (st->completed < count && (st->running || !st->tasks.empty())) return false;
    return true;  // completed, or dropped (a hung or dead GPU: nothing left to wait for)
  };
}

bool WaitFor(const std::function<bool()>& done, const std::string& what) {
  return WaitUntil(done, what);
}

bool WaitForDevice(int device, const std::string& call, bool settle) {
  return WaitUntil(DeviceWorkBefore(device),
                   call + " on device " + std::to_string(device) +
                       " (it waits for every work queue of the device)",
                   settle);
}

bool WaitForMemoryOf(int device, const std::string& call) {
  std::vector<int> mappers;  // devices with peer access to `device`: its memory is in theirs
  {
    Lock lock(S().mu);
    for (const auto& [from, to] : S().peer_enabled)
      if (to == device && from != device) mappers.push_back(from);
  }
  std::vector<std::function<bool()>> conditions{DeviceWorkBefore(device)};
  std::string also;
  for (int d : mappers) {
    conditions.push_back(DeviceWorkBefore(d));
    also += (also.empty() ? " and of device " : ", ") + std::to_string(d);
  }
  const std::function<bool()> done = [conditions] {
    for (const auto& condition : conditions)
      if (!condition()) return false;
    return true;
  };
  return WaitUntil(done, call + " on device " + std::to_string(device) +
                             " (it waits for every work queue of the device" + also +
                             (mappers.empty() ? "" : ", which maps its memory: peer access") + ")");
}

bool WaitForTask(cudaStream_t s, int64_t seq, const std::string& call) {
  int device = 0;
  {
    Lock lock(S().mu);
    device = s->device;
  }
  const std::function<bool()> done = [s, seq] {
    return s->completed >= seq || (!s->running && s->tasks.empty());  // completed, or dropped
  };
  return WaitUntil(done, call + " on device " + std::to_string(device) +
                             " (it returns only once the copy has completed)");
}

bool LoadFunction(int device, const std::string& function, const std::string& call) {
  if (!LazyLoading()) return true;
  const auto key = std::make_pair(device, function);
  {
    Lock lock(S().mu);
    if (g_loaded.count(key) > 0) return true;
  }
  CheckEnqueuePath(("lazy loading of " + function).c_str());
  if (!WaitForDevice(device, call + " loading " + function + " (lazy loading)")) return false;
  Lock lock(S().mu);
  g_loaded.insert(key);
  return true;
}

bool AwaitOtherCommunicators(ncclComm_t comm) {
  int device = 0;
  {
    Lock lock(S().mu);
    device = comm->device;
  }
  NoteHostActivity();  // marked aborted: its kernels exit, a waiting abort may go on
  return WaitForDevice(
      device, "ncclCommAbort (rank " + std::to_string(comm->rank) + ", freeing its device memory)",
      /*settle=*/true);
}

void CheckEnqueuePath(const char* api) {
  if (!HandlerEnqueued() || EnqueuePathCalls().count(api) > 0) return;
  Fail(std::string(api) +
       " called between a handler's first enqueue and its return: only calls that enqueue or "
       "poll without waiting may run there, since ranks' work already on the GPU may wait for "
       "this thread's next enqueue (docs/gpu-internals.md §1, \"What may run on the enqueue "
       "path\")");
}

}  // namespace jo::fake
