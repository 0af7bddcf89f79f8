// Transport nccl: ncclSend/ncclRecv on communicators of the clique's ranks.
// Works on any topology and across nodes; buffers are this process's own.
#include <chrono>

#include "core/log.h"
#include "cuda/transport/transports.h"

namespace jo::cuda {
namespace {

// One process: an id of our own. Spanning processes: the clique's id,
// exchanged through jax.distributed at trace time; every process creates
// its ranks' communicators with it, and creation completes once every
// process's ranks have joined — awaited until our deadline, not forever.
Status CreateComms(CliqueState& s, const ErrorContext& ctx) {
  if (s.nccl && s.nccl->created()) return OkStatus();
  ncclUniqueId id = s.nccl_id;
  if (!s.spans_processes()) JO_NCCL_CHECK(&ctx, ncclGetUniqueId(&id));
  auto comms = std::make_shared<NcclComms>(s.timeout);
  JO_CHECK(comms->Create(s.devices, id, std::chrono::steady_clock::now() + s.timeout,
                         s.spans_processes() ? "NCCL communicator creation (every process's ranks "
                                               "must join: they do at their first call)"
                                             : "NCCL communicator creation",
                         ctx));
  s.nccl = std::move(comms);
  JO_INFO(ctx.Describe() + ": NCCL communicators created for " + std::to_string(s.local_ranks) +
          " of " + std::to_string(s.devices.size()) + " ranks, one per ring direction" +
          (s.spans_processes() ? " (the others in other processes)" : ""));
  return OkStatus();
}

Status NcclConnect(CliqueState& s, const ErrorContext& ctx) {
  return s.nranks() > 1 ? CreateComms(s, ctx) : OkStatus();
}

Status NcclAllocBuffers(CliqueState& s, Generation* gen, const ErrorContext& ctx) {
  JO_CHECK(AllocLocalBuffers(s, gen, /*with_workspace=*/true, ctx));
  return AwaitSetup(s, ctx);
}

}  // namespace

const TransportOps kNcclOps = {Transport::kNccl, NcclConnect, NcclAllocBuffers};

const TransportOps& OpsOf(Transport transport) {
  switch (transport) {
#define JO_TRANSPORT_OPS_CASE(e, id, name, auto_rank, fused, mechanism, cuda) \
  case Transport::e:                                                          \
    return cuda;
    JO_TRANSPORTS(JO_TRANSPORT_OPS_CASE)
#undef JO_TRANSPORT_OPS_CASE
  }
  return kNcclOps;
}

}  // namespace jo::cuda
