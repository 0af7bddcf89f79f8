// GPU memory the CUDA executor owns, as RAII objects, and the few helpers
// that make and map it. Nothing here knows about cliques or transports.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <vector>

#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/base/driver.h"

namespace jo::cuda {

// Device memory a rank addresses: cudaMalloc'd on `device` (kMalloc);
// another process's allocation opened with cudaIpcOpenMemHandle on `device`
// (kIpc); or cuMem physical memory — created here with a fabric handle, or
// imported from one — mapped at `ptr` for the local GPUs (kVmm).
struct DeviceAlloc {
  enum class Kind { kMalloc, kIpc, kVmm };
  Kind kind = Kind::kMalloc;
  int device = -1;
  void* ptr = nullptr;
  size_t bytes = 0;
  // kVmm only.
  const DriverApi* drv = nullptr;
  CUmemGenericAllocationHandle handle = 0;
  size_t mapped_bytes = 0;  // bytes rounded up to the allocation granularity
  bool mapped = false;
  DeviceAlloc() = default;
  DeviceAlloc(const DeviceAlloc&) = delete;
  DeviceAlloc& operator=(const DeviceAlloc&) = delete;
  ~DeviceAlloc();
};

// The multicast workspace: physical memory per device bound to one multicast object.
struct MulticastRegion {
  const DriverApi* drv = nullptr;
  std::vector<int> devices;
  size_t bytes = 0;
  CUmemGenericAllocationHandle mc = 0;
  bool mc_created = false;
  std::vector<CUmemGenericAllocationHandle> phys;  // per rank (0: not created)
  std::vector<int> bound;                          // per rank: bound to mc
  std::vector<CUdeviceptr> unicast;                // per rank: its own mapping
  CUdeviceptr mc_va = 0;                           // one mapping, accessible by every device
  bool mc_mapped = false;
  MulticastRegion() = default;
  MulticastRegion(const MulticastRegion&) = delete;
  MulticastRegion& operator=(const MulticastRegion&) = delete;
  ~MulticastRegion();
};

// Page-locked host memory (cudaMallocHost), where the watchdog reads a rank's flags: a
// device-to-host cudaMemcpyAsync into it is asynchronous, while into pageable memory it
// "will return only once the copy has completed" (CUDA runtime API, "API synchronization
// behavior") — which, behind a wait that never ends, is never. Allocating it waits for the
// device like cudaMalloc (implicit synchronization): set-up only.
struct PinnedHost {
  void* ptr = nullptr;
  size_t bytes = 0;
  std::atomic<bool> busy{false};  // a copy into it was enqueued and has not been seen complete
  PinnedHost() = default;
  PinnedHost(const PinnedHost&) = delete;
  PinnedHost& operator=(const PinnedHost&) = delete;
  ~PinnedHost();
};

// Memory a GPU may still touch (under a hung kernel, or a copy that may still land) is never
// freed: freeing it is worse than leaking it. Keeps `memory` alive until the process ends.
void KeepForever(std::shared_ptr<const void> memory);

// Sets the current device for a scope and restores the caller's.
class DeviceGuard {
 public:
  DeviceGuard() { ok_ = cudaGetDevice(&prev_) == cudaSuccess; }
  ~DeviceGuard() {
    if (ok_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
  bool ok_ = false;
};

// Owns the fds it is given: closed on every path out.
class Fds {
 public:
  Fds() = default;
  ~Fds();
  Fds(const Fds&) = delete;
  Fds& operator=(const Fds&) = delete;
  void Add(int fd) { fds_.push_back(fd); }

 private:
  std::vector<int> fds_;
};

size_t RoundUp(size_t v, size_t to);

// cudaMalloc on `device`, zero-filled on stream `zero_on` (enqueued, not
// waited for: the caller polls, clique_state.h AwaitSetup).
Status Alloc(int device, size_t bytes, cudaStream_t zero_on, const ErrorContext& ctx,
             std::unique_ptr<DeviceAlloc>* out);

// `bytes` of page-locked host memory (the current device's context).
Status AllocPinned(size_t bytes, const ErrorContext& ctx, std::unique_ptr<PinnedHost>* out);

// Pinned device memory on `device` that can be exported as a fabric handle.
CUmemAllocationProp FabricProp(int device);

// Gives every device of `devices` read-write access to [va, va + bytes).
Status SetAccess(const DriverApi* drv, CUdeviceptr va, size_t bytes,
                 const std::vector<int>& devices, const ErrorContext& ctx);

// Maps `alloc->handle` (mapped_bytes) at a new address, for `devices`.
Status MapForDevices(DeviceAlloc* alloc, const std::vector<int>& devices, size_t granularity,
                     const ErrorContext& ctx);

}  // namespace jo::cuda
