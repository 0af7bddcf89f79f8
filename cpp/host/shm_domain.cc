#include "host/shm_domain.h"

#include <poll.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>
#include <set>

#include "core/call.h"
#include "core/clique.h"
#include "core/hash.h"
#include "core/log.h"

namespace jo::host {
namespace {

constexpr uint64_t kMagic = 0x6e6d646d6873656aULL;  // "jeshmdmn"
constexpr uint32_t kVersion = 4;
constexpr size_t kReasonBytes = 2048;
constexpr size_t kServerBytes = 108;  // sockaddr_un's sun_path
constexpr size_t kSignatureBytes = 192;
constexpr int32_t kMaxCapacity = 1 << 20;
constexpr size_t kAlign = 64;
constexpr int32_t kMaxRanks = 1 << 16;
// How often a waiter looks for dead peers (each look is one poll() call).
constexpr auto kPeerCheckInterval = std::chrono::milliseconds(200);

size_t RoundUp(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }

std::vector<int32_t> Distinct(const std::vector<int32_t>& values) {
  std::set<int32_t> set(values.begin(), values.end());
  return {set.begin(), set.end()};
}

std::string TableText(const std::vector<int32_t>& rank_process) {
  std::string out = "[";
  for (size_t r = 0; r < rank_process.size(); ++r)
    out += (r ? ", " : "") + std::to_string(rank_process[r]);
  return out + "]";
}

}  // namespace

struct ShmDomain::Header {
  uint64_t magic;
  uint32_t version;
  int32_t nranks;
  int32_t nprocs;
  int32_t site_capacity;
  int64_t key;
  int64_t group;
  int64_t attempt;
  std::atomic<int32_t> attached;  // processes that mapped the control segment
  std::atomic<int32_t> broken;    // 0, or 1 + the process slot whose reason is valid
  pthread_mutex_t sites_lock;     // process-shared, robust: guards the site directory
  uint64_t incarnations;          // directory entries made so far (under sites_lock)
};

struct alignas(kAlign) ShmDomain::ProcessSlot {
  int32_t process;              // its process index (written by the leader)
  std::atomic<int32_t> pid;     // written by that process when it maps the segment
  std::atomic<uint64_t> pidns;  // its pid namespace (pids compare only within one)
  char server[kServerBytes];    // its segment server's abstract socket (written before pid)
  char reason[kReasonBytes];    // its failure text; valid once `broken` points here
};

struct alignas(kAlign) ShmDomain::RankSlot {
  int32_t process;
  std::atomic<uint32_t> doorbell;
  // The call this rank began or finished last, for errors; `seq` is odd
  // while it is being written (a reader retries).
  std::atomic<uint32_t> seq;
  int32_t in_call;
  int64_t site;
  int64_t epoch;
  char signature[kSignatureBytes];
  // The calls this rank waits in for peers (BeginWait); `wait_seq` changes
  // with every change of them and is odd while they are being written.
  struct Wait {
    int64_t site;  // 0: a free record
    int64_t epoch;
    uint64_t missing;  // the ranks that have not started the call
    char signature[kSignatureBytes];
  };
  std::atomic<uint32_t> wait_seq;
  int32_t overflow;  // waits that found no free record
  Wait waits[kMaxWaits];
};

struct ShmDomain::SiteEntry {  // only touched under Header::sites_lock
  int64_t site;                // 0: free
  uint64_t incarnation;        // which life of this entry (Header::incarnations)
  int32_t holders;             // processes that hold the site now
  int32_t creator;             // the process slot that made its segment
  uint64_t token;              // the fd's token in the creator's segment server
  int64_t bytes;               // the segment's size
};

namespace {

struct Offsets {
  size_t processes, ranks, sites, total;
  Offsets(int32_t nranks, int32_t nprocs, int32_t capacity) {
    processes = RoundUp(sizeof(ShmDomain::Header), kAlign);
    ranks = processes + static_cast<size_t>(nprocs) * sizeof(ShmDomain::ProcessSlot);
    sites = ranks + static_cast<size_t>(nranks) * sizeof(ShmDomain::RankSlot);
    total = sites + static_cast<size_t>(capacity) * sizeof(ShmDomain::SiteEntry);
  }
};

// Holds the site directory's process-shared lock. A holder that died leaves
// the directory possibly half-written: that breaks the domain.
class SitesLock {
 public:
  SitesLock(pthread_mutex_t* mu, Clock::time_point deadline) : mu_(mu) {
    const auto ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(deadline.time_since_epoch()).count();
    timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
    result_ = pthread_mutex_clocklock(mu_, CLOCK_MONOTONIC, &ts);
    if (result_ == EOWNERDEAD) pthread_mutex_consistent(mu_);
  }
  ~SitesLock() {
    if (result_ == 0 || result_ == EOWNERDEAD) pthread_mutex_unlock(mu_);
  }
  int result() const { return result_; }

