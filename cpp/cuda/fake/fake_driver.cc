// The fake CUDA driver API: the functions cudaGetDriverEntryPointByVersion
// hands out (stream memory operations, virtual memory, multicast objects,
// shareable handles). Signatures are the real headers' (PFN types).
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_waits.h"

namespace jo::fake {
namespace {

CUresult FakeGetErrorString(CUresult code, const char** out) {
  Count("cuGetErrorString");
  *out = code == CUDA_SUCCESS ? "no error" : "fake driver error";
  return CUDA_SUCCESS;
}
CUresult FakeDriverGetVersion(int* v) {
  Count("cuDriverGetVersion");
  *v = 13000;
  return CUDA_SUCCESS;
}
CUresult FakeDeviceGet(CUdevice* d, int ordinal) {
  Count("cuDeviceGet");
  if (!ValidDevice(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *d = ordinal;
  return CUDA_SUCCESS;
}
CUresult FakeDeviceGetAttribute(int* v, CUdevice_attribute attr, CUdevice d) {
  Count("cuDeviceGetAttribute");
  Lock lock(S().mu);
  if (attr == CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED) {
    *v = S().config.multicast;
    return CUDA_SUCCESS;
  }
  if (attr == CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED) {
    *v = S().config.fabric;
    return CUDA_SUCCESS;
  }
  if (attr == CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES) {
    *v = S().config.flush_remote_writes;
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
  // CU_STREAM_WAIT_VALUE_FLUSH "is restricted to selected platforms and can be
  // queried with CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES" (cuda.h).
  if ((flags & CU_STREAM_WAIT_VALUE_FLUSH) != 0) {
    Count("cuStreamWaitValue32(FLUSH)");
    if (!S().config.flush_remote_writes) {
      Fail(
          "cuStreamWaitValue32: CU_STREAM_WAIT_VALUE_FLUSH on a device without "
          "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES");
      return CUDA_ERROR_NOT_SUPPORTED;
    }
    flags &= ~static_cast<unsigned>(CU_STREAM_WAIT_VALUE_FLUSH);
  }
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

// Granularities: MINIMUM is what sizes must be multiples of (cuMemCreate,
// cuMulticastCreate, cuMulticastBindMem); RECOMMENDED only "for best
// performance" (cuda.h). The fake's RECOMMENDED multicast value is larger than
// MINIMUM, as the driver's may be (the values are the fake's own).
CUresult FakeMemGetAllocationGranularity(size_t* g, const CUmemAllocationProp*,
                                         CUmemAllocationGranularity_flags flags) {
  Count(flags == CU_MEM_ALLOC_GRANULARITY_MINIMUM ? "cuMemGetAllocationGranularity(MINIMUM)"
                                                  : "cuMemGetAllocationGranularity(RECOMMENDED)");
  *g = size_t{2} << 20;
  return CUDA_SUCCESS;
}
CUresult FakeMulticastGetGranularity(size_t* g, const CUmulticastObjectProp*,
                                     CUmulticastGranularity_flags flags) {
  const bool minimum = flags == CU_MULTICAST_GRANULARITY_MINIMUM;
  Count(minimum ? "cuMulticastGetGranularity(MINIMUM)" : "cuMulticastGetGranularity(RECOMMENDED)");
  *g = minimum ? size_t{2} << 20 : size_t{64} << 20;
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

// The devices whose memory a VMM release or unmap gives back: they wait for
// every queue of each (fake_waits.cc). False on a deadlock.
bool AwaitDevices(const std::set<int>& devices, const std::string& call) {
  for (int d : devices)
    if (d >= 0 && !WaitForDevice(d, call)) return false;
  return true;
}

CUresult FakeMemRelease(CUmemGenericAllocationHandle h) {
  {
    std::set<int> devices;
    {
      Lock lock(S().mu);
      Count("cuMemRelease");
      if (auto p = S().phys.find(h); p != S().phys.end()) devices.insert(p->second.device);
      if (auto m = S().mcs.find(h); m != S().mcs.end())
        devices.insert(m->second.devices.begin(), m->second.devices.end());
    }
    if (!AwaitDevices(devices, "cuMemRelease")) return CUDA_ERROR_UNKNOWN;
  }
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
  Count("cuMemAddressFree");
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
  {
    std::set<int> devices;
    {
      Lock lock(S().mu);
      Count("cuMemUnmap");
      if (auto it = S().allocs.find(static_cast<uintptr_t>(p)); it != S().allocs.end()) {
        devices = it->second.access;
        devices.insert(it->second.device);
        if (it->second.multicast)
          if (auto m = S().mcs.find(it->second.mc); m != S().mcs.end())
            devices.insert(m->second.devices.begin(), m->second.devices.end());
      }
    }
    if (!AwaitDevices(devices, "cuMemUnmap")) return CUDA_ERROR_UNKNOWN;
  }
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
  Count("cuMulticastAddDevice");
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
  Count("cuMulticastUnbind");
  return CUDA_SUCCESS;
}

}  // namespace
}  // namespace jo::fake

using jo::fake::Count;
using jo::fake::Fail;
using jo::fake::Lock;
using jo::fake::RtFail;
using jo::fake::S;
using jo::fake::t_device;
using jo::fake::t_last;

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
