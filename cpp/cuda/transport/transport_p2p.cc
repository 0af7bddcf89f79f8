// Transport p2p: copies into the peers' workspace (the copy engine) and
// flags raised with stream memory operations. Needs peer access among this
// process's GPUs; peers in other processes are reached through mappings of
// their buffers (peer_handles.h).
#include "cuda/transport/peer_handles.h"
#include "cuda/transport/transports.h"

namespace jo::cuda {

namespace {

Status EnablePeerAccess(CliqueState& s, const ErrorContext& ctx) {
  if (s.peers_enabled) return OkStatus();
  DeviceGuard guard;
  for (size_t i = 0; i < s.devices.size(); ++i)
    for (size_t j = 0; j < s.devices.size(); ++j) {
      // This process's GPUs only (another process's rank is reached through a mapping).
      if (i == j || s.devices[i] == s.devices[j] || s.devices[i] < 0 || s.devices[j] < 0) continue;
      int can = 0;
      JO_CUDA_CHECK(&ctx, cudaDeviceCanAccessPeer(&can, s.devices[i], s.devices[j]));
      if (!can)
        return Status(Code::kInvalidArgument,
                      ctx.Describe() + ": transport " + TransportName(s.transport) +
                          " needs peer access from GPU " + std::to_string(s.devices[i]) +
                          " to GPU " + std::to_string(s.devices[j]) +
                          ", which this machine does not offer; use transport='nccl' (or 'auto')");
      JO_CUDA_CHECK(&ctx, cudaSetDevice(s.devices[i]));
      const cudaError_t code = cudaDeviceEnablePeerAccess(s.devices[j], 0);
      if (code == cudaErrorPeerAccessAlreadyEnabled) {
        (void)cudaGetLastError();  // enabled earlier (by us or by the user): fine
      } else {
        JO_CUDA_CHECK(&ctx, code);
      }
    }
  s.peers_enabled = true;
  return OkStatus();
}

Status P2pAllocBuffers(CliqueState& s, Generation* gen, const ErrorContext& ctx) {
  JO_CHECK(AllocLocalBuffers(s, gen, /*with_workspace=*/true, ctx));
  JO_CHECK(AwaitSetup(s, ctx));  // zero before any peer can use them
  if (s.spans_processes()) JO_CHECK(ImportPeerBuffers(s, gen, /*with_workspace=*/true, ctx));
  return OkStatus();
}

}  // namespace

Status ConnectDirect(CliqueState& s, const ErrorContext& ctx) {
  Status peers = OkStatus();
  if (s.local_ranks > 1) peers = EnablePeerAccess(s, ctx);
  if (s.spans_processes() && s.handles == Handles::kUnset) JO_CHECK(Negotiate(s, ctx, peers));
  return peers;
}

const TransportOps kP2pOps = {Transport::kP2p, ConnectDirect, P2pAllocBuffers};

}  // namespace jo::cuda
