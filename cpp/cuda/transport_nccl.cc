// Transport nccl: ncclSend/ncclRecv on communicators of the clique's ranks.
// Works on any topology and across nodes; buffers are this process's own.
#include <chrono>

#include "core/log.h"
#include "cuda/transports.h"

namespace jo::cuda {
namespace {

Status CreateComms(CliqueState& s, const ErrorContext& ctx) {
  if (!s.comms.empty()) return OkStatus();
  DeviceGuard guard;
  // One process: an id of our own. Spanning processes: the clique's id,
  // exchanged through jax.distributed at trace time; every process creates
  // its ranks' communicators with it, and creation completes once every
  // process's ranks have joined — awaited until our deadline, not forever.
  ncclUniqueId id = s.nccl_id;
  if (!s.spans_processes()) JO_NCCL_CHECK(&ctx, ncclGetUniqueId(&id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclComm_t> comms(s.devices.size(), nullptr);
  // One ncclCommInitRankConfig per local rank, in one group (NCCL requires
  // the group when one thread initialises several ranks).
  JO_NCCL_CHECK(&ctx, ncclGroupStart());
  Status status = OkStatus();
  for (size_t r = 0; r < s.devices.size() && status.ok(); ++r) {
    if (s.devices[r] < 0) continue;
    const cudaError_t set = cudaSetDevice(s.devices[r]);
    if (set != cudaSuccess) {
      status = CudaFailure(set, "cudaSetDevice", &ctx);
      break;
    }
    const ncclResult_t code = ncclCommInitRankConfig(&comms[r], static_cast<int>(s.devices.size()),
                                                     id, static_cast<int>(r), &config);
    if (code != ncclSuccess && code != ncclInProgress)
      status = NcclFailure(code, "ncclCommInitRankConfig", &ctx);
  }
  const ncclResult_t end = ncclGroupEnd();
  if (status.ok() && end != ncclSuccess && end != ncclInProgress)
    status = NcclFailure(end, "ncclGroupEnd", &ctx);
  const auto deadline = std::chrono::steady_clock::now() + s.timeout;
  for (size_t r = 0; r < comms.size() && status.ok(); ++r)
    if (comms[r] != nullptr)
      status = AwaitNccl(comms[r], deadline,
                         s.spans_processes() ? "NCCL communicator creation (every process's ranks "
                                               "must join: they do at their first call)"
                                             : "NCCL communicator creation",
                         &ctx);
  if (!status.ok()) {
    for (ncclComm_t c : comms)
      if (c != nullptr) (void)ncclCommAbort(c);
    return status;
  }
  s.comms = std::move(comms);
  JO_INFO(ctx.Describe() + ": NCCL communicators created for " + std::to_string(s.local_ranks) +
          " of " + std::to_string(s.devices.size()) + " ranks" +
          (s.spans_processes() ? " (the others in other processes)" : ""));
  return OkStatus();
}

Status NcclConnect(CliqueState& s, const ErrorContext& ctx) {
  return s.nranks() > 1 ? CreateComms(s, ctx) : OkStatus();
}

Status NcclAllocBuffers(CliqueState& s, Generation* gen, const ErrorContext& ctx) {
  return AllocLocalBuffers(s, gen, /*with_workspace=*/true, ctx);
}

}  // namespace

const TransportOps kNcclTransport = {Transport::kNccl, NcclConnect, NcclAllocBuffers};

const TransportOps& OpsOf(Transport transport) {
  switch (transport) {
    case Transport::kNccl:
      return kNcclTransport;
    case Transport::kP2p:
      return kP2pTransport;
    case Transport::kMulticast:
      return kMulticastTransport;
  }
  return kNcclTransport;
}

}  // namespace jo::cuda
