// The host-side fake (see fake_runtime.h). Definitions below match the
// declarations of the real headers exactly (they are included), so a
// signature drift is a compile error.
#include "cuda/fake/fake_runtime.h"

#include <cublasLt.h>
#include <cuda.h>
#include <nccl.h>

#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "core/convert.h"

// Opaque handle types of the real headers, defined by the fake.
struct CUstream_st {
  int device = 0;
  int id = 0;
  struct Task {
    std::string what;
    std::function<bool()> ready;  // may have side effects (NCCL posting)
    std::function<void()> run;
  };
  std::deque<Task> tasks;
};
struct CUevent_st {
  int device = 0;
  int64_t recorded = 0;   // records enqueued
  int64_t completed = 0;  // records executed
};
struct ncclComm {
  int clique = 0;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  bool nonblocking = false;
  // Non-blocking: creation completes once all nranks have joined; a call that
  // answered ncclInProgress must be awaited (ncclCommGetAsyncError) first.
  bool joining = false;
  bool in_progress = false;
};
struct cublasLtContext {
  int device = 0;
};

namespace jo::fake {
namespace {

// Every fake "device" memory range is a shared anonymous mapping, so a second
// mapping of the same pages (mremap with old size 0) models what the driver
// does for CUDA IPC opens and cuMemMap of imported memory: a new address,
// valid only where the driver made it valid.
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
  if (p != nullptr) (void)::munmap(p, PageRound(bytes));
}
// A second address for the pages at `p` (at `at` when given, replacing what was there).
std::byte* Alias(std::byte* p, size_t bytes, std::byte* at = nullptr) {
  void* q = at == nullptr ? ::mremap(p, 0, PageRound(bytes), MREMAP_MAYMOVE)
                          : ::mremap(p, 0, PageRound(bytes), MREMAP_MAYMOVE | MREMAP_FIXED, at);
  return q == MAP_FAILED ? nullptr : static_cast<std::byte*>(q);
}

struct Alloc {
  size_t bytes = 0;
  int device = -1;
  bool multicast = false;  // a multicast mapping: only multimem may touch it
  CUmemGenericAllocationHandle mc = 0;
  std::byte* mem = nullptr;
  // A cuMemMap mapping: only the devices cuMemSetAccess named may touch it.
  bool vmm = false;
  std::set<int> access;
  // A cudaIpcOpenMemHandle mapping: only the device that opened it may touch it.
  int viewer = -1;
  Alloc() = default;
  Alloc(size_t b, int d, bool m, CUmemGenericAllocationHandle h, std::byte* p)
      : bytes(b), device(d), multicast(m), mc(h), mem(p) {}
};

// Physical memory (cuMemCreate); imported handles share the pages.
struct Pages {
  std::byte* mem = nullptr;
  size_t bytes = 0;
  explicit Pages(size_t n) : mem(MapShared(n)), bytes(n) {}
  ~Pages() { Unmap(mem, bytes); }
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;
};

struct Phys {
  int device = 0;
  size_t bytes = 0;
  std::shared_ptr<Pages> pages;
  unsigned long long handle_types = 0;  // CUmemAllocationProp::requestedHandleTypes
};

struct McObject {
  size_t bytes = 0;
  unsigned num_devices = 0;
  std::vector<int> devices;
  std::map<int, CUmemGenericAllocationHandle> bound;  // device -> phys
  unsigned long long handle_types = 0;                // CUmulticastObjectProp::handleTypes
  int refs = 1;  // creation + imports, each dropped by cuMemRelease
};

struct Message {
  std::vector<std::byte> data;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  bool taken = false;
  std::shared_ptr<bool> taken_flag;
};

struct NcclP2p {
  bool send = false;
  void* buf = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  int peer = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};

struct Desc {
  int32_t compute = -1, scale = -1, transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
};
struct Layout {
  int32_t type = -1;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t order = CUBLASLT_ORDER_COL;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct Pref {
  uint64_t workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};
};

struct State {
  std::recursive_mutex mu;
  Config config;
  std::mt19937_64 rng{1};
  std::vector<std::string> errors;
  std::map<std::string, int64_t> counters;
  std::map<uintptr_t, Alloc> allocs;  // by base address
  std::vector<std::unique_ptr<CUstream_st>> streams;
  std::vector<std::unique_ptr<CUevent_st>> events;
  std::set<std::pair<int, int>> peer_enabled;
  std::map<CUmemGenericAllocationHandle, Phys> phys;
  std::map<CUmemGenericAllocationHandle, McObject> mcs;
  CUmemGenericAllocationHandle next_handle = 1;
  std::vector<std::unique_ptr<ncclComm>> comms;
  int next_clique = 0;
  // ncclCommInitRank: the clique each unique id names, and its ranks so far.
  std::map<std::string, std::pair<int, std::set<int>>> id_cliques;
  uint64_t next_unique_id = 1;
  std::map<uintptr_t, int> ipc_open;  // cudaIpcOpenMemHandle mappings (base -> opens)
  std::map<ino_t, CUmemGenericAllocationHandle> exported;  // memfd inode -> multicast object
  std::map<std::tuple<int, int, int>, std::deque<std::shared_ptr<Message>>> channels;
  std::map<cublasLtMatmulDesc_t, Desc> descs;
  std::map<cublasLtMatrixLayout_t, Layout> layouts;
  std::map<cublasLtMatmulPreference_t, Pref> prefs;
  std::vector<std::unique_ptr<cublasLtContext>> handles;
  int stream_ids = 0;
  int64_t side_effects = 0;  // NCCL posts and matches done inside ready() checks
};

State& S() {
  static auto* s = new State();
  return *s;
}

thread_local int t_device = 0;
thread_local int t_group_depth = 0;
thread_local std::vector<NcclP2p> t_group;
thread_local bool t_group_nonblocking_init = false;  // the open group created a non-blocking comm
thread_local cudaError_t t_last = cudaSuccess;

using Lock = std::lock_guard<std::recursive_mutex>;

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

// The allocation containing [p, p+bytes), or nullptr.
Alloc* Find(const void* p, size_t bytes) {
  auto& allocs = S().allocs;
  const uintptr_t v = reinterpret_cast<uintptr_t>(p);
  auto it = allocs.upper_bound(v);
  if (it == allocs.begin()) return nullptr;
  --it;
  if (v < it->first || v + bytes > it->first + it->second.bytes) return nullptr;
  return &it->second;
}

// Memory `stream`'s device may touch: its own, or a peer's with access enabled.
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
  return true;
}

void Push(cudaStream_t s, std::string what, std::function<bool()> ready,
          std::function<void()> run) {
  s->tasks.push_back({std::move(what), std::move(ready), std::move(run)});
}

jo::DType FromCuda(int32_t type, bool* ok) {
  *ok = true;
  switch (type) {
    case CUDA_R_32F:
      return jo::DType::kF32;
    case CUDA_R_16BF:
      return jo::DType::kBF16;
    case CUDA_R_16F:
      return jo::DType::kF16;
    default:
      *ok = false;
      return jo::DType::kF32;
  }
}

size_t NcclSize(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return 4;
    case ncclBfloat16:
    case ncclFloat16:
      return 2;
    default:
      return 0;
  }
}

// ---- driver functions handed out by cudaGetDriverEntryPointByVersion ----

