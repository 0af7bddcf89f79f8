// ShmDomain: what the processes of one group of a mesh axis share, set up
// once through the jax.distributed key-value store (jaxoverlap/_executors/bootstrap.py)
// and then used by every call site of that group.
//
// A call site (one custom call of one executable, core/call.h CallSite) gets
// a clique of its own, ShmClique (shm_clique.h), so that calls that XLA runs
// concurrently or in different orders on different devices never share
// epochs, flags or buffers. Call sites appear at run time, long after the
// bootstrap; the domain is where their processes find each other without
// the store:
//
// * the CONTROL segment, made by the leader (the process of rank 0) and
//   passed to the others at bootstrap: the rank table; per process its pid
//   (for the liveness checks below), the name of its segment server
//   (host/fd_share.h) and a slot for an error text; per rank its doorbell,
//   the call it is in (for errors) and the calls it waits in for peers (for
//   the deadlock check, shm_clique.h); the domain's broken flag; and the
//   SITE DIRECTORY;
// * the site directory: an entry per live call site, found by its site id
//   (open addressing under a process-shared lock: any free entry will do, so
//   the capacity counts live sites, never sites made over the job's life).
//   The first process to run a site creates its segment and offers the fd to
//   its peers through its segment server; the others fetch it from there.
//   The entry counts the processes holding the site and is freed when none
//   does.
//
// A process that drops a site (its executables went) while others still
// hold it keeps its mapping: if it compiles the same site again (the same
// program after jax.clear_caches, say), its ranks continue with the site's
// epochs where they left off, as its peers expect. Mappings of sites that
// were freed meanwhile are let go at the next directory operation.
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
// use; segments are mapped only if they are ours and private (shm.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/clique.h"
#include "core/deadline.h"
#include "core/status.h"
#include "host/fd_share.h"
#include "host/shm.h"

namespace jo::host {

class ShmDomain {
 public:
  struct Header;
  struct ProcessSlot;
  struct RankSlot;
  struct SiteEntry;

  // Leader: makes the control segment; `fd` receives it, for the bootstrap
  // to pass to the other processes. `rank_process[r]` is the process index
  // of rank r; `process` is ours; `attempt` names this bootstrap (agreed
  // through the store), so that a late process cannot join a stale one;
  // `capacity` is the most call sites alive at once.
  static Status Create(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, int32_t capacity,
                       std::shared_ptr<ShmDomain>* out, UniqueFd* fd);
  // The other processes: maps the leader's segment `fd` and checks that it
  // describes the same clique and attempt.
  static Status Attach(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, int fd, std::shared_ptr<ShmDomain>* out);
  ~ShmDomain();
  ShmDomain(const ShmDomain&) = delete;
  ShmDomain& operator=(const ShmDomain&) = delete;

  int64_t key() const { return key_; }
  int64_t group() const { return group_; }
  int32_t nranks() const { return static_cast<int32_t>(rank_process_.size()); }
  int32_t nprocs() const { return static_cast<int32_t>(processes_.size()); }
  int32_t process() const { return process_; }
  int32_t capacity() const;
  const std::vector<int32_t>& rank_process() const { return rank_process_; }
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

  // The segment of call site `site` (`bytes` long): created by the first
  // process to ask (`init` fills it, knowing the site and `arg`), fetched
  // from its creator by the others, or the mapping this process kept. A
  // site this process holds already gives the same mapping. Never waits for
  // room: a full directory is an error naming the capacity.
  using SiteInit = void (*)(std::byte* base, const ShmDomain& domain, int64_t site,
                            const void* arg);
  Status OpenSite(int64_t site, size_t bytes, Clock::time_point deadline, const std::string& during,
                  SiteInit init, const void* arg, std::shared_ptr<ShmSegment>* out);
  // One holder of `site` in this process is done with it (OpenSite's count).
  void ReleaseSite(int64_t site);

  // For errors: what each rank is doing. NoteCall records that `rank` began
  // (`in_call`) or finished call `epoch` of `site` ("signature" describes it).
  void NoteCall(int32_t rank, int64_t site, int64_t epoch, bool in_call,
                const std::string& signature);
  // "rank 1 (process 1) is in call 3 of site 0x... ('ag_matmul/nccl ...')".
  std::string WhereIs(int32_t rank) const;

