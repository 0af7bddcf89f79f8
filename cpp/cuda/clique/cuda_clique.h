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
// first execution — never under CUDA-graph capture (the handlers refuse a
// capturing stream).
//
// Locking: the clique's lock guards its state, never a wait for the GPU or
// for a peer process. The transport is connected (communicators created, peer
// access enabled, handles agreed) with the lock released, and so is a new
// generation made (its zero-fill is awaited, its handles exchanged); ranks
// that need either wait for it, ranks still on older epochs go on — their
// calls are what lets the GPU get to the zero-fill when streams share a
// hardware queue — and Describe answers meanwhile. The watchdog needs no lock
// of the clique (the communicators have their own, with leases:
// nccl_comms.h).
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/call.h"
#include "core/clique.h"
#include "core/exchange.h"
#include "core/program.h"
#include "cuda/base/check.h"
#include "cuda/clique/clique_state.h"

namespace jo::cuda {

// What one call gets from Reserve.
struct Reservation {
  std::shared_ptr<const Generation> gen;  // held until the call is watched (or done)
  RankResources* resources = nullptr;
  std::shared_ptr<const RankPool> pool;      // the rank's pooled memory, as grown for the call
  std::shared_ptr<const CallEvents> events;  // the call's own started/done events
  std::shared_ptr<const KernelArea> area;    // asked for (kernel_area): the clique's kernel area
};

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
  // connects the transport (once); if it is the first local rank at `epoch`,
  // frees the generations every local rank is past and grows every local
  // rank's pool to `pool_needs` (clique_state.h), the others waiting; makes a
  // buffer generation as big as `needs` (core/call.h: the same on every rank)
  // when the current one is smaller; and the rank's streams and events for
  // `program` (without the lock). Everything here may wait for the GPU: it
  // runs before the call's first enqueue (docs/gpu-internals.md §1, "What may
  // run on the enqueue path"). A failure breaks the clique.
  // `kernel_area`: the call runs the one-launch all-reduce (docs/gpu-internals.md §7): also
  // makes the clique's kernel area if it has none yet (clique_state.h KernelArea), at this
  // epoch, with the discipline of a new generation.
  // `generation` false (a replayable program's set-up, which has buffers of its own:
  // ReplayArea): no generation either.
  Status Reserve(const Program& program, const CallNeeds& needs, const PoolNeeds& pool_needs,
                 int64_t epoch, const ErrorContext& ctx, Reservation* out, bool kernel_area = false,
                 bool generation = true);

  // A replayable program's own buffers (docs/gpu-internals.md §8): a generation of
  // `workspace_bytes` per half and `num_flags` flags per half (its programs use half 0), and
  // per local rank the zeroed fault record of its bounded flag waits (page-locked host memory),
  // made once per call site `site` — no epoch-based call and no other site touches them, and
  // the flags start at 0 — at the site's set-up `epoch` by the first local rank to ask, the
  // others waiting, with a generation's discipline; kept until teardown (a captured call keeps
  // its addresses).
  // `acks`: the program's first acknowledgement flag (KernelArea::acks; its op: ctx.op).
  Status ReplayArea(int64_t site, int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                    int32_t acks, const ErrorContext& ctx, std::shared_ptr<const KernelArea>* out);

  // A one-launch all-reduce of this clique was captured into a CUDA graph: its replays are
  // GPU work no event of ours tracks, so teardown keeps the kernel area (never frees it under a
  // replay that may still run).
  void NoteCaptured() { captured_ = true; }

  // Transport nccl: leases `rank`'s communicators (nccl_comms.h), kAborted once they were
  // aborted (naming the clique's failure when it broke); other transports: nothing. Taken just
  // before the call's first enqueue, after everything that may wait for the device: a lease held
  // across such a wait would keep the watchdog from aborting the communicator whose stuck kernel
  // the wait waits for.
  Status AcquireComms(int32_t rank, const ErrorContext& ctx, NcclComms::Lease* out);