CUresult FakeGetErrorString(CUresult code, const char** out) {
  *out = code == CUDA_SUCCESS ? "no error" : "fake driver error";
  return CUDA_SUCCESS;
}
CUresult FakeDriverGetVersion(int* v) {
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult FakeDeviceGet(CUdevice* d, int ordinal) {
  if (!ValidDevice(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult FakeDeviceGetAttribute(int* v, CUdevice_attribute attr, CUdevice d) {
  Lock lock(S().mu);
  if (attr == CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) {
    *v = S().config.multicast;
    return CUDA_SUCCESS;
  }
  if (attr == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) {
    *v = S().config.fabric;
    return CUDA_SUCCESS;
  }
  Fail("cuDeviceGetAttribute: attribute " + std::to_string(attr) + " not modeled (device " +
       std::to_string(d) + ")");
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult FakeWriteValue32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags) {
  Lock lock(S().mu);
  Count("cuStreamWriteValue32");
  if (!StreamOk(s, "cuStreamWriteValue32")) return CUDA_ERROR_INVALID_HANDLE;
  if (flags != CU_STREAM_WRITE_VALUE_DEFAULT) {
    Fail("cuStreamWriteValue32: flags not modeled");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  auto* p = reinterpret_cast<uint32_t*>(addr);
  if (addr % 4 != 0 || !CheckAccess(p, 4, s->device, "cuStreamWriteValue32"))
    return CUDA_ERROR_INVALID_VALUE;
  Push(
      s, "cuStreamWriteValue32(" + std::to_string(value) + ")", [] { return true; },
      [p, value] { *p = value; });
  return CUDA_SUCCESS;
}

CUresult FakeWaitValue32(CUstream s, CUdeviceptr addr, cuuint32_t value, unsigned flags) {
  Lock lock(S().mu);
  Count("cuStreamWaitValue32");
  if (!StreamOk(s, "cuStreamWaitValue32")) return CUDA_ERROR_INVALID_HANDLE;
  if (flags != CU_STREAM_WAIT_VALUE_GEQ) {
    Fail("cuStreamWaitValue32: only GEQ is modeled");
    return CUDA_ERROR_NOT_SUPPORTED;
  }
  auto* p = reinterpret_cast<const uint32_t*>(addr);
  if (addr % 4 != 0 || !CheckAccess(p, 4, s->device, "cuStreamWaitValue32"))
    return CUDA_ERROR_INVALID_VALUE;
  Push(
      s, "cuStreamWaitValue32(>= " + std::to_string(value) + ")",
      [p, value] { return static_cast<int32_t>(*p - value) >= 0; }, [] {});
  return CUDA_SUCCESS;
}

CUresult FakeMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp*,
                                         CUmemAllocationGranularity_flags) {
  *g = size_t{2} << 20;
  return CUDA_SUCCESS;
}
CUresult FakeMulticastGetGranularity(size_t* g, const CUmulticastObjectProp*,
                                     CUmulticastGranularity_flags) {
  *g = size_t{2} << 20;
  return CUDA_SUCCESS;
}

CUresult FakeMemCreate(CUmemGenericAllocationHandle* h, size_t bytes,
                       const CUmemAllocationProp* prop, unsigned long long) {
  Lock lock(S().mu);
  Count("cuMemCreate");
  if (prop->type != CU_MEM_ALLOCATION_TYPE_PINNED ||
      prop->location.type != CU_MEM_LOCATION_TYPE_DEVICE || !ValidDevice(prop->location.id) ||
      bytes % (size_t{2} << 20) != 0) {
    Fail("cuMemCreate: unsupported properties or size not a multiple of the granularity");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (prop->requestedHandleTypes & CU_MEM_HANDLE_TYPE_FABRIC) {
    if (!S().config.fabric) return CUDA_ERROR_NOT_SUPPORTED;
    if (!S().config.imex_channel) return CUDA_ERROR_NOT_PERMITTED;  // no IMEX channel for this user
  }
  auto pages = std::make_shared<Pages>(bytes);
  if (pages->mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::memset(pages->mem, 0xA5, bytes);  // cuMemCreate memory is not zeroed
  *h = S().next_handle++;
  S().phys[*h] = Phys{prop->location.id, bytes, std::move(pages),
                      static_cast<unsigned long long>(prop->requestedHandleTypes)};
  return CUDA_SUCCESS;
}

CUresult FakeMemRelease(CUmemGenericAllocationHandle h) {
  Lock lock(S().mu);
  if (S().phys.erase(h)) return CUDA_SUCCESS;
  auto mc = S().mcs.find(h);
  if (mc == S().mcs.end()) return CUDA_ERROR_INVALID_VALUE;
  if (--mc->second.refs == 0) S().mcs.erase(mc);
  return CUDA_SUCCESS;
}

// Fabric handles: 64 bytes naming the object (physical memory or a multicast
// object) in the one fake world; importing one returns a new handle to the
// same pages (physical memory) or one more reference (multicast object).
constexpr char kFabricTag[] = "fake-fabric";
struct FakeFabric {
  char tag[sizeof(kFabricTag)];
  int64_t pid;
  uint64_t handle;
};
static_assert(sizeof(FakeFabric) <= sizeof(CUmemFabricHandle), "fake fabric handle too big");

CUresult ExportFabric(void* out, CUmemGenericAllocationHandle h) {
  auto ph = S().phys.find(h);
  auto mc = S().mcs.find(h);
  const unsigned long long types = ph != S().phys.end()  ? ph->second.handle_types
                                   : mc != S().mcs.end() ? mc->second.handle_types
                                                         : 0;
  if (ph == S().phys.end() && mc == S().mcs.end()) {
    Fail("cuMemExportToShareableHandle(FABRIC): unknown handle");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!S().config.fabric || (types & CU_MEM_HANDLE_TYPE_FABRIC) == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  FakeFabric f{};
  std::memcpy(f.tag, kFabricTag, sizeof(kFabricTag));
  f.pid = ::getpid();
  f.handle = h;
  std::memset(out, 0, sizeof(CUmemFabricHandle));
  std::memcpy(out, &f, sizeof(f));
  return CUDA_SUCCESS;
}

CUresult ImportFabric(CUmemGenericAllocationHandle* h, const void* handle) {
  FakeFabric f{};
  std::memcpy(&f, handle, sizeof(f));
  if (std::memcmp(f.tag, kFabricTag, sizeof(kFabricTag)) != 0) {
    Fail("cuMemImportFromShareableHandle(FABRIC): not a handle from cuMemExportToShareableHandle");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (f.pid != ::getpid()) {
    Fail(
        "cuMemImportFromShareableHandle(FABRIC): the fake models fabric handles within one OS "
        "process only (handle from pid " +
        std::to_string(f.pid) + ")");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (!S().config.fabric) return CUDA_ERROR_NOT_SUPPORTED;
  if (!S().config.imex_channel) return CUDA_ERROR_NOT_PERMITTED;
  if (auto mc = S().mcs.find(f.handle); mc != S().mcs.end()) {
    ++mc->second.refs;
    *h = mc->first;
    return CUDA_SUCCESS;
  }
  auto ph = S().phys.find(f.handle);
  if (ph == S().phys.end()) {
    Fail("cuMemImportFromShareableHandle(FABRIC): the exported memory is gone");
    return CUDA_ERROR_INVALID_VALUE;
  }
  *h = S().next_handle++;
  Phys imported = ph->second;  // shares the pages
  S().phys[*h] = imported;
  return CUDA_SUCCESS;
}

// Shareable handles of multicast objects, modelled within one OS process: the
// exported POSIX fd is a memfd (a unique inode); importing an fd (a dup of it,
// as another process would get through SCM_RIGHTS) finds the object by inode
// and returns its handle, holding one more reference.
CUresult FakeMemExportToShareableHandle(void* out, CUmemGenericAllocationHandle h,
                                        CUmemAllocationHandleType type, unsigned long long flags) {
  Lock lock(S().mu);
  Count("cuMemExportToShareableHandle");
  if (type == CU_MEM_HANDLE_TYPE_FABRIC && flags == 0) return ExportFabric(out, h);
  auto mc = S().mcs.find(h);
  if (mc == S().mcs.end() || flags != 0) {
    Fail("cuMemExportToShareableHandle: only multicast objects are modelled");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !S().config.shareable ||
      (mc->second.handle_types & type) == 0)
    return CUDA_ERROR_NOT_SUPPORTED;
  const int fd = memfd_create("jaxoverlap-fake-multicast", MFD_CLOEXEC);
  if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
  struct stat st{};
  if (fstat(fd, &st) != 0) {
    close(fd);
    return CUDA_ERROR_UNKNOWN;
  }
  S().exported[st.st_ino] = h;
  *static_cast<int*>(out) = fd;
  return CUDA_SUCCESS;
}

CUresult FakeMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os_handle,
                                          CUmemAllocationHandleType type) {
  Lock lock(S().mu);
  Count("cuMemImportFromShareableHandle");
  if (type == CU_MEM_HANDLE_TYPE_FABRIC) return ImportFabric(h, os_handle);
  if (type != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) return CUDA_ERROR_NOT_SUPPORTED;
  const int fd = static_cast<int>(reinterpret_cast<uintptr_t>(os_handle));
  struct stat st{};
  if (fstat(fd, &st) != 0) {
    Fail("cuMemImportFromShareableHandle: not an open fd");
    return CUDA_ERROR_INVALID_VALUE;
  }
  auto it = S().exported.find(st.st_ino);
  auto mc = it == S().exported.end() ? S().mcs.end() : S().mcs.find(it->second);
  if (mc == S().mcs.end()) {
    Fail(
        "cuMemImportFromShareableHandle: not an fd from cuMemExportToShareableHandle, or its "
        "object is gone");
    return CUDA_ERROR_INVALID_VALUE;
  }
  ++mc->second.refs;
  *h = mc->first;
  return CUDA_SUCCESS;
}

CUresult FakeMemAddressReserve(CUdeviceptr* p, size_t bytes, size_t, CUdeviceptr,
                               unsigned long long) {
  Lock lock(S().mu);
  Count("cuMemAddressReserve");
  std::byte* mem = MapShared(bytes);
  if (mem == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  std::memset(mem, 0xA5, bytes);  // not zero: unmapped/uninitialised memory must not look clean
  Alloc reserved{bytes, -2, false, 0, mem};
  reserved.vmm = true;  // nobody may touch it before cuMemMap + cuMemSetAccess
  S().allocs[reinterpret_cast<uintptr_t>(mem)] = reserved;
  *p = reinterpret_cast<CUdeviceptr>(mem);
  return CUDA_SUCCESS;
}

CUresult FakeMemAddressFree(CUdeviceptr p, size_t) {
  Lock lock(S().mu);
  auto it = S().allocs.find(static_cast<uintptr_t>(p));
  if (it == S().allocs.end()) return CUDA_ERROR_INVALID_VALUE;
  Unmap(it->second.mem, it->second.bytes);
  S().allocs.erase(it);
  return CUDA_SUCCESS;
}

CUresult FakeMemMap(CUdeviceptr p, size_t bytes, size_t offset, CUmemGenericAllocationHandle h,
                    unsigned long long) {
  Lock lock(S().mu);
  Count("cuMemMap");
  auto it = S().allocs.find(static_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.bytes != bytes || offset != 0) {
    Fail("cuMemMap: only whole reserved ranges at offset 0 are modeled");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (it->second.device != -2) {
    Fail("cuMemMap: the range is already mapped");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (auto ph = S().phys.find(h); ph != S().phys.end()) {
    if (ph->second.bytes != bytes) {
      Fail("cuMemMap: size mismatch");
      return CUDA_ERROR_INVALID_VALUE;
    }
    // The reserved range now shows the physical pages (and stays theirs until unmapped).
    if (Alias(ph->second.pages->mem, bytes, it->second.mem) != it->second.mem)
      return CUDA_ERROR_OUT_OF_MEMORY;
    it->second.device = ph->second.device;
    return CUDA_SUCCESS;
  }
  if (auto mc = S().mcs.find(h); mc != S().mcs.end()) {
    if (mc->second.bytes != bytes) {
      Fail("cuMemMap: multicast size mismatch");
      return CUDA_ERROR_INVALID_VALUE;
    }
    it->second.multicast = true;
    it->second.mc = h;
    it->second.device = -1;  // every bound device's memory at once
    return CUDA_SUCCESS;
  }
  Fail("cuMemMap: unknown handle");
  return CUDA_ERROR_INVALID_VALUE;
}

CUresult FakeMemUnmap(CUdeviceptr p, size_t bytes) {
  Lock lock(S().mu);
  auto it = S().allocs.find(static_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.bytes != bytes) return CUDA_ERROR_INVALID_VALUE;
  it->second.device = -2;  // reserved again: nobody may touch it
  it->second.access.clear();
  it->second.multicast = false;
  return CUDA_SUCCESS;
}

CUresult FakeMemSetAccess(CUdeviceptr p, size_t bytes, const CUmemAccessDesc* desc, size_t count) {
  Lock lock(S().mu);
  Count("cuMemSetAccess");
  auto it = S().allocs.find(static_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.bytes != bytes || count == 0)
    return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < count; ++i)
    if (desc[i].flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE || !ValidDevice(desc[i].location.id))
      return CUDA_ERROR_INVALID_VALUE;
  if (it->second.device == -2) {
    Fail("cuMemSetAccess on a range nothing is mapped at");
    return CUDA_ERROR_INVALID_VALUE;
  }
  for (size_t i = 0; i < count; ++i)
    if (!it->second.multicast && !CanAccessPeer(desc[i].location.id, it->second.device))
      return CUDA_ERROR_INVALID_DEVICE;  // no P2P path from that device to the memory's
  for (size_t i = 0; i < count; ++i) it->second.access.insert(desc[i].location.id);
  return CUDA_SUCCESS;
}

CUresult FakeMulticastCreate(CUmemGenericAllocationHandle* h, const CUmulticastObjectProp* prop) {
  Lock lock(S().mu);
  Count("cuMulticastCreate");
  if (!S().config.multicast) return CUDA_ERROR_NOT_SUPPORTED;
  if (prop->handleTypes & CU_MEM_HANDLE_TYPE_FABRIC) {
    if (!S().config.fabric) return CUDA_ERROR_NOT_SUPPORTED;
    if (!S().config.imex_channel) return CUDA_ERROR_NOT_PERMITTED;
  }
  if (prop->size % (size_t{2} << 20) != 0 || prop->numDevices < 1) {
    Fail("cuMulticastCreate: bad size/devices");
    return CUDA_ERROR_INVALID_VALUE;
  }
  *h = S().next_handle++;
  S().mcs[*h] = McObject{prop->size, prop->numDevices, {}, {}, prop->handleTypes, 1};
  return CUDA_SUCCESS;
}

CUresult FakeMulticastAddDevice(CUmemGenericAllocationHandle h, CUdevice d) {
  Lock lock(S().mu);
  auto it = S().mcs.find(h);
  if (it == S().mcs.end() || !ValidDevice(d) || it->second.devices.size() >= it->second.num_devices)
    return CUDA_ERROR_INVALID_VALUE;
  if (!it->second.bound.empty()) {
    Fail("cuMulticastAddDevice after cuMulticastBindMem");
    return CUDA_ERROR_INVALID_VALUE;
  }
  it->second.devices.push_back(d);
  return CUDA_SUCCESS;
}

CUresult FakeMulticastBindMem(CUmemGenericAllocationHandle h, size_t mc_offset,
                              CUmemGenericAllocationHandle mem, size_t mem_offset, size_t bytes,
                              unsigned long long) {
  Lock lock(S().mu);
  Count("cuMulticastBindMem");
  auto it = S().mcs.find(h);
  auto ph = S().phys.find(mem);
  if (it == S().mcs.end() || ph == S().phys.end() || mc_offset != 0 || mem_offset != 0 ||
      bytes != it->second.bytes) {
    Fail("cuMulticastBindMem: only whole-object binds are modeled");
    return CUDA_ERROR_INVALID_VALUE;
  }
  McObject& mc = it->second;
  if (mc.devices.size() != mc.num_devices) {
    Fail("cuMulticastBindMem before every device was added");
    return CUDA_ERROR_INVALID_VALUE;
  }
  if (std::find(mc.devices.begin(), mc.devices.end(), ph->second.device) == mc.devices.end())
    return CUDA_ERROR_INVALID_DEVICE;
  mc.bound[ph->second.device] = mem;
  return CUDA_SUCCESS;
}

CUresult FakeMulticastUnbind(CUmemGenericAllocationHandle, CUdevice, size_t, size_t) {
  return CUDA_SUCCESS;
}

// ---- cuBLASLt reference ----

int64_t Extent(const Layout& l) {  // elements spanned by one layout, all batches
  if (l.rows == 0 || l.cols == 0) return 0;
  return static_cast<int64_t>(l.batch - 1) * l.stride + static_cast<int64_t>(l.cols - 1) * l.ld +
         static_cast<int64_t>(l.rows);
}

}  // namespace

void Count(const char* api) { ++S().counters[api]; }

void Fail(const std::string& text) {
  Lock lock(S().mu);
  S().errors.push_back(text);
}

void Reset(const Config& config) {
  Lock lock(S().mu);
  State& s = S();
  for (auto& [base, a] : s.allocs) Unmap(a.mem, a.bytes);
  s.allocs.clear();
  s.streams.clear();
  s.events.clear();
  s.peer_enabled.clear();
  s.phys.clear();
  s.mcs.clear();
  s.exported.clear();
  s.comms.clear();
  s.id_cliques.clear();
  s.ipc_open.clear();
  s.channels.clear();
  s.descs.clear();
  s.layouts.clear();
  s.prefs.clear();
  s.handles.clear();
  s.errors.clear();
  s.counters.clear();
  s.config = config;
  s.rng.seed(config.seed);
}

std::vector<std::string> Errors() {
  Lock lock(S().mu);
  return S().errors;
}

std::map<std::string, int64_t> Counters() {
  Lock lock(S().mu);
  return S().counters;
}

void* Malloc(int device, size_t bytes) {
  Lock lock(S().mu);
  std::byte* mem = MapShared(bytes);
  if (mem == nullptr) {
    Fail("fake: out of host memory");
    return nullptr;
  }
  std::memset(mem, 0, bytes);
  S().allocs[reinterpret_cast<uintptr_t>(mem)] = Alloc{bytes, device, false, 0, mem};
  return mem;
}

bool CheckRange(const void* p, size_t bytes, const char* what) {
  Lock lock(S().mu);
  return CheckAccess(p, bytes, t_device, what);
}

int DeviceCc(int) { return S().config.cc_major; }
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

void Enqueue(cudaStream_t s, const std::string& what, std::function<void()> run) {
  Lock lock(S().mu);
  Push(s, what, [] { return true; }, std::move(run));
}

bool Drain() {
  std::unique_lock<std::recursive_mutex> lock(S().mu);
  State& s = S();
  auto grace_end = std::chrono::steady_clock::now() + std::chrono::milliseconds(s.config.grace_ms);
  for (;;) {
    std::vector<CUstream_st*> ready;
    bool pending = false;
    const int64_t effects_before = s.side_effects;
    for (auto& st : s.streams) {
      if (st->tasks.empty()) continue;
      pending = true;
      if (st->tasks.front().ready()) ready.push_back(st.get());
    }
    if (!pending) return true;
    if (ready.empty() && s.side_effects != effects_before) continue;  // a match enabled more
    if (ready.empty() && std::chrono::steady_clock::now() < grace_end) {
      lock.unlock();  // let another host thread (the watchdog) enqueue a release
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      lock.lock();
      continue;
    }
    if (ready.empty()) {
      std::string text = "deadlock: no stream can progress;";
      for (auto& st : s.streams)
        if (!st->tasks.empty())
          text += " [device " + std::to_string(st->device) + " stream " + std::to_string(st->id) +
                  " blocked at " + st->tasks.front().what + "]";
      s.errors.push_back(text);
      for (auto& st : s.streams) st->tasks.clear();
      return false;
    }
    CUstream_st* pick = ready[std::uniform_int_distribution<size_t>(0, ready.size() - 1)(s.rng)];
    auto task = std::move(pick->tasks.front());
    pick->tasks.pop_front();
    task.run();
  }
}

}  // namespace jo::fake

using jo::fake::Count;
using jo::fake::Fail;
using jo::fake::Lock;
using jo::fake::RtFail;
using jo::fake::S;
using jo::fake::t_device;
using jo::fake::t_last;

// ============================ CUDA runtime ============================

cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last;
  t_last = cudaSuccess;
  return e;
}
const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaSuccess ? "cudaSuccess" : "cudaErrorFake";
}
const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "fake CUDA error (see fake errors)";
}

cudaError_t cudaGetDevice(int* d) {
  *d = t_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int d) {
  Lock lock(S().mu);
  if (!jo::fake::ValidDevice(d))
    return RtFail(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(d) + ")");
  t_device = d;
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** p, size_t bytes) {
  Count("cudaMalloc");
  *p = jo::fake::Malloc(t_device, bytes);
  // Real cudaMalloc memory is not zeroed: poison it.
  std::memset(*p, 0x5A, bytes);
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  Lock lock(S().mu);
  auto it = S().allocs.find(reinterpret_cast<uintptr_t>(p));
  if (it == S().allocs.end() || it->second.viewer >= 0 || it->second.vmm)
    return RtFail(cudaErrorInvalidValue, "cudaFree of an unknown pointer");
  jo::fake::Unmap(it->second.mem, it->second.bytes);
  S().allocs.erase(it);
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

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  Lock lock(S().mu);
  if (!jo::fake::StreamOk(s, "cudaStreamSynchronize"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize");
  // Only the setup stream is ever synchronized; it must not wait on others.
  while (!s->tasks.empty()) {
    if (!s->tasks.front().ready())
      return RtFail(cudaErrorInvalidValue, "cudaStreamSynchronize would block forever");
    auto task = std::move(s->tasks.front());
    s->tasks.pop_front();
    task.run();
  }
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) {
  jo::fake::Drain();
  return cudaSuccess;
}

static cudaError_t MakeStream(cudaStream_t* out) {
  Lock lock(S().mu);
  auto st = std::make_unique<CUstream_st>();
  st->device = t_device;
  st->id = S().stream_ids++;
  *out = st.get();
  S().streams.push_back(std::move(st));
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int flags) {
  if (flags != cudaStreamNonBlocking)
    return RtFail(cudaErrorInvalidValue, "streams must be non-blocking");
  return MakeStream(s);
}
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned int flags, int) {
  if (flags != cudaStreamNonBlocking)
    return RtFail(cudaErrorInvalidValue, "streams must be non-blocking");
  return MakeStream(s);
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }  // kept until Reset

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  Lock lock(S().mu);
  if (!jo::fake::StreamOk(s, "cudaStreamIsCapturing"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaStreamIsCapturing");
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int flags) {
  Lock lock(S().mu);
  if (flags != cudaEventDisableTiming)
    return RtFail(cudaErrorInvalidValue, "events must disable timing");
  auto ev = std::make_unique<CUevent_st>();
  ev->device = t_device;
  *e = ev.get();
  S().events.push_back(std::move(ev));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }

cudaError_t cudaEventQuery(cudaEvent_t e) {
  Lock lock(S().mu);
  Count("cudaEventQuery");
  bool known = false;
  for (auto& ev : S().events) known = known || ev.get() == e;
  if (!known) return cudaErrorInvalidResourceHandle;  // (destroyed by a reset)
  return e->completed >= e->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  Lock lock(S().mu);
  Count("cudaEventRecord");
  if (!jo::fake::StreamOk(s, "cudaEventRecord"))
    return RtFail(cudaErrorInvalidResourceHandle, "cudaEventRecord");
  if (e->device != s->device)
    return RtFail(cudaErrorInvalidResourceHandle,
                  "cudaEventRecord: event and stream on different devices");
  const int64_t seq = ++e->recorded;
  jo::fake::Push(
      s, "cudaEventRecord", [] { return true; },
      [e, seq] { e->completed = std::max(e->completed, seq); });
  return cudaSuccess;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int flags) {
  Lock lock(S().mu);
  Count("cudaStreamWaitEvent");
  if (!jo::fake::StreamOk(s, "cudaStreamWaitEvent") || flags != 0)
    return RtFail(cudaErrorInvalidValue, "cudaStreamWaitEvent");
  const int64_t target = e->recorded;  // the record enqueued before this call
  if (target == 0)
    Fail("cudaStreamWaitEvent on an event never recorded (a no-op on a GPU: a missing dependency)");
  jo::fake::Push(s, "cudaStreamWaitEvent", [e, target] { return e->completed >= target; }, [] {});
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
  Lock lock(S().mu);
  Count("cudaMemcpyAsync");
  if (kind == cudaMemcpyDeviceToHost) {  // the watchdog reading flags into host memory
    if (!jo::fake::StreamOk(s, "cudaMemcpyAsync") ||
        !jo::fake::CheckAccess(src, bytes, s->device, "cudaMemcpyAsync D2H src"))
      return RtFail(cudaErrorInvalidValue, "cudaMemcpyAsync D2H");
    jo::fake::Push(
        s, "cudaMemcpyAsync D2H", [] { return true; }, [=] { std::memcpy(dst, src, bytes); });
    return cudaSuccess;
  }
  if (kind != cudaMemcpyDefault && kind != cudaMemcpyDeviceToDevice)
    return RtFail(cudaErrorInvalidMemcpyDirection, "cudaMemcpyAsync kind");
  if (!jo::fake::StreamOk(s, "cudaMemcpyAsync") ||
      !jo::fake::CheckAccess(src, bytes, s->device, "cudaMemcpyAsync src") ||
      !jo::fake::CheckAccess(dst, bytes, s->device, "cudaMemcpyAsync dst"))
    return RtFail(cudaErrorInvalidValue, "cudaMemcpyAsync");
  jo::fake::Push(s, "cudaMemcpyAsync", [] { return true; }, [=] { std::memmove(dst, src, bytes); });
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
  jo::fake::Push(
      s, "cudaMemcpy2DAsync", [] { return true; },
      [=] {
        for (size_t r = 0; r < height; ++r)
          std::memmove(static_cast<char*>(dst) + r * dpitch,
                       static_cast<const char*>(src) + r * spitch, width);
      });
  return cudaSuccess;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status) {
  Count("cudaGetDriverEntryPointByVersion");
  static const std::map<std::string, std::pair<void*, unsigned>> table = {
      {"cuGetErrorString", {reinterpret_cast<void*>(&jo::fake::FakeGetErrorString), 6000}},
      {"cuDriverGetVersion", {reinterpret_cast<void*>(&jo::fake::FakeDriverGetVersion), 2020}},
      {"cuDeviceGet", {reinterpret_cast<void*>(&jo::fake::FakeDeviceGet), 2000}},
      {"cuDeviceGetAttribute", {reinterpret_cast<void*>(&jo::fake::FakeDeviceGetAttribute), 2000}},
      {"cuStreamWriteValue32", {reinterpret_cast<void*>(&jo::fake::FakeWriteValue32), 11070}},
      {"cuStreamWaitValue32", {reinterpret_cast<void*>(&jo::fake::FakeWaitValue32), 11070}},
      {"cuMemGetAllocationGranularity",
       {reinterpret_cast<void*>(&jo::fake::FakeMemGetAllocationGranularity), 10020}},
      {"cuMemCreate", {reinterpret_cast<void*>(&jo::fake::FakeMemCreate), 10020}},
      {"cuMemRelease", {reinterpret_cast<void*>(&jo::fake::FakeMemRelease), 10020}},
      {"cuMemAddressReserve", {reinterpret_cast<void*>(&jo::fake::FakeMemAddressReserve), 10020}},
      {"cuMemAddressFree", {reinterpret_cast<void*>(&jo::fake::FakeMemAddressFree), 10020}},
      {"cuMemMap", {reinterpret_cast<void*>(&jo::fake::FakeMemMap), 10020}},
      {"cuMemUnmap", {reinterpret_cast<void*>(&jo::fake::FakeMemUnmap), 10020}},
      {"cuMemSetAccess", {reinterpret_cast<void*>(&jo::fake::FakeMemSetAccess), 10020}},
      {"cuMemExportToShareableHandle",
       {reinterpret_cast<void*>(&jo::fake::FakeMemExportToShareableHandle), 10020}},
      {"cuMemImportFromShareableHandle",
       {reinterpret_cast<void*>(&jo::fake::FakeMemImportFromShareableHandle), 10020}},
      {"cuMulticastCreate", {reinterpret_cast<void*>(&jo::fake::FakeMulticastCreate), 12010}},
      {"cuMulticastAddDevice", {reinterpret_cast<void*>(&jo::fake::FakeMulticastAddDevice), 12010}},
      {"cuMulticastBindMem", {reinterpret_cast<void*>(&jo::fake::FakeMulticastBindMem), 12010}},
      {"cuMulticastUnbind", {reinterpret_cast<void*>(&jo::fake::FakeMulticastUnbind), 12010}},
      {"cuMulticastGetGranularity",
       {reinterpret_cast<void*>(&jo::fake::FakeMulticastGetGranularity), 12010}},
  };
  *fn = nullptr;
  if (flags != cudaEnableDefault)
    return RtFail(cudaErrorInvalidValue, "cudaGetDriverEntryPointByVersion flags");
  auto it = table.find(symbol);
  if (it == table.end()) {
    Fail(std::string("driver entry point not modeled by the fake: ") + symbol);
    if (status) *status = cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
  }
  if (version < it->second.second) {
    if (status) *status = cudaDriverEntryPointVersionNotSufficent;
    return cudaSuccess;
  }
  const bool multicast = it->second.second == 12010;
  if (multicast && !S().config.multicast) {  // an old driver without the API
    if (status) *status = cudaDriverEntryPointSymbolNotFound;
    return cudaSuccess;
  }
  *fn = it->second.first;
  if (status) *status = cudaDriverEntryPointSuccess;
  return cudaSuccess;
}

// ================================ NCCL ================================

const char* ncclGetErrorString(ncclResult_t r) {
  return r == ncclSuccess ? "no error" : "fake NCCL error (see fake errors)";
}
const char* ncclGetLastError(ncclComm_t) { return ""; }
ncclResult_t ncclGetVersion(int* v) {
  *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  Lock lock(S().mu);
  Count("ncclCommInitAll");
  const int clique = S().next_clique++;
  for (int r = 0; r < ndev; ++r) {
    if (!jo::fake::ValidDevice(devlist[r])) {
      Fail("ncclCommInitAll: bad device");
      return ncclInvalidArgument;
    }
    auto c = std::make_unique<ncclComm>();
    c->clique = clique;
    c->rank = r;
    c->nranks = ndev;
    c->device = devlist[r];
    comms[r] = c.get();
    S().comms.push_back(std::move(c));
  }
  return ncclSuccess;
}

// ncclGetUniqueId: distinct bytes per call and per OS process (pid, counter).
ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  Lock lock(S().mu);
  Count("ncclGetUniqueId");
  std::memset(id->internal, 0, sizeof(id->internal));
  const std::string text = "fake-nccl-id pid=" + std::to_string(::getpid()) +
                           " n=" + std::to_string(S().next_unique_id++);
  std::memcpy(id->internal, text.data(), std::min(text.size(), sizeof(id->internal)));
  return ncclSuccess;
}

// ncclCommInitRank: ranks giving the same id join one clique (the fake's
// NCCL world is this process, so "other processes" are other callers here).
// Each rank joins once; nranks must agree. Unlike NCCL it does not block
// until every rank has joined: the fake's send/recv rendezvous in Drain()
// is what would hang on a missing rank.
static ncclResult_t InitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                             bool nonblocking);

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  Lock lock(S().mu);
  Count("ncclCommInitRank");
  return InitRank(comm, nranks, id, rank, false);
}

// Non-blocking (config->blocking == 0): the communicator is usable only once
// every rank of the id has joined (ncclCommGetAsyncError says when), so a
// rank whose peers never come waits — as long as its caller lets it.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  Lock lock(S().mu);
  Count("ncclCommInitRankConfig");
  const bool nonblocking = config != nullptr && config->blocking == 0;
  const ncclResult_t r = InitRank(comm, nranks, id, rank, nonblocking);
  if (r != ncclSuccess || !nonblocking) return r;
  if (jo::fake::t_group_depth > 0) {
    jo::fake::t_group_nonblocking_init = true;
    return ncclSuccess;  // deferred to ncclGroupEnd
  }
  return ncclInProgress;
}

static ncclResult_t InitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                             bool nonblocking) {
  if (nranks < 1 || rank < 0 || rank >= nranks || !jo::fake::ValidDevice(t_device)) {
    Fail("ncclCommInitRank: bad nranks/rank/current device");
    return ncclInvalidArgument;
  }
  const std::string key(id.internal, sizeof(id.internal));
  if (key.rfind("fake-nccl-id", 0) != 0) {
    Fail("ncclCommInitRank: the id was not made by ncclGetUniqueId");
    return ncclInvalidArgument;
  }
  auto [it, fresh] = S().id_cliques.try_emplace(key, S().next_clique, std::set<int>{});
  if (fresh) ++S().next_clique;
  if (!it->second.second.insert(rank).second) {
    Fail("ncclCommInitRank: rank " + std::to_string(rank) + " joined this id twice");
    return ncclInvalidUsage;
  }
  auto c = std::make_unique<ncclComm>();
  c->clique = it->second.first;
  c->rank = rank;
  c->nranks = nranks;
  c->device = t_device;
  c->nonblocking = nonblocking;
  c->joining = nonblocking;
  c->in_progress = nonblocking;
  for (const auto& other : S().comms)
    if (other->clique == c->clique && other->nranks != nranks) {
      Fail("ncclCommInitRank: ranks of one id disagree on nranks");
      return ncclInvalidUsage;
    }
  *comm = c.get();
  S().comms.push_back(std::move(c));
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t) { return ncclSuccess; }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  Lock lock(S().mu);
  Count("ncclCommGetAsyncError");
  if (comm == nullptr || state == nullptr) {
    Fail("ncclCommGetAsyncError: null argument");
    return ncclInvalidArgument;
  }
  if (comm->joining) {
    int joined = 0;
    for (const auto& other : S().comms) joined += other->clique == comm->clique;
    if (joined == comm->nranks) comm->joining = false;
  }
  comm->in_progress = comm->joining;  // a group's connection set-up completes at once here
  *state = comm->in_progress ? ncclInProgress : ncclSuccess;
  return ncclSuccess;
}
ncclResult_t ncclCommAbort(ncclComm_t) {
  Lock lock(S().mu);
  Count("ncclCommAbort");
  // Aborted communicators' queued groups complete (their kernels exit).
  for (auto& st : S().streams)
    for (auto& task : st->tasks)
      if (task.what.rfind("ncclGroup", 0) == 0) task.ready = [] { return true; };
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++jo::fake::t_group_depth;
  return ncclSuccess;
}

static ncclResult_t FlushGroup() {
  using jo::fake::NcclP2p;
  std::vector<NcclP2p> ops;
  ops.swap(jo::fake::t_group);
  Lock lock(S().mu);
  std::map<cudaStream_t, std::vector<NcclP2p>> by_stream;
  for (auto& op : ops) by_stream[op.stream].push_back(op);
  for (auto& [stream, list] : by_stream) {
    struct GroupState {
      bool posted = false;
      std::vector<std::shared_ptr<bool>> sends_taken;
      std::vector<bool> recv_done;
    };
    auto gs = std::make_shared<GroupState>();
    gs->recv_done.assign(list.size(), false);
    auto ready = [gs, list]() {
      auto& channels = S().channels;
      if (!gs->posted) {
        gs->posted = true;
        ++S().side_effects;
        for (const auto& op : list) {
          if (!op.send) continue;
          auto msg = std::make_shared<jo::fake::Message>();
          const size_t bytes = op.count * jo::fake::NcclSize(op.type);
          msg->data.assign(static_cast<std::byte*>(op.buf),
                           static_cast<std::byte*>(op.buf) + bytes);
          msg->count = op.count;
          msg->type = op.type;
          msg->taken_flag = std::make_shared<bool>(false);
          gs->sends_taken.push_back(msg->taken_flag);
          channels[{op.comm->clique, op.comm->rank, op.peer}].push_back(msg);
        }
      }
      bool done = true;
      for (size_t i = 0; i < list.size(); ++i) {
        const auto& op = list[i];
        if (op.send || gs->recv_done[i]) continue;
        auto& q = channels[{op.comm->clique, op.peer, op.comm->rank}];
        if (q.empty()) {
          done = false;
          continue;
        }
        auto msg = q.front();
        q.pop_front();
        if (msg->count != op.count || msg->type != op.type)
          Fail("NCCL: rank " + std::to_string(op.comm->rank) + " receives " +
               std::to_string(op.count) + " elements from rank " + std::to_string(op.peer) +
               ", which sent " + std::to_string(msg->count) + " (send/recv pairs mismatched)");
        std::memcpy(op.buf, msg->data.data(),
                    std::min(msg->data.size(), op.count * jo::fake::NcclSize(op.type)));
        *msg->taken_flag = true;
        gs->recv_done[i] = true;
        ++S().side_effects;
      }
      for (const auto& taken : gs->sends_taken) done = done && *taken;
      return done;
    };
    jo::fake::Push(stream, "ncclGroup(" + std::to_string(list.size()) + " ops)", ready, [] {});
  }
  // Non-blocking communicators answer ncclInProgress (real NCCL may, e.g. while
  // it connects to a new peer): the caller must await them before their next call.
  bool in_progress = false;
  for (auto& op : ops)
    if (op.comm->nonblocking) in_progress = op.comm->in_progress = true;
  return in_progress ? ncclInProgress : ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (jo::fake::t_group_depth <= 0) {
    Fail("ncclGroupEnd without ncclGroupStart");
    return ncclInvalidUsage;
  }
  if (--jo::fake::t_group_depth > 0) return ncclSuccess;
  const bool inits = jo::fake::t_group_nonblocking_init;
  jo::fake::t_group_nonblocking_init = false;
  const ncclResult_t flushed = FlushGroup();
  return flushed == ncclSuccess && inits ? ncclInProgress : flushed;
}

static ncclResult_t P2p(bool send, void* buf, size_t count, ncclDataType_t type, int peer,
                        ncclComm_t comm, cudaStream_t s) {
  {
    Lock lock(S().mu);
    Count(send ? "ncclSend" : "ncclRecv");
    const char* what = send ? "ncclSend" : "ncclRecv";
    if (!jo::fake::StreamOk(s, what)) return ncclInvalidArgument;
    if (comm == nullptr || peer < 0 || peer >= comm->nranks || peer == comm->rank ||
        jo::fake::NcclSize(type) == 0) {
      Fail(std::string(what) + ": bad comm, peer or type");
      return ncclInvalidArgument;
    }
    if (s->device != comm->device || t_device != comm->device) {
      Fail(std::string(what) + ": stream/current device differ from the communicator's device");
      return ncclInvalidUsage;
    }
    if (comm->in_progress) {
      Fail(std::string(what) +
           ": on a non-blocking communicator whose last call is still in "
           "progress (await ncclCommGetAsyncError == ncclSuccess first)");
      return ncclInvalidUsage;
    }
    if (!jo::fake::CheckAccess(buf, count * jo::fake::NcclSize(type), comm->device, what))
      return ncclInvalidArgument;
  }
  jo::fake::t_group.push_back({send, buf, count, type, peer, comm, s});
  if (jo::fake::t_group_depth == 0) return FlushGroup();
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return P2p(true, const_cast<void*>(buf), count, type, peer, comm, s);
}
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t s) {
  return P2p(false, buf, count, type, peer, comm, s);
}

