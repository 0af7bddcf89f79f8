#include "cuda/cuda_clique.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>

#include <unistd.h>

#include "core/log.h"

namespace jo::cuda {
namespace {

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

Status Alloc(int device, size_t bytes, cudaStream_t zero_on, const ErrorContext& ctx,
             std::unique_ptr<DeviceAlloc>* out) {
  auto alloc = std::make_unique<DeviceAlloc>();
  alloc->device = device;
  alloc->bytes = bytes;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CUDA_CHECK(&ctx, cudaMalloc(&alloc->ptr, bytes == 0 ? 1 : bytes));
  if (zero_on != nullptr && bytes > 0) {
    // A private stream: never waits for (possibly flag-blocked) work of the call streams.
    JO_CUDA_CHECK(&ctx, cudaMemsetAsync(alloc->ptr, 0, bytes, zero_on));
    JO_CUDA_CHECK(&ctx, cudaStreamSynchronize(zero_on));
  }
  *out = std::move(alloc);
  return OkStatus();
}

// Owns the fds it is given: closed on every path out.
class Fds {
 public:
  Fds() = default;
  ~Fds() {
    for (int fd : fds_) (void)::close(fd);
  }
  Fds(const Fds&) = delete;
  Fds& operator=(const Fds&) = delete;
  void Add(int fd) { fds_.push_back(fd); }