 private:
  pthread_mutex_t* mu_;
  int result_;
};

std::string Text(const char* chars, size_t bytes) {
  return std::string(chars, strnlen(chars, bytes));
}

}  // namespace

ShmDomain::ShmDomain(int64_t key, int64_t group, std::vector<int32_t> rank_process, int32_t process,
                     std::unique_ptr<ShmSegment> control)
    : key_(key),
      group_(group),
      rank_process_(std::move(rank_process)),
      processes_(Distinct(rank_process_)),
      process_(process),
      control_(std::move(control)),
      pidfds_(processes_.size(), -1),
      uncheckable_(processes_.size(), false) {}

ShmDomain::~ShmDomain() {
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
}

namespace {

Status CheckTable(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                  int32_t process) {
  const std::string name = CliqueName(CliqueKey{key, group, 0});
  JO_REQUIRE(!rank_process.empty() && rank_process.size() <= kMaxRanks,
             name + ": a rank table of 1.." + std::to_string(kMaxRanks) + " ranks, got " +
                 std::to_string(rank_process.size()));
  JO_REQUIRE(std::find(rank_process.begin(), rank_process.end(), process) != rank_process.end(),
             name + ": process " + std::to_string(process) + " has no rank in the rank table " +
                 TableText(rank_process));
  return OkStatus();
}

}  // namespace

Status ShmDomain::Create(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                         int32_t process, int64_t attempt, int32_t capacity,
                         std::shared_ptr<ShmDomain>* out, UniqueFd* fd) {
  JO_CHECK(CheckTable(key, group, rank_process, process));
  JO_REQUIRE(capacity >= 1 && capacity <= kMaxCapacity, "JAXOVERLAP_MAX_CALL_SITES expected 1.." +
                                                            std::to_string(kMaxCapacity) +
                                                            ", got " + std::to_string(capacity));
  const std::vector<int32_t> processes = Distinct(rank_process);
  const int32_t nranks = static_cast<int32_t>(rank_process.size());
  const int32_t nprocs = static_cast<int32_t>(processes.size());
  const Offsets at(nranks, nprocs, capacity);
  std::unique_ptr<ShmSegment> control;
  JO_CHECK(ShmSegment::Create(
      at.total, "the control segment of " + CliqueName(CliqueKey{key, group, 0}), &control, fd));
  std::byte* base = control->data();
  auto* h = new (base) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = nranks;
  h->nprocs = nprocs;
  h->site_capacity = capacity;
  h->key = key;
  h->group = group;
  h->attempt = attempt;
  h->incarnations = 0;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int init = pthread_mutex_init(&h->sites_lock, &attr);
  pthread_mutexattr_destroy(&attr);
  if (init != 0)
    return Status(Code::kResource, std::string("pthread_mutex_init: ") + std::strerror(init));
  for (int32_t i = 0; i < nprocs; ++i)
    (new (base + at.processes + i * sizeof(ProcessSlot)) ProcessSlot())->process = processes[i];
  for (int32_t r = 0; r < nranks; ++r)
    (new (base + at.ranks + r * sizeof(RankSlot)) RankSlot())->process = rank_process[r];
  for (int32_t s = 0; s < capacity; ++s) new (base + at.sites + s * sizeof(SiteEntry)) SiteEntry();
  h->attached.store(1);
  std::shared_ptr<ShmDomain> domain(
      new ShmDomain(key, group, rank_process, process, std::move(control)));
  JO_CHECK(domain->Announce());
  JO_INFO(domain->name() + ": created its shared-memory control segment for " +
          std::to_string(nprocs) + " processes, room for " + std::to_string(capacity) +
          " live call sites");
  *out = std::move(domain);
  return OkStatus();
}

Status ShmDomain::Attach(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                         int32_t process, int64_t attempt, int fd,
                         std::shared_ptr<ShmDomain>* out) {
  JO_CHECK(CheckTable(key, group, rank_process, process));
  const int32_t nranks = static_cast<int32_t>(rank_process.size());
  const int32_t nprocs = static_cast<int32_t>(Distinct(rank_process).size());
  const std::string mine = CliqueName(CliqueKey{key, group, 0});
  const std::string what = "the control segment of " + mine;
  // Its capacity (which sizes it) is in its header: read that first.
  size_t bytes = 0;
  JO_CHECK(ShmSegment::Check(fd, what, &bytes));
  JO_REQUIRE(bytes >= sizeof(Header), "refusing " + what + ": it has " + std::to_string(bytes) +
                                          " bytes, too few to be one");
  std::unique_ptr<ShmSegment> control;
  int32_t capacity = 0;
  {
    std::unique_ptr<ShmSegment> head;
    JO_CHECK(ShmSegment::Map(fd, bytes, what, &head));
    const auto* h = reinterpret_cast<const Header*>(head->data());
    JO_REQUIRE(h->magic == kMagic && h->version == kVersion,
               "refusing " + what + ": it is not a jaxoverlap control segment of version " +
                   std::to_string(kVersion));
    capacity = h->site_capacity;
    JO_REQUIRE(
        capacity >= 1 && capacity <= kMaxCapacity,
        "refusing " + what + ": it claims room for " + std::to_string(capacity) + " call sites");
  }
  JO_CHECK(ShmSegment::Map(fd, Offsets(nranks, nprocs, capacity).total, what, &control));
  const auto* h = reinterpret_cast<const Header*>(control->data());
  JO_REQUIRE(h->key == key && h->group == group && h->nranks == nranks && h->nprocs == nprocs,
             "refusing " + what + ": it describes " + CliqueName(CliqueKey{h->key, h->group, 0}) +
                 " with " + std::to_string(h->nranks) + " ranks, but this process bootstraps " +
                 mine + " with " + std::to_string(nranks));
  JO_REQUIRE(h->attempt == attempt, "refusing " + what + ": it belongs to bootstrap attempt " +
                                        std::to_string(h->attempt) + " of " + mine +
                                        ", this process joins attempt " + std::to_string(attempt));
  std::shared_ptr<ShmDomain> domain(
      new ShmDomain(key, group, rank_process, process, std::move(control)));
  for (int32_t r = 0; r < nranks; ++r)
    JO_REQUIRE(domain->rank_slot(r)->process == rank_process[r],
               domain->name() + ": the leader puts rank " + std::to_string(r) + " in process " +
                   std::to_string(domain->rank_slot(r)->process) + ", this process's rank table " +
                   TableText(rank_process) + " puts it in process " +
                   std::to_string(rank_process[r]) + " (do all processes use the same mesh?)");
  JO_CHECK(domain->Announce());
  domain->header()->attached.fetch_add(1);
  *out = std::move(domain);
  return OkStatus();
}

Status ShmDomain::Announce() {
  SegmentServer* server = nullptr;
  JO_CHECK(SegmentServer::Instance(&server));
  ProcessSlot* slot = process_slot(SlotOf(process_));
  std::snprintf(slot->server, kServerBytes, "%s", server->name().c_str());
  slot->pidns.store(PidNamespace());
  slot->pid.store(static_cast<int32_t>(getpid()));  // last: peers read the rest after it
  return OkStatus();
}

ShmDomain::Header* ShmDomain::header() const { return reinterpret_cast<Header*>(control_->data()); }

ShmDomain::ProcessSlot* ShmDomain::process_slot(int32_t index) const {
  return reinterpret_cast<ProcessSlot*>(control_->data() +
                                        Offsets(nranks(), nprocs(), 0).processes +
                                        static_cast<size_t>(index) * sizeof(ProcessSlot));
}

ShmDomain::RankSlot* ShmDomain::rank_slot(int32_t rank) const {
  return reinterpret_cast<RankSlot*>(control_->data() + Offsets(nranks(), nprocs(), 0).ranks +
                                     static_cast<size_t>(rank) * sizeof(RankSlot));
}

int32_t ShmDomain::capacity() const { return header()->site_capacity; }

ShmDomain::SiteEntry* ShmDomain::site_entry(int32_t index) const {
  return reinterpret_cast<SiteEntry*>(control_->data() +
                                      Offsets(nranks(), nprocs(), capacity()).sites +
                                      static_cast<size_t>(index) * sizeof(SiteEntry));
}

ShmDomain::SiteEntry* ShmDomain::FindSite(int64_t site) const {
  // Entries are freed anywhere, so a probe never stops early: it looks at
  // every entry (a few thousand compares, only when a site opens or closes).
  const int32_t n = capacity();
  const int32_t start = static_cast<int32_t>(Mix64(static_cast<uint64_t>(site)) % n);
  for (int32_t i = 0; i < n; ++i) {
    SiteEntry* e = site_entry((start + i) % n);
    if (e->site == site) return e;
  }
  return nullptr;
}

ShmDomain::SiteEntry* ShmDomain::FreeEntry(int64_t site) const {
  const int32_t n = capacity();
  const int32_t start = static_cast<int32_t>(Mix64(static_cast<uint64_t>(site)) % n);
  for (int32_t i = 0; i < n; ++i) {
    SiteEntry* e = site_entry((start + i) % n);
    if (e->site == 0) return e;
  }
  return nullptr;
}

int32_t ShmDomain::SlotOf(int32_t process) const {
  auto it = std::lower_bound(processes_.begin(), processes_.end(), process);
  return it != processes_.end() && *it == process ? static_cast<int32_t>(it - processes_.begin())
                                                  : -1;
}

std::string ShmDomain::name() const { return CliqueName(CliqueKey{key_, group_, 0}); }

std::string ShmDomain::Describe() {
  std::string local;
  for (int32_t r = 0; r < nranks(); ++r)
    if (Local(r)) local += (local.empty() ? "" : ",") + std::to_string(r);
  size_t open = 0, kept = 0;
  {
    std::lock_guard<std::mutex> lock(sites_mu_);
    for (const auto& [site, local_site] : sites_) ++(local_site.users > 0 ? open : kept);
  }
  std::string out = name() + ": domain of " + std::to_string(nranks()) +
                    " ranks, shared memory across " + std::to_string(nprocs()) +
                    " processes (ranks " + local + " in this process " + std::to_string(process_) +
                    "), " + std::to_string(open) + " call sites open here" +
                    (kept != 0 ? " (" + std::to_string(kept) + " kept for peers)" : "");
  const std::string reason = BrokenReason();
  if (!reason.empty()) out += ", BROKEN: " + reason;
  return out;
}

std::string ShmDomain::RankName(int32_t rank) const {
  return "rank " + std::to_string(rank) + " (process " + std::to_string(rank_process_[rank]) + ")";
}

std::atomic<uint32_t>* ShmDomain::Doorbell(int32_t rank) const {
  return &rank_slot(rank)->doorbell;
}

void ShmDomain::Ring(int32_t rank) const {
  std::atomic<uint32_t>* bell = Doorbell(rank);
  bell->fetch_add(1);
  FutexWakeAll(bell);
}

void ShmDomain::RingAll() const {
  for (int32_t r = 0; r < nranks(); ++r) Ring(r);
}

void ShmDomain::Break(const Status& status) {
  Header* h = header();
  if (h->broken.load(std::memory_order_acquire) != 0) return;
  const int32_t me = SlotOf(process_);
  {
    std::lock_guard<std::mutex> lock(break_mu_);
    if (h->broken.load(std::memory_order_acquire) != 0) return;
    // The text first, then the flag that points at it: no half-set state.
    ProcessSlot* slot = process_slot(me);
    std::snprintf(slot->reason, kReasonBytes, "%s", status.message().c_str());
    int32_t expected = 0;
    h->broken.compare_exchange_strong(expected, me + 1, std::memory_order_acq_rel);
  }
  RingAll();
}

bool ShmDomain::broken() const { return header()->broken.load(std::memory_order_acquire) != 0; }

std::string ShmDomain::BrokenReason() const {
  const int32_t who = header()->broken.load(std::memory_order_acquire);
  if (who <= 0 || who > nprocs()) return "";
  const ProcessSlot* slot = process_slot(who - 1);
  return std::string(slot->reason, strnlen(slot->reason, kReasonBytes));
}

Status ShmDomain::CheckPeers(const std::string& during) {
  const int64_t now = Clock::now().time_since_epoch().count();
  int64_t last = last_check_ns_.load();
  const int64_t interval = std::chrono::nanoseconds(kPeerCheckInterval).count();
  if (now - last < interval || !last_check_ns_.compare_exchange_strong(last, now))
    return OkStatus();  // another waiter of this process looked a moment ago
  std::string dead;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    const uint64_t my_ns = PidNamespace();
    for (int32_t i = 0; i < nprocs(); ++i) {
      if (processes_[i] == process_ || uncheckable_[i]) continue;
      const ProcessSlot* slot = process_slot(i);
      const int32_t pid = slot->pid.load();
      if (pid <= 0) continue;  // not announced yet
      if (pidfds_[i] < 0) {
        if (slot->pidns.load() != my_ns || my_ns == 0) {
          uncheckable_[i] = true;  // another pid namespace: its pid means nothing here
          continue;
        }
#if defined(SYS_pidfd_open)
        const int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
        if (fd < 0 && errno == ESRCH) {
          dead = "process " + std::to_string(processes_[i]) + " (pid " + std::to_string(pid) + ")";
          break;
        }
        if (fd < 0) {
          uncheckable_[i] = true;
          continue;
        }
        pidfds_[i] = fd;
#else
        uncheckable_[i] = true;
        continue;
#endif
      }
      pollfd p{pidfds_[i], POLLIN, 0};
      if (poll(&p, 1, 0) > 0 && (p.revents & (POLLIN | POLLHUP)) != 0) {
        dead = "process " + std::to_string(processes_[i]) + " (pid " + std::to_string(pid) + ")";
        break;
      }
    }
  }
  if (dead.empty()) return OkStatus();
  std::string ranks;
  for (int32_t r = 0; r < nranks(); ++r)
    if (dead.find("process " + std::to_string(rank_process_[r]) + " ") == 0)
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  Status status(Code::kAborted, during + ": peer " + dead +
                                    " of this clique has exited (its "
                                    "rank(s) " +
                                    ranks + " will never arrive)");
  JO_WARN(status.message());
  Break(status);
  return status;
}

