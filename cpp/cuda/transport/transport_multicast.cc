// Transport multicast (NVLS): stores and load-reduces through one multicast
// object whose physical memory is bound on every GPU of the clique (sm_90+,
// NVSwitch). Flags go over the same peer mappings as p2p's.
#include <algorithm>

#include "core/log.h"
#include "cuda/transport/peer_handles.h"
#include "cuda/transport/transports.h"

namespace jo::cuda {

namespace {

Status AllocMulticast(CliqueState& s, Generation* gen, const ErrorContext& ctx) {
  const DriverApi* drv = nullptr;
  JO_CHECK(LoadDriver(&drv));
  if (!drv->has_multicast)
    return Status(Code::kInvalidArgument,
                  ctx.Describe() +
                      ": transport multicast needs the CUDA >= 12.1 driver API "
                      "(cuMulticastCreate); this driver lacks it. Use transport='p2p' or 'nccl'");
  auto region = std::make_unique<MulticastRegion>();
  region->drv = drv;
  region->devices = s.devices;
  const size_t n = s.devices.size();
  region->phys.assign(n, 0);
  region->bound.assign(n, 0);
  region->unicast.assign(n, 0);
  CUmulticastObjectProp mc_prop{};
  mc_prop.numDevices = static_cast<unsigned>(n);
  mc_prop.handleTypes = s.handles == Handles::kFabric ? CU_MEM_HANDLE_TYPE_FABRIC
                                                      : CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  mc_prop.size = static_cast<size_t>(gen->halves * gen->workspace_bytes);
  // Sizes rounded to the MINIMUM granularities: that is what cuMulticastCreate,
  // cuMulticastBindMem and cuMemCreate require ("must be a multiple of" them,
  // cuda.h); RECOMMENDED is only "for best performance" and may be far larger,
  // while NVSwitch multicast resources are finite and every generation holds
  // one object.
  size_t mc_gran = 0, mem_gran = 0;
  JO_CU_CHECK(&ctx,
              drv->cuMulticastGetGranularity(&mc_gran, &mc_prop, CU_MULTICAST_GRANULARITY_MINIMUM));
  CUmemAllocationProp mem_prop{};
  mem_prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  mem_prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  mem_prop.location.id = *std::max_element(s.devices.begin(), s.devices.end());  // a local GPU
  // The same handle type as the multicast object's (as NCCL's NVLS does).
  mem_prop.requestedHandleTypes = static_cast<CUmemAllocationHandleType>(mc_prop.handleTypes);
  JO_CU_CHECK(&ctx, drv->cuMemGetAllocationGranularity(&mem_gran, &mem_prop,
                                                       CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  const size_t gran = std::max(mc_gran, mem_gran);
  region->bytes = RoundUp(std::max<size_t>(mc_prop.size, 1), gran);
  mc_prop.size = region->bytes;
  if (s.spans_processes()) {
    JO_CHECK(ShareMulticastObject(s, drv, &mc_prop, region.get(), ctx));
  } else {
    JO_CU_CHECK(&ctx, drv->cuMulticastCreate(&region->mc, &mc_prop));
    region->mc_created = true;
    for (int device : s.devices) {
      CUdevice dev = 0;
      JO_CU_CHECK(&ctx, drv->cuDeviceGet(&dev, device));
      JO_CU_CHECK(&ctx, drv->cuMulticastAddDevice(region->mc, dev));
    }
  }
  // Every device must be added before memory is bound.
  std::vector<CUmemAccessDesc> access;
  for (size_t r = 0; r < n; ++r) {
    if (s.devices[r] < 0) continue;  // another process binds and maps its own
    mem_prop.location.id = s.devices[r];
    JO_CU_CHECK(&ctx, drv->cuMemCreate(&region->phys[r], region->bytes, &mem_prop, 0));
    JO_CU_CHECK(&ctx, drv->cuMulticastBindMem(region->mc, 0, region->phys[r], 0, region->bytes, 0));
    region->bound[r] = 1;
    JO_CU_CHECK(&ctx, drv->cuMemAddressReserve(&region->unicast[r], region->bytes, gran, 0, 0));
    JO_CU_CHECK(&ctx, drv->cuMemMap(region->unicast[r], region->bytes, 0, region->phys[r], 0));
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = s.devices[r];
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    JO_CU_CHECK(&ctx, drv->cuMemSetAccess(region->unicast[r], region->bytes, &desc, 1));
    access.push_back(desc);
  }
  JO_CU_CHECK(&ctx, drv->cuMemAddressReserve(&region->mc_va, region->bytes, gran, 0, 0));
  JO_CU_CHECK(&ctx, drv->cuMemMap(region->mc_va, region->bytes, 0, region->mc, 0));
  region->mc_mapped = true;
  JO_CU_CHECK(&ctx,
              drv->cuMemSetAccess(region->mc_va, region->bytes, access.data(), access.size()));
  // cuMemCreate memory is not zeroed; the workspace carries no state between
  // calls, but zero it anyway so a protocol bug reads zeros, not garbage.
  for (size_t r = 0; r < n; ++r) {
    if (s.devices[r] < 0) continue;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(s.devices[r]));
    cudaStream_t setup = s.ranks[r]->setup;
    JO_CUDA_CHECK(&ctx, cudaMemsetAsync(reinterpret_cast<void*>(region->unicast[r]), 0,
                                        region->bytes, setup));  // awaited by AwaitSetup
  }
  gen->multicast = std::move(region);
  return OkStatus();
}

Status MulticastAllocBuffers(CliqueState& s, Generation* gen, const ErrorContext& ctx) {
  JO_CHECK(AllocLocalBuffers(s, gen, /*with_workspace=*/false, ctx));
  if (gen->workspace_bytes > 0) JO_CHECK(AllocMulticast(s, gen, ctx));
  JO_CHECK(AwaitSetup(s, ctx));  // zero before any peer can use them
  // Peers signal into our flags: across processes they map them.
  if (s.spans_processes()) JO_CHECK(ImportPeerBuffers(s, gen, /*with_workspace=*/false, ctx));
  return OkStatus();
}

}  // namespace

const TransportOps kMulticastOps = {Transport::kMulticast, ConnectDirect, MulticastAllocBuffers};

}  // namespace jo::cuda