 private:
  std::vector<int> fds_;
};

size_t RoundUp(size_t v, size_t to) { return to == 0 ? v : (v + to - 1) / to * to; }

std::vector<int> LocalDevices(const std::vector<int>& devices) {
  std::vector<int> local;
  for (int d : devices)
    if (d >= 0) local.push_back(d);
  return local;
}

CUmemAllocationProp FabricProp(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  return prop;
}

// Gives every device of `devices` read-write access to [va, va + bytes).
Status SetAccess(const DriverApi* drv, CUdeviceptr va, size_t bytes, const std::vector<int>& devices,
                 const ErrorContext& ctx) {
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

// Maps `alloc->handle` (mapped_bytes) at a new address, for `devices`.
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

std::mutex g_fabric_mu;
std::map<int, std::string>& FabricKnown() {
  static auto* known = new std::map<int, std::string>();  // outlives static destructors
  return *known;
}

// Why `device` cannot share memory through fabric handles ("" when it can),
// found by asking the driver and then trying (a missing IMEX channel shows
// only when creating). Once per device per process.
std::string FabricReason(const DriverApi* drv, int device) {
  std::lock_guard<std::mutex> lock(g_fabric_mu);
  std::map<int, std::string>& known = FabricKnown();
  auto it = known.find(device);
  if (it != known.end()) return it->second;
  std::string why;
  CUdevice dev = 0;
  int supported = 0;
  if (!drv->has_shareable) {
    why = "the driver lacks cuMemExportToShareableHandle";
  } else if (drv->cuDeviceGet(&dev, device) != CUDA_SUCCESS ||
             drv->cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
                                       dev) != CUDA_SUCCESS ||
             !supported) {
    why = "GPU " + std::to_string(device) + " does not support fabric handles "
          "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED; needs multi-node NVLink)";
  } else {
    const CUmemAllocationProp prop = FabricProp(device);
    size_t gran = 0;
    CUmemGenericAllocationHandle h = 0;
    CUmemFabricHandle exported{};
    CUresult code = drv->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (code == CUDA_SUCCESS) code = drv->cuMemCreate(&h, gran, &prop, 0);
    if (code == CUDA_SUCCESS) {
      code = drv->cuMemExportToShareableHandle(&exported, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
      (void)drv->cuMemRelease(h);
    }
    if (code != CUDA_SUCCESS)
      why = "GPU " + std::to_string(device) + " cannot create a fabric-shareable allocation (" +
            DriverErrorText(code) + "; is an IMEX channel, /dev/nvidia-caps-imex-channels/channel*, "
            "accessible to this user?)";
  }
  known[device] = why;
  return why;
}

}  // namespace

void ForgetFabricProbes() {
  std::lock_guard<std::mutex> lock(g_fabric_mu);
  FabricKnown().clear();
}

DeviceAlloc::~DeviceAlloc() {
  if (kind == Kind::kVmm) {
    if (drv == nullptr) return;
    if (mapped) (void)drv->cuMemUnmap(reinterpret_cast<CUdeviceptr>(ptr), mapped_bytes);
    if (ptr != nullptr) (void)drv->cuMemAddressFree(reinterpret_cast<CUdeviceptr>(ptr), mapped_bytes);
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

std::byte* Generation::Workspace(int32_t rank, int64_t epoch, int32_t viewer) const {
  const size_t parity = static_cast<size_t>(epoch % 2) * static_cast<size_t>(workspace_bytes);
  if (multicast) return reinterpret_cast<std::byte*>(multicast->unicast[rank]) + parity;
  if (workspace[rank]) return static_cast<std::byte*>(workspace[rank]->ptr) + parity;
  return remote[viewer][rank].workspace + parity;
}

std::byte* Generation::MulticastAddress(int64_t epoch) const {
  const size_t parity = static_cast<size_t>(epoch % 2) * static_cast<size_t>(workspace_bytes);
  return multicast ? reinterpret_cast<std::byte*>(multicast->mc_va) + parity : nullptr;
}

CUdeviceptr Generation::Flag(int32_t rank, int64_t epoch, int32_t id, int32_t viewer) const {
  const int64_t index = (epoch % 2) * num_flags + id;
  void* base = flags[rank] ? flags[rank]->ptr : remote[viewer][rank].flags;
  return reinterpret_cast<CUdeviceptr>(static_cast<uint32_t*>(base) + index);
}

RankResources::~RankResources() {
  if (device < 0) return;  // a rank of another process: nothing here
  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return;
  for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : done) (void)cudaEventDestroy(e);
  for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
  if (setup != nullptr) (void)cudaStreamDestroy(setup);
}

Status RankResources::Reserve(const Program& p, const ErrorContext& ctx) {
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  if (setup == nullptr) JO_CUDA_CHECK(&ctx, cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking));
  int least = 0, greatest = 0;
  JO_CUDA_CHECK(&ctx, cudaDeviceGetStreamPriorityRange(&least, &greatest));
  while (static_cast<int32_t>(streams.size()) < p.num_streams - 1) {
    cudaStream_t s = nullptr;
    // Communication streams run at the highest priority: a transfer should
    // not queue behind the GEMMs it is meant to overlap.
    JO_CUDA_CHECK(&ctx, cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    streams.push_back(s);
  }
  while (static_cast<int64_t>(done.size()) < kDoneSlots) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    done.push_back(e);
  }
  // Program events, then 1 fork event and one join event per comm stream.
  const size_t need = static_cast<size_t>(p.num_events + p.num_streams);
  while (events.size() < need) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events.push_back(e);
  }
  const size_t scratch_bytes = static_cast<size_t>(p.scratch_elems * DTypeSize(p.problem.dtype));
  if (scratch_bytes > 0 && (!scratch || scratch->bytes < scratch_bytes)) {
    // The old scratch may still be read by queued work: retire, do not free.
    if (scratch) retired_scratch.push_back(std::move(scratch));
    JO_CHECK(Alloc(device, scratch_bytes, nullptr, ctx, &scratch));
  }
  return OkStatus();
}

CudaClique::CudaClique(CliqueKey key, Transport transport, std::vector<int> devices,
                       std::vector<int64_t> processes, const ncclUniqueId* nccl_id,
                       std::shared_ptr<Exchange> exchange,
                       std::chrono::milliseconds timeout)
    : Clique(key, static_cast<int32_t>(devices.size())), transport_(transport),
      devices_(std::move(devices)), processes_(std::move(processes)),
      local_devices_(LocalDevices(devices_)),
      local_ranks_(static_cast<int32_t>(local_devices_.size())),
      exchange_(std::move(exchange)), timeout_(timeout) {
  if (nccl_id != nullptr) nccl_id_ = *nccl_id;
  for (int device : devices_) {
    ranks_.push_back(std::make_unique<RankResources>());
    ranks_.back()->device = device;
  }
}

CudaClique::~CudaClique() {
  // Work still queued may use these buffers; wait for it (best effort).
  for (int device : devices_) {
    if (device >= 0 && cudaSetDevice(device) == cudaSuccess) (void)cudaDeviceSynchronize();
  }
  for (ncclComm_t comm : comms_)
    if (comm != nullptr) (void)ncclCommDestroy(comm);
}

Status CudaClique::EnablePeerAccess(const ErrorContext& ctx) {
  if (peers_enabled_) return OkStatus();
  DeviceGuard guard;
  for (size_t i = 0; i < devices_.size(); ++i)
    for (size_t j = 0; j < devices_.size(); ++j) {
      // This process's GPUs only (another process's rank is reached through a mapping).
      if (i == j || devices_[i] == devices_[j] || devices_[i] < 0 || devices_[j] < 0) continue;
      int can = 0;
      JO_CUDA_CHECK(&ctx, cudaDeviceCanAccessPeer(&can, devices_[i], devices_[j]));
      if (!can)
        return Status(Code::kInvalidArgument,
                      ctx.Describe() + ": transport " + TransportName(transport_) +
                          " needs peer access from GPU " + std::to_string(devices_[i]) + " to GPU " +
                          std::to_string(devices_[j]) +
                          ", which this machine does not offer; use transport='nccl' (or 'auto')");
      JO_CUDA_CHECK(&ctx, cudaSetDevice(devices_[i]));
      const cudaError_t code = cudaDeviceEnablePeerAccess(devices_[j], 0);
      if (code == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // enabled earlier (by us or by the user): fine
      } else {
        JO_CUDA_CHECK(&ctx, code);
      }
    }
  peers_enabled_ = true;
  return OkStatus();
}

Status CudaClique::CreateComms(const ErrorContext& ctx) {
  if (!comms_.empty()) return OkStatus();
  DeviceGuard guard;
  // One process: an id of our own. Spanning processes: the clique's id,
  // exchanged through jax.distributed at trace time; every process creates
  // its ranks' communicators with it, and creation completes once every
  // process's ranks have joined — awaited until our deadline, not forever.
  ncclUniqueId id = nccl_id_;
  if (!spans_processes()) JO_NCCL_CHECK(&ctx, ncclGetUniqueId(&id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclComm_t> comms(devices_.size(), nullptr);
  // One ncclCommInitRankConfig per local rank, in one group (NCCL requires
  // the group when one thread initialises several ranks).
  JO_NCCL_CHECK(&ctx, ncclGroupStart());
  Status status = OkStatus();
  for (size_t r = 0; r < devices_.size() && status.ok(); ++r) {
    if (devices_[r] < 0) continue;
    const cudaError_t set = cudaSetDevice(devices_[r]);
    if (set != cudaSuccess) {
      status = CudaFailure(set, "cudaSetDevice", &ctx);
      break;
    }
    const ncclResult_t code = ncclCommInitRankConfig(&comms[r], static_cast<int>(devices_.size()),
                                                     id, static_cast<int>(r), &config);
    if (code != ncclSuccess && code != ncclInProgress)
      status = NcclFailure(code, "ncclCommInitRankConfig", &ctx);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (status.ok() && end != ncclSuccess && end != ncclInProgress)
    status = NcclFailure(end, "ncclGroupEnd", &ctx);
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  for (size_t r = 0; r < comms.size() && status.ok(); ++r)
    if (comms[r] != nullptr)
      status = AwaitNccl(comms[r], deadline,
                         spans_processes() ? "NCCL communicator creation (every process's ranks "
                                             "must join: they do at their first call)"
                                           : "NCCL communicator creation",
                         &ctx);
  if (!status.ok()) {
    for (ncclComm_t c : comms)
      if (c != nullptr) (void)ncclCommAbort(c);
    return status;
  }
  comms_ = std::move(comms);
  JO_INFO(ctx.Describe() + ": NCCL communicators created for " + std::to_string(local_ranks_) +
          " of " + std::to_string(devices_.size()) + " ranks" +
          (spans_processes() ? " (the others in other processes)" : ""));
  return OkStatus();
}

Status CudaClique::AllocMulticast(Generation* gen, const ErrorContext& ctx) {
  const DriverApi* drv = nullptr;
  JO_CHECK(LoadDriver(&drv));
  if (!drv->has_multicast)
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": transport multicast needs the CUDA >= 12.1 driver API "
                  "(cuMulticastCreate); this driver lacks it. Use transport='p2p' or 'nccl'");
  auto region = std::make_unique<MulticastRegion>();
  region->drv = drv;
  region->devices = devices_;
  const size_t n = devices_.size();
  region->phys.assign(n, 0);
  region->bound.assign(n, 0);
  region->unicast.assign(n, 0);
  CUmulticastObjectProp mc_prop{};
  mc_prop.numDevices = static_cast<unsigned>(n);
  mc_prop.handleTypes = handles_ == Handles::kFabric ? CU_MEM_HANDLE_TYPE_FABRIC
                                                     : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  mc_prop.size = static_cast<size_t>(2 * gen->workspace_bytes);
  size_t mc_gran = 0, mem_gran = 0;
  JO_CU_CHECK(&ctx, drv->cuMulticastGetGranularity(&mc_gran, &mc_prop,
                                                      CU_MULTICAST_GRANULARITY_RECOMMENDED));
  CUmemAllocationProp mem_prop{};
  mem_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  mem_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  mem_prop.location.id = *std::max_element(devices_.begin(), devices_.end());  // a local GPU
  // The same handle type as the multicast object's (as NCCL's NVLS does).
  mem_prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(mc_prop.handleTypes);
  JO_CU_CHECK(&ctx, drv->cuMemGetAllocationGranularity(&mem_gran, &mem_prop,
                                                          CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const size_t gran = std::max(mc_gran, mem_gran);
  region->bytes = RoundUp(std::max<size_t>(mc_prop.size, 1), gran);
  mc_prop.size = region->bytes;
  if (spans_processes()) {
    JO_CHECK(ShareMulticastObject(drv, &mc_prop, region.get(), ctx));
  } else {
    JO_CU_CHECK(&ctx, drv->cuMulticastCreate(&region->mc, &mc_prop));
    region->mc_created = true;
    for (int device : devices_) {
      CUdevice dev = 0;
      JO_CU_CHECK(&ctx, drv->cuDeviceGet(&dev, device));
      JO_CU_CHECK(&ctx, drv->cuMulticastAddDevice(region->mc, dev));
    }
  }
  // Every device must be added before memory is bound.
  std::vector<CUmemAccessDesc> access;
  for (size_t r = 0; r < n; ++r) {
    if (devices_[r] < 0) continue;  // another process binds and maps its own
    mem_prop.location.id = devices_[r];
    JO_CU_CHECK(&ctx, drv->cuMemCreate(&region->phys[r], region->bytes, &mem_prop, 0));
    JO_CU_CHECK(&ctx, drv->cuMulticastBindMem(region->mc, 0, region->phys[r], 0, region->bytes, 0));
    region->bound[r] = 1;
    JO_CU_CHECK(&ctx, drv->cuMemAddressReserve(&region->unicast[r], region->bytes, gran, 0, 0));
    JO_CU_CHECK(&ctx, drv->cuMemMap(region->unicast[r], region->bytes, 0, region->phys[r], 0));
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = devices_[r];
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    JO_CU_CHECK(&ctx, drv->cuMemSetAccess(region->unicast[r], region->bytes, &desc, 1));
    access.push_back(desc);
  }
  JO_CU_CHECK(&ctx, drv->cuMemAddressReserve(&region->mc_va, region->bytes, gran, 0, 0));
  JO_CU_CHECK(&ctx, drv->cuMemMap(region->mc_va, region->bytes, 0, region->mc, 0));
  region->mc_mapped = true;
  JO_CU_CHECK(&ctx, drv->cuMemSetAccess(region->mc_va, region->bytes, access.data(), access.size()));
  // cuMemCreate memory is not zeroed; the workspace carries no state between
  // calls, but zero it anyway so a protocol bug reads zeros, not garbage.
  for (size_t r = 0; r < n; ++r) {
    if (devices_[r] < 0) continue;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(devices_[r]));
    cudaStream_t setup = ranks_[r]->setup;
    JO_CUDA_CHECK(&ctx, cudaMemsetAsync(reinterpret_cast<void*>(region->unicast[r]), 0,
                                         region->bytes, setup));
    JO_CUDA_CHECK(&ctx, cudaStreamSynchronize(setup));
  }
  gen->multicast = std::move(region);
  return OkStatus();
}

// Multicast across processes: the process of rank 0 creates the object and
// exports it — a fabric handle (bytes, allgathered) or a POSIX fd (moved by
// the clique's exchange, share_fds: SCM_RIGHTS or pidfd_getfd); the others
// import it. Each process adds its own devices; an allgather then makes sure
// every device of the clique is added before anyone binds memory (the driver
// requires it). Binding and mapping are per process (AllocMulticast).
Status CudaClique::ShareMulticastObject(const DriverApi* drv, const CUmulticastObjectProp* prop,
                                        MulticastRegion* region, const ErrorContext& ctx) {
  if (!exchange_)
    return Internal(ctx.Describe() + ": multicast clique spanning processes without an exchange");
  if (!drv->has_shareable)
    return InvalidArgument(ctx.Describe() + ": transport multicast across processes needs "
                           "cuMemExportToShareableHandle/cuMemImportFromShareableHandle, which "
                           "this driver lacks. Use transport='nccl'");
  const bool owner = devices_[0] >= 0;  // this process holds rank 0
  if (owner) {
    JO_CU_CHECK(&ctx, drv->cuMulticastCreate(&region->mc, prop));
    region->mc_created = true;
  }
  if (handles_ == Handles::kFabric) {
    std::string mine;
    if (owner) {
      CUmemFabricHandle handle{};
      JO_CU_CHECK(&ctx, drv->cuMemExportToShareableHandle(&handle, region->mc,
                                                           CU_MEM_HANDLE_TYPE_FABRIC, 0));
      mine.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }
    std::map<int32_t, std::string> all;
    JO_CHECK(exchange_->AllGather("mc_fabric", mine, &all));
    if (!owner) {
      const std::string* from_owner = nullptr;
      for (const auto& [process, bytes] : all)
        if (!bytes.empty()) from_owner = &bytes;
      if (from_owner == nullptr || from_owner->size() != sizeof(CUmemFabricHandle))
        return InvalidArgument(ctx.Describe() + ": expected the multicast object's fabric handle "
                               "from the process of rank 0: the processes disagree on the rank table");
      CUmemFabricHandle handle{};
      std::memcpy(&handle, from_owner->data(), sizeof(handle));
      JO_CU_CHECK(&ctx, drv->cuMemImportFromShareableHandle(&region->mc, &handle,
                                                             CU_MEM_HANDLE_TYPE_FABRIC));
      region->mc_created = true;  // released (one reference) like the owner's
    }
  } else {
    Fds own;
    std::vector<int> offer;
    if (owner) {
      int fd = -1;
      JO_CU_CHECK(&ctx, drv->cuMemExportToShareableHandle(
                             &fd, region->mc, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
      own.Add(fd);
      offer.push_back(fd);
    }
    std::map<int32_t, std::vector<int>> got;
    const Status shared = exchange_->ShareFds("mc_fd", offer, &got);
    Fds received;
    for (const auto& [process, fds] : got)
      for (int fd : fds) received.Add(fd);
    JO_CHECK(shared);
    if (!owner) {
      if (got.size() != 1 || got.begin()->second.size() != 1)
        return InvalidArgument(ctx.Describe() + ": expected the multicast handle (one fd) from "
                               "the process of rank 0, got fds from " +
                               std::to_string(got.size()) +
                               " processes: the processes disagree on the rank table");
      const int fd = got.begin()->second[0];
      JO_CU_CHECK(&ctx, drv->cuMemImportFromShareableHandle(
                             &region->mc, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      region->mc_created = true;  // released (one reference) like the owner's
    }
  }
  for (int device : devices_) {
    if (device < 0) continue;
    CUdevice dev = 0;
    JO_CU_CHECK(&ctx, drv->cuDeviceGet(&dev, device));
    JO_CU_CHECK(&ctx, drv->cuMulticastAddDevice(region->mc, dev));
  }
  std::map<int32_t, std::string> added;
  JO_CHECK(exchange_->AllGather("mc_added", "", &added));
  JO_INFO(ctx.Describe() + std::string(owner ? ": exported" : ": imported") +
          " the multicast object across " + std::to_string(exchange_->processes().size()) +
          " processes (" + (handles_ == Handles::kFabric ? "fabric handle" : "POSIX fd") + ")");
  return OkStatus();
}

// What one process says in Negotiate: its host, whether (or why not) its
// GPUs of this clique can use fabric handles, and its own set-up failure.
Status CudaClique::Negotiate(const ErrorContext& ctx, const Status& local) {
  if (!exchange_)
    return Internal(ctx.Describe() + ": clique spanning processes without an exchange");
  const DriverApi* drv = nullptr;
  JO_CHECK(LoadDriver(&drv));
  std::string why_not;
  for (int device : devices_)
    if (device >= 0 && why_not.empty() && local.ok()) why_not = FabricReason(drv, device);
  // host '\n' fabric reason ("" = fabric works here) '\n' set-up failure ("" = none)
  std::map<int32_t, std::string> all;
  JO_CHECK(exchange_->AllGather("handles", exchange_->host() + "\n" + why_not + "\n" +
                                               (local.ok() ? std::string() : local.message()),
                                &all));
  JO_CHECK(local);
  std::map<std::string, std::vector<int32_t>> hosts;
  std::string first_refusal;
  for (const auto& [process, record] : all) {
    const size_t cut = record.find('\n');
    const size_t cut2 = cut == std::string::npos ? cut : record.find('\n', cut + 1);
    hosts[record.substr(0, cut)].push_back(process);
    const std::string reason =
        cut == std::string::npos ? "no answer" : record.substr(cut + 1, cut2 - cut - 1);
    const std::string failed = cut2 == std::string::npos ? "" : record.substr(cut2 + 1);
    if (!failed.empty())
      return InvalidArgument(ctx.Describe() + ": process " + std::to_string(process) +
                             " could not set up its GPUs of this clique: " + failed);
    if (!reason.empty() && first_refusal.empty())
      first_refusal = "process " + std::to_string(process) + ": " + reason;
  }
  if (first_refusal.empty()) {
    handles_ = Handles::kFabric;
  } else if (hosts.size() == 1) {
    handles_ = Handles::kIpc;
  } else {
    std::string where;
    for (const auto& [host, procs] : hosts) {
      where += (where.empty() ? "" : ", ") + std::string("processes");
      for (int32_t p : procs) where += " " + std::to_string(p);
      where += " on " + host;
    }
    return InvalidArgument(ctx.Describe() + ": transport " + TransportName(transport_) +
                           " between hosts (" + where + ") needs fabric handles (multi-node "
                           "NVLink with IMEX), which are not available (" + first_refusal +
                           "). Use transport='nccl' (or 'auto')");
  }
  JO_INFO(ctx.Describe() + ": peers' buffers through " +
          (handles_ == Handles::kFabric ? std::string("fabric handles")
                                        : "CUDA IPC (fabric handles: " + first_refusal + ")"));
  return OkStatus();
}

Status CudaClique::AllocShared(int32_t rank, size_t bytes, const ErrorContext& ctx,
                               std::unique_ptr<DeviceAlloc>* out) {
  const int device = devices_[rank];
  cudaStream_t setup = ranks_[rank]->setup;
  if (handles_ != Handles::kFabric) return Alloc(device, bytes, setup, ctx, out);
  auto alloc = std::make_unique<DeviceAlloc>();
  alloc->kind = DeviceAlloc::Kind::kVmm;
  JO_CHECK(LoadDriver(&alloc->drv));
  alloc->device = device;
  alloc->bytes = bytes;
  const CUmemAllocationProp prop = FabricProp(device);
  size_t gran = 0;
  JO_CU_CHECK(&ctx, alloc->drv->cuMemGetAllocationGranularity(&gran, &prop,
                                                                CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  alloc->mapped_bytes = RoundUp(std::max<size_t>(bytes, 1), gran);
  JO_CU_CHECK(&ctx, alloc->drv->cuMemCreate(&alloc->handle, alloc->mapped_bytes, &prop, 0));
  JO_CHECK(MapForDevices(alloc.get(), local_devices_, gran, ctx));
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CUDA_CHECK(&ctx, cudaMemsetAsync(alloc->ptr, 0, alloc->mapped_bytes, setup));
  JO_CUDA_CHECK(&ctx, cudaStreamSynchronize(setup));
  *out = std::move(alloc);
  return OkStatus();
}

Status CudaClique::NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                                 const ErrorContext& ctx) {
  DeviceGuard guard;
  auto gen = std::make_unique<Generation>();
  gen->since_epoch = epoch;
  gen->workspace_bytes = RoundUp(static_cast<size_t>(workspace_bytes), 256);  // keep halves aligned
  gen->num_flags = num_flags;
  if (spans_processes() && transport_ != Transport::kNccl && handles_ == Handles::kUnset)
    JO_CHECK(Negotiate(ctx));
  for (size_t r = 0; r < devices_.size(); ++r) {
    RankResources& res = *ranks_[r];
    if (res.device < 0) {  // another process's rank: its buffers are there
      gen->flags.push_back(nullptr);
      if (transport_ != Transport::kMulticast) gen->workspace.push_back(nullptr);
      continue;
    }
    JO_CUDA_CHECK(&ctx, cudaSetDevice(res.device));
    if (res.setup == nullptr)
      JO_CUDA_CHECK(&ctx, cudaStreamCreateWithFlags(&res.setup, cudaStreamNonBlocking));
    std::unique_ptr<DeviceAlloc> flags;
    JO_CHECK(AllocShared(static_cast<int32_t>(r), static_cast<size_t>(2 * num_flags) * sizeof(uint32_t),
                         ctx, &flags));
    gen->flags.push_back(std::move(flags));
    if (transport_ != Transport::kMulticast) {
      std::unique_ptr<DeviceAlloc> ws;
      JO_CHECK(AllocShared(static_cast<int32_t>(r), static_cast<size_t>(2 * gen->workspace_bytes),
                           ctx, &ws));
      gen->workspace.push_back(std::move(ws));
    }
  }
  if (transport_ == Transport::kMulticast && gen->workspace_bytes > 0)
    JO_CHECK(AllocMulticast(gen.get(), ctx));
  if (spans_processes() && transport_ != Transport::kNccl)
    JO_CHECK(ImportPeerBuffers(gen.get(), ctx));
  JO_INFO(ctx.Describe() + ": new buffers from epoch " + std::to_string(epoch) + ": workspace 2 x " +
          std::to_string(gen->workspace_bytes) + " bytes, " + std::to_string(num_flags) +
          " flags per rank");
  generations_.push_back(std::move(gen));
  return OkStatus();
}

// Record of one local rank in the exchange: its rank, then the handles of its
// flags and of its workspace (CUDA IPC or fabric: both 64 bytes) and, for
// fabric, the sizes of the allocations they name.
struct PeerRecord {
  int32_t rank = -1;
  uint32_t kind = 0;  // Handles
  uint64_t flags_bytes = 0;
  uint64_t workspace_bytes = 0;
  unsigned char flags[64] = {};
  unsigned char workspace[64] = {};
};
static_assert(sizeof(cudaIpcMemHandle_t) == 64 && sizeof(CUmemFabricHandle) == 64,
              "IPC and fabric handles are 64 bytes");

// The 64-byte handle peers map `buf` with, and the size they map.
Status CudaClique::ExportBuffer(const DeviceAlloc& buf, unsigned char* handle, uint64_t* bytes,
                                const ErrorContext& ctx) {
  if (handles_ == Handles::kFabric) {
    CUmemFabricHandle fabric{};
    JO_CU_CHECK(&ctx, buf.drv->cuMemExportToShareableHandle(&fabric, buf.handle,
                                                             CU_MEM_HANDLE_TYPE_FABRIC, 0));
    std::memcpy(handle, &fabric, sizeof(fabric));
    *bytes = buf.mapped_bytes;
    return OkStatus();
  }
  cudaIpcMemHandle_t ipc{};
  JO_CUDA_CHECK(&ctx, cudaIpcGetMemHandle(&ipc, buf.ptr));
  std::memcpy(handle, &ipc, sizeof(ipc));
  *bytes = buf.bytes;
  return OkStatus();
}

// One remote rank's buffer, named by `handle`, as each local rank addresses
// it: fabric — imported and mapped once, for every local GPU; CUDA IPC —
// cudaIpcOpenMemHandle maps into the current device's context only, so each
// local GPU opens its own. The mappings go to gen->mappings.
Status CudaClique::MapRemoteBuffer(const unsigned char* handle, uint64_t bytes, Generation* gen,
                                   std::vector<std::byte*>* views, const ErrorContext& ctx) {
  views->assign(devices_.size(), nullptr);
  if (handles_ == Handles::kFabric) {
    auto mapping = std::make_unique<DeviceAlloc>();
    mapping->kind = DeviceAlloc::Kind::kVmm;
    JO_CHECK(LoadDriver(&mapping->drv));
    mapping->device = local_devices_.front();
    mapping->bytes = mapping->mapped_bytes = bytes;
    CUmemFabricHandle fabric{};
    std::memcpy(&fabric, handle, sizeof(fabric));
    JO_CU_CHECK(&ctx, mapping->drv->cuMemImportFromShareableHandle(&mapping->handle, &fabric,
                                                                    CU_MEM_HANDLE_TYPE_FABRIC));
    JO_CHECK(MapForDevices(mapping.get(), local_devices_, 0, ctx));
    for (size_t v = 0; v < devices_.size(); ++v)
      if (devices_[v] >= 0) (*views)[v] = static_cast<std::byte*>(mapping->ptr);
    gen->mappings.push_back(std::move(mapping));
    return OkStatus();
  }
  cudaIpcMemHandle_t ipc{};
  std::memcpy(&ipc, handle, sizeof(ipc));
  for (size_t v = 0; v < devices_.size(); ++v) {
    if (devices_[v] < 0) continue;
    auto mapping = std::make_unique<DeviceAlloc>();
    mapping->kind = DeviceAlloc::Kind::kIpc;
    mapping->device = devices_[v];
    mapping->bytes = bytes;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(devices_[v]));
    // Lazy peer access: the mapping is usable from this GPU at once.
    JO_CUDA_CHECK(&ctx, cudaIpcOpenMemHandle(&mapping->ptr, ipc, cudaIpcMemLazyEnablePeerAccess));
    (*views)[v] = static_cast<std::byte*>(mapping->ptr);
    gen->mappings.push_back(std::move(mapping));
  }
  return OkStatus();
}

Status CudaClique::ImportPeerBuffers(Generation* gen, const ErrorContext& ctx) {
  if (!exchange_)
    return Internal(ctx.Describe() + ": p2p clique spanning processes without an exchange");
  const bool fabric = handles_ == Handles::kFabric;
  // multicast: only the flags (peers signal into them); the workspace is the multicast object.
  const bool with_workspace = transport_ == Transport::kP2p;
  std::string mine;
  for (size_t r = 0; r < devices_.size(); ++r) {
    if (devices_[r] < 0) continue;
    PeerRecord rec;
    rec.rank = static_cast<int32_t>(r);
    rec.kind = static_cast<uint32_t>(handles_);
    const DeviceAlloc* bufs[2] = {gen->flags[r].get(),
                                  with_workspace ? gen->workspace[r].get() : nullptr};
    unsigned char* out[2] = {rec.flags, rec.workspace};
    uint64_t* sizes[2] = {&rec.flags_bytes, &rec.workspace_bytes};
    JO_CUDA_CHECK(&ctx, cudaSetDevice(devices_[r]));
    for (int b = 0; b < 2; ++b)
      if (bufs[b] != nullptr) JO_CHECK(ExportBuffer(*bufs[b], out[b], sizes[b], ctx));
    mine.append(reinterpret_cast<const char*>(&rec), sizeof(rec));
  }
  std::map<int32_t, std::string> all;
  JO_CHECK(exchange_->AllGather(with_workspace ? "p2p_buffers" : "mc_flags", mine, &all));
  gen->remote.assign(devices_.size(), std::vector<Generation::Remote>(devices_.size()));
  std::vector<bool> seen(devices_.size(), false);
  for (const auto& [process, bytes] : all) {
    if (process == exchange_->process()) continue;
    if (bytes.size() % sizeof(PeerRecord) != 0)
      return Internal(ctx.Describe() + ": process " + std::to_string(process) +
                      " sent a malformed buffer handle record");
    for (size_t off = 0; off < bytes.size(); off += sizeof(PeerRecord)) {
      PeerRecord rec;
      std::memcpy(&rec, bytes.data() + off, sizeof(rec));
      if (rec.rank < 0 || rec.rank >= nranks() || devices_[rec.rank] >= 0 || seen[rec.rank] ||
          rec.kind != static_cast<uint32_t>(handles_))
        return InvalidArgument(ctx.Describe() + ": process " + std::to_string(process) +
                               " sent buffer handles for rank " + std::to_string(rec.rank) +
                               ", which is not one of its ranks here: the processes disagree "
                               "on the rank table");
      seen[rec.rank] = true;
      const unsigned char* handles[2] = {rec.flags, with_workspace ? rec.workspace : nullptr};
      const uint64_t sizes[2] = {rec.flags_bytes, rec.workspace_bytes};
      for (int b = 0; b < 2; ++b) {
        if (handles[b] == nullptr) continue;
        std::vector<std::byte*> views;
        JO_CHECK(MapRemoteBuffer(handles[b], sizes[b], gen, &views, ctx));
        for (size_t v = 0; v < devices_.size(); ++v) {
          if (views[v] == nullptr) continue;
          (b == 0 ? gen->remote[v][rec.rank].flags : gen->remote[v][rec.rank].workspace) = views[v];
        }
      }
    }
  }
  for (size_t r = 0; r < devices_.size(); ++r)
    if (devices_[r] < 0 && !seen[r])
      return InvalidArgument(ctx.Describe() + ": no process sent the buffer handles of rank " +
                             std::to_string(r));
  JO_INFO(ctx.Describe() + ": mapped the buffers of " + std::to_string(nranks() - local_ranks_) +
          " ranks in other processes (" + (fabric ? "fabric handles" : "CUDA IPC") + ") for " +
          std::to_string(local_ranks_) + " local GPU(s)");
  return OkStatus();
}

void CudaClique::AbortComms() {
  std::lock_guard<std::mutex> lock(mu_);
  for (ncclComm_t& comm : comms_) {
    if (comm != nullptr) (void)ncclCommAbort(comm);  // frees the communicator
    comm = nullptr;
  }
}

Status CudaClique::Reserve(const Program& program, const CallNeeds& needs, int64_t epoch,
                           const ErrorContext& ctx, const Generation** gen,
                           RankResources** resources, ncclComm_t* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  // Broken before the lock is released: a rank next in line must not start a set-up (an
  // exchange with the peers) that the failing one will never join.
  Status status = ReserveLocked(program, needs, epoch, ctx, gen, resources, comm);
  if (!status.ok() && status.code() != Code::kAborted) Break(status);
  return status;
}

Status CudaClique::ReserveLocked(const Program& program, const CallNeeds& needs, int64_t epoch,
                                 const ErrorContext& ctx, const Generation** gen,
                                 RankResources** resources, ncclComm_t* comm) {
  const int32_t rank = program.problem.rank;
  const int64_t ws_bytes = needs.workspace_bytes;
  JO_CHECK(CheckNotBroken(ctx.Describe()));
  // Peer access among this process's GPUs; other processes' buffers are
  // reached through their mappings (ImportPeerBuffers), which need none.
  if (transport_ != Transport::kNccl && local_ranks_ > 1) {
    const Status peers = EnablePeerAccess(ctx);
    // Spanning processes: agree on the handles now, telling the peers if this failed.
    if (spans_processes() && handles_ == Handles::kUnset) JO_CHECK(Negotiate(ctx, peers));
    JO_CHECK(peers);
  }
  if (transport_ == Transport::kNccl && nranks() > 1) JO_CHECK(CreateComms(ctx));
  // The newest generation valid at this epoch (see the header).
  const Generation* use = nullptr;
  for (auto it = generations_.rbegin(); it != generations_.rend(); ++it)
    if ((*it)->since_epoch <= epoch) {
      use = it->get();
      break;
    }
  if (use == nullptr || use->workspace_bytes < ws_bytes || use->num_flags < needs.num_flags) {
    if (!generations_.empty() && generations_.back()->since_epoch > epoch)
      return Internal(ctx.Describe() + ": epoch " + std::to_string(epoch) +
                      " needs more workspace than a later epoch already set up: ranks disagree "
                      "on the call sequence");
    const int64_t grow_ws = std::max<int64_t>(ws_bytes, use ? use->workspace_bytes : 0);
    const int32_t grow_flags = std::max<int32_t>(needs.num_flags, use ? use->num_flags : 0);
    JO_CHECK(NewGeneration(epoch, grow_ws, grow_flags, ctx));
    use = generations_.back().get();
  }
  JO_CHECK(ranks_[rank]->Reserve(program, ctx));
  *gen = use;
  *resources = ranks_[rank].get();
  *comm = comms_.empty() ? nullptr : comms_[rank];
  return OkStatus();
}

std::string CudaClique::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = name() + ": " + TransportName(transport_) + ", GPUs [";
  for (size_t i = 0; i < devices_.size(); ++i)
    out += (i ? "," : "") + (devices_[i] < 0 ? std::string("remote") : std::to_string(devices_[i]));
  int32_t first_local = 0;
  while (first_local < nranks() && devices_[first_local] < 0) ++first_local;
  out += "], epoch " + std::to_string(Epoch(first_local < nranks() ? first_local : 0));
  if (handles_ != Handles::kUnset)
    out += handles_ == Handles::kFabric ? ", peers through fabric handles" : ", peers through CUDA IPC";
  const std::string broken = BrokenReason();
  if (!broken.empty()) out += ", BROKEN: " + broken;
  if (!generations_.empty())
    out += ", workspace 2 x " + std::to_string(generations_.back()->workspace_bytes) +
           " bytes per rank (" + std::to_string(generations_.size()) + " generation(s))";
  return out;
}

}  // namespace jo::cuda
