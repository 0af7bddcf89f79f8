#include "cuda/transport/peer_handles.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "core/log.h"

namespace jo::cuda {
namespace {

std::mutex g_fabric_mu;
std::map<int, std::string>& FabricKnown() {
  static auto* known = new std::map<int, std::string>();  // outlives static destructors
  return *known;
}

}  // namespace

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
    why = "GPU " + std::to_string(device) +
          " does not support fabric handles "
          "(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED; needs multi-node NVLink)";
  } else {
    const CUmemAllocationProp prop = FabricProp(device);
    size_t gran = 0;
    CUmemGenericAllocationHandle h = 0;
    CUmemFabricHandle exported{};
    CUresult code =
        drv->cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (code == CUDA_SUCCESS) code = drv->cuMemCreate(&h, gran, &prop, 0);
    if (code == CUDA_SUCCESS) {
      code = drv->cuMemExportToShareableHandle(&exported, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
      (void)drv->cuMemRelease(h);
    }
    if (code != CUDA_SUCCESS)
      why = "GPU " + std::to_string(device) + " cannot create a fabric-shareable allocation (" +
            DriverErrorText(code) +
            "; is an IMEX channel, /dev/nvidia-caps-imex-channels/channel*, "
            "accessible to this user?)";
  }
  known[device] = why;
  return why;
}

void ForgetFabricProbes() {
  std::lock_guard<std::mutex> lock(g_fabric_mu);
  FabricKnown().clear();
}

