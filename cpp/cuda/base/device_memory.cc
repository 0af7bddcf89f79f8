#include "cuda/base/device_memory.h"

#include <unistd.h>

#include <mutex>

namespace jo::cuda {

void KeepForever(std::shared_ptr<const void> memory) {
  static auto* mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<const void>>;
  std::lock_guard<std::mutex> lock(*mu);
  kept->push_back(std::move(memory));
}

DeviceAlloc::~DeviceAlloc() {
  if (kind == Kind::kVmm) {
    if (drv == nullptr) return;
    if (mapped) (void)drv->cuMemUnmap(reinterpret_cast<CUdeviceptr>(ptr), mapped_bytes);
    if (ptr != nullptr)
      (void)drv->cuMemAddressFree(reinterpret_cast<CUdeviceptr>(ptr), mapped_bytes);
    if (handle != 0) (void)drv->cuMemRelease(handle);
    return;
  }
  if (ptr == nullptr) return;
  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return;  // teardown: nobody to tell
  if (kind == Kind::kIpc) {
    (void)cudaIpcCloseMemHandle(ptr);
  } else {
    (void)cudaFree(ptr);
  }
}

MulticastRegion::~MulticastRegion() {
  if (drv == nullptr) return;
  if (mc_mapped) {
    (void)drv->cuMemUnmap(mc_va, bytes);
    (void)drv->cuMemAddressFree(mc_va, bytes);
  }
  for (size_t r = 0; r < devices.size(); ++r) {
    if (r < unicast.size() && unicast[r] != 0) {
      (void)drv->cuMemUnmap(unicast[r], bytes);
      (void)drv->cuMemAddressFree(unicast[r], bytes);
    }
    if (r < bound.size() && bound[r]) (void)drv->cuMulticastUnbind(mc, devices[r], 0, bytes);
    if (r < phys.size() && phys[r] != 0) (void)drv->cuMemRelease(phys[r]);
  }
  if (mc_created) (void)drv->cuMemRelease(mc);
}

PinnedHost::~PinnedHost() {
  if (ptr != nullptr) (void)cudaFreeHost(ptr);
}

Status AllocPinned(size_t bytes, const ErrorContext& ctx, std::unique_ptr<PinnedHost>* out) {
  auto pinned = std::make_unique<PinnedHost>();
  JO_CUDA_CHECK(&ctx, cudaMallocHost(&pinned->ptr, bytes == 0 ? 1 : bytes));
  pinned->bytes = bytes;
  *out = std::move(pinned);
  return OkStatus();
}

Fds::~Fds() {
  for (int fd : fds_) (void)::close(fd);
}

size_t RoundUp(size_t v, size_t to) { return to == 0 ? v : (v + to - 1) / to * to; }

Status Alloc(int device, size_t bytes, cudaStream_t zero_on, const ErrorContext& ctx,
             std::unique_ptr<DeviceAlloc>* out) {
  auto alloc = std::make_unique<DeviceAlloc>();
  alloc->device = device;
  alloc->bytes = bytes;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CUDA_CHECK(&ctx, cudaMalloc(&alloc->ptr, bytes == 0 ? 1 : bytes));
  if (zero_on != nullptr && bytes > 0)
    JO_CUDA_CHECK(&ctx, cudaMemsetAsync(alloc->ptr, 0, bytes, zero_on));
  *out = std::move(alloc);
  return OkStatus();
}

CUmemAllocationProp FabricProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  return prop;
}

Status SetAccess(const DriverApi* drv, CUdeviceptr va, size_t bytes,
                 const std::vector<int>& devices, const ErrorContext& ctx) {
  std::vector<CUmemAccessDesc> access;
  for (int d : devices) {
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = d;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    access.push_back(desc);
  }
  JO_CU_CHECK(&ctx, drv->cuMemSetAccess(va, bytes, access.data(), access.size()));
  return OkStatus();
}

Status MapForDevices(DeviceAlloc* alloc, const std::vector<int>& devices, size_t granularity,
                     const ErrorContext& ctx) {
  const DriverApi* drv = alloc->drv;
  CUdeviceptr va = 0;
  JO_CU_CHECK(&ctx, drv->cuMemAddressReserve(&va, alloc->mapped_bytes, granularity, 0, 0));
  alloc->ptr = reinterpret_cast<void*>(va);
  JO_CU_CHECK(&ctx, drv->cuMemMap(va, alloc->mapped_bytes, 0, alloc->handle, 0));
  alloc->mapped = true;
  return SetAccess(drv, va, alloc->mapped_bytes, devices, ctx);
}

}  // namespace jo::cuda
