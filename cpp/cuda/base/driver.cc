#include "cuda/base/driver.h"

#include <cuda_runtime_api.h>

#include <map>
#include <mutex>
#include <string>

#include "cuda/base/check.h"

namespace jo::cuda {
namespace {

// The CUDA version whose signature of each function we call (cudaTypedefs.h
// names them PFN_<name>_v<version>).
constexpr unsigned kBase = 12000;
constexpr unsigned kMulticast = 12010;

template <typename Fn>
Status Lookup(const char* name, unsigned version, bool required, Fn* fn) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t code =
      cudaGetDriverEntryPointByVersion(name, &ptr, version, cudaEnableDefault, &found);
  if (code != cudaSuccess || found != cudaDriverEntryPointSuccess || ptr == nullptr) {
    (void)cudaGetLastError();
    *fn = nullptr;
    if (!required) return OkStatus();
    std::string why =
        code != cudaSuccess
            ? std::string(cudaGetErrorName(code)) + " (" + cudaGetErrorString(code) + ")"
            : (found == cudaDriverEntryPointVersionNotSufficent
                   ? "the driver is older than CUDA " + std::to_string(version / 1000) + "." +
                         std::to_string(version % 1000 / 10)
                   : "symbol not found");
    return Status(Code::kInternal, std::string("CUDA driver entry point ") + name +
                                       " is unavailable: " + why +
                                       " (is an NVIDIA driver installed? see docs/gpu.md)");
  }
  *fn = reinterpret_cast<Fn>(ptr);
  return OkStatus();
}

Status LoadAll(DriverApi* d) {
  JO_CHECK(Lookup("cuGetErrorString", kBase, true, &d->cuGetErrorString));
  JO_CHECK(Lookup("cuDriverGetVersion", kBase, true, &d->cuDriverGetVersion));
  JO_CHECK(Lookup("cuDeviceGet", kBase, true, &d->cuDeviceGet));
  JO_CHECK(Lookup("cuDeviceGetAttribute", kBase, true, &d->cuDeviceGetAttribute));
  JO_CHECK(Lookup("cuStreamWriteValue32", kBase, true, &d->cuStreamWriteValue32));
  JO_CHECK(Lookup("cuStreamWaitValue32", kBase, true, &d->cuStreamWaitValue32));
  JO_CHECK(Lookup("cuMemGetAllocationGranularity", kBase, true, &d->cuMemGetAllocationGranularity));
  JO_CHECK(Lookup("cuMemCreate", kBase, true, &d->cuMemCreate));
  JO_CHECK(Lookup("cuMemRelease", kBase, true, &d->cuMemRelease));
  JO_CHECK(Lookup("cuMemAddressReserve", kBase, true, &d->cuMemAddressReserve));
  JO_CHECK(Lookup("cuMemAddressFree", kBase, true, &d->cuMemAddressFree));
  JO_CHECK(Lookup("cuMemMap", kBase, true, &d->cuMemMap));
  JO_CHECK(Lookup("cuMemUnmap", kBase, true, &d->cuMemUnmap));
  JO_CHECK(Lookup("cuMemSetAccess", kBase, true, &d->cuMemSetAccess));
  JO_CHECK(Lookup("cuMemExportToShareableHandle", kBase, false, &d->cuMemExportToShareableHandle));
  JO_CHECK(
      Lookup("cuMemImportFromShareableHandle", kBase, false, &d->cuMemImportFromShareableHandle));
  d->has_shareable =
      d->cuMemExportToShareableHandle != nullptr && d->cuMemImportFromShareableHandle != nullptr;
  JO_CHECK(Lookup("cuMulticastCreate", kMulticast, false, &d->cuMulticastCreate));
  JO_CHECK(Lookup("cuMulticastAddDevice", kMulticast, false, &d->cuMulticastAddDevice));
  JO_CHECK(Lookup("cuMulticastBindMem", kMulticast, false, &d->cuMulticastBindMem));
  JO_CHECK(Lookup("cuMulticastUnbind", kMulticast, false, &d->cuMulticastUnbind));
  JO_CHECK(Lookup("cuMulticastGetGranularity", kMulticast, false, &d->cuMulticastGetGranularity));
  d->has_multicast = d->cuMulticastCreate != nullptr && d->cuMulticastAddDevice != nullptr &&
                     d->cuMulticastBindMem != nullptr && d->cuMulticastUnbind != nullptr &&
                     d->cuMulticastGetGranularity != nullptr;
  return OkStatus();
}

struct Loaded {
  DriverApi api;
  Status status;
};

const Loaded& Get() {
  static Loaded* loaded = [] {
    auto* l = new Loaded();  // lives for the process: handlers may run at exit
    l->status = LoadAll(&l->api);
    return l;
  }();
  return *loaded;
}

}  // namespace

Status LoadDriver(const DriverApi** out) {
  const Loaded& l = Get();
  *out = l.status.ok() ? &l.api : nullptr;
  return l.status;
}

namespace {
std::mutex g_attr_mu;
std::map<int, unsigned>& WaitFlagsByDevice() {
  static auto* flags = new std::map<int, unsigned>();
  return *flags;
}
}  // namespace

Status WaitValueFlags(int device, unsigned* flags) {
  {
    std::lock_guard<std::mutex> lock(g_attr_mu);
    auto it = WaitFlagsByDevice().find(device);
    if (it != WaitFlagsByDevice().end()) {
      *flags = it->second;
      return OkStatus();
    }
  }
  const DriverApi* drv = nullptr;
  JO_CHECK(LoadDriver(&drv));
  CUdevice dev = 0;
  int can_flush = 0;
  JO_CU_CHECK(nullptr, drv->cuDeviceGet(&dev, device));
  JO_CU_CHECK(nullptr, drv->cuDeviceGetAttribute(&can_flush,
                                                 CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev));
  *flags = static_cast<unsigned>(CU_STREAM_WAIT_VALUE_GEQ) |
           (can_flush ? static_cast<unsigned>(CU_STREAM_WAIT_VALUE_FLUSH) : 0u);
  std::lock_guard<std::mutex> lock(g_attr_mu);
  WaitFlagsByDevice()[device] = *flags;
  return OkStatus();
}

void ForgetDeviceAttributes() {
  std::lock_guard<std::mutex> lock(g_attr_mu);
  WaitFlagsByDevice().clear();
}

std::string DriverErrorText(CUresult code) {
  const Loaded& l = Get();
  const char* text = nullptr;
  if (l.api.cuGetErrorString != nullptr && l.api.cuGetErrorString(code, &text) == CUDA_SUCCESS &&
      text != nullptr)
    return text;
  return "driver error " + std::to_string(static_cast<int>(code));
}

}  // namespace jo::cuda