Status Negotiate(CliqueState& s, const ErrorContext& ctx, const Status& local) {
  if (!s.exchange)
    return Internal(ctx.Describe() + ": clique spanning processes without an exchange");
  const DriverApi* drv = nullptr;
  JO_CHECK(LoadDriver(&drv));
  std::string why_not;
  for (int device : s.devices)
    if (device >= 0 && why_not.empty() && local.ok()) why_not = FabricReason(drv, device);
  // host '\n' fabric reason ("" = fabric works here) '\n' set-up failure ("" = none)
  std::map<int32_t, std::string> all;
  JO_CHECK(s.exchange->AllGather(
      "handles",
      s.exchange->host() + "\n" + why_not + "\n" + (local.ok() ? std::string() : local.message()),
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
    s.handles = Handles::kFabric;
  } else if (hosts.size() == 1) {
    s.handles = Handles::kIpc;
  } else {
    std::string where;
    for (const auto& [host, procs] : hosts) {
      where += (where.empty() ? "" : ", ") + std::string("processes");
      for (int32_t p : procs) where += " " + std::to_string(p);
      where += " on " + host;
    }
    return InvalidArgument(ctx.Describe() + ": transport " + TransportName(s.transport) +
                           " between hosts (" + where +
                           ") needs fabric handles (multi-node "
                           "NVLink with IMEX), which are not available (" +
                           first_refusal + "). Use transport='nccl' (or 'auto')");
  }
  JO_INFO(ctx.Describe() + ": peers' buffers through " +
          (s.handles == Handles::kFabric ? std::string("fabric handles")
                                         : "CUDA IPC (fabric handles: " + first_refusal + ")"));
  return OkStatus();
}

Status AllocShared(CliqueState& s, int32_t rank, size_t bytes, const ErrorContext& ctx,
                   std::unique_ptr<DeviceAlloc>* out) {
  const int device = s.devices[rank];
  cudaStream_t setup = s.ranks[rank]->setup;
  if (s.handles != Handles::kFabric) return Alloc(device, bytes, setup, ctx, out);
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
  JO_CHECK(MapForDevices(alloc.get(), s.local_devices, gran, ctx));
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CUDA_CHECK(&ctx, cudaMemsetAsync(alloc->ptr, 0, alloc->mapped_bytes, setup));
  *out = std::move(alloc);
  return OkStatus();
}

namespace {

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

Status ExportBuffer(const CliqueState& s, const DeviceAlloc& buf, unsigned char* handle,
                    uint64_t* bytes, const ErrorContext& ctx) {
  if (s.handles == Handles::kFabric) {
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

Status MapRemoteBuffer(const CliqueState& s, const unsigned char* handle, uint64_t bytes,
                       Generation* gen, std::vector<std::byte*>* views, const ErrorContext& ctx) {
  views->assign(s.devices.size(), nullptr);
  if (s.handles == Handles::kFabric) {
    auto mapping = std::make_unique<DeviceAlloc>();
    mapping->kind = DeviceAlloc::Kind::kVmm;
    JO_CHECK(LoadDriver(&mapping->drv));
    mapping->device = s.local_devices.front();
    mapping->bytes = mapping->mapped_bytes = bytes;
    CUmemFabricHandle fabric{};
    std::memcpy(&fabric, handle, sizeof(fabric));
    JO_CU_CHECK(&ctx, mapping->drv->cuMemImportFromShareableHandle(&mapping->handle, &fabric,
                                                                   CU_MEM_HANDLE_TYPE_FABRIC));
    JO_CHECK(MapForDevices(mapping.get(), s.local_devices, 0, ctx));
    for (size_t v = 0; v < s.devices.size(); ++v)
      if (s.devices[v] >= 0) (*views)[v] = static_cast<std::byte*>(mapping->ptr);
    gen->mappings.push_back(std::move(mapping));
    return OkStatus();
  }
  cudaIpcMemHandle_t ipc{};
  std::memcpy(&ipc, handle, sizeof(ipc));
  for (size_t v = 0; v < s.devices.size(); ++v) {
    if (s.devices[v] < 0) continue;
    auto mapping = std::make_unique<DeviceAlloc>();
    mapping->kind = DeviceAlloc::Kind::kIpc;
    mapping->device = s.devices[v];
    mapping->bytes = bytes;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(s.devices[v]));
    // Lazy peer access: the mapping is usable from this GPU at once.
    JO_CUDA_CHECK(&ctx, cudaIpcOpenMemHandle(&mapping->ptr, ipc, cudaIpcMemLazyEnablePeerAccess));
    (*views)[v] = static_cast<std::byte*>(mapping->ptr);
    gen->mappings.push_back(std::move(mapping));
  }
  return OkStatus();
}

}  // namespace

Status ImportPeerBuffers(CliqueState& s, Generation* gen, bool with_workspace,
                         const ErrorContext& ctx) {
  if (!s.exchange)
    return Internal(ctx.Describe() + ": p2p clique spanning processes without an exchange");
  const bool fabric = s.handles == Handles::kFabric;
  std::string mine;
  for (size_t r = 0; r < s.devices.size(); ++r) {
    if (s.devices[r] < 0) continue;
    PeerRecord rec;
    rec.rank = static_cast<int32_t>(r);
    rec.kind = static_cast<uint32_t>(s.handles);
    const DeviceAlloc* bufs[2] = {gen->flags[r].get(),
                                  with_workspace ? gen->workspace[r].get() : nullptr};
    unsigned char* out[2] = {rec.flags, rec.workspace};
    uint64_t* sizes[2] = {&rec.flags_bytes, &rec.workspace_bytes};
    JO_CUDA_CHECK(&ctx, cudaSetDevice(s.devices[r]));
    for (int b = 0; b < 2; ++b)
      if (bufs[b] != nullptr) JO_CHECK(ExportBuffer(s, *bufs[b], out[b], sizes[b], ctx));
    mine.append(reinterpret_cast<const char*>(&rec), sizeof(rec));
  }
  std::map<int32_t, std::string> all;
  JO_CHECK(s.exchange->AllGather(with_workspace ? "p2p_buffers" : "mc_flags", mine, &all));
  gen->remote.assign(s.devices.size(), std::vector<Generation::Remote>(s.devices.size()));
  std::vector<bool> seen(s.devices.size(), false);
  for (const auto& [process, bytes] : all) {
    if (process == s.exchange->process()) continue;
    if (bytes.size() % sizeof(PeerRecord) != 0)
      return Internal(ctx.Describe() + ": process " + std::to_string(process) +
                      " sent a malformed buffer handle record");
    for (size_t off = 0; off < bytes.size(); off += sizeof(PeerRecord)) {
      PeerRecord rec;
      std::memcpy(&rec, bytes.data() + off, sizeof(rec));
      if (rec.rank < 0 || rec.rank >= s.nranks() || s.devices[rec.rank] >= 0 || seen[rec.rank] ||
          rec.kind != static_cast<uint32_t>(s.handles))
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
        JO_CHECK(MapRemoteBuffer(s, handles[b], sizes[b], gen, &views, ctx));
        for (size_t v = 0; v < s.devices.size(); ++v) {
          if (views[v] == nullptr) continue;
          (b == 0 ? gen->remote[v][rec.rank].flags : gen->remote[v][rec.rank].workspace) = views[v];
        }
      }
    }
  }
  for (size_t r = 0; r < s.devices.size(); ++r)
    if (s.devices[r] < 0 && !seen[r])
      return InvalidArgument(ctx.Describe() + ": no process sent the buffer handles of rank " +
                             std::to_string(r));
  JO_INFO(ctx.Describe() + ": mapped the buffers of " + std::to_string(s.nranks() - s.local_ranks) +
          " ranks in other processes (" + (fabric ? "fabric handles" : "CUDA IPC") + ") for " +
          std::to_string(s.local_ranks) + " local GPU(s)");
  return OkStatus();
}

Status ShareMulticastObject(CliqueState& s, const DriverApi* drv, const CUmulticastObjectProp* prop,
                            MulticastRegion* region, const ErrorContext& ctx) {
  if (!s.exchange)
    return Internal(ctx.Describe() + ": multicast clique spanning processes without an exchange");
  if (!drv->has_shareable)
    return InvalidArgument(ctx.Describe() +
                           ": transport multicast across processes needs "
                           "cuMemExportToShareableHandle/cuMemImportFromShareableHandle, which "
                           "this driver lacks. Use transport='nccl'");
  const bool owner = s.devices[0] >= 0;  // this process holds rank 0
  if (owner) {
    JO_CU_CHECK(&ctx, drv->cuMulticastCreate(&region->mc, prop));
    region->mc_created = true;
  }
  if (s.handles == Handles::kFabric) {
    std::string mine;
    if (owner) {
      CUmemFabricHandle handle{};
      JO_CU_CHECK(&ctx, drv->cuMemExportToShareableHandle(&handle, region->mc,
                                                          CU_MEM_HANDLE_TYPE_FABRIC, 0));
      mine.assign(reinterpret_cast<const char*>(&handle), sizeof(handle));
    }
    std::map<int32_t, std::string> all;
    JO_CHECK(s.exchange->AllGather("mc_fabric", mine, &all));
    if (!owner) {
      const std::string* from_owner = nullptr;
      for (const auto& [process, bytes] : all)
        if (!bytes.empty()) from_owner = &bytes;
      if (from_owner == nullptr || from_owner->size() != sizeof(CUmemFabricHandle))
        return InvalidArgument(
            ctx.Describe() +
            ": expected the multicast object's fabric handle "
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
    const Status shared = s.exchange->ShareFds("mc_fd", offer, &got);
    Fds received;
    for (const auto& [process, fds] : got)
      for (int fd : fds) received.Add(fd);
    JO_CHECK(shared);
    if (!owner) {
      if (got.size() != 1 || got.begin()->second.size() != 1)
        return InvalidArgument(ctx.Describe() +
                               ": expected the multicast handle (one fd) from "
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
  for (int device : s.devices) {
    if (device < 0) continue;
    CUdevice dev = 0;
    JO_CU_CHECK(&ctx, drv->cuDeviceGet(&dev, device));
    JO_CU_CHECK(&ctx, drv->cuMulticastAddDevice(region->mc, dev));
  }
  std::map<int32_t, std::string> added;
  JO_CHECK(s.exchange->AllGather("mc_added", "", &added));
  JO_INFO(ctx.Describe() + std::string(owner ? ": exported" : ": imported") +
          " the multicast object across " + std::to_string(s.exchange->processes().size()) +
          " processes (" + (s.handles == Handles::kFabric ? "fabric handle" : "POSIX fd") + ")");
  return OkStatus();
}

}  // namespace jo::cuda