Status ShmDomain::OpenSite(int64_t site, size_t bytes, Clock::time_point deadline,
                           const std::string& during, SiteInit init, const void* arg,
                           std::shared_ptr<ShmSegment>* out) {
  JO_REQUIRE(site != 0, name() + ": a call site's id is never 0");
  const std::string what = "the segment of " + CliqueName(CliqueKey{key_, group_, site});
  if (broken())
    return Status(Code::kAborted,
                  during + ": clique aborted by an earlier failure: " + BrokenReason());
  std::lock_guard<std::mutex> local_lock(sites_mu_);
  auto held = sites_.find(site);
  if (held != sites_.end() && held->second.users > 0) {  // another clique here has it open
    ++held->second.users;
    *out = held->second.segment;
    return OkStatus();
  }
  std::vector<std::shared_ptr<ShmSegment>> unmap;  // after the lock: munmap takes time
  int32_t creator = -1;
  uint64_t token = 0, incarnation = 0;
  int64_t entry_bytes = 0;
  {
    SitesLock lock(&header()->sites_lock, deadline);
    if (lock.result() == EOWNERDEAD) {
      Status status(Code::kAborted, during +
                                        ": a process died while it changed the call-site "
                                        "directory of " +
                                        name());
      Break(status);
      return status;
    }
    if (lock.result() == ETIMEDOUT)
      return Status(Code::kTimeout,
                    during + ": timeout waiting for the call-site directory lock of " + name());
    if (lock.result() != 0)
      return Status(Code::kResource,
                    std::string("pthread_mutex_clocklock: ") + std::strerror(lock.result()));
    Sweep(&unmap);
    held = sites_.find(site);
    if (SiteEntry* e = FindSite(site)) {
      ++e->holders;
      if (held != sites_.end() && held->second.incarnation == e->incarnation) {
        held->second.users = 1;  // the mapping this process kept: its epochs continue
        *out = held->second.segment;
        return OkStatus();
      }
      creator = e->creator;
      token = e->token;
      incarnation = e->incarnation;
      entry_bytes = e->bytes;
    } else {
      SiteEntry* free = FreeEntry(site);
      if (free == nullptr) {
        Status status(Code::kResource,
                      during + ": " + name() +
                          " has no room for another call site: " + std::to_string(capacity()) +
                          " call sites of this group are alive at once across its processes "
                          "(JAXOVERLAP_MAX_CALL_SITES, read when the group bootstraps); drop "
                          "executables that are no longer needed, or raise it");
        Break(status);
        return status;
      }
      std::unique_ptr<ShmSegment> segment;
      uint64_t offered = 0;
      {
        HiddenFromPeers hidden;  // until its fd is parked (or closed)
        UniqueFd fd;
        JO_CHECK(ShmSegment::Create(bytes, what, &segment, &fd));
        init(segment->data(), *this, site, arg);
        std::vector<int> peers;
        for (int32_t i = 0; i < nprocs(); ++i)
          if (processes_[i] != process_) peers.push_back(process_slot(i)->pid.load());
        SegmentServer* server = nullptr;
        JO_CHECK(SegmentServer::Instance(&server));
        JO_CHECK(server->Offer(std::move(fd), peers, nprocs() - 1, &offered));
      }
      free->site = site;
      free->incarnation = ++header()->incarnations;
      free->holders = 1;
      free->creator = SlotOf(process_);
      free->token = offered;
      free->bytes = static_cast<int64_t>(bytes);
      if (nprocs() > 1) offers_[site] = {free->incarnation, offered};
      LocalSite& mine = sites_[site];
      mine.segment = std::move(segment);
      mine.incarnation = free->incarnation;
      mine.users = 1;
      *out = mine.segment;
      return OkStatus();
    }
  }
  // Another process made it: fetch its segment from the creator's server.
  if (held != sites_.end()) sites_.erase(held);  // kept from an older life of the entry
  JO_REQUIRE(creator >= 0 && creator < nprocs() && creator != SlotOf(process_) &&
                 entry_bytes == static_cast<int64_t>(bytes),
             during + ": the call-site directory of " + name() + " describes " + what +
                 " as made by process slot " + std::to_string(creator) + " with " +
                 std::to_string(entry_bytes) + " bytes, but this call needs " +
                 std::to_string(bytes) + " (do all processes run the same calls at this site?)");
  const ProcessSlot* slot = process_slot(creator);
  const std::string server = Text(slot->server, kServerBytes);
  std::unique_ptr<ShmSegment> segment;
  Status fetched;
  {
    HiddenFromPeers hidden;  // while its fd is in this process's table
    UniqueFd fd;
    fetched = FetchFd(server, slot->pid.load(), token, deadline, &fd);
    if (fetched.ok()) JO_CHECK(ShmSegment::Map(fd.get(), bytes, what, &segment));
  }
  if (!fetched.ok()) {
    JO_CHECK(CheckPeers(during));  // a creator that exited is named as such
    return Status(fetched.code(), during + ": fetching " + what + " from process " +
                                      std::to_string(processes_[creator]) + ": " +
                                      fetched.message());
  }
  LocalSite& mine = sites_[site];
  mine.segment = std::move(segment);
  mine.incarnation = incarnation;
  mine.users = 1;
  *out = mine.segment;
  return OkStatus();
}