// ============================== cuBLASLt ==============================

const char* cublasLtGetStatusName(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS ? "CUBLAS_STATUS_SUCCESS" : "CUBLAS_STATUS_FAKE_ERROR";
}
const char* cublasLtGetStatusString(cublasStatus_t) {
  return "fake cuBLASLt status (see fake errors)";
}
size_t cublasLtGetVersion(void) { return CUBLAS_VERSION; }

cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  Lock lock(S().mu);
  auto c = std::make_unique<cublasLtContext>();
  c->device = t_device;
  *h = c.get();
  S().handles.push_back(std::move(c));
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t) { return CUBLAS_STATUS_SUCCESS; }

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
  Lock lock(S().mu);
  *d = new cublasLtMatmulDescOpaque_t();
  S().descs[*d] = jo::fake::Desc{static_cast<int32_t>(compute), static_cast<int32_t>(scale)};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  Lock lock(S().mu);
  S().descs.erase(d);
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                              cublasLtMatmulDescAttributes_t attr, const void* buf,
                                              size_t size) {
  Lock lock(S().mu);
  auto it = S().descs.find(d);
  if (it == S().descs.end()) return CUBLAS_STATUS_INVALID_VALUE;
  if ((attr == CUBLASLT_MATMUL_DESC_TRANSA || attr == CUBLASLT_MATMUL_DESC_TRANSB) &&
      size == sizeof(int32_t)) {
    int32_t v;
    std::memcpy(&v, buf, sizeof(v));
    if (v != CUBLAS_OP_N && v != CUBLAS_OP_T) {
      Fail("cuBLASLt: transpose op " + std::to_string(v) + " not modeled");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    (attr == CUBLASLT_MATMUL_DESC_TRANSA ? it->second.transa : it->second.transb) = v;
    return CUBLAS_STATUS_SUCCESS;
  }
  Fail("cuBLASLt: matmul descriptor attribute " + std::to_string(attr) +
       " is not modeled by the fake");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType type,
                                          uint64_t rows, uint64_t cols, int64_t ld) {
  Lock lock(S().mu);
  *l = new cublasLtMatrixLayoutOpaque_t();
  jo::fake::Layout layout;
  layout.type = type;
  layout.rows = rows;
  layout.cols = cols;
  layout.ld = ld;
  S().layouts[*l] = layout;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  Lock lock(S().mu);
  S().layouts.erase(l);
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                cublasLtMatrixLayoutAttribute_t attr,
                                                const void* buf, size_t size) {
  Lock lock(S().mu);
  auto it = S().layouts.find(l);
  if (it == S().layouts.end()) return CUBLAS_STATUS_INVALID_VALUE;
  jo::fake::Layout& layout = it->second;
  if (attr == CUBLASLT_MATRIX_LAYOUT_ORDER && size == sizeof(int32_t)) {
    std::memcpy(&layout.order, buf, size);
    if (layout.order != CUBLASLT_ORDER_COL && layout.order != CUBLASLT_ORDER_ROW) {
      Fail("cuBLASLt: layout order not modeled");
      return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && size == sizeof(int32_t)) {
    std::memcpy(&layout.batch, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (attr == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && size == sizeof(int64_t)) {
    std::memcpy(&layout.stride, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  Fail("cuBLASLt: matrix layout attribute " + std::to_string(attr) + " (size " +
       std::to_string(size) + ") is not modeled by the fake");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  Lock lock(S().mu);
  *p = new cublasLtMatmulPreferenceOpaque_t();
  S().prefs[*p] = jo::fake::Pref{};
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  Lock lock(S().mu);
  S().prefs.erase(p);
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr,
                                                    const void* buf, size_t size) {
  Lock lock(S().mu);
  auto it = S().prefs.find(p);
  if (it == S().prefs.end()) return CUBLAS_STATUS_INVALID_VALUE;
  if (attr == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && size == sizeof(uint64_t)) {
    std::memcpy(&it->second.workspace, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  const cublasLtMatmulPreferenceAttributes_t align[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    if (attr == align[i] && size == sizeof(uint32_t)) {
      std::memcpy(&it->second.align[i], buf, size);
      return CUBLAS_STATUS_SUCCESS;
    }
  Fail("cuBLASLt: preference attribute " + std::to_string(attr) + " is not modeled by the fake");
  return CUBLAS_STATUS_NOT_SUPPORTED;
}

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dd,
                                              cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t* results,
                                              int* count) {
  Lock lock(S().mu);
  Count("cublasLtMatmulAlgoGetHeuristic");
  if (!S().descs.count(d) || !S().layouts.count(a) || !S().layouts.count(b) ||
      !S().layouts.count(c) || !S().layouts.count(dd) || !S().prefs.count(p) || requested < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  std::memset(results, 0, sizeof(*results));
  // The fake's "algorithm" carries the alignments the preference promised.
  for (int i = 0; i < 4; ++i) results->algo.data[i] = S().prefs[p].align[i];
  results->workspaceSize = 0;
  results->state = CUBLAS_STATUS_SUCCESS;
  *count = 1;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* A, cublasLtMatrixLayout_t Adesc, const void* B,
                              cublasLtMatrixLayout_t Bdesc, const void* beta, const void* C,
                              cublasLtMatrixLayout_t Cdesc, void* D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t* algo, void* workspace,
                              size_t workspace_bytes, cudaStream_t s) {
  using jo::fake::Layout;
  Lock lock(S().mu);
  Count("cublasLtMatmul");
  auto fail = [](const std::string& t) {
    Fail("cublasLtMatmul: " + t);
    return CUBLAS_STATUS_NOT_SUPPORTED;
  };
  if (!jo::fake::StreamOk(s, "cublasLtMatmul")) return CUBLAS_STATUS_INVALID_VALUE;
  if (h->device != s->device || t_device != s->device)
    return fail("handle, stream and current device differ");
  if (!S().descs.count(desc) || !S().layouts.count(Adesc) || !S().layouts.count(Bdesc) ||
      !S().layouts.count(Cdesc) || !S().layouts.count(Ddesc))
    return fail("unknown descriptor");
  const jo::fake::Desc dsc = S().descs[desc];
  const Layout la = S().layouts[Adesc], lb = S().layouts[Bdesc], lc = S().layouts[Cdesc],
               ld = S().layouts[Ddesc];
  if (dsc.compute != CUBLAS_COMPUTE_32F || dsc.scale != CUDA_R_32F)
    return fail("only CUBLAS_COMPUTE_32F with CUDA_R_32F scale is modeled");
  if (la.type != lb.type || la.type != lc.type || la.type != ld.type)
    return fail("mixed matrix types are not modeled");
  bool ok = false;
  const jo::DType dt = jo::fake::FromCuda(la.type, &ok);
  if (!ok) return fail("matrix type not modeled");
  for (const Layout* l : {&la, &lb, &lc, &ld}) {
    if (l->order != CUBLASLT_ORDER_COL) return fail("ORDER other than COL is not modeled");
    if (l->ld < static_cast<int64_t>(l->rows))
      return fail("leading dimension smaller than the rows of a column-major layout");
    if (l->batch != la.batch) return fail("batch counts differ");
  }
  const uint64_t m = dsc.transa == CUBLAS_OP_N ? la.rows : la.cols;
  const uint64_t k = dsc.transa == CUBLAS_OP_N ? la.cols : la.rows;
  const uint64_t kb = dsc.transb == CUBLAS_OP_N ? lb.rows : lb.cols;
  const uint64_t n = dsc.transb == CUBLAS_OP_N ? lb.cols : lb.rows;
  if (k != kb || lc.rows != m || lc.cols != n || ld.rows != m || ld.cols != n)
    return fail("inconsistent dimensions");
  if (C != D && (lc.ld != ld.ld || lc.stride != ld.stride))
    return fail("C != D with different layouts (cuBLASLt's out-of-place rule)");
  const void* ptrs[4] = {A, B, C, D};
  for (int i = 0; i < 4; ++i)
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % algo->data[i] != 0)
      return fail("a pointer is less aligned than the preference promised");
  (void)workspace;
  (void)workspace_bytes;
  const size_t es = static_cast<size_t>(jo::DTypeSize(dt));
  const float fa = *static_cast<const float*>(alpha), fb = *static_cast<const float*>(beta);
  if (!jo::fake::CheckAccess(A, static_cast<size_t>(Extent(la)) * es, s->device,
                             "cublasLtMatmul A") ||
      !jo::fake::CheckAccess(B, static_cast<size_t>(Extent(lb)) * es, s->device,
                             "cublasLtMatmul B") ||
      (fb != 0.0f && !jo::fake::CheckAccess(C, static_cast<size_t>(Extent(lc)) * es, s->device,
                                            "cublasLtMatmul C")) ||
      !jo::fake::CheckAccess(D, static_cast<size_t>(Extent(ld)) * es, s->device,
                             "cublasLtMatmul D"))
    return CUBLAS_STATUS_INVALID_VALUE;
  const int32_t ta = dsc.transa, tb = dsc.transb;
  jo::fake::Push(
      s, "cublasLtMatmul", [] { return true; },
      [=] {
        auto at = [&](const void* base, const Layout& l, int64_t bt, uint64_t r,
                      uint64_t c) {  // column-major element
          return jo::LoadElement(
              dt, static_cast<const std::byte*>(base),
              bt * l.stride + static_cast<int64_t>(c) * l.ld + static_cast<int64_t>(r));
        };
        std::vector<float> out(m * n);
        for (int64_t bt = 0; bt < la.batch; ++bt) {
          for (uint64_t i = 0; i < m; ++i)
            for (uint64_t j = 0; j < n; ++j) {
              float acc = 0.0f;
              for (uint64_t p = 0; p < k; ++p) {
                const float av = ta == CUBLAS_OP_N ? at(A, la, bt, i, p) : at(A, la, bt, p, i);
                const float bv = tb == CUBLAS_OP_N ? at(B, lb, bt, p, j) : at(B, lb, bt, j, p);
                acc += av * bv;
              }
              out[i * n + j] = fa * acc + (fb != 0.0f ? fb * at(C, lc, bt, i, j) : 0.0f);
            }
          for (uint64_t i = 0; i < m; ++i)
            for (uint64_t j = 0; j < n; ++j)
              jo::StoreElement(
                  dt, static_cast<std::byte*>(D),
                  bt * ld.stride + static_cast<int64_t>(j) * ld.ld + static_cast<int64_t>(i),
                  out[i * n + j]);
        }
      });
  return CUBLAS_STATUS_SUCCESS;
}