  // Waits for peers, published for the deadlock check: BeginWait records that
  // `rank` waits in call `epoch` of `site` (-1: no room, the rank is then
  // never counted as stuck), UpdateWait the peers that have not started that
  // call yet (a mask of ranks), EndWait that the wait is over.
  int32_t BeginWait(int32_t rank, int64_t site, int64_t epoch, const std::string& signature);
  void UpdateWait(int32_t rank, int32_t record, uint64_t missing);
  void EndWait(int32_t rank, int32_t record);
  // The ranks that wait for each other in calls none of them can reach, with
  // `rank` among them: every one waits, and every peer that one waits for has
  // not started that call and waits too (each in a call another has not
  // started: a cycle of waits that can never end). Empty if there is none.
  // `stamp` gets which ranks and what their waits were then (the check repeats until it
  // is the same for a while: peers that merely run late change it), `described` those
  // waits as read then ("rank 0 (process 0) waits in call 1 of site 0x... ('...') for
  // rank(s) 1; ..."): the error names them all, though a peer that gave up first has
  // cleared its own by the time the error is written.
  std::vector<int32_t> Stuck(int32_t rank, std::vector<uint32_t>* stamp,
                             std::string* described) const;
  static constexpr int32_t kMaxWaits = 4;  // waits per rank at once that the check sees

  static constexpr int32_t kDefaultCapacity = 4096;

 private:
  struct LocalSite {  // a site's segment as this process has it
    std::shared_ptr<ShmSegment> segment;
    uint64_t incarnation = 0;  // the directory entry's, when we got it
    int users = 0;             // open cliques here; 0: kept for a re-open
  };
  ShmDomain(int64_t key, int64_t group, std::vector<int32_t> rank_process, int32_t process,
            std::unique_ptr<ShmSegment> control);
  Header* header() const;
  ProcessSlot* process_slot(int32_t index) const;
  RankSlot* rank_slot(int32_t rank) const;
  SiteEntry* site_entry(int32_t index) const;
  SiteEntry* FindSite(int64_t site) const;  // requires the directory lock
  SiteEntry* FreeEntry(int64_t site) const;
  int32_t SlotOf(int32_t process) const;  // its process slot (dense index), -1 if not ours
  Status Announce();                      // writes our pid and segment server into our process slot
  // Lets go of kept mappings and offers whose sites were freed; requires the
  // directory lock and sites_mu_.
  void Sweep(std::vector<std::shared_ptr<ShmSegment>>* unmap);

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
  std::mutex note_mu_;   // one writer of our ranks' slots at a time (calls of several sites)
  std::mutex sites_mu_;  // the two maps below; taken before the directory lock
  std::map<int64_t, LocalSite> sites_;
  std::map<int64_t, std::pair<uint64_t, uint64_t>> offers_;  // site -> (incarnation, token)
};

// The domains of this process, by (clique_key, group). The Python bootstrap
// (jaxoverlap/_executors/bootstrap.py) makes them at trace time, before any call runs:
// rank_process[r] is the process index of rank r; `process` is ours;
// `attempt` names the bootstrap attempt (agreed through the store). The
// leader (the process of rank 0) creates the control segment and gets its fd
// to pass on; the others attach to the fd they received. A broken domain is
// replaced by the next bootstrap (its call sites keep the old one).
// JAXOVERLAP_MAX_CALL_SITES (read by the leader) sets the capacity.
Status CreateShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, UniqueFd* fd);
Status AttachShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, int fd);
// The domain of a call's group: null when the group's ranks are all in this
// process; an error naming the cause when they span processes and this
// process has none (its bootstrap never ran here: an executable that was not
// lowered in this process), or when the domain has another rank count.
Status DomainOf(const CliqueKey& key, const std::vector<int64_t>& rank_process, const char* op,
                std::shared_ptr<ShmDomain>* out);
// "absent", "ok" or "broken".
std::string DomainState(int64_t clique_key, int64_t group);
// Marks the domain broken (a failed bootstrap): its processes' calls fail fast.
void BreakDomain(int64_t clique_key, int64_t group, const std::string& reason);
bool ForgetDomain(int64_t clique_key, int64_t group);
std::string DescribeDomains();  // one line per domain

}  // namespace jo::host