void ShmDomain::ReleaseSite(int64_t site) {
  std::vector<std::shared_ptr<ShmSegment>> unmap;
  std::lock_guard<std::mutex> local_lock(sites_mu_);
  auto it = sites_.find(site);
  if (it == sites_.end() || it->second.users <= 0 || --it->second.users > 0) return;
  SitesLock lock(&header()->sites_lock, DeadlineAfter(std::chrono::seconds(5)));
  if (lock.result() != 0 && lock.result() != EOWNERDEAD) return;  // leaves the entry held
  SiteEntry* e = FindSite(site);
  if (e != nullptr && e->incarnation == it->second.incarnation && --e->holders > 0)
    return;  // others hold it: keep the mapping, in case this process opens the site again
  if (e != nullptr && e->incarnation == it->second.incarnation) {
    *e = SiteEntry();  // nobody holds it: the entry is free
    e->site = 0;
  }
  unmap.push_back(std::move(it->second.segment));
  sites_.erase(it);
  Sweep(&unmap);
}

void ShmDomain::Sweep(std::vector<std::shared_ptr<ShmSegment>>* unmap) {
  for (auto it = sites_.begin(); it != sites_.end();) {
    const SiteEntry* e = it->second.users > 0 ? nullptr : FindSite(it->first);
    if (it->second.users > 0 || (e != nullptr && e->incarnation == it->second.incarnation)) {
      ++it;
      continue;
    }
    unmap->push_back(std::move(it->second.segment));  // freed (or reused) since we let go
    it = sites_.erase(it);
  }
  if (offers_.empty()) return;
  SegmentServer* server = nullptr;
  if (!SegmentServer::Instance(&server).ok()) return;
  for (auto it = offers_.begin(); it != offers_.end();) {
    const SiteEntry* e = FindSite(it->first);
    if (e != nullptr && e->incarnation == it->second.first) {
      ++it;
      continue;
    }
    server->Withdraw(it->second.second);  // its site is gone: nobody may fetch it now
    it = offers_.erase(it);
  }
}

