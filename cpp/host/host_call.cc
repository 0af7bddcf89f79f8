#include "host/host_call.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "core/build.h"
#include "core/call.h"
#include "core/clique.h"
#include "core/deadline.h"
#include "core/log.h"
#include "host/heap_workspace.h"
#include "host/shm_clique.h"
#include "host/workers.h"

namespace jo::host {
namespace {

// Process-wide state is never destroyed: worker threads may still run calls
// while the process exits, and must not find it gone.
CliqueRegistry& Registry() {
  static auto* registry = new CliqueRegistry;
  return *registry;
}

std::shared_ptr<WorkspaceAllocator> Allocator() {
  static auto* allocator = new std::shared_ptr<WorkspaceAllocator>(std::make_shared<HeapAllocator>());
  return *allocator;
}

// The domains of cliques spanning processes, by (clique_key, group): made by
// the bootstrap at trace time, used by every call site of that group.
struct Domains {
  std::mutex mu;
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<ShmDomain>> by_key;
};

Domains& AllDomains() {
  static auto* domains = new Domains;
  return *domains;
}

std::shared_ptr<ShmDomain> FindDomain(int64_t key, int64_t group) {
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  auto it = d.by_key.find({key, group});
  return it == d.by_key.end() ? nullptr : it->second;
}

std::mutex g_skip_mu;
int32_t g_skip_rank = -1;
int64_t g_skip_calls = 0;

bool ConsumeSkip(int32_t rank) {
  std::lock_guard<std::mutex> lock(g_skip_mu);
  if (g_skip_calls <= 0 || rank != g_skip_rank) return false;
  --g_skip_calls;
  return true;
}


// What a call needs per rank: the maximum over the programs of ALL ranks, so
// that every rank of a clique decides the same way whether the call needs a
// growth rendezvous (the programs of a ring are symmetric today; this does
// not rely on it). Cached per call signature.
Status NeedsOf(const Problem& q, const std::string& signature, CallNeeds* out) {
  static auto* mu = new std::mutex;
  static auto* cache = new std::map<std::string, CallNeeds>;
  {
    std::lock_guard<std::mutex> lock(*mu);
    auto it = cache->find(signature);
    if (it != cache->end()) {
      *out = it->second;
      return OkStatus();
    }
  }
  CallNeeds needs;
  const int64_t es = DTypeSize(q.dtype);
  for (int32_t r = 0; r < q.nranks; ++r) {
    Problem other = q;
    other.rank = r;
    Program program;
    JO_CHECK(BuildProgram(other, &program));
    needs.workspace_bytes = std::max(needs.workspace_bytes, program.workspace_elems * es);
    needs.num_flags = std::max(needs.num_flags, program.num_flags);
    int64_t mail = 0;
    int32_t messages = 0;
    for (const Op& op : program.ops) {
      if (op.kind != OpKind::kSend) continue;
      mail += op.batch * op.m * op.n * es;
      ++messages;
    }
    needs.mail_bytes = std::max(needs.mail_bytes, mail);
    needs.mail_messages = std::max(needs.mail_messages, messages);
  }
  std::lock_guard<std::mutex> lock(*mu);
  cache->emplace(signature, needs);
  *out = needs;
  return OkStatus();
}

Status AddDomain(std::shared_ptr<ShmDomain> domain) {
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  auto& slot = d.by_key[{domain->key(), domain->group()}];
  JO_REQUIRE(slot == nullptr || slot->broken(),
             domain->name() + " already exists in this process");
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

void SetTestSkip(int32_t rank, int64_t calls) {
  std::lock_guard<std::mutex> lock(g_skip_mu);
  g_skip_rank = rank;
  g_skip_calls = calls;
}

void ResetCliques() { Registry().Clear(); }

std::string DescribeCliques() {
  std::string out;
  for (const auto& clique : Registry().List()) {
    auto* host = static_cast<HostClique*>(clique.get());
    int64_t epoch = 0;  // the furthest call of the ranks in this process
    for (int32_t r = 0; r < clique->nranks(); ++r) epoch = std::max(epoch, clique->Epoch(r));
    out += clique->name() + ": " + std::to_string(clique->nranks()) + " ranks, " + host->Kind() +
           ", epoch " + std::to_string(epoch) + ", workspace 2 x " +
           std::to_string(host->WorkspaceBytes()) + " bytes per rank";
    const std::string broken = host->BrokenReason();
    if (!broken.empty()) out += ", BROKEN: " + broken;
    out += "\n";
  }
  Domains& d = AllDomains();
  std::lock_guard<std::mutex> lock(d.mu);
  for (const auto& entry : d.by_key) out += entry.second->Describe() + "\n";
  return out;
}

namespace {

// A call between its synchronous start and its run on a worker.
struct PendingCall {
  CallArgs args;
  Program program;
  std::shared_ptr<Clique> clique;
  int64_t epoch = 0;
};

// On the calling (XLA device) thread: the epoch is taken here, so it follows
// this rank's order of executions of the call site.
Status Begin(const CallArgs& args, PendingCall* call) {
  const Problem& q = args.problem;
  call->args = args;
  JO_CHECK(BuildProgram(q, &call->program));
  // Every call site has its own clique (docs/native.md §4): in-process, or,
  // when the bootstrap made a domain for this group, spanning processes.
  const CliqueKey key{args.clique_key, args.group, args.site};
  std::shared_ptr<ShmDomain> domain = FindDomain(args.clique_key, args.group);
  JO_REQUIRE(domain == nullptr || domain->nranks() == q.nranks,
             domain->name() + " has " + std::to_string(domain->nranks()) +
                 " ranks, but this call has axis_size " + std::to_string(q.nranks));
  JO_CHECK(Registry().GetOrCreate(key, q.nranks, [&]() -> std::unique_ptr<Clique> {
    if (domain != nullptr) return std::make_unique<ShmClique>(domain, args.site);
    return std::make_unique<LocalClique>(key, q.nranks, Allocator());
  }, &call->clique));
  LogPlanOnce(call->program, key, "host");
  call->epoch = call->clique->NextEpoch(q.rank);
  return OkStatus();
}

// On a worker thread.
Status Finish(const PendingCall& call) {
  const Problem& q = call.args.problem;
  auto* host = static_cast<HostClique*>(call.clique.get());
  WaitContext ctx;
  ctx.op = CollectiveName(q.op);
  ctx.rank = q.rank;
  ctx.epoch = call.epoch;
  ctx.timeout = Millis(call.args.timeout_ms);
  JO_CHECK(host->ClaimRank(ctx, call.args.device));
  struct Release {  // RAII: the rank is free again however the call ends
    HostClique* clique;
    int32_t rank;
    ~Release() { clique->ReleaseRank(rank); }
  } release{host, q.rank};
  const std::string signature = CallSignature(q);
  CallNeeds needs;
  JO_CHECK(NeedsOf(q, signature, &needs));
  JO_CHECK(host->Prepare(ctx, signature, needs));
  JO_CHECK(RunProgram(call.program, *host, ctx.epoch, call.args.io, ctx.timeout, ctx.op));
  return OkStatus();
}

// Nothing throws past here (bad_alloc and friends become a Status).
template <typename F>
Status Guarded(const char* op, F&& fn) {
  try {
    return fn();
  } catch (const std::exception& e) {
    return Internal(std::string(op) + ": " + e.what());
  } catch (...) {
    return Internal(std::string(op) + ": unknown exception");
  }
}

struct Sites {
  std::mutex mu;
  std::map<int64_t, int64_t> count;  // clique_key -> call sites created
};

Sites& AllSites() {
  static auto* sites = new Sites;
  return *sites;
}

}  // namespace

void StartHostCall(const CallArgs& args, std::function<void(const Status&)> done) {
  const Problem& q = args.problem;
  const char* op = CollectiveName(q.op);
  if (ConsumeSkip(q.rank)) {
    JO_WARN(std::string(op) + ": test hook: rank " + std::to_string(q.rank) +
            " skips this call");
    done(OkStatus());
    return;
  }
  auto call = std::make_shared<PendingCall>();
  Status begun = Guarded(op, [&] { return Begin(args, call.get()); });
  if (!begun.ok()) {
    done(begun);
    return;
  }
  std::shared_ptr<Clique> clique = call->clique;
  Status posted = Guarded(op, [&] {
    return PostToWorker([call, done, op]() mutable {
      Status status = Guarded(op, [&] { return Finish(*call); });
      call.reset();  // release the program and the clique before XLA continues
      done(status);
    });
  });
  if (!posted.ok()) {
    // This rank took an epoch it will not run: let its peers fail fast.
    static_cast<HostClique*>(clique.get())->Break(posted);
    done(posted);
  }
}

int64_t NewCallSite(int64_t clique_key) {
  Sites& sites = AllSites();
  std::lock_guard<std::mutex> lock(sites.mu);
  return ++sites.count[clique_key];
}

void ForgetCallSite(int64_t clique_key, int64_t site) { Registry().EraseSite(clique_key, site); }

}  // namespace jo::host
