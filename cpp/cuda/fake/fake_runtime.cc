// The fake CUDA runtime: devices, memory (and CUDA IPC, peer access),
// streams, events and copies (see fake_runtime.h). Definitions match the
// declarations of the real headers exactly (they are included), so a
// signature drift is a compile error.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <iterator>
#include <mutex>

#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_waits.h"

using jo::fake::Count;
using jo::fake::Fail;
using jo::fake::Lock;
using jo::fake::RtFail;
using jo::fake::S;
using jo::fake::t_device;
using jo::fake::t_last;

// ============================ CUDA runtime ============================

cudaError_t cudaGetLastError(void) {
  Count("cudaGetLastError");
  if (const cudaError_t sticky = jo::fake::StickyError(t_device); sticky != cudaSuccess) {
    t_last = cudaSuccess;
    return sticky;  // a sticky error is never reset
  }
  cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}
const char* cudaGetErrorName(cudaError_t e) {
  Count("cudaGetErrorName");
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorFake";
}
const char* cudaGetErrorString(cudaError_t e) {
  Count("cudaGetErrorString");
  return e == cudaSuccess ? "no error" : "fake CUDA error (see fake errors)";
}

cudaError_t cudaGetDevice(int* d) {
  Count("cudaGetDevice");
  *d = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  Count("cudaSetDevice");
  jo::fake::Jitter();  // Config::host_jitter: ranks' threads at uneven speeds
  Lock lock(S().mu);
  if (!jo::fake::ValidDevice(d))
    return RtFail(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(d) + ")");
  t_device = d;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  jo::fake::Jitter();
  Count("cudaMalloc");
  // It waits for every queue of the device and of the devices that map its memory
  // (fake_waits.cc).
  if (!jo::fake::WaitForMemoryOf(t_device, "cudaMalloc")) return cudaErrorMemoryAllocation;
  // Real cudaMalloc memory is not zeroed: poison it.
  *p = jo::fake::Malloc(t_device, bytes, 0x5A);
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  jo::fake::Jitter();
  {
    int device = -1;
    {
      Lock lock(S().mu);
      Count("cudaFree");
      if (const jo::fake::Alloc* a = jo::fake::Find(p, 1)) device = a->device;
    }
    // It waits for every queue of the device and of the devices that map its memory
    // (fake_waits.cc).
    if (device >= 0 && !jo::fake::WaitForMemoryOf(device, "cudaFree")) return cudaErrorUnknown;
  }
  Lock lock(S().mu);
  auto it = S().allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.viewer >= 0 || it->second.vmm)
    return RtFail(cudaErrorInvalidValue, "cudaFree of an unknown pointer");
  jo::fake::Unmap(it->second.mem, it->second.bytes);
  S().allocs.erase(it);
  return cudaSuccess;
}

