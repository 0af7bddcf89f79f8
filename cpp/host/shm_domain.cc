#include "host/shm_domain.h"

#include <poll.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>
#include <set>

#include "core/clique.h"
#include "core/log.h"

namespace jo::host {
namespace {

constexpr uint64_t kMagic = 0x6e6d646d6873656aULL;  // "jeshmdmn"
constexpr uint32_t kVersion = 2;
constexpr size_t kReasonBytes = 2048;
constexpr size_t kNameBytes = 160;
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
};

struct alignas(kAlign) ShmDomain::ProcessSlot {
  int32_t process;              // its process index (written by the leader)
  std::atomic<int32_t> pid;     // written by that process when it maps the segment
  std::atomic<uint64_t> pidns;  // its pid namespace (pids compare only within one)
  char reason[kReasonBytes];    // its failure text; valid once `broken` points here
};

struct alignas(kAlign) ShmDomain::RankSlot {
  int32_t process;
  std::atomic<uint32_t> doorbell;
};

struct ShmDomain::SiteEntry {  // not padded: entries are only touched under the lock
  int64_t site;                // 0: free. All fields under Header::sites_lock.
  int32_t attached;            // processes that opened the site's segment
  int32_t released;            // processes that let go of it
  char name[kNameBytes];
};

namespace {

struct Offsets {
  size_t processes, ranks, sites, total;
  Offsets(int32_t nranks, int32_t nprocs) {
    processes = RoundUp(sizeof(ShmDomain::Header), kAlign);
    ranks = processes + static_cast<size_t>(nprocs) * sizeof(ShmDomain::ProcessSlot);
    sites = ranks + static_cast<size_t>(nranks) * sizeof(ShmDomain::RankSlot);
    total = sites + static_cast<size_t>(ShmDomain::kSiteCapacity) * sizeof(ShmDomain::SiteEntry);
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
                         int32_t process, int64_t attempt, std::shared_ptr<ShmDomain>* out) {
  JO_CHECK(CheckTable(key, group, rank_process, process));
  SweepStaleSegments();  // what killed jobs of this user left behind
  const std::vector<int32_t> processes = Distinct(rank_process);
  const int32_t nranks = static_cast<int32_t>(rank_process.size());
  const int32_t nprocs = static_cast<int32_t>(processes.size());
  const Offsets at(nranks, nprocs);
  std::string name;
  JO_CHECK(NewShmName(&name));
  std::unique_ptr<ShmSegment> control;
  JO_CHECK(ShmSegment::Create(
      name, at.total, "the control segment of " + CliqueName(CliqueKey{key, group, 0}), &control));
  std::byte* base = control->data();
  auto* h = new (base) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = nranks;
  h->nprocs = nprocs;
  h->site_capacity = kSiteCapacity;
  h->key = key;
  h->group = group;
  h->attempt = attempt;
  pthread_mutexattr_t attr;
  pthread_mutexattr_init(&attr);
  pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  const int init = pthread_mutex_init(&h->sites_lock, &attr);
  pthread_mutexattr_destroy(&attr);
  if (init != 0) {
    (void)UnlinkShm(name);
    return Status(Code::kResource, std::string("pthread_mutex_init: ") + std::strerror(init));
  }
  for (int32_t i = 0; i < nprocs; ++i)
    (new (base + at.processes + i * sizeof(ProcessSlot)) ProcessSlot())->process = processes[i];
  for (int32_t r = 0; r < nranks; ++r)
    (new (base + at.ranks + r * sizeof(RankSlot)) RankSlot())->process = rank_process[r];
  for (int32_t s = 0; s < kSiteCapacity; ++s)
    new (base + at.sites + s * sizeof(SiteEntry)) SiteEntry();
  h->attached.store(1);
  std::shared_ptr<ShmDomain> domain(
      new ShmDomain(key, group, rank_process, process, std::move(control)));
  domain->Announce();
  JO_INFO(domain->name() + ": created shared-memory control segment " + domain->control_name() +
          " for " + std::to_string(nprocs) + " processes");
  *out = std::move(domain);
  return OkStatus();
}

Status ShmDomain::Attach(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                         int32_t process, int64_t attempt, const std::string& name,
                         std::shared_ptr<ShmDomain>* out) {
  JO_CHECK(CheckTable(key, group, rank_process, process));
  JO_REQUIRE(name.rfind("/jaxoverlap-", 0) == 0 && name.size() < kNameBytes,
             "not a jaxoverlap shared-memory name: '" + name + "'");
  const int32_t nranks = static_cast<int32_t>(rank_process.size());
  const int32_t nprocs = static_cast<int32_t>(Distinct(rank_process).size());
  std::unique_ptr<ShmSegment> control;
  JO_CHECK(ShmSegment::Open(name, Offsets(nranks, nprocs).total, &control));
  const auto* h = reinterpret_cast<const Header*>(control->data());
  const std::string mine = CliqueName(CliqueKey{key, group, 0});
  JO_REQUIRE(h->magic == kMagic && h->version == kVersion,
             name + " is not a jaxoverlap clique segment of version " + std::to_string(kVersion));
  JO_REQUIRE(h->key == key && h->group == group && h->nranks == nranks && h->nprocs == nprocs &&
                 h->site_capacity == kSiteCapacity,
             name + " describes " + CliqueName(CliqueKey{h->key, h->group, 0}) + " with " +
                 std::to_string(h->nranks) + " ranks, but this process bootstraps " + mine +
                 " with " + std::to_string(nranks));
  JO_REQUIRE(h->attempt == attempt, name + " belongs to bootstrap attempt " +
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
  domain->Announce();
  if (domain->header()->attached.fetch_add(1) + 1 == nprocs)
    JO_CHECK(UnlinkShm(name));  // every process has it mapped: the name is no longer needed
  *out = std::move(domain);
  return OkStatus();
}

void ShmDomain::Announce() {
  ProcessSlot* slot = process_slot(SlotOf(process_));
  slot->pidns.store(PidNamespace());
  slot->pid.store(static_cast<int32_t>(getpid()));
}

ShmDomain::Header* ShmDomain::header() const { return reinterpret_cast<Header*>(control_->data()); }

ShmDomain::ProcessSlot* ShmDomain::process_slot(int32_t index) const {
  return reinterpret_cast<ProcessSlot*>(control_->data() + Offsets(nranks(), nprocs()).processes +
                                        static_cast<size_t>(index) * sizeof(ProcessSlot));
}

ShmDomain::RankSlot* ShmDomain::rank_slot(int32_t rank) const {
  return reinterpret_cast<RankSlot*>(control_->data() + Offsets(nranks(), nprocs()).ranks +
                                     static_cast<size_t>(rank) * sizeof(RankSlot));
}

ShmDomain::SiteEntry* ShmDomain::site_entry(int64_t site) const {
  const size_t index = static_cast<size_t>((site - 1) % kSiteCapacity);
  return reinterpret_cast<SiteEntry*>(control_->data() + Offsets(nranks(), nprocs()).sites +
                                      index * sizeof(SiteEntry));
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
  size_t sites = 0;
  {
    std::lock_guard<std::mutex> lock(sites_mu_);
    sites = opened_sites_.size();
  }
  std::string out = name() + ": domain of " + std::to_string(nranks()) +
                    " ranks, shared memory "
                    "across " +
                    std::to_string(nprocs()) + " processes (ranks " + local + " in this process " +
                    std::to_string(process_) + "), " + std::to_string(sites) +
                    " call sites open here";
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

Status ShmDomain::OpenSite(int64_t site, size_t site_bytes, Clock::time_point deadline,
                           const std::string& during,
                           void (*init)(std::byte*, const ShmDomain&, int64_t),
                           std::unique_ptr<ShmSegment>* out) {
  JO_REQUIRE(site > 0, name() + ": call sites are numbered from 1, got " + std::to_string(site));
  const std::string what = CliqueName(CliqueKey{key_, group_, site});
  int32_t local_rank = 0;
  while (!Local(local_rank)) ++local_rank;
  std::atomic<uint32_t>* bell = Doorbell(local_rank);
  while (true) {
    const uint32_t seq = bell->load();
    if (broken())
      return Status(Code::kAborted,
                    during + ": clique aborted by an earlier failure: " + BrokenReason());
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
        return Status(Code::kTimeout, during +
                                          ": timeout waiting for the call-site directory "
                                          "lock of " +
                                          name());
      if (lock.result() != 0)
        return Status(Code::kResource,
                      std::string("pthread_mutex_clocklock: ") + std::strerror(lock.result()));
      SiteEntry* e = site_entry(site);
      if (e->site == 0) {  // first process to run this site: create it
        std::string segment_name;
        JO_CHECK(NewShmName(&segment_name));
        std::unique_ptr<ShmSegment> segment;
        JO_CHECK(ShmSegment::Create(segment_name, site_bytes, "the call-site segment of " + what,
                                    &segment));
        init(segment->data(), *this, site);
        e->site = site;
        e->attached = 1;
        e->released = 0;
        std::snprintf(e->name, kNameBytes, "%s", segment_name.c_str());
        if (e->attached == nprocs()) (void)UnlinkShm(segment_name);
        *out = std::move(segment);
      } else if (e->site == site) {
        const std::string segment_name(e->name, strnlen(e->name, kNameBytes));
        JO_REQUIRE(segment_name.rfind("/jaxoverlap-", 0) == 0,
                   what + ": the call-site directory holds no valid segment name");
        JO_CHECK(ShmSegment::Open(segment_name, site_bytes, out));
        if (++e->attached == nprocs()) (void)UnlinkShm(segment_name);
      }
    }
    if (*out != nullptr) {
      std::lock_guard<std::mutex> lock(sites_mu_);
      opened_sites_.push_back(site);
      RingAll();
      return OkStatus();
    }
    // The entry still belongs to an older site that some process uses.
    JO_CHECK(CheckPeers(during));
    const auto now = Clock::now();
    if (now >= deadline)
      return Status(Code::kTimeout, during + ": more than " + std::to_string(kSiteCapacity) +
                                        " call sites of " + name() +
                                        " are alive at once (the directory entry "
                                        "of site " +
                                        std::to_string(site) + " is still held by an older site)");
    FutexWait(bell, seq, std::min<Clock::duration>(deadline - now, std::chrono::milliseconds(100)));
  }
}

void ShmDomain::ReleaseSite(int64_t site) {
  {
    std::lock_guard<std::mutex> lock(sites_mu_);
    auto it = std::find(opened_sites_.begin(), opened_sites_.end(), site);
    if (it == opened_sites_.end()) return;
    opened_sites_.erase(it);
  }
  SitesLock lock(&header()->sites_lock, DeadlineAfter(std::chrono::seconds(5)));
  if (lock.result() != 0 && lock.result() != EOWNERDEAD) return;  // leaves the entry held
  SiteEntry* e = site_entry(site);
  if (e->site != site) return;
  if (++e->released < e->attached) return;
  // Every process that opened the site let go of it: free the entry.
  (void)UnlinkShm(std::string(e->name, strnlen(e->name, kNameBytes)));
  std::memset(e->name, 0, kNameBytes);
  e->attached = 0;
  e->released = 0;
  e->site = 0;
  RingAll();
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

}  // namespace

Status CreateShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, std::string* name) {
  std::shared_ptr<ShmDomain> domain;
  JO_CHECK(ShmDomain::Create(clique_key, group, rank_process, process, attempt, &domain));
  *name = domain->control_name();
  Status status = AddDomain(std::move(domain));
  if (!status.ok()) (void)UnlinkShm(*name);
  return status;
}

Status AttachShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, const std::string& name) {
  std::shared_ptr<ShmDomain> domain;
  JO_CHECK(ShmDomain::Attach(clique_key, group, rank_process, process, attempt, name, &domain));
  return AddDomain(std::move(domain));
}

std::shared_ptr<ShmDomain> FindDomain(int64_t clique_key, int64_t group) {
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.by_key.find({clique_key, group});
  return it == d.by_key.end() ? nullptr : it->second;
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