void ShmDomain::NoteCall(int32_t rank, int64_t site, int64_t epoch, bool in_call,
                         const std::string& signature) {
  RankSlot* slot = rank_slot(rank);
  std::lock_guard<std::mutex> lock(note_mu_);
  slot->seq.fetch_add(1);  // odd: being written
  slot->in_call = in_call ? 1 : 0;
  slot->site = site;
  slot->epoch = epoch;
  std::snprintf(slot->signature, kSignatureBytes, "%s", signature.c_str());
  slot->seq.fetch_add(1);
}

std::string ShmDomain::WhereIs(int32_t rank) const {
  const RankSlot* slot = rank_slot(rank);
  for (int attempt = 0; attempt < 4; ++attempt) {
    const uint32_t before = slot->seq.load();
    if (before & 1) continue;
    const bool in_call = slot->in_call != 0;
    const int64_t site = slot->site, epoch = slot->epoch;
    const std::string signature = Text(slot->signature, kSignatureBytes);
    if (slot->seq.load() != before) continue;
    if (site == 0) return RankName(rank) + " has run no call of this group yet";
    return RankName(rank) + (in_call ? " is in call " : " last finished call ") +
           std::to_string(epoch) + " of " + SiteName(site) + " ('" + signature + "')";
  }
  return RankName(rank) + " is busy (its state changed while read)";
}

