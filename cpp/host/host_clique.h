// HostClique: the transport state of one clique; LocalClique: in-process.
//
// * Flags: per rank, 2 parities x num_flags int64 values. Signal sets a
//   peer's flag to the call's epoch; Wait blocks until the own flag is >= the
//   epoch. Flags are never reset (epochs only grow), except a replayable
//   call's (WaitContext::replayable: parity 0's, values 0 and 1, reset by
//   their reader).
// * Workspace: per rank, 2 parities x workspace bytes (symmetric: every rank
//   has the same layout), on the heap.
// * Mailbox: Send deposits a copy keyed by (epoch, src, dst, tag); Recv takes
//   it (sends are eager, like NCCL's for small messages).
//
// Buffer reuse across back-to-back calls: DOUBLE-BUFFERING BY EPOCH PARITY.
// Call e uses the workspace and flags of parity e % 2. Each rank runs a
// clique's calls one at a time, in epoch order (ClaimRank waits until the
// rank finished call e-1: XLA may start the next execution of a program
// before a rank's worker finished the last one). So rank r can only be in
// call e+2 (reusing parity e % 2 of its peers) after finishing e+1, and
// every program's result on r depends on data from every other rank in the
// same call, so every peer has started e+1, i.e. finished reading parity
// e % 2. No entry handshake is needed in steady state. Growth is the exception: a
// call that needs more workspace than the clique has holds a rendezvous of
// all ranks (no rank is inside a call then), and one thread reallocates.
//
// Every wait has a deadline and wakes up early when the clique is broken (a
// rank failed): the first error is kept (core/clique.h) and later calls fail
// fast with it. The agreement check is the base's.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/call.h"
#include "core/clique.h"

namespace jo::host {

using Clock = std::chrono::steady_clock;

// Who is waiting, for error messages: "ag_matmul (clique .../group 0, rank 2, epoch 5)".
struct WaitContext {
  const char* op = "";
  int32_t rank = 0;
  int64_t epoch = 0;
  std::chrono::milliseconds timeout{0};
  // A replayable program's call (core/program.h Problem::replayable): its
  // flags and workspace are parity 0's whatever the epoch, a Signal writes 1
  // (and finds the flag 0: else its reader has not consumed the last call), a
  // WaitFlag waits for >= 1, and the reader resets them (ResetFlags).
  bool replayable = false;
};

// The flag value a call signals and waits for, and the epoch whose parity its
// flags and workspace are: the call's epoch, or 1 and 0 for a replayable call.
inline int64_t FlagValue(const WaitContext& ctx) { return ctx.replayable ? 1 : ctx.epoch; }
inline int64_t SlotEpoch(const WaitContext& ctx) { return ctx.replayable ? 0 : ctx.epoch; }

// The transport state of one clique as the host executor sees it. Two
// implementations: LocalClique (below: every rank is a thread of this
// process) and ShmClique (cpp/host/shm_clique.h: ranks in several
// processes, everything in POSIX shared memory).
class HostClique : public Clique {
 public:
  using Clique::Clique;

  // Reserve: before a call, grows workspace, flags and mailbox to `needs`
  // with a rendezvous of all ranks if they are too small. Every rank asks
  // for the same sizes at the same epoch (core/call.h NeedsOf).
  virtual Status Reserve(const WaitContext& ctx, const CallNeeds& needs) = 0;

  // Marks `device` as inside a call as rank ctx->rank until ReleaseRank,
  // once the rank has finished its call ctx->epoch - 1 (calls of a clique run
  // one at a time per rank, in epoch order). A second device calling as the
  // same rank at the same time is an error that breaks the clique (two
  // devices would share one rank's epochs and flags). ctx->epoch comes in as
  // this process's count of the rank's calls and leaves as the clique's
  // epoch: a clique spanning processes that this process re-joined continues
  // its ranks where they left off (shm_clique.h).
  virtual Status ClaimRank(WaitContext* ctx, int64_t device) = 0;
  // The call of ctx (claimed) is over, whatever its result.
  virtual void ReleaseRank(const WaitContext& ctx) = 0;

  // Base of `owner`'s workspace for the parity of `epoch`.
  virtual std::byte* Workspace(int32_t owner, int64_t epoch) = 0;
  virtual int64_t WorkspaceBytes() const = 0;  // per parity per rank

  virtual Status Signal(const WaitContext& ctx, int32_t peer, int32_t flag) = 0;
  virtual Status WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) = 0;
  // Own flags [first, first + count) <- 0 (replayable calls only).
  virtual Status ResetFlags(const WaitContext& ctx, int32_t first, int32_t count) = 0;
  virtual Status Send(const WaitContext& ctx, int32_t peer, int32_t tag,
                      std::vector<std::byte> data) = 0;
  virtual Status Recv(const WaitContext& ctx, int32_t peer, int32_t tag,
                      std::vector<std::byte>* data) = 0;

  // "in-process" or how the clique spans processes, for info().
  virtual std::string Kind() const = 0;
  // "ag_matmul (clique ..., rank 2, epoch 5)": how errors name a waiter.
  virtual std::string Where(const WaitContext& ctx) const;
};

// The error of a replayable call's Signal that finds the flag still raised.
Status RaisedFlag(const WaitContext& ctx, int32_t peer, int32_t flag);

// The live cliques of this process's call sites. A clique lives while a call
// site uses it (its plans hold it; calls in flight too), not longer. A clique
// spanning processes is shared by every live call site with its site id (the
// same program compiled twice in this process: its peers see one site); an
// in-process one belongs to its call site alone (`instance`: CallSite's
// serial), so a new executable gets fresh cliques.
class SiteCliques {
 public:
  using Factory = std::function<std::unique_ptr<HostClique>()>;
  // `instance` 0: shared by key.
  Status GetOrCreate(const CliqueKey& key, int64_t instance, int32_t nranks, const Factory& make,
                     std::shared_ptr<HostClique>* out);
  std::vector<std::shared_ptr<HostClique>> List() const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<CliqueKey, int64_t>, std::weak_ptr<HostClique>> cliques_;
};

class LocalClique : public HostClique {
 public:
  LocalClique(CliqueKey key, int32_t nranks);

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
  std::string Kind() const override { return "in-process"; }

 protected:
  void WakeAll() override;

 private:
  using MailKey = std::tuple<int64_t, int32_t, int32_t, int32_t>;  // epoch, src, dst, tag
  std::string Missing(const WaitContext& ctx, int32_t expected) const;
  Status Fail(Status status);  // breaks the clique with `status` and returns it
  void Grow(int64_t workspace_bytes, int32_t num_flags);  // requires mu_, all ranks parked

  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t workspace_bytes_ = 0;                    // per parity
  int32_t num_flags_ = 0;                          // per parity
  std::vector<std::vector<std::byte>> workspace_;  // per rank: 2 parities
  std::vector<std::vector<int64_t>> flags_;        // per rank: 2 parities x num_flags_
  std::map<MailKey, std::vector<std::byte>> mailbox_;
  std::vector<int64_t> owner_device_;  // per rank: device inside a call, or -1
  std::vector<int64_t> done_;          // per rank: the last call it finished
  std::vector<bool> grow_arrived_;
  int32_t grow_count_ = 0;
  int64_t grow_generation_ = 0;
};

}  // namespace jo::host
