// ShmClique: the clique of ONE call site whose ranks live in several
// processes (the host executor's counterpart of LocalClique).
//
// Every call site has its own clique, in every process, exactly as in one
// process: XLA runs independent calls concurrently and in different orders on
// different devices, so two calls must never share epochs, flags or buffers.
// The processes of a site find each other through the site directory of
// their ShmDomain (shm_domain.h), which was bootstrapped for the mesh-axis
// group through the jax.distributed store; nothing of a site goes through the
// store.
//
// Everything the ranks share is in ONE segment per site (a memfd, shm.h),
// made by the first process to run the site and sized for its call: a site
// is named by what it is (core/call.h CallSite), so every call of it has the
// same shapes and the same needs, and it never grows. It holds
//
// * the site's call (its signature and sizes, to check the others against);
// * per rank: the epoch of the call it is in, the epoch of the last call it
//   finished, the device inside a call as this rank, and the call signature
//   per parity (the agreement check);
// * per rank and parity: the flags, an outbox (the nccl-style mailbox) and
//   the workspace.
//
// Local ranks (threads of one process) use it exactly like remote ones.
// Waiting: on the rank's doorbell in the domain (futex), re-checking the
// condition after every wake and at least every 100 ms, looking for dead
// peers (ShmDomain::CheckPeers) and giving up at the deadline with an error
// naming the clique, epoch, rank, the missing peer with its process, and
// where that peer is instead (ShmDomain::WhereIs). A wait for peers is also
// published in the domain, and refused at once, naming every call involved,
// when the ranks wait for each other in calls none of them can reach (each
// waits in a call a peer has not started, and that peer waits too): the
// processes started the same calls in different orders, which no wait ends.
//
// Buffer reuse is double-buffering by epoch parity (host_clique.h), which
// needs each rank to run a site's calls one at a time: a call claims its rank
// only once the rank has finished the call before it (the done epoch), in
// epoch order. A process that drops the site and makes it again while its
// peers hold it continues its ranks' epochs where they left off.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host/host_clique.h"
#include "host/shm.h"
#include "host/shm_domain.h"

namespace jo::host {

class ShmClique : public HostClique {
 public:
  // The clique of call site `site` in `domain`, for calls with `needs` and
  // `signature` (every call of a site has the same). Its segment is opened
  // (or created) at the first call, on a worker thread: nothing here blocks.
  ShmClique(std::shared_ptr<ShmDomain> domain, int64_t site, const CallNeeds& needs,
            std::string signature);
  ~ShmClique() override;

  // The agreement and the broken state live in shared memory (every process
  // of the clique sees them), not in the base.
  Status Agree(const std::string& where, int32_t rank, int64_t epoch,
               const std::string& signature) override;
  void Break(const Status& status) override;
  std::string BrokenReason() const override;
  Status Reserve(const WaitContext& ctx, const CallNeeds& needs) override;
  Status ClaimRank(WaitContext* ctx, int64_t device) override;
  void ReleaseRank(const WaitContext& ctx) override;
  std::byte* Workspace(int32_t owner, int64_t epoch) override;
  int64_t WorkspaceBytes() const override;
  Status Signal(const WaitContext& ctx, int32_t peer, int32_t flag) override;
  Status WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) override;
  Status ResetFlags(const WaitContext& ctx, int32_t first, int32_t count) override;
  Status Send(const WaitContext& ctx, int32_t peer, int32_t tag,
              std::vector<std::byte> data) override;
  Status Recv(const WaitContext& ctx, int32_t peer, int32_t tag,
              std::vector<std::byte>* data) override;
  std::string Kind() const override;
  std::string Where(const WaitContext& ctx) const override;
  int64_t Epoch(int32_t rank) const override;

  struct SiteHeader;
  struct RankState;
  struct Layout;

 private:
  RankState* rank_state(int32_t rank) const;
  std::string Missing(const WaitContext& ctx, int32_t expected) const;
  Status BrokenStatus(const WaitContext& ctx) const;
  Status Fail(Status status);           // breaks the domain with `status`, logs, returns it
  Status Open(const WaitContext& ctx);  // maps the site segment (first call)
  // Waits until pred() or the clique breaks, a peer dies or the deadline
  // passes; returns OK, the failure, or kTimeout with an empty message
  // (the caller words it). `for_peers`: a wait for what peers of this call
  // send, published in the domain (ShmDomain::BeginWait), and refused at once
  // as a deadlock when the ranks it waits for wait for each other in calls
  // none of them can reach (ShmDomain::Stuck), unchanged for a while (at least a second).
  template <typename Pred>
  Status WaitFor(const WaitContext& ctx, Pred pred, bool for_peers = false);
  // `waits`: the cycle's waits as ShmDomain::Stuck read them.
  Status Deadlock(const WaitContext& ctx, const std::string& waits) const;
  std::atomic<int64_t>* Flag(int32_t owner, int64_t epoch, int32_t flag) const;
  std::byte* Parity(int32_t owner, int64_t epoch) const;  // base of owner's half for `epoch`

  const std::shared_ptr<ShmDomain> domain_;
  const std::string signature_;
  const std::unique_ptr<Layout> layout_;
  std::mutex open_mu_;                // the first call of each local rank opens the site
  Status open_status_;                // a failed open, for every local rank after it
  std::shared_ptr<ShmSegment> site_;  // null until opened
  // Per rank: its epochs before this process opened the site (set once, at Open).
  std::unique_ptr<std::atomic<int64_t>[]> base_;
};

}  // namespace jo::host