  // Aborts the NCCL communicators (the watchdog releasing kernels stuck in
  // NCCL): those no enqueue holds at once, the others when it lets go; each
  // on a thread of its own, never waited for (nccl_comms.h) — except, when
  // `await_until` is given, until then (the fake's virtual-clock watchdog, so
  // that the fake GPU sees the aborts before it decides it cannot progress).
  void AbortComms(std::optional<std::chrono::steady_clock::time_point> await_until = {});

  std::string Describe() const;

  // Takes over a reference to a generation the watchdog held (Fire): dropped by the next
  // reservation that frees past generations, or at teardown — never on the watchdog's thread,
  // where the last reference would free device memory (which waits for the device) and stop
  // the watching of every clique meanwhile. Takes only a lock of its own, held for the push.
  void DeferRelease(std::shared_ptr<const Generation> gen);

  // CudaClique objects not yet fully destroyed (members included): the last
  // reference may be dropped on another thread (the watchdog's poll), whose
  // destructor then frees the buffers after ResetCudaCliques saw it expire.
  static int Live();

 protected:
  int32_t LocalRanks() const override { return state_.local_ranks; }
  void WakeAll() override { made_.notify_all(); }  // waiters for a generation see the break

 private:
  Status ReserveLocked(std::unique_lock<std::mutex>& lock, const Program& program,
                       const CallNeeds& needs, const PoolNeeds& pool_needs, int64_t epoch,
                       const ErrorContext& ctx, Reservation* out, bool kernel_area,
                       bool generation);
  // Makes the kernel area (WITHOUT the lock, like a generation).
  Status NewKernelArea(int64_t epoch, const ErrorContext& ctx, std::shared_ptr<KernelArea>* out);
  // Makes a generation valid from `epoch`; called WITHOUT the lock.
  // `halves`: 2 (epoch parities), or 1 (a replayable program's, run at epoch 0).
  Status NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                       const ErrorContext& ctx, std::shared_ptr<Generation>* out,
                       int32_t halves = 2);
  // Transport nccl: connects the rank's communicators to the peers `program` sends to and
  // receives from, those not connected yet (NcclComms::Connect); called WITHOUT the lock.
  Status ConnectPeers(const Program& program, const ErrorContext& ctx, RankResources* res);
  // Moves the generations every local rank is past into `out` (requires mu_).
  void TakePast(std::vector<std::shared_ptr<const Generation>>* out);
  // Whether each local rank's last enqueued call has finished on the GPU,
  // waiting for it until `deadline`.
  bool AwaitIdle(std::chrono::steady_clock::time_point deadline);

  // Counts this object in Live() until every member below is destroyed
  // (declared first: destroyed last).
  struct LiveToken {
    LiveToken();
    ~LiveToken();
  } live_;
  mutable std::mutex mu_;
  std::condition_variable made_;  // a generation was made (or its making failed)
  CliqueState state_;
  bool connected_ = false;
  bool connecting_ = false;  // a rank is connecting the transport, without the lock
  std::vector<std::shared_ptr<Generation>> generations_;  // newest last
  int64_t making_ = -1;  // the epoch a generation is being made for, without the lock
  std::shared_ptr<KernelArea> kernel_area_;  // made once, never replaced
  bool making_area_ = false;                 // a rank makes it, without the lock
  std::map<int64_t, std::shared_ptr<KernelArea>> replay_areas_;  // ReplayArea, by call site
  bool making_replay_ = false;         // a rank makes one, without the lock
  std::atomic<bool> captured_{false};  // NoteCaptured
  // The newest epoch a local rank has reserved, and the one whose first reserver frees past
  // generations and grows the pools now, without the lock (-1: none): ranks at it or later
  // wait.
  int64_t first_reserved_ = 0;
  int64_t freeing_ = -1;
  int64_t freed_ = 0;       // generations freed so far
  std::mutex deferred_mu_;  // guards deferred_ only; never held across a call
  std::vector<std::shared_ptr<const Generation>> deferred_;  // DeferRelease
};

}  // namespace jo::cuda
