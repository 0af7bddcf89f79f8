// The fake's model (see fake_runtime.h): its state and the memory checks
// every call makes (fake_queues.cc has the GPU that runs the queued work).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_kernels.h"
#include "cuda/fake/fake_waits.h"
#include "cuda/kernels/kernels.h"

namespace jo::fake {

State& S() {
  static auto* s = new State();
  return *s;
}

thread_local int t_device = 0;
thread_local int t_process = 0;
thread_local int t_group_depth = 0;
thread_local std::vector<NcclP2p> t_group;
thread_local bool t_group_nonblocking_init = false;
thread_local cudaError_t t_last = cudaSuccess;

size_t PageRound(size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}
std::byte* MapShared(size_t bytes) {
  void* p =
      ::mmap(nullptr, PageRound(bytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : static_cast<std::byte*>(p);
}
void Unmap(std::byte* p, size_t bytes) {
  if (p == nullptr) return;
  State& s = S();
  const size_t size = PageRound(bytes);
  if (s.malloced.erase(p) > 0 && s.spare_bytes + size <= State::kSpareBytes) {
    s.spare.emplace(size, p);
    s.spare_bytes += size;
    return;
  }
  (void)::munmap(p, size);
}
std::byte* Alias(std::byte* p, size_t bytes, std::byte* at) {
  void* q = at == nullptr ? ::mremap(p, 0, PageRound(bytes), MREMAP_MAYMOVE)
                          : ::mremap(p, 0, PageRound(bytes), MREMAP_MAYMOVE | MREMAP_FIXED, at);
  return q == MAP_FAILED ? nullptr : static_cast<std::byte*>(q);
}

bool ValidDevice(int d) { return d >= 0 && d < S().config.devices; }

bool CanAccessPeer(int a, int b) {
  const auto& peer = S().config.peer;
  if (a == b) return true;
  if (peer.empty()) return true;
  return peer[static_cast<size_t>(a)][static_cast<size_t>(b)];
}

cudaError_t RtFail(cudaError_t code, const std::string& text) {
  Fail("cuda: " + text);
  t_last = code;
  return code;
}

Alloc* Find(const void* p, size_t bytes) {
  auto& allocs = S().allocs;
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  auto it = allocs.upper_bound(v);
  if (it == allocs.begin()) return nullptr;
  --it;
  if (v < it->first || v + bytes > it->first + it->second.bytes) return nullptr;
  return &it->second;
}

bool CheckAccess(const void* p, size_t bytes, int device, const char* what) {
  Alloc* a = Find(p, bytes);
  if (a == nullptr) {
    Fail(std::string(what) + ": " + std::to_string(bytes) + " bytes at " +
         std::to_string(reinterpret_cast<uintptr_t>(p)) + " are not inside one device allocation");
    return false;
  }
  if (a->multicast) {
    Fail(std::string(what) + ": touches a multicast address outside a multimem kernel");
    return false;
  }
  if (a->vmm) {
    if (a->access.count(device)) return true;
    Fail(std::string(what) + ": device " + std::to_string(device) +
         " touches a cuMemMap mapping "
         "it was not given access to (cuMemSetAccess)");
    return false;
  }
  if (a->viewer >= 0) {
    if (a->viewer == device) return true;
    Fail(std::string(what) + ": device " + std::to_string(device) +
         " touches a CUDA IPC mapping "
         "opened on device " +
         std::to_string(a->viewer) + " (each device must open its own)");
    return false;
  }
  if (a->device != device && !S().peer_enabled.count({device, a->device})) {
    Fail(std::string(what) + ": device " + std::to_string(device) + " touches memory of device " +
         std::to_string(a->device) + " without peer access enabled");
    return false;
  }
  return true;
}

bool KnownStream(cudaStream_t s) {
  for (auto& st : S().streams)
    if (st.get() == s) return true;
  return false;
}

bool StreamOk(cudaStream_t s, const char* what) {
  if (s == nullptr || !KnownStream(s)) {
    Fail(std::string(what) + ": unknown or default stream (the executor must name its streams)");
    return false;
  }
  if (auto it = S().sticky.find(s->device); it != S().sticky.end()) {
    Fail(std::string(what) + ": device " + std::to_string(s->device) +
         " has a sticky error from an earlier kernel (" + it->second.second +
         "); every later call on its context fails");
    return false;
  }
  return true;
}

// The dtype of a cuBLASLt matrix type the executor uses (core/kinds.h, the
// cublaslt column); *ok false for any other.
jo::DType FromCuda(int32_t type, bool* ok) {
  *ok = true;
#define JO_FROM_CUDA(e, id, name, short_name, bytes, fp8, out, fused, elem, ffi, nccl, cublaslt) \
  if (type == cublaslt) return jo::DType::e;
  JO_DTYPES(JO_FROM_CUDA)
#undef JO_FROM_CUDA
  *ok = false;
  return jo::DType::kF32;
}

// The element size of an NCCL type the executor uses (core/kinds.h, the nccl
// column); 0 for any other.
size_t NcclSize(ncclDataType_t t) {
#define JO_NCCL_SIZE(e, id, name, short_name, bytes, fp8, out, fused, elem, ffi, nccl, cublaslt) \
  if (t == nccl) return bytes;
  JO_DTYPES(JO_NCCL_SIZE)
#undef JO_NCCL_SIZE
  return 0;
}

void Count(const char* api) {
  Lock lock(S().mu);
  ++S().counters[api];
  CheckEnqueuePath(api);  // fake_waits.cc: only non-blocking calls once a handler enqueued
}

void Fail(const std::string& text) {
  Lock lock(S().mu);
  S().errors.push_back(text);
}

void Reset(const Config& config) {
  Lock lock(S().mu);
  State& s = S();
  for (auto& [base, a] : s.allocs) Unmap(a.mem, a.bytes);
  s.allocs.clear();
  for (const auto& [base, bytes] : s.pinned)
    (void)::munmap(reinterpret_cast<void*>(base), PageRound(bytes));
  s.pinned.clear();
  s.gpu_ns = 0;
  ForgetAllReduceMemory();
  s.capturing.clear();
  s.graph_execs.clear();
  s.graphs.clear();
  s.streams.clear();
  s.events.clear();
  s.peer_enabled.clear();
  s.phys.clear();
  s.mcs.clear();
  s.exported.clear();
  s.comms.clear();
  s.id_cliques.clear();
  s.split_cliques.clear();
  s.ipc_open.clear();
  s.channels.clear();
  s.descs.clear();
  s.layouts.clear();
  s.prefs.clear();
  s.handles.clear();
  s.errors.clear();
  s.counters.clear();
  s.sticky.clear();
  s.sms_held.clear();
  s.shared_grants.clear();
  s.config = config;
  s.rng.seed(config.seed);
  ResetQueues();
  ResetWaits();
  SetKernelImages(config.kernel_images ? *config.kernel_images : cuda::KernelImages());
}

std::vector<std::string> Errors() {
  Lock lock(S().mu);
  return S().errors;
}

std::map<std::string, int64_t> Counters() {
  Lock lock(S().mu);
  return S().counters;
}

constexpr size_t kFullPoisonBytes = size_t{4} << 20;

void* Malloc(int device, size_t bytes, int fill) {
  Lock lock(S().mu);
  State& s = S();
  std::byte* mem = nullptr;
  const auto kept = s.spare.find(PageRound(bytes));
  if (kept != s.spare.end()) {
    mem = kept->second;
    s.spare_bytes -= kept->first;
    s.spare.erase(kept);
  } else {
    mem = MapShared(bytes);
  }
  if (mem == nullptr) {
    Fail("fake: out of host memory");
    return nullptr;
  }
  // Poisoned, all of it up to kFullPoisonBytes; of a larger allocation (the executor's cuBLASLt
  // workspaces: 32 MiB per stream, whose contents the fake's cuBLASLt never reads) its first and
  // last kFullPoisonBytes / 2 only: touching every page of each would make a set-up of the fake
  // take longer than its tests' 200 ms timeouts. Its middle is zero, or an earlier user's data.
  if (bytes <= kFullPoisonBytes) {
    std::memset(mem, fill, bytes);
  } else {
    std::memset(mem, fill, kFullPoisonBytes / 2);
    std::memset(mem + bytes - kFullPoisonBytes / 2, fill, kFullPoisonBytes / 2);
  }
  s.malloced.insert(mem);
  s.allocs[reinterpret_cast<uintptr_t>(mem)] = Alloc{bytes, device, false, 0, mem};
  return mem;
}

bool Pinned(const void* p, size_t bytes) {
  Lock lock(S().mu);
  const auto at = reinterpret_cast<uintptr_t>(p);
  for (const auto& [base, size] : S().pinned)
    if (at >= base && at + bytes <= base + size) return true;
  return false;
}

bool CheckRange(const void* p, size_t bytes, const char* what) {
  Lock lock(S().mu);
  return CheckAccess(p, bytes, t_device, what);
}

int DeviceArch(int) { return S().config.cc_major * 10 + S().config.cc_minor; }
int DeviceSms(int) { return S().config.sms; }

cudaError_t StickyError(int device) {
  Lock lock(S().mu);
  auto it = S().sticky.find(device);
  return it == S().sticky.end() ? cudaSuccess : it->second.first;
}
void SetPlayedProcess(int process) { t_process = process; }
int CurrentDevice() { return t_device; }
int StreamDevice(cudaStream_t s) {
  Lock lock(S().mu);
  return KnownStream(s) ? s->device : -1;
}

bool MulticastTargets(const void* mc, size_t bytes, std::vector<std::byte*>* out) {
  Lock lock(S().mu);
  Alloc* a = Find(mc, bytes);
  if (a == nullptr || !a->multicast) return false;
  const size_t offset = static_cast<size_t>(static_cast<const std::byte*>(mc) - a->mem);
  const McObject& obj = S().mcs[a->mc];
  out->clear();
  for (const auto& [device, handle] : obj.bound) {
    const Phys& ph = S().phys[handle];
    out->push_back(ph.pages->mem + offset);
  }
  return obj.bound.size() == obj.num_devices;
}

}  // namespace jo::fake
