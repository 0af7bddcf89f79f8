// The CUDA executor's side of one call site: its placed calls, the group's
// clique, and enqueueing its calls.
//
// A CudaSite is the FFI instantiate-stage state of one custom call of one
// executable (ffi/ffi_call.h). The first execution on a GPU places the call
// there (core/call.h), orders its issue and binds it to the clique; later
// executions fetch it, so an execution only agrees, reserves and enqueues.
//
// The clique is the mesh-axis group's, shared by the group's call sites (its
// buffers are GPU memory: one set per call site would not fit a model's
// hundreds of sites). Sharing is sound on XLA:GPU: a device's calls are
// enqueued by one host thread in the executable's program order (thunks run
// in sequence; the handlers are not command-buffer compatible, so never
// captured and replayed out of order), every process compiles the same HLO,
// and each call forks from and joins back into XLA's stream, so a device
// runs the group's calls one after another, in the same order on every
// device. The agreement check includes the call site: should a device ever
// run another site at the same epoch, the call fails instead of exchanging
// wrong data (docs/gpu-internals.md §1).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/call.h"
#include "core/issue_order.h"
#include "core/status.h"
#include "cuda/clique/cuda_clique.h"
#include "cuda/executor.h"

namespace jo::cuda {

class CudaSite {
 public:
  CudaSite(CallDesc desc, CallSite site);

  // Enqueues one call of `caller` (XLA:GPU names devices by local ordinal) on
  // `stream`, XLA's stream of that GPU. Returns once the work is enqueued.
  // `gate`: the loopback runner's order among ranks sharing a GPU (executor.h).
  Status Enqueue(const Caller& caller, const Problem& problem, const CallBuffers& io,
                 cudaStream_t stream, IssueGate* gate = nullptr);

  const CallDesc& desc() const { return desc_; }

 private:
  // The site's call on one GPU: placed, in its issue order, and bound to the
  // group's clique.
  struct BoundCall {
    PlacedCall call;
    // The order the executor issues the program in (core/issue_order.h): one
    // that completes through a single hardware work queue per device.
    std::vector<IssueUnit> issue;
    std::shared_ptr<CudaClique> clique;
    // What the watchdog names when a call does not finish (WatchedCall): the
    // flags the program waits for, (flag id, writer) once each, and whether
    // it waits inside NCCL.
    std::vector<std::pair<int32_t, int32_t>> waits;
    bool nccl = false;
    PoolNeeds pool_needs;           // what each local rank's pool must hold (clique_state.h)
    int32_t fused_wait_flags = -1;  // a fused GEMM that waits: its first block's flag (-1: none)
    // The kernel algorithms (one AllReduce op: docs/gpu-internals.md §7): the signature the kernel
    // checks against its peers' (a hash of `call.signature`), and what the call's first execution
    // on this GPU set up — the clique's kernel area, the rank's resources — once, under setup_mu.
    uint32_t device_signature = 0;
    mutable std::mutex setup_mu;
    mutable std::shared_ptr<const KernelArea> area;
    mutable RankResources* resources = nullptr;
    mutable std::shared_ptr<const RankPool> pool;
    // A replayable program (docs/gpu-internals.md §8): its own buffers and its flag waits'
    // fault records (CudaClique::ReplayArea), made at its first execution on this GPU, under
    // setup_mu, and watched from then on (WatchKernelArea).
    mutable std::shared_ptr<const KernelArea> replay;
  };
  Status BindCall(const Caller& caller, const Problem& problem, BoundCall* out);
  // A call of the kernel algorithms: no epoch, no agreement and no watch of its own (it would
  // not replay): its first execution on a GPU sets it up (an epoch of the clique, as every call
  // of a clique takes, in the same order on every rank), then every execution, eager or under
  // capture, enqueues the GEMM and the kernel, whose sequence numbers live on the device.
  Status EnqueueOneLaunch(const Caller& caller, const BoundCall& bound, const CallBuffers& io,
                          cudaStream_t stream, bool capturing);
  // A replayable program (any program over p2p or multicast, docs/gpu-internals.md §8): likewise no
  // epoch, agreement or watch per call; its first execution on a GPU sets up its own buffers and
  // the standing watch of its flag waits' fault records.
  Status EnqueueReplayable(const Caller& caller, const BoundCall& bound, const CallBuffers& io,
                           cudaStream_t stream, bool capturing);

  const CallDesc desc_;
  const CallSite site_;
  PerDevice<BoundCall> bound_;
};

// Tests only (the fake's misuse check of a host-side epoch baked into a graph): a capturing
// stream is not refused for any program, so that one that does not replay can be recorded.
void AllowCapturingAnyCallForTests(bool allow);

// One line per live clique (for info()).
std::string DescribeCudaCliques();
// Tests only: forgets every clique (waits for their queued work first).
void ResetCudaCliques();

}  // namespace jo::cuda