int32_t ShmDomain::BeginWait(int32_t rank, int64_t site, int64_t epoch,
                             const std::string& signature) {
  RankSlot* slot = rank_slot(rank);
  std::lock_guard<std::mutex> lock(note_mu_);
  slot->wait_seq.fetch_add(1);
  int32_t found = -1;
  for (int32_t i = 0; i < kMaxWaits && found < 0; ++i)
    if (slot->waits[i].site == 0) found = i;
  if (found < 0) {
    ++slot->overflow;
  } else {
    RankSlot::Wait& w = slot->waits[found];
    w.site = site;
    w.epoch = epoch;
    w.missing = 0;
    std::snprintf(w.signature, kSignatureBytes, "%s", signature.c_str());
  }
  slot->wait_seq.fetch_add(1);
  return found;
}

void ShmDomain::UpdateWait(int32_t rank, int32_t record, uint64_t missing) {
  if (record < 0) return;
  RankSlot* slot = rank_slot(rank);
  std::lock_guard<std::mutex> lock(note_mu_);
  if (slot->waits[record].missing == missing) return;
  slot->wait_seq.fetch_add(1);
  slot->waits[record].missing = missing;
  slot->wait_seq.fetch_add(1);
}

void ShmDomain::EndWait(int32_t rank, int32_t record) {
  RankSlot* slot = rank_slot(rank);
  std::lock_guard<std::mutex> lock(note_mu_);
  slot->wait_seq.fetch_add(1);
  if (record < 0)
    --slot->overflow;
  else
    slot->waits[record] = RankSlot::Wait();
  slot->wait_seq.fetch_add(1);
}