// Page-locked host memory (the watchdog reads flags into it): host memory the fake remembers, so
// that a device-to-host copy into it is asynchronous and one into any other host memory is not.
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  jo::fake::Jitter();
  Count("cudaMallocHost");
  // A page-locked allocation waits for every queue of the device (fake_waits.cc).
  if (!jo::fake::WaitForDevice(t_device, "cudaMallocHost")) return cudaErrorMemoryAllocation;
  Lock lock(S().mu);
  std::byte* mem = jo::fake::MapShared(bytes);
  if (mem == nullptr) return RtFail(cudaErrorMemoryAllocation, "cudaMallocHost: out of memory");
  S().pinned[reinterpret_cast<uintptr_t>(mem)] = bytes;
  *p = mem;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  jo::fake::Jitter();
  Count("cudaFreeHost");
  if (!jo::fake::WaitForDevice(t_device, "cudaFreeHost")) return cudaErrorUnknown;
  Lock lock(S().mu);
  auto it = S().pinned.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().pinned.end())
    return RtFail(cudaErrorInvalidValue, "cudaFreeHost of a pointer cudaMallocHost did not return");
  ::munmap(p, jo::fake::PageRound(it->second));
  S().pinned.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  Lock lock(S().mu);
  Count("cudaMemsetAsync");
  if (!jo::fake::StreamOk(s, "cudaMemsetAsync") ||
      !jo::fake::CheckAccess(p, bytes, s->device, "cudaMemsetAsync"))
    return RtFail(cudaErrorInvalidValue, "cudaMemsetAsync");
  jo::fake::Push(
      s, "cudaMemsetAsync", [] { return true; },
      [p, value, bytes] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

// Host synchronisation lets the fake GPU run (deterministically) until the
// stream is idle; if it cannot get there the real call would never return.
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Lock lock(S().mu);
  Count("cudaStreamSynchronize");
  if (!jo::fake::StreamOk(s, "cudaStreamSynchronize"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize");
  if (s->capture != 0)
    return RtFail(cudaErrorStreamCaptureUnsupported,
                  "cudaStreamSynchronize on a capturing stream (CUDA programming guide, stream "
                  "capture: synchronizing or querying a capturing stream is prohibited)");
  if (!jo::fake::RunUntil([s] { return s->tasks.empty() && !s->running; }))
    return RtFail(cudaErrorInvalidValue,
                  "cudaStreamSynchronize would block forever: its work waits behind work that "
                  "never completes");
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  Lock lock(S().mu);
  Count("cudaDeviceSynchronize");
  const int device = t_device;
  auto idle = [device] {
    for (auto& st : S().streams)
      if (st->device == device && (!st->tasks.empty() || st->running)) return false;
    return true;
  };
  if (!jo::fake::RunUntil(idle))
    return RtFail(cudaErrorInvalidValue, "cudaDeviceSynchronize on device " +
                                             std::to_string(device) +
                                             " would block forever: queued work never completes");
  return cudaSuccess;
}

static cudaError_t MakeStream(cudaStream_t* out) {
  Lock lock(S().mu);
  auto st = std::make_unique<CUstream_st>();
  st->device = t_device;
  st->process = jo::fake::t_process;
  st->id = S().stream_ids++;
  jo::fake::MapOntoQueue(st.get());
  *out = st.get();
  S().streams.push_back(std::move(st));
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  Count("cudaStreamCreateWithFlags");
  if (flags != cudaStreamNonBlocking)
    return RtFail(cudaErrorInvalidValue, "streams must be non-blocking");
  return MakeStream(s);
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int) {
  Count("cudaStreamCreateWithPriority");
  if (flags != cudaStreamNonBlocking)
    return RtFail(cudaErrorInvalidValue, "streams must be non-blocking");
  return MakeStream(s);
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  Count("cudaDeviceGetStreamPriorityRange");
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) {
  Count("cudaStreamDestroy");  // kept until Reset
  return cudaSuccess;
}

// Stream capture and graphs: fake_graphs.cc.

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  Count("cudaStreamIsCapturing");
  Lock lock(S().mu);
  if (!jo::fake::StreamOk(s, "cudaStreamIsCapturing"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaStreamIsCapturing");
  *status = s->capture != 0 ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, cudaStreamCaptureStatus* status,
                                     unsigned long long* id, cudaGraph_t* graph,
                                     const cudaGraphNode_t** dependencies,
                                     const cudaGraphEdgeData** edges, size_t* count) {
  Lock lock(S().mu);
  Count("cudaStreamGetCaptureInfo");
  if (!jo::fake::StreamOk(s, "cudaStreamGetCaptureInfo"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaStreamGetCaptureInfo");
  if (graph != nullptr || dependencies != nullptr || edges != nullptr || count != nullptr)
    return RtFail(cudaErrorInvalidValue,
                  "cudaStreamGetCaptureInfo: only the status and the id are modelled");
  *status = s->capture != 0 ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  if (id != nullptr) *id = s->capture;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  Count("cudaEventCreateWithFlags");
  Lock lock(S().mu);
  if (flags != cudaEventDisableTiming)
    return RtFail(cudaErrorInvalidValue, "events must disable timing");
  auto ev = std::make_unique<CUevent_st>();
  ev->device = t_device;
  *e = ev.get();
  S().events.push_back(std::move(ev));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) {
  Count("cudaEventDestroy");
  return cudaSuccess;
}

// A host query sees the GPU as far as it could have run on the event's device.
namespace {
std::mutex g_query_hook_mu;
std::function<void(cudaEvent_t)> g_query_hook;
}  // namespace

void jo::fake::SetEventQueryHook(std::function<void(cudaEvent_t)> hook) {
  std::lock_guard<std::mutex> lock(g_query_hook_mu);
  g_query_hook = std::move(hook);
}

cudaError_t cudaEventQuery(cudaEvent_t e) {
  std::function<void(cudaEvent_t)> hook;
  {
    std::lock_guard<std::mutex> lock(g_query_hook_mu);
    hook = g_query_hook;
  }
  if (hook) hook(e);
  Lock lock(S().mu);
  Count("cudaEventQuery");
  bool known = false;
  for (auto& ev : S().events) known = known || ev.get() == e;
  if (!known) return cudaErrorInvalidResourceHandle;  // (destroyed by a reset)
  if (e->captured != 0)
    return RtFail(cudaErrorStreamCaptureUnsupported,
                  "cudaEventQuery of an event recorded during stream capture (CUDA programming "
                  "guide, stream capture: querying the execution status of a captured event is "
                  "prohibited; a handler must refuse a capturing stream)");
  jo::fake::RunUntil([e] { return e->completed >= e->recorded || e->abandoned; });
  if (e->completed >= e->recorded) return cudaSuccess;
  return e->abandoned ? cudaErrorLaunchFailure : cudaErrorNotReady;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Lock lock(S().mu);
  Count("cudaEventRecord");
  if (!jo::fake::StreamOk(s, "cudaEventRecord"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaEventRecord");
  if (e->device != s->device)
    return RtFail(cudaErrorInvalidResourceHandle,
                  "cudaEventRecord: event and stream on different devices");
  if (s->capture != 0) {  // a node of the capture's graph
    jo::fake::RecordEventIntoCapture(e, s);
    return cudaSuccess;
  }
  jo::fake::RecordEvent(e, s);
  return cudaSuccess;
}

namespace jo::fake {

void RecordEvent(cudaEvent_t e, cudaStream_t s) {
  const int64_t seq = ++e->recorded;
  e->captured = 0;
  e->captured_record = -1;
  e->abandoned = false;
  FakeTask task;
  task.what = "cudaEventRecord";
  task.ready = [] { return true; };
  task.run = [e, seq] { e->completed = std::max(e->completed, seq); };
  task.records = e;
  Push(s, std::move(task));
  e->clock = s->clock;  // what this record is ordered after (itself included)
}

void WaitEvent(cudaStream_t s, cudaEvent_t e) {
  const int64_t target = e->recorded;  // the record enqueued before this call
  if (target == 0)
    Fail("cudaStreamWaitEvent on an event never recorded (a no-op on a GPU: a missing dependency)");
  Push(s, "cudaStreamWaitEvent", [e, target] { return e->completed >= target; }, [] {});
  for (const auto& [st, seq] : e->clock) {  // ordered after everything before the record
    int64_t& mine = s->clock[st];
    if (seq > mine) mine = seq;
  }
}

}  // namespace jo::fake

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  Lock lock(S().mu);
  Count("cudaStreamWaitEvent");
  if (!jo::fake::StreamOk(s, "cudaStreamWaitEvent") || flags != 0)
    return RtFail(cudaErrorInvalidValue, "cudaStreamWaitEvent");
  if (e->captured != 0 && s->capture == 0) {
    if (s->device != e->device)
      return RtFail(cudaErrorInvalidValue,
                    "cudaStreamWaitEvent: a stream of another device joining a capture is not "
                    "modelled");
    s->capture = e->captured;  // waiting on a captured event joins the capture
    jo::fake::WaitIntoCapture(s, e);
    return cudaSuccess;
  }
  if (s->capture != 0 && e->captured != s->capture)
    return RtFail(cudaErrorStreamCaptureIsolation,
                  "cudaStreamWaitEvent: a capturing stream waits on an event recorded outside "
                  "its capture");
  if (s->capture != 0) {  // an edge between two streams of the capture
    jo::fake::WaitIntoCapture(s, e);
    return cudaSuccess;
  }
  jo::fake::WaitEvent(s, e);
  return cudaSuccess;
}

// CUDA IPC. The fake's "device memory" is this OS process's heap, so IPC is
// modelled within one OS process (the tests play several processes in one):
// a handle names the allocation's base (and the pid, checked); opening it
// returns a new mapping of the same pages that only the opening device may
// touch (cudaIpcMemLazyEnablePeerAccess: no other peer access is implied).
// Like the driver: only a whole allocation's base can be exported, opening
// in another "process" requires the handle be well-formed, close needs an open.
namespace {
constexpr char kIpcTag[] = "fake-ipc";
struct FakeIpc {
  char tag[sizeof(kIpcTag)];
  int64_t pid;
  uint64_t base;
  uint64_t bytes;
};
static_assert(sizeof(FakeIpc) <= sizeof(cudaIpcMemHandle_t), "fake IPC handle too big");
}  // namespace

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* p) {
  Lock lock(S().mu);
  Count("cudaIpcGetMemHandle");
  auto it = S().allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.multicast || it->second.vmm || it->second.viewer >= 0)
    return RtFail(cudaErrorInvalidValue,
                  "cudaIpcGetMemHandle: not the base of a cudaMalloc allocation");
  FakeIpc ipc{};
  std::memcpy(ipc.tag, kIpcTag, sizeof(kIpcTag));
  ipc.pid = ::getpid();
  ipc.base = it->first;
  ipc.bytes = it->second.bytes;
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle, &ipc, sizeof(ipc));
  return cudaSuccess;
}

cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t handle, unsigned int flags) {
  Lock lock(S().mu);
  Count("cudaIpcOpenMemHandle");
  FakeIpc ipc{};
  std::memcpy(&ipc, &handle, sizeof(ipc));
  if (std::memcmp(ipc.tag, kIpcTag, sizeof(kIpcTag)) != 0)
    return RtFail(cudaErrorInvalidValue,
                  "cudaIpcOpenMemHandle: not a handle from cudaIpcGetMemHandle");
  if (ipc.pid != ::getpid())
    return RtFail(cudaErrorInvalidValue,
                  "cudaIpcOpenMemHandle: the fake models CUDA IPC within one "
                  "OS process only (handle from pid " +
                      std::to_string(ipc.pid) + ")");
  auto it = S().allocs.find(ipc.base);
  if (it == S().allocs.end() || it->second.bytes != ipc.bytes || it->second.viewer >= 0)
    return RtFail(cudaErrorInvalidValue, "cudaIpcOpenMemHandle: the exported allocation is gone");
  if (flags != cudaIpcMemLazyEnablePeerAccess)
    return RtFail(
        cudaErrorInvalidValue,
        "cudaIpcOpenMemHandle: flags other than cudaIpcMemLazyEnablePeerAccess are not modelled");
  if (it->second.device != t_device) {
    if (!jo::fake::CanAccessPeer(t_device, it->second.device))
      return RtFail(cudaErrorPeerAccessUnsupported,
                    "cudaIpcOpenMemHandle: device " + std::to_string(t_device) +
                        " cannot access device " + std::to_string(it->second.device));
  }
  std::byte* alias = jo::fake::Alias(it->second.mem, it->second.bytes);
  if (alias == nullptr)
    return RtFail(cudaErrorMemoryAllocation, "cudaIpcOpenMemHandle: mremap failed");
  jo::fake::Alloc mapping{it->second.bytes, it->second.device, false, 0, alias};
  mapping.viewer = t_device;
  S().allocs[reinterpret_cast<uintptr_t>(alias)] = mapping;
  ++S().ipc_open[reinterpret_cast<uintptr_t>(alias)];
  *p = alias;
  return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void* p) {
  Lock lock(S().mu);
  Count("cudaIpcCloseMemHandle");
  auto it = S().ipc_open.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().ipc_open.end() || it->second == 0)
    return RtFail(cudaErrorInvalidValue, "cudaIpcCloseMemHandle: not an opened IPC mapping");
  --it->second;
  auto alloc = S().allocs.find(it->first);
  if (alloc != S().allocs.end()) {
    jo::fake::Unmap(alloc->second.mem, alloc->second.bytes);
    S().allocs.erase(alloc);
  }
  S().ipc_open.erase(it);
  return cudaSuccess;
}

cudaError_t cudaDeviceCanAccessPeer(int* can, int a, int b) {
  Count("cudaDeviceCanAccessPeer");
  Lock lock(S().mu);
  if (!jo::fake::ValidDevice(a) || !jo::fake::ValidDevice(b))
    return RtFail(cudaErrorInvalidDevice, "cudaDeviceCanAccessPeer");
  *can = jo::fake::CanAccessPeer(a, b);
  return cudaSuccess;
}

cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  Lock lock(S().mu);
  Count("cudaDeviceEnablePeerAccess");
  if (!jo::fake::ValidDevice(peer) || flags != 0 || peer == t_device ||
      !jo::fake::CanAccessPeer(t_device, peer))
    return RtFail(cudaErrorInvalidDevice, "cudaDeviceEnablePeerAccess");
  if (!S().peer_enabled.insert({t_device, peer}).second) {
    t_last = cudaErrorPeerAccessAlreadyEnabled;
    return cudaErrorPeerAccessAlreadyEnabled;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  Count("cudaMemcpyAsync");
  if (kind == cudaMemcpyDeviceToHost) {  // the watchdog reading flags into host memory
    bool pageable = true;
    int64_t seq = 0;
    {
      Lock lock(S().mu);
      if (!jo::fake::StreamOk(s, "cudaMemcpyAsync") ||
          !jo::fake::CheckAccess(src, bytes, s->device, "cudaMemcpyAsync D2H src"))
        return RtFail(cudaErrorInvalidValue, "cudaMemcpyAsync D2H");
      const uintptr_t d = reinterpret_cast<uintptr_t>(dst);
      auto it = S().pinned.upper_bound(d);
      pageable =
          it == S().pinned.begin() || d + bytes > std::prev(it)->first + std::prev(it)->second;
      if (pageable) jo::fake::CheckEnqueuePath("cudaMemcpyAsync into pageable host memory");
      jo::fake::Push(
          s, "cudaMemcpyAsync D2H", [] { return true; }, [=] { std::memcpy(dst, src, bytes); });
      seq = s->enqueued;
    }
    // Into pageable memory the call returns only once the copy has completed (fake_waits.cc).
    if (pageable &&
        !jo::fake::WaitForTask(s, seq, "cudaMemcpyAsync device-to-host into pageable memory"))
      return cudaErrorUnknown;
    return cudaSuccess;
  }
  Lock lock(S().mu);
  if (kind != cudaMemcpyDefault && kind != cudaMemcpyDeviceToDevice)
    return RtFail(cudaErrorInvalidMemcpyDirection, "cudaMemcpyAsync kind");
  if (!jo::fake::StreamOk(s, "cudaMemcpyAsync") ||
      !jo::fake::CheckAccess(src, bytes, s->device, "cudaMemcpyAsync src") ||
      !jo::fake::CheckAccess(dst, bytes, s->device, "cudaMemcpyAsync dst"))
    return RtFail(cudaErrorInvalidValue, "cudaMemcpyAsync");
  jo::fake::Push(
      s, "cudaMemcpyAsync", [] { return true; },
      [=] {
        bool reported = false;  // a copy of a fused GEMM's output before its release
        jo::fake::CheckReleased(src, bytes, "cudaMemcpyAsync", &reported);
        std::memmove(dst, src, bytes);
      });
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                              size_t width, size_t height, cudaMemcpyKind kind, cudaStream_t s) {
  Lock lock(S().mu);
  Count("cudaMemcpy2DAsync");
  if (kind != cudaMemcpyDefault && kind != cudaMemcpyDeviceToDevice)
    return RtFail(cudaErrorInvalidMemcpyDirection, "cudaMemcpy2DAsync kind");
  if (width > dpitch || width > spitch)
    return RtFail(cudaErrorInvalidPitchValue, "cudaMemcpy2DAsync: width exceeds a pitch");
  if (height == 0 || width == 0) return cudaSuccess;
  const size_t dspan = (height - 1) * dpitch + width, sspan = (height - 1) * spitch + width;
  if (!jo::fake::StreamOk(s, "cudaMemcpy2DAsync") ||
      !jo::fake::CheckAccess(src, sspan, s->device, "cudaMemcpy2DAsync src") ||
      !jo::fake::CheckAccess(dst, dspan, s->device, "cudaMemcpy2DAsync dst"))
    return RtFail(cudaErrorInvalidValue, "cudaMemcpy2DAsync");
  // A 2-D copy to or from a peer's memory while a fused GEMM of the device holds every SM:
  // CUDA documents no copy engine for cudaMemcpy2DAsync (nor says it never runs as a kernel),
  // and one run as a kernel would wait for the SMs while the peers' fused GEMMs wait for its
  // data (docs/gpu-internals.md §5, rule 1). The executor copies such blocks 1-D, a copy per batch.
  const jo::fake::Alloc* from = jo::fake::Find(src, sspan);
  const jo::fake::Alloc* to = jo::fake::Find(dst, dspan);
  const bool peer =
      (from != nullptr && from->device != s->device) || (to != nullptr && to->device != s->device);
  if (peer && jo::fake::PersistentKernelPending(s->process, s->device))
    return RtFail(cudaErrorInvalidValue,
                  "cudaMemcpy2DAsync of peer memory on device " + std::to_string(s->device) +
                      " behind the fused GEMM, which holds every SM: CUDA documents no copy "
                      "engine for a 2-D copy, and one run as a kernel would wait for the SMs "
                      "while the peers' fused GEMMs wait for its data (use 1-D copies)");
  jo::fake::Push(
      s, "cudaMemcpy2DAsync", [] { return true; },
      [=] {
        bool reported = false;  // a copy of a fused GEMM's output before its release
        for (size_t r = 0; r < height; ++r) {
          jo::fake::CheckReleased(static_cast<const char*>(src) + r * spitch, width,
                                  "cudaMemcpy2DAsync", &reported);
          std::memmove(static_cast<char*>(dst) + r * dpitch,
                       static_cast<const char*>(src) + r * spitch, width);
        }
      });
  return cudaSuccess;
}
