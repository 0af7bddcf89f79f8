#include "cuda/cuda_clique.h"

#include <algorithm>
#include <cstring>
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

Status Alloc(int device, size_t bytes, cudaStream_t zero_on, const CallSite& site,
             std::unique_ptr<DeviceAlloc>* out) {
  auto alloc = std::make_unique<DeviceAlloc>();
  alloc->device = device;
  alloc->bytes = bytes;
  JO_CUDA_CHECK(&site, cudaSetDevice(device));
  JO_CUDA_CHECK(&site, cudaMalloc(&alloc->ptr, bytes == 0 ? 1 : bytes));
  if (zero_on != nullptr && bytes > 0) {
    // A private stream: never waits for (possibly flag-blocked) work of the call streams.
    JO_CUDA_CHECK(&site, cudaMemsetAsync(alloc->ptr, 0, bytes, zero_on));
    JO_CUDA_CHECK(&site, cudaStreamSynchronize(zero_on));
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

}  // namespace

DeviceAlloc::~DeviceAlloc() {
  if (ptr == nullptr) return;
  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return;  // teardown: nobody to tell
  if (ipc) {
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

std::byte* Generation::Workspace(int32_t rank, int64_t epoch) const {
  const size_t parity = static_cast<size_t>(epoch % 2) * static_cast<size_t>(workspace_bytes);
  if (multicast) return reinterpret_cast<std::byte*>(multicast->unicast[rank]) + parity;
  return static_cast<std::byte*>(workspace[rank]->ptr) + parity;
}

std::byte* Generation::MulticastAddress(int64_t epoch) const {
  const size_t parity = static_cast<size_t>(epoch % 2) * static_cast<size_t>(workspace_bytes);
  return multicast ? reinterpret_cast<std::byte*>(multicast->mc_va) + parity : nullptr;
}

CUdeviceptr Generation::Flag(int32_t rank, int64_t epoch, int32_t id) const {
  const int64_t index = (epoch % 2) * num_flags + id;
  return reinterpret_cast<CUdeviceptr>(static_cast<uint32_t*>(flags[rank]->ptr) + index);
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

Status RankResources::Reserve(const Program& p, const CallSite& site) {
  JO_CUDA_CHECK(&site, cudaSetDevice(device));
  if (setup == nullptr) JO_CUDA_CHECK(&site, cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking));
  int least = 0, greatest = 0;
  JO_CUDA_CHECK(&site, cudaDeviceGetStreamPriorityRange(&least, &greatest));
  while (static_cast<int32_t>(streams.size()) < p.num_streams - 1) {
    cudaStream_t s = nullptr;
    // Communication streams run at the highest priority: a transfer should
    // not queue behind the GEMMs it is meant to overlap.
    JO_CUDA_CHECK(&site, cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    streams.push_back(s);
  }
  while (static_cast<int64_t>(done.size()) < kDoneSlots) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&site, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    done.push_back(e);
  }
  // Program events, then 1 fork event and one join event per comm stream.
  const size_t need = static_cast<size_t>(p.num_events + p.num_streams);
  while (events.size() < need) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&site, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events.push_back(e);
  }
  const size_t scratch_bytes = static_cast<size_t>(p.scratch_elems * DTypeSize(p.problem.dtype));
  if (scratch_bytes > 0 && (!scratch || scratch->bytes < scratch_bytes)) {
    // The old scratch may still be read by queued work: retire, do not free.
    if (scratch) retired_scratch.push_back(std::move(scratch));
    JO_CHECK(Alloc(device, scratch_bytes, nullptr, site, &scratch));
  }
  return OkStatus();
}

CudaClique::CudaClique(CliqueKey key, Transport transport, std::vector<int> devices,
                       const ncclUniqueId* nccl_id, std::shared_ptr<Exchange> exchange)
    : Clique(key, static_cast<int32_t>(devices.size())), transport_(transport),
      devices_(std::move(devices)),
      local_ranks_(static_cast<int32_t>(
          std::count_if(devices_.begin(), devices_.end(), [](int d) { return d >= 0; }))),
      exchange_(std::move(exchange)) {
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

Status CudaClique::EnablePeerAccess(const CallSite& site) {
  if (peers_enabled_) return OkStatus();
  DeviceGuard guard;
  for (size_t i = 0; i < devices_.size(); ++i)
    for (size_t j = 0; j < devices_.size(); ++j) {
      if (i == j || devices_[i] == devices_[j]) continue;
      int can = 0;
      JO_CUDA_CHECK(&site, cudaDeviceCanAccessPeer(&can, devices_[i], devices_[j]));
      if (!can)
        return Status(Code::kInvalidArgument,
                      site.Describe() + ": transport " + TransportName(transport_) +
                          " needs peer access from GPU " + std::to_string(devices_[i]) + " to GPU " +
                          std::to_string(devices_[j]) +
                          ", which this machine does not offer; use transport='nccl' (or 'auto')");
      JO_CUDA_CHECK(&site, cudaSetDevice(devices_[i]));
      const cudaError_t code = cudaDeviceEnablePeerAccess(devices_[j], 0);
      if (code == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // enabled earlier (by us or by the user): fine
      } else {
        JO_CUDA_CHECK(&site, code);
      }
    }
  peers_enabled_ = true;
  return OkStatus();
}

Status CudaClique::CreateComms(const CallSite& site) {
  if (!comms_.empty()) return OkStatus();
  DeviceGuard guard;
  std::vector<ncclComm_t> comms(devices_.size(), nullptr);
  if (spans_processes()) {
    // One ncclCommInitRank per local rank, in one group (NCCL requires the
    // group when one thread initialises several ranks). It returns once every
    // process's ranks have joined: NCCL's own bootstrap, bounded by NCCL's
    // timeouts, not ours; peers reach it at their first execution too.
    JO_NCCL_CHECK(&site, ncclGroupStart());
    Status status = OkStatus();
    for (size_t r = 0; r < devices_.size() && status.ok(); ++r) {
      if (devices_[r] < 0) continue;
      const cudaError_t set = cudaSetDevice(devices_[r]);
      if (set != cudaSuccess) {
        status = CudaFailure(set, "cudaSetDevice", &site);
        break;
      }
      const ncclResult_t code = ncclCommInitRank(&comms[r], static_cast<int>(devices_.size()),
                                                 nccl_id_, static_cast<int>(r));
      if (code != ncclSuccess) status = NcclFailure(code, "ncclCommInitRank", &site);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (status.ok() && end != ncclSuccess) status = NcclFailure(end, "ncclGroupEnd", &site);
    if (!status.ok()) {
      for (ncclComm_t c : comms)
        if (c != nullptr) (void)ncclCommAbort(c);
      return status;
    }
    comms_ = std::move(comms);
    JO_INFO(site.Describe() + ": NCCL communicators created for " +
            std::to_string(local_ranks_) + " of " + std::to_string(devices_.size()) +
            " ranks (the others in other processes)");
    return OkStatus();
  }
  JO_NCCL_CHECK(&site, ncclCommInitAll(comms.data(), static_cast<int>(devices_.size()),
                                       devices_.data()));
  comms_ = std::move(comms);
  JO_INFO(site.Describe() + ": NCCL communicators created for " + std::to_string(devices_.size()) +
          " GPUs");
  return OkStatus();
}

Status CudaClique::AllocMulticast(Generation* gen, const CallSite& site) {
  const DriverApi* drv = nullptr;
  JO_CHECK(LoadDriver(&drv));
  if (!drv->has_multicast)
    return Status(Code::kInvalidArgument,
                  site.Describe() + ": transport multicast needs the CUDA >= 12.1 driver API "
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
  mc_prop.handleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  mc_prop.size = static_cast<size_t>(2 * gen->workspace_bytes);
  size_t mc_gran = 0, mem_gran = 0;
  JO_CU_CHECK(&site, drv->cuMulticastGetGranularity(&mc_gran, &mc_prop,
                                                      CU_MULTICAST_GRANULARITY_RECOMMENDED));
  CUmemAllocationProp mem_prop{};
  mem_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  mem_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  mem_prop.location.id = *std::max_element(devices_.begin(), devices_.end());  // a local GPU
  mem_prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  JO_CU_CHECK(&site, drv->cuMemGetAllocationGranularity(&mem_gran, &mem_prop,
                                                          CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  const size_t gran = std::max(mc_gran, mem_gran);
  region->bytes = RoundUp(std::max<size_t>(mc_prop.size, 1), gran);
  mc_prop.size = region->bytes;
  if (spans_processes()) {
    JO_CHECK(ShareMulticastObject(drv, &mc_prop, region.get(), site));
  } else {
    JO_CU_CHECK(&site, drv->cuMulticastCreate(&region->mc, &mc_prop));
    region->mc_created = true;
    for (int device : devices_) {
      CUdevice dev = 0;
      JO_CU_CHECK(&site, drv->cuDeviceGet(&dev, device));
      JO_CU_CHECK(&site, drv->cuMulticastAddDevice(region->mc, dev));
    }
  }
  // Every device must be added before memory is bound.
  std::vector<CUmemAccessDesc> access;
  for (size_t r = 0; r < n; ++r) {
    if (devices_[r] < 0) continue;  // another process binds and maps its own
    mem_prop.location.id = devices_[r];
    JO_CU_CHECK(&site, drv->cuMemCreate(&region->phys[r], region->bytes, &mem_prop, 0));
    JO_CU_CHECK(&site, drv->cuMulticastBindMem(region->mc, 0, region->phys[r], 0, region->bytes, 0));
    region->bound[r] = 1;
    JO_CU_CHECK(&site, drv->cuMemAddressReserve(&region->unicast[r], region->bytes, gran, 0, 0));
    JO_CU_CHECK(&site, drv->cuMemMap(region->unicast[r], region->bytes, 0, region->phys[r], 0));
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = devices_[r];
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    JO_CU_CHECK(&site, drv->cuMemSetAccess(region->unicast[r], region->bytes, &desc, 1));
    access.push_back(desc);
  }
  JO_CU_CHECK(&site, drv->cuMemAddressReserve(&region->mc_va, region->bytes, gran, 0, 0));
  JO_CU_CHECK(&site, drv->cuMemMap(region->mc_va, region->bytes, 0, region->mc, 0));
  region->mc_mapped = true;
  JO_CU_CHECK(&site, drv->cuMemSetAccess(region->mc_va, region->bytes, access.data(), access.size()));
  // cuMemCreate memory is not zeroed; the workspace carries no state between
  // calls, but zero it anyway so a protocol bug reads zeros, not garbage.
  for (size_t r = 0; r < n; ++r) {
    if (devices_[r] < 0) continue;
    JO_CUDA_CHECK(&site, cudaSetDevice(devices_[r]));
    cudaStream_t setup = ranks_[r]->setup;
    JO_CUDA_CHECK(&site, cudaMemsetAsync(reinterpret_cast<void*>(region->unicast[r]), 0,
                                         region->bytes, setup));
    JO_CUDA_CHECK(&site, cudaStreamSynchronize(setup));
  }
  gen->multicast = std::move(region);
  return OkStatus();
}

// Multicast across processes: the process of rank 0 creates the object with a
// POSIX-fd handle type and exports it; the fd goes to the other processes
// through the clique's exchange (share_fds: SCM_RIGHTS or pidfd_getfd); they
// import it. Each process adds its own devices; an allgather then makes sure
// every device of the clique is added before anyone binds memory (the driver
// requires it). Binding and mapping are per process (AllocMulticast).
Status CudaClique::ShareMulticastObject(const DriverApi* drv, const CUmulticastObjectProp* prop,
                                        MulticastRegion* region, const CallSite& site) {
  if (!exchange_)
    return Internal(site.Describe() + ": multicast clique spanning processes without an exchange");
  if (!drv->has_shareable)
    return InvalidArgument(site.Describe() + ": transport multicast across processes needs "
                           "cuMemExportToShareableHandle/cuMemImportFromShareableHandle, which "
                           "this driver lacks. Use transport='nccl'");
  const bool owner = devices_[0] >= 0;  // this process holds rank 0
  Fds own;
  std::vector<int> offer;
  if (owner) {
    JO_CU_CHECK(&site, drv->cuMulticastCreate(&region->mc, prop));
    region->mc_created = true;
    int fd = -1;
    JO_CU_CHECK(&site, drv->cuMemExportToShareableHandle(
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
      return InvalidArgument(site.Describe() + ": expected the multicast handle (one fd) from "
                             "the process of rank 0, got fds from " + std::to_string(got.size()) +
                             " processes: the processes disagree on the rank table");
    const int fd = got.begin()->second[0];
    JO_CU_CHECK(&site, drv->cuMemImportFromShareableHandle(
                           &region->mc, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    region->mc_created = true;  // released (one reference) like the owner's
  }
  for (int device : devices_) {
    if (device < 0) continue;
    CUdevice dev = 0;
    JO_CU_CHECK(&site, drv->cuDeviceGet(&dev, device));
    JO_CU_CHECK(&site, drv->cuMulticastAddDevice(region->mc, dev));
  }
  std::map<int32_t, std::string> added;
  JO_CHECK(exchange_->AllGather("mc_added", "", &added));
  JO_INFO(site.Describe() + std::string(owner ? ": exported" : ": imported") +
          " the multicast object across " + std::to_string(exchange_->processes().size()) +
          " processes");
  return OkStatus();
}

Status CudaClique::NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                                 const CallSite& site) {
  DeviceGuard guard;
  auto gen = std::make_unique<Generation>();
  gen->since_epoch = epoch;
  gen->workspace_bytes = RoundUp(static_cast<size_t>(workspace_bytes), 256);  // keep halves aligned
  gen->num_flags = num_flags;
  for (size_t r = 0; r < devices_.size(); ++r) {
    RankResources& res = *ranks_[r];
    if (res.device < 0) {  // another process's rank: its buffers are there
      gen->flags.push_back(nullptr);
      if (transport_ != Transport::kMulticast) gen->workspace.push_back(nullptr);
      continue;
    }
    JO_CUDA_CHECK(&site, cudaSetDevice(res.device));
    if (res.setup == nullptr)
      JO_CUDA_CHECK(&site, cudaStreamCreateWithFlags(&res.setup, cudaStreamNonBlocking));
    std::unique_ptr<DeviceAlloc> flags;
    JO_CHECK(Alloc(res.device, static_cast<size_t>(2 * num_flags) * sizeof(uint32_t), res.setup,
                   site, &flags));
    gen->flags.push_back(std::move(flags));
    if (transport_ != Transport::kMulticast) {
      std::unique_ptr<DeviceAlloc> ws;
      JO_CHECK(Alloc(res.device, static_cast<size_t>(2 * gen->workspace_bytes), res.setup, site, &ws));
      gen->workspace.push_back(std::move(ws));
    }
  }
  if (transport_ == Transport::kMulticast && gen->workspace_bytes > 0)
    JO_CHECK(AllocMulticast(gen.get(), site));
  if (spans_processes() && transport_ != Transport::kNccl)
    JO_CHECK(ImportPeerBuffers(gen.get(), site));
  JO_INFO(site.Describe() + ": new buffers from epoch " + std::to_string(epoch) + ": workspace 2 x " +
          std::to_string(gen->workspace_bytes) + " bytes, " + std::to_string(num_flags) +
          " flags per rank");
  generations_.push_back(std::move(gen));
  return OkStatus();
}

// Record of one local rank in the exchange: rank, then the IPC handles of its
// flags and of its workspace.
struct IpcRecord {
  int32_t rank = -1;
  cudaIpcMemHandle_t flags{};
  cudaIpcMemHandle_t workspace{};
};

Status CudaClique::ImportPeerBuffers(Generation* gen, const CallSite& site) {
  if (!exchange_)
    return Internal(site.Describe() + ": p2p clique spanning processes without an exchange");
  int local_device = -1;
  std::string mine;
  for (size_t r = 0; r < devices_.size(); ++r) {
    if (devices_[r] < 0) continue;
    local_device = devices_[r];
    IpcRecord rec;
    rec.rank = static_cast<int32_t>(r);
    JO_CUDA_CHECK(&site, cudaSetDevice(devices_[r]));
    JO_CUDA_CHECK(&site, cudaIpcGetMemHandle(&rec.flags, gen->flags[r]->ptr));
    if (transport_ == Transport::kP2p)
      JO_CUDA_CHECK(&site, cudaIpcGetMemHandle(&rec.workspace, gen->workspace[r]->ptr));
    mine.append(reinterpret_cast<const char*>(&rec), sizeof(rec));
  }
  std::map<int32_t, std::string> all;
  // multicast: only the flags (peers signal into them); the workspace is the multicast object.
  const bool with_workspace = transport_ == Transport::kP2p;
  JO_CHECK(exchange_->AllGather(with_workspace ? "p2p_ipc" : "mc_flags_ipc", mine, &all));
  const size_t flag_bytes = static_cast<size_t>(2 * gen->num_flags) * sizeof(uint32_t);
  const size_t ws_bytes = static_cast<size_t>(2 * gen->workspace_bytes);
  JO_CUDA_CHECK(&site, cudaSetDevice(local_device));
  for (const auto& [process, bytes] : all) {
    if (process == exchange_->process()) continue;
    if (bytes.size() % sizeof(IpcRecord) != 0)
      return Internal(site.Describe() + ": process " + std::to_string(process) +
                      " sent a malformed IPC handle record");
    for (size_t off = 0; off < bytes.size(); off += sizeof(IpcRecord)) {
      IpcRecord rec;
      std::memcpy(&rec, bytes.data() + off, sizeof(rec));
      if (rec.rank < 0 || rec.rank >= nranks() || devices_[rec.rank] >= 0 ||
          gen->flags[rec.rank] != nullptr)
        return InvalidArgument(site.Describe() + ": process " + std::to_string(process) +
                               " sent IPC handles for rank " + std::to_string(rec.rank) +
                               ", which is not one of its ranks here: the processes disagree "
                               "on the rank table");
      for (auto [handle, slot, size] :
           {std::tuple{&rec.flags, &gen->flags[rec.rank], flag_bytes},
            std::tuple{&rec.workspace, with_workspace ? &gen->workspace[rec.rank] : nullptr,
                       ws_bytes}}) {
        if (slot == nullptr) continue;
        auto mapping = std::make_unique<DeviceAlloc>();
        mapping->device = local_device;
        mapping->bytes = size;
        mapping->ipc = true;
        // Lazy peer access: the mapping is usable from local_device at once.
        JO_CUDA_CHECK(&site, cudaIpcOpenMemHandle(&mapping->ptr, *handle,
                                                  cudaIpcMemLazyEnablePeerAccess));
        *slot = std::move(mapping);
      }
    }
  }
  for (size_t r = 0; r < devices_.size(); ++r)
    if (gen->flags[r] == nullptr || (with_workspace && gen->workspace[r] == nullptr))
      return InvalidArgument(site.Describe() + ": no process sent the IPC handles of rank " +
                             std::to_string(r));
  JO_INFO(site.Describe() + ": opened the IPC buffers of " +
          std::to_string(nranks() - local_ranks_) + " ranks in other processes");
  return OkStatus();
}

void CudaClique::AbortComms() {
  std::lock_guard<std::mutex> lock(mu_);
  for (ncclComm_t& comm : comms_) {
    if (comm != nullptr) (void)ncclCommAbort(comm);  // frees the communicator
    comm = nullptr;
  }
}

void CudaClique::Break(const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (broken_.empty()) broken_ = status.message();
}

Status CudaClique::Prepare(const Program& program, int64_t epoch, const std::string& signature,
                           const CallSite& site, const Generation** gen, RankResources** resources,
                           ncclComm_t* comm) {
  const int32_t rank = program.problem.rank;
  const int64_t ws_bytes = program.workspace_elems * DTypeSize(program.problem.dtype);
  std::lock_guard<std::mutex> lock(mu_);
  if (!broken_.empty())
    return Status(Code::kAborted, site.Describe() + ": this clique is broken by an earlier "
                                  "failure: " + broken_);
  auto& seen = signatures_[epoch];
  if (seen.second == 0) seen.first = signature;
  if (seen.first != signature) {
    Status status = InvalidArgument(
        site.Describe() + ": ranks disagree on call " + std::to_string(epoch) +
        " of this clique: '" + signature + "' here, '" + seen.first +
        "' on another rank (do all devices run the same program, with the collective calls in "
        "the same order?); peers that already enqueued this call will wait on the GPU");
    broken_ = status.message();
    return status;
  }
  // Only this process's ranks check in here (ranks of other processes agree
  // through NCCL's matching, or hang there until the watchdog fires).
  if (++seen.second == local_ranks_) signatures_.erase(epoch);
  // Across processes, p2p and multicast reach peers' flags (and p2p their
  // workspaces) through CUDA IPC mappings (opened with
  // cudaIpcMemLazyEnablePeerAccess) and have one local GPU: nothing to enable.
  if (transport_ != Transport::kNccl && nranks() > 1 && !spans_processes())
    JO_CHECK(EnablePeerAccess(site));
  if (transport_ == Transport::kNccl && nranks() > 1) JO_CHECK(CreateComms(site));
  // The newest generation valid at this epoch (see the header).
  const Generation* use = nullptr;
  for (auto it = generations_.rbegin(); it != generations_.rend(); ++it)
    if ((*it)->since_epoch <= epoch) {
      use = it->get();
      break;
    }
  if (use == nullptr || use->workspace_bytes < ws_bytes || use->num_flags < program.num_flags) {
    if (!generations_.empty() && generations_.back()->since_epoch > epoch)
      return Internal(site.Describe() + ": epoch " + std::to_string(epoch) +
                      " needs more workspace than a later epoch already set up: ranks disagree "
                      "on the call sequence");
    const int64_t grow_ws = std::max<int64_t>(ws_bytes, use ? use->workspace_bytes : 0);
    const int32_t grow_flags = std::max<int32_t>(program.num_flags, use ? use->num_flags : 0);
    JO_CHECK(NewGeneration(epoch, grow_ws, grow_flags, site));
    use = generations_.back().get();
  }
  JO_CHECK(ranks_[rank]->Reserve(program, site));
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
  if (!broken_.empty()) out += ", BROKEN: " + broken_;
  if (!generations_.empty())
    out += ", workspace 2 x " + std::to_string(generations_.back()->workspace_bytes) +
           " bytes per rank (" + std::to_string(generations_.size()) + " generation(s))";
  return out;
}

}  // namespace jo::cuda