namespace {

// One rank's waits as read at one moment.
struct WaitsSeen {
  uint32_t seq = 0;
  bool stuck = false;  // waits somewhere, every wait for peers that have not started it
  uint64_t waits_for = 0;
  std::string described;  // the waits as read, for the error (a peer may end them later)
};

}  // namespace

std::vector<int32_t> ShmDomain::Stuck(int32_t rank, std::vector<uint32_t>* stamp,
                                      std::string* described) const {
  const int32_t n = nranks();
  if (n > 64) return {};  // the masks hold 64 ranks
  // "rank 0 (process 0) waits in call 1 of site 0x... ('...') for rank(s) 1".
  auto describe = [this](int32_t rank, const RankSlot::Wait& w) {
    std::string peers;
    for (int32_t r = 0; r < 64 && r < nranks(); ++r)
      if (w.missing >> r & 1) peers += (peers.empty() ? "" : ", ") + std::to_string(r);
    return RankName(rank) + " waits in call " + std::to_string(w.epoch) + " of " +
           SiteName(w.site) + " ('" + Text(w.signature, kSignatureBytes) + "') for rank(s) " +
           peers;
  };
  std::vector<WaitsSeen> seen(n);
  for (int32_t r = 0; r < n; ++r) {
    const RankSlot* slot = rank_slot(r);
    bool read = false;
    for (int attempt = 0; attempt < 8 && !read; ++attempt) {
      const uint32_t before = slot->wait_seq.load();
      if (before & 1) continue;
      WaitsSeen s;
      s.seq = before;
      int32_t waits = 0;
      bool all_missing = slot->overflow == 0;
      for (const RankSlot::Wait& w : slot->waits) {
        if (w.site == 0) continue;
        ++waits;
        all_missing = all_missing && w.missing != 0;
        s.waits_for |= w.missing;
        s.described += (s.described.empty() ? "" : "; ") + describe(r, w);
      }
      s.stuck = waits > 0 && all_missing;
      // A sequence lock's reader: the plain reads above happen before the
      // re-check (an acquire fence; the writer's increments are read-modify-
      // writes, which order its stores after the first).
      std::atomic_thread_fence(std::memory_order_acquire);
      if (slot->wait_seq.load() != before) continue;
      seen[r] = s;
      read = true;
    }
    if (!read) return {};  // it is changing: not stuck
  }
  // The ranks that wait only for ranks that wait the same way: drop every
  // rank that waits for one that may still come, until none is left to drop.
  uint64_t stuck = 0;
  for (int32_t r = 0; r < n; ++r)
    if (seen[r].stuck) stuck |= uint64_t{1} << r;
  for (bool dropped = true; dropped;) {
    dropped = false;
    for (int32_t r = 0; r < n; ++r)
      if ((stuck >> r & 1) && (seen[r].waits_for & ~stuck) != 0) {
        stuck &= ~(uint64_t{1} << r);
        dropped = true;
      }
  }
  if (!(stuck >> rank & 1)) return {};
  std::vector<int32_t> ranks;
  stamp->clear();
  described->clear();
  for (int32_t r = 0; r < n; ++r)
    if (stuck >> r & 1) {
      ranks.push_back(r);
      stamp->push_back(static_cast<uint32_t>(r));  // which ranks, and each one's record
      stamp->push_back(seen[r].seq);
      *described += (described->empty() ? "" : "; ") + seen[r].described;
    }
  return ranks;
}

