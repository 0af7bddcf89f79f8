// ShmDomain: what the processes of one group of a mesh axis share, set up
// once through the jax.distributed key-value store (jaxoverlap/_bootstrap.py)
// and then used by every call site of that group.
//
// A call site (one custom call of one executable, host_call.h) gets a clique
// of its own, ShmClique (shm_clique.h), so that calls that XLA runs
// concurrently or in different orders on different devices never share
// epochs, flags or buffers. Call sites appear at run time, long after the
// bootstrap; the domain is where their processes find each other without
// the store:
//
// * the CONTROL segment, created by the leader (the process of rank 0) and
//   attached by the others at bootstrap: the rank table, per process its pid
//   (for the liveness checks below) and a slot for an error text, per rank
//   its doorbell, the domain's broken flag, and the SITE DIRECTORY;
// * the site directory: entry (site - 1) % capacity belongs to a live call
//   site. The first process to run a site claims the entry (compare-and-swap
//   on the site id), creates the site's segment under a fresh random name and
//   publishes that name there; the others open it by that name. The entry is
//   freed when every process that opened the site has let go of it.
//
// Broken: the first failure of any site breaks the whole domain (a peer that
// timed out or died leaves the group unusable), and every waiter of every
// site wakes at once. The error text is written into the breaking process's
// own slot before the flag points at it, so a process that dies half-way
// leaves no half-set state. Liveness: waits check every poll slice whether a
// peer process has exited (pidfd), so a dead peer is reported within about
// a second, not at the timeout.
//
// Everything a peer wrote that sizes or locates memory is validated before
// use; segments are opened only if they are ours and private (shm.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/deadline.h"
#include "core/status.h"
#include "host/shm.h"

namespace jo::host {

class ShmDomain {
 public:
  struct Header;
  struct ProcessSlot;
  struct RankSlot;
  struct SiteEntry;

  // Leader: creates the control segment under a fresh name. `rank_process[r]`
  // is the process index of rank r; `process` is ours; `attempt` names this
  // bootstrap (agreed through the store), so that a late process cannot join
  // a stale one.
  static Status Create(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, std::shared_ptr<ShmDomain>* out);
  // The other processes: maps the leader's segment and checks that it
  // describes the same clique and attempt.
  static Status Attach(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, const std::string& name,
                       std::shared_ptr<ShmDomain>* out);
  ~ShmDomain();
  ShmDomain(const ShmDomain&) = delete;
  ShmDomain& operator=(const ShmDomain&) = delete;

  int64_t key() const { return key_; }
  int64_t group() const { return group_; }
  int32_t nranks() const { return static_cast<int32_t>(rank_process_.size()); }
  int32_t nprocs() const { return static_cast<int32_t>(processes_.size()); }
  int32_t process() const { return process_; }
  const std::string& control_name() const { return control_->name(); }
  std::string name() const;                  // "clique 0x.../group 1" (no site)
  std::string RankName(int32_t rank) const;  // "rank 2 (process 1)"
  bool Local(int32_t rank) const { return rank_process_[rank] == process_; }
  // For info(): "clique 0x.../group 0: domain of 4 ranks, shared memory across 2 processes
  // (ranks 0,1 in this process 0), 3 call sites open here".
  std::string Describe();

  // Doorbells: whoever raises a flag of, posts a message to, or breaks the
  // domain for a rank bumps its doorbell and futex-wakes its waiters.
  std::atomic<uint32_t>* Doorbell(int32_t rank) const;
  void Ring(int32_t rank) const;
  void RingAll() const;

  // Marks the domain broken with `status` (the first failure wins) and wakes
  // every waiter.
  void Break(const Status& status);
  bool broken() const;
  std::string BrokenReason() const;  // "" while not broken

  // Ok while every peer process is alive; else breaks the domain naming the
  // process that exited (`during` says what this process was doing) and
  // returns that status. Cheap enough for every poll slice.
  Status CheckPeers(const std::string& during);

  // The site segment of `site`: created by the first process to ask, opened
  // by the others (waiting for its creator until `deadline`). `site_bytes` is
  // its size, the same in every process; `init` fills a new one.
  Status OpenSite(int64_t site, size_t site_bytes, Clock::time_point deadline,
                  const std::string& during, void (*init)(std::byte*, const ShmDomain&, int64_t),
                  std::unique_ptr<ShmSegment>* out);
  // This process no longer uses `site` (its cliques went away).
  void ReleaseSite(int64_t site);

  static constexpr int32_t kSiteCapacity = 4096;

 private:
  ShmDomain(int64_t key, int64_t group, std::vector<int32_t> rank_process, int32_t process,
            std::unique_ptr<ShmSegment> control);
  Header* header() const;
  ProcessSlot* process_slot(int32_t index) const;
  RankSlot* rank_slot(int32_t rank) const;
  SiteEntry* site_entry(int64_t site) const;
  int32_t SlotOf(int32_t process) const;  // its process slot (dense index), -1 if not ours
  void Announce();                        // writes our pid into our process slot

  const int64_t key_;
  const int64_t group_;
  const std::vector<int32_t> rank_process_;
  const std::vector<int32_t> processes_;  // sorted, distinct
  const int32_t process_;
  std::unique_ptr<ShmSegment> control_;

  std::mutex break_mu_;      // one writer of our reason slot at a time
  std::mutex peers_mu_;      // the pidfds below
  std::vector<int> pidfds_;  // per dense process index, -1 until opened (or not checkable)
  std::vector<bool> uncheckable_;
  std::atomic<int64_t> last_check_ns_{0};
  std::mutex sites_mu_;
  std::vector<int64_t> opened_sites_;  // sites this process opened (to release)
};

// The domains of this process, by (clique_key, group). The Python bootstrap
// (jaxoverlap/_bootstrap.py) makes them at trace time, before any call runs:
// rank_process[r] is the process index of rank r; `process` is ours;
// `attempt` names the bootstrap attempt (agreed through the store). The
// leader (the process of rank 0) creates the control segment and returns its
// name for the key-value store; the others attach to it by name. A broken
// domain is replaced by the next bootstrap (its call sites keep the old one).
Status CreateShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, std::string* name);
Status AttachShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, const std::string& name);
std::shared_ptr<ShmDomain> FindDomain(int64_t clique_key, int64_t group);  // null if none
// "absent", "ok" or "broken".
std::string DomainState(int64_t clique_key, int64_t group);
// Marks the domain broken (a failed bootstrap): its processes' calls fail fast.
void BreakDomain(int64_t clique_key, int64_t group, const std::string& reason);
bool ForgetDomain(int64_t clique_key, int64_t group);
std::string DescribeDomains();  // one line per domain

}  // namespace jo::host
