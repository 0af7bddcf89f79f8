// HostClique: the in-process transport state of one clique.
//
// * Flags: per rank, 2 parities x num_flags int64 values. Signal sets a
//   peer's flag to the call's epoch; Wait blocks until the own flag is >= the
//   epoch. Flags are never reset (epochs only grow).
// * Workspace: per rank, 2 parities x workspace bytes (symmetric: every rank
//   has the same layout), from a WorkspaceAllocator.
// * Mailbox: Send deposits a copy keyed by (epoch, src, dst, tag); Recv takes
//   it (sends are eager, like NCCL's for small messages).
//
// Buffer reuse across back-to-back calls: DOUBLE-BUFFERING BY EPOCH PARITY.
// Call e uses the workspace and flags of parity e % 2. Rank r can only be in
// call e+2 (reusing parity e % 2 of its peers) after finishing e+1, and every
// program's result on r depends on data from every other rank in the same
// call, so every peer has started e+1, i.e. finished reading parity e % 2.
// No entry handshake is needed in steady state. Growth is the exception: a
// call that needs more workspace than the clique has holds a rendezvous of
// all ranks (no rank is inside a call then), and one thread reallocates.
//
// Every wait has a deadline and wakes up early when the clique is broken (a
// rank failed): the first error is kept and later calls fail fast with it.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "core/clique.h"
#include "core/workspace.h"

namespace jo::host {

using Clock = std::chrono::steady_clock;

// Who is waiting, for error messages: "ag_matmul (clique .../group 0, rank 2, epoch 5)".
struct WaitContext {
  const char* op = "";
  int32_t rank = 0;
  int64_t epoch = 0;
  std::chrono::milliseconds timeout{0};
};

class HostClique : public Clique {
 public:
  HostClique(CliqueKey key, int32_t nranks, std::shared_ptr<WorkspaceAllocator> allocator);

  // Start of a call: fails fast if the clique is broken; checks that every
  // rank makes the same call at this epoch (`signature` describes the call
  // without the rank: a mismatch means ranks disagree on the call order);
  // grows workspace and flags with a rendezvous of all ranks if needed.
  Status Prepare(const WaitContext& ctx, const std::string& signature, int64_t workspace_bytes,
                 int32_t num_flags);

  // Marks `device` as inside a call as rank ctx.rank until ReleaseRank. A
  // second device calling as the same rank at the same time is an error that
  // breaks the clique (two devices would share one rank's epochs and flags);
  // different devices taking turns (same-shaped meshes used one after the
  // other) are fine.
  Status ClaimRank(const WaitContext& ctx, int64_t device);
  void ReleaseRank(int32_t rank);

  // Base of `owner`'s workspace for the parity of `epoch`.
  std::byte* Workspace(int32_t owner, int64_t epoch);
  int64_t WorkspaceBytes() const;  // per parity per rank

  Status Signal(const WaitContext& ctx, int32_t peer, int32_t flag);
  Status WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag);
  Status Send(const WaitContext& ctx, int32_t peer, int32_t tag, std::vector<std::byte> data);
  Status Recv(const WaitContext& ctx, int32_t peer, int32_t tag, std::vector<std::byte>* data);

  // Marks the clique broken (first error wins) and wakes every waiter.
  void Break(const Status& status);
  std::string BrokenReason() const;

 private:
  using MailKey = std::tuple<int64_t, int32_t, int32_t, int32_t>;  // epoch, src, dst, tag
  std::string Where(const WaitContext& ctx) const;
  Status BrokenStatus(const WaitContext& ctx) const;  // requires mu_
  std::string Missing(const WaitContext& ctx, int32_t expected) const;
  Status Grow(int64_t workspace_bytes, int32_t num_flags);  // requires mu_, all ranks parked

  std::shared_ptr<WorkspaceAllocator> allocator_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t workspace_bytes_ = 0;  // per parity
  int32_t num_flags_ = 0;        // per parity
  std::vector<std::unique_ptr<WorkspaceRegion>> workspace_;  // per rank
  std::vector<std::vector<int64_t>> flags_;                  // per rank
  std::map<MailKey, std::vector<std::byte>> mailbox_;
  std::map<int64_t, std::pair<std::string, int32_t>> signatures_;  // epoch -> (call, seen)
  std::vector<int64_t> owner_device_;  // per rank: device inside a call, or -1
  std::vector<bool> grow_arrived_;
  int32_t grow_count_ = 0;
  int64_t grow_generation_ = 0;
  std::string broken_;
};

}  // namespace jo::host
