// ShmClique: a host clique whose ranks live in several processes.
//
// Everything the ranks share is in POSIX shared memory, and local ranks
// (threads of one process) use it exactly like remote ones, so a program runs
// the same whether its peers are threads or processes:
//
// * the CONTROL segment (fixed size, created when the clique is bootstrapped
//   through the jax.distributed key-value store, see jaxoverlap/_bootstrap.py):
//   per rank its epoch, its process, its doorbell, the call signature per
//   parity, and the clique's broken flag + reason;
// * a DATA segment per growth generation, named <control>-d<generation>: per
//   rank and parity, the flags, an outbox (the nccl-style mailbox) and the
//   workspace. The last rank to enter a growth rendezvous creates it; every
//   process maps it when its first rank leaves the rendezvous; the process
//   whose attach completes the count unlinks the name.
//
// Waiting: each rank has a 32-bit doorbell; whoever raises a flag, posts a
// message to, or breaks the clique for a rank bumps its doorbell and
// futex-wakes it. Waiters re-check their condition after every wake and at
// least every 100 ms, and give up at their deadline with an error naming the
// clique, epoch, rank and the missing peer with its process.
//
// Mailbox: Send appends (dst, tag, bytes) to the sender's outbox of the
// call's parity; Recv scans the peer's outbox for its (epoch, dst, tag). An
// outbox is reset by its owner at the start of each call: by the same
// argument as the workspace's double-buffering (host_clique.h), no receiver
// still reads the call two epochs back.
//
// Buffer reuse, growth, the agreement check and ClaimRank follow LocalClique.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host/host_clique.h"
#include "host/shm.h"

namespace jo::host {

class ShmClique : public HostClique {
 public:
  // Leader (the process of rank 0): creates the control segment under a new
  // name. `rank_process[r]` is the process index of rank r; `process` is ours.
  static Status Create(CliqueKey key, const std::vector<int32_t>& rank_process, int32_t process,
                       std::unique_ptr<ShmClique>* out);
  // The other processes: maps the leader's control segment and checks that it
  // describes the same clique.
  static Status Attach(CliqueKey key, const std::vector<int32_t>& rank_process, int32_t process,
                       const std::string& name, std::unique_ptr<ShmClique>* out);
  ~ShmClique() override;

  const std::string& control_name() const { return control_->name(); }
  int32_t process() const { return process_; }

  Status Prepare(const WaitContext& ctx, const std::string& signature,
                 const CallNeeds& needs) override;
  Status ClaimRank(const WaitContext& ctx, int64_t device) override;
  void ReleaseRank(int32_t rank) override;
  std::byte* Workspace(int32_t owner, int64_t epoch) override;
  int64_t WorkspaceBytes() const override;
  Status Signal(const WaitContext& ctx, int32_t peer, int32_t flag) override;
  Status WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) override;
  Status Send(const WaitContext& ctx, int32_t peer, int32_t tag,
              std::vector<std::byte> data) override;
  Status Recv(const WaitContext& ctx, int32_t peer, int32_t tag,
              std::vector<std::byte>* data) override;
  void Break(const Status& status) override;
  std::string BrokenReason() const override;
  std::string Kind() const override;

  struct Header;
  struct RankSlot;
  struct Layout;

 private:
  ShmClique(CliqueKey key, int32_t nranks, std::vector<int32_t> rank_process, int32_t process,
            std::unique_ptr<ShmSegment> control);

  Header* header() const;
  RankSlot* slot(int32_t rank) const;
  std::string Where(const WaitContext& ctx) const;
  std::string RankName(int32_t rank) const;  // "rank 2 (process 1)"
  std::string Missing(const WaitContext& ctx, int32_t expected) const;
  Status BrokenStatus(const WaitContext& ctx) const;
  Status Fail(Status status);  // breaks the clique with `status`, logs, returns it
  void Ring(int32_t rank);
  void RingAll();
  // Waits until pred() or the clique breaks or the deadline passes; returns
  // OK, the broken status, or kTimeout with an empty message (caller words it).
  template <typename Pred>
  Status WaitFor(const WaitContext& ctx, Pred pred);
  Status CheckSignature(const WaitContext& ctx, const std::string& signature);
  Status Grow(const WaitContext& ctx, const CallNeeds& needs);
  Status MapCurrentData();  // maps the published data generation (process mutex)
  std::atomic<int64_t>* Flag(int32_t owner, int64_t epoch, int32_t flag) const;

  const std::vector<int32_t> rank_process_;
  const int32_t process_;
  const int32_t nprocs_;
  std::unique_ptr<ShmSegment> control_;
  mutable std::mutex mu_;             // guards the local mapping of the data segment
  std::unique_ptr<ShmSegment> data_;  // current generation, mapped here
  int64_t data_generation_ = 0;
  std::unique_ptr<Layout> layout_;
};

}  // namespace jo::host