namespace {

struct Domains {
  std::mutex mu;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<ShmDomain>> by_key;
};

Domains& AllDomains() {
  static auto* domains = new Domains;  // never destroyed: workers may run at exit
  return *domains;
}

Status AddDomain(std::shared_ptr<ShmDomain> domain) {
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  auto& slot = d.by_key[{domain->key(), domain->group()}];
  JO_REQUIRE(slot == nullptr || slot->broken(), domain->name() + " already exists in this process");
  slot = std::move(domain);  // a broken one is replaced: its call sites keep it
  return OkStatus();
}

std::shared_ptr<ShmDomain> FindDomain(int64_t clique_key, int64_t group) {  // null if none
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.by_key.find({clique_key, group});
  return it == d.by_key.end() ? nullptr : it->second;
}

}  // namespace

Status CreateShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, UniqueFd* fd) {
  int64_t capacity = ShmDomain::kDefaultCapacity;
  if (const char* text = std::getenv("JAXOVERLAP_MAX_CALL_SITES"); text != nullptr && *text) {
    char* end = nullptr;
    capacity = std::strtoll(text, &end, 10);
    JO_REQUIRE(end != text && *end == '\0' && capacity >= 1 && capacity <= kMaxCapacity,
               std::string("JAXOVERLAP_MAX_CALL_SITES expected an integer in 1..") +
                   std::to_string(kMaxCapacity) + ", got '" + text + "'");
  }
  std::shared_ptr<ShmDomain> domain;
  JO_CHECK(ShmDomain::Create(clique_key, group, rank_process, process, attempt,
                             static_cast<int32_t>(capacity), &domain, fd));
  return AddDomain(std::move(domain));
}

Status AttachShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, int fd) {
  std::shared_ptr<ShmDomain> domain;
  JO_CHECK(ShmDomain::Attach(clique_key, group, rank_process, process, attempt, fd, &domain));
  return AddDomain(std::move(domain));
}

Status DomainOf(const CliqueKey& key, const std::vector<int64_t>& rank_process, const char* op,
                std::shared_ptr<ShmDomain>* out) {
  *out = FindDomain(key.key, key.group);
  const bool spans = std::any_of(rank_process.begin(), rank_process.end(),
                                 [&](int64_t p) { return p != rank_process.front(); });
  if (*out == nullptr && spans) {
    std::string table;
    for (size_t r = 0; r < rank_process.size(); ++r)
      table += (r ? ", " : "") + std::to_string(rank_process[r]);
    return Status(
        Code::kInvalidArgument,
        std::string(op) + ": " + CliqueName(CliqueKey{key.key, key.group, 0}) +
            " spans processes (rank -> process [" + table + "]), but process " +
            std::to_string(ProcessIndex()) +
            " has no shared memory set up for it. That is set up through jax.distributed "
            "where the call lowers, and this executable's call did not lower in this process: "
            "the executable was deserialized, or compiled by another process "
            "(jax_share_binary_between_hosts, on the global-array path under Auto mesh axes, "
            "where the call lowers in XLA's partitioner). Lower and compile it in every "
            "process: call the program through jax.jit here, leave "
            "jax_share_binary_between_hosts off, or call the op inside jax.shard_map, which "
            "lowers it in every process");
  }
  if (*out != nullptr && (*out)->nranks() != static_cast<int32_t>(rank_process.size()))
    return InvalidArgument((*out)->name() + " has " + std::to_string((*out)->nranks()) +
                           " ranks, but this call has axis_size " +
                           std::to_string(rank_process.size()));
  return OkStatus();
}

std::string DomainState(int64_t clique_key, int64_t group) {
  std::shared_ptr<ShmDomain> domain = FindDomain(clique_key, group);
  if (domain == nullptr) return "absent";
  return domain->broken() ? "broken" : "ok";
}

void BreakDomain(int64_t clique_key, int64_t group, const std::string& reason) {
  if (std::shared_ptr<ShmDomain> domain = FindDomain(clique_key, group))
    domain->Break(Status(Code::kAborted, reason));
}

bool ForgetDomain(int64_t clique_key, int64_t group) {
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  return d.by_key.erase({clique_key, group}) != 0;
}

std::string DescribeDomains() {
  std::vector<std::shared_ptr<ShmDomain>> domains;
  {
    Domains& d = AllDomains();
    std::lock_guard<std::mutex> lock(d.mu);
    for (const auto& entry : d.by_key) domains.push_back(entry.second);
  }
  std::string out;
  for (const auto& domain : domains) out += domain->Describe() + "\n";
  return out;
}

}  // namespace jo::host
