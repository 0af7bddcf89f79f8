// Peers in other processes: how a clique spanning processes reaches their
// buffers, and theirs ours.
//
// Every process of the clique agrees at its first buffer generation on one
// kind of handle (Negotiate):
//   * fabric handles (CU_MEM_HANDLE_TYPE_FABRIC: multi-node NVLink with IMEX,
//     e.g. GB200 NVL72), when every process's GPUs support them and may use
//     them; they are plain bytes, so they work across hosts. Buffers are
//     cuMemCreate'd with a fabric handle, exported, allgathered, imported
//     and mapped once per process, accessible to every local GPU;
//   * otherwise CUDA IPC (one host only; processes on different hosts get an
//     error saying why): buffers are cudaMalloc'd; each local GPU opens its
//     own mapping of every remote rank's buffers (cudaIpcOpenMemHandle maps
//     into the opening device's context only).
// The mappings stand in the generation for the remote ranks' buffers, per
// viewing rank. The multicast object travels the same way: a fabric handle
// allgathered as bytes, or a POSIX fd that the exchange moves with
// share_fds. All of it goes through the clique's jo::Exchange (the
// jax.distributed store), registered when the call lowered.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "cuda/base/driver.h"
#include "cuda/clique/clique_state.h"

namespace jo::cuda {

// Agrees with every process on s.handles. `local` is this process's own
// set-up so far: a failure is told to the peers, so that they fail at once
// naming it instead of waiting for this process until the timeout.
Status Negotiate(CliqueState& s, const ErrorContext& ctx, const Status& local = OkStatus());

// A buffer of local rank `rank` that peers address: cudaMalloc'd, or (fabric)
// cuMemCreate'd with a fabric handle and mapped for every local GPU.
Status AllocShared(CliqueState& s, int32_t rank, size_t bytes, const ErrorContext& ctx,
                   std::unique_ptr<DeviceAlloc>* out);

// Exchanges this generation's buffer handles with the peers and maps theirs:
// flags, and the workspace when `with_workspace` (p2p; multicast's workspace
// is the multicast object).
Status ImportPeerBuffers(CliqueState& s, Generation* gen, bool with_workspace,
                         const ErrorContext& ctx);

// Multicast across processes: the process of rank 0 creates the object and
// exports it; the others import it; every process adds its own GPUs.
Status ShareMulticastObject(CliqueState& s, const DriverApi* drv, const CUmulticastObjectProp* prop,
                            MulticastRegion* region, const ErrorContext& ctx);

// Why `device` cannot share memory through fabric handles ("" when it can),
// found once per device per process by asking the driver and then trying (a
// missing IMEX channel shows only when creating).
std::string FabricReason(const DriverApi* drv, int device);
// Tests (the fake's reset changes the machine): probe fabric support again.
void ForgetFabricProbes();

}  // namespace jo::cuda
