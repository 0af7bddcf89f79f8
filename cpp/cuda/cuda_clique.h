// CudaClique: the GPU side of one clique in this process — the group of a
// mesh axis whose call sites run on these GPUs (cuda_site.h says why GPU
// cliques are per group).
//
// Single process (JAX's default on one node: one process drives every local
// GPU) is complete: all ranks' devices are here, so the first rank to need a
// resource creates it for every rank, without a rendezvous. Cliques spanning
// processes (one process per GPU or per node, or anything between): each
// process holds the ranks whose GPUs it drives and creates resources for
// those only, exchanging what must cross processes (the NCCL id at lowering,
// buffer handles at the first buffers: peer_handles.h).
//
// What depends on the transport is in its table (transports.h): before the
// first buffers, connect (communicators; peer access); per buffer
// generation, its memory. The clique itself keeps the generations
// (clique_state.h), the per-rank streams and events, and the base's epochs,
// agreement check and broken state. Set-up happens in Reserve, at a call's
// first execution — never under CUDA-graph capture (the handlers are not
// command-buffer compatible).
#pragma once

#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/call.h"
#include "core/clique.h"
#include "core/exchange.h"
#include "core/program.h"
#include "cuda/check.h"
#include "cuda/clique_state.h"

namespace jo::cuda {

class CudaClique : public Clique {
 public:
  // `devices`: the local ordinal of each rank, -1 for a rank of another
  // process; then `nccl_id` is the clique's ncclUniqueId (transport nccl) and
  // `exchange` reaches the other processes (p2p, multicast). `processes`: the
  // process of each rank. `timeout` bounds waiting for peers in set-up.
  CudaClique(CliqueKey key, Transport transport, std::vector<int> devices,
             std::vector<int64_t> processes, const ncclUniqueId* nccl_id = nullptr,
             std::shared_ptr<Exchange> exchange = nullptr,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(120000));
  ~CudaClique() override;

  Transport transport() const { return state_.transport; }
  const std::vector<int>& devices() const { return state_.devices; }
  const std::vector<int64_t>& processes() const { return state_.processes; }
  bool spans_processes() const { return state_.spans_processes(); }

  // Reserve, before call `epoch` of `rank` (the agreement check has passed):
  // connects the transport (once), makes a buffer generation as big as
  // `needs` (core/call.h: the same on every rank) when the current one is
  // smaller, and the rank's streams, events and scratch for `program`.
  // Returns the generation the call must use, the rank's resources and its
  // communicator. A failure breaks the clique.
  Status Reserve(const Program& program, const CallNeeds& needs, int64_t epoch,
                 const ErrorContext& ctx, const Generation** gen, RankResources** resources,
                 ncclComm_t* comm);

  // Aborts the NCCL communicators (the watchdog releasing stuck kernels).
  void AbortComms();

  std::string Describe() const;

 protected:
  int32_t LocalRanks() const override { return state_.local_ranks; }

 private:
  Status ReserveLocked(const Program& program, const CallNeeds& needs, int64_t epoch,
                       const ErrorContext& ctx, const Generation** gen, RankResources** resources,
                       ncclComm_t* comm);  // requires mu_
  Status NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                       const ErrorContext& ctx);  // requires mu_

  mutable std::mutex mu_;
  CliqueState state_;
  bool connected_ = false;
  std::vector<std::unique_ptr<Generation>> generations_;  // newest last
};

}  // namespace jo::cuda
