// The GPU transports, one table each (transport_nccl.cc, transport_p2p.cc,
// transport_multicast.cc): what a clique needs before its first buffers, and
// what memory each buffer generation holds. Whether a machine's GPUs can
// serve a transport is decided in one place before anything runs
// (jaxoverlap/_executors/capabilities.py transport_reasons, used by the one
// resolver there, resolve_transport); these tables only set up what was chosen and
// refuse clearly if the machine disagrees.
#pragma once

#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/clique/clique_state.h"

namespace jo::cuda {

struct TransportOps {
  Transport transport;
  // Before the first buffers (once per clique): communicators, or peer
  // access among this process's GPUs and, across processes, the agreed
  // handle kind.
  Status (*connect)(CliqueState& s, const ErrorContext& ctx);
  // One buffer generation's memory for this process's ranks (and the
  // mappings of other processes' ranks' buffers).
  Status (*alloc_buffers)(CliqueState& s, Generation* gen, const ErrorContext& ctx);
};

// One table per transport (core/kinds.h, the cuda column), defined by its file.
#define JO_DECLARE_TRANSPORT_OPS(e, id, name, auto_rank, fused, mechanism, cuda) \
  extern const TransportOps cuda;
JO_TRANSPORTS(JO_DECLARE_TRANSPORT_OPS)
#undef JO_DECLARE_TRANSPORT_OPS

const TransportOps& OpsOf(Transport transport);

// The connect step of the direct transports (p2p, multicast): peer access
// among this process's GPUs of the clique and, across processes, the handle
// kind every process uses (telling the peers if this process's own set-up
// failed, so that they fail at once).
Status ConnectDirect(CliqueState& s, const ErrorContext& ctx);

}  // namespace jo::cuda
