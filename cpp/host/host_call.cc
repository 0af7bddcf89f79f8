#include "host/host_call.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <set>

#include "core/build.h"
#include "core/clique.h"
#include "core/log.h"
#include "host/heap_workspace.h"

namespace jo::host {
namespace {

CliqueRegistry& Registry() {
  static CliqueRegistry registry;
  return registry;
}

std::shared_ptr<WorkspaceAllocator> Allocator() {
  static std::shared_ptr<WorkspaceAllocator> allocator = std::make_shared<HeapAllocator>();
  return allocator;
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

// JAXOVERLAP_LOG=debug: print each distinct plan once (rank 0 prints it).
void LogPlanOnce(const Program& program, const CliqueKey& key) {
  if (CurrentLogLevel() < LogLevel::kDebug || program.problem.rank != 0) return;
  static std::mutex mu;
  static std::set<std::string> seen;
  const std::string summary = CliqueName(key) + " " + Summary(program);
  std::lock_guard<std::mutex> lock(mu);
  if (!seen.insert(summary).second) return;
  JO_DEBUG("plan: " + CliqueName(key) + "\n" + ToString(program));
}

// The call as every rank of the clique must see it (everything but the rank).
std::string Signature(const Problem& q) {
  return std::string(CollectiveName(q.op)) + "/" + TransportName(q.transport) + " n=" +
         std::to_string(q.nranks) + " [" + std::to_string(q.batch) + "," +
         std::to_string(q.rows) + "," + std::to_string(q.k) + "]x" + std::to_string(q.n) + " " +
         DTypeName(q.dtype) + " chunks=" + std::to_string(q.chunks) +
         (q.bidirectional ? " bidirectional" : "") + (q.return_gathered ? " gathered" : "");
}

}  // namespace

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
    out += clique->name() + ": " + std::to_string(clique->nranks()) + " ranks, epoch " +
           std::to_string(clique->Epoch(0)) + ", workspace 2 x " +
           std::to_string(host->WorkspaceBytes()) + " bytes per rank";
    const std::string broken = host->BrokenReason();
    if (!broken.empty()) out += ", BROKEN: " + broken;
    out += "\n";
  }
  return out;
}

Status HostCall(const CallArgs& args) {
  const Problem& q = args.problem;
  if (ConsumeSkip(q.rank)) {
    JO_WARN(std::string(CollectiveName(q.op)) + ": test hook: rank " + std::to_string(q.rank) +
            " skips this call");
    return OkStatus();
  }
  Program program;
  JO_CHECK(BuildProgram(q, &program));
  const CliqueKey key{args.clique_key, args.group};
  std::shared_ptr<Clique> clique;
  JO_CHECK(Registry().GetOrCreate(key, q.nranks, [&] {
    return std::make_unique<HostClique>(key, q.nranks, Allocator());
  }, &clique));
  auto* host = static_cast<HostClique*>(clique.get());
  LogPlanOnce(program, key);

  WaitContext ctx;
  ctx.op = CollectiveName(q.op);
  ctx.rank = q.rank;
  ctx.epoch = clique->NextEpoch(q.rank);
  JO_CHECK(host->ClaimRank(ctx, args.device));
  struct Release {  // RAII: the rank is free again however the call ends
    HostClique* clique;
    int32_t rank;
    ~Release() { clique->ReleaseRank(rank); }
  } release{host, q.rank};
  ctx.timeout = std::chrono::milliseconds(args.timeout_ms);
  JO_CHECK(host->Prepare(ctx, Signature(q), program.workspace_elems * DTypeSize(q.dtype),
                         program.num_flags));
  JO_CHECK(RunProgram(program, *host, ctx.epoch, args.io, ctx.timeout, ctx.op));
  return OkStatus();
}

}  // namespace jo::host
