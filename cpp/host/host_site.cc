#include "host/host_site.h"

#include <algorithm>
#include <memory>

#include "core/log.h"
#include "host/executor.h"
#include "host/shm_clique.h"
#include "host/shm_domain.h"
#include "host/workers.h"

namespace jo::host {
namespace {

// Never destroyed: worker threads may still run calls while the process exits.
SiteCliques& Registry() {
  static auto* registry = new SiteCliques;
  return *registry;
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

}  // namespace

HostSite::HostSite(CallDesc desc, CallSite site) : desc_(std::move(desc)), site_(std::move(site)) {}

Status HostSite::BindCall(const Caller& caller, const Problem& problem, BoundCall* out) {
  JO_CHECK(PlaceCall(desc_, problem, site_.id(), caller, &out->call));
  // Every call site has its own clique (docs/native.md §4): in-process, or,
  // when the group spans processes, in the domain the bootstrap made for it.
  const CliqueKey key = out->call.clique;
  std::shared_ptr<ShmDomain> domain;
  JO_CHECK(DomainOf(key, out->call.place.processes, CollectiveName(desc_.problem.op), &domain));
  JO_CHECK(Registry().GetOrCreate(
      key, domain != nullptr ? 0 : site_.serial(), problem.nranks,
      [&]() -> std::unique_ptr<HostClique> {
        if (domain != nullptr)
          return std::make_unique<ShmClique>(domain, key.site, out->call.needs,
                                             out->call.signature);
        return std::make_unique<LocalClique>(key, problem.nranks);
      },
      &out->clique));
  return OkStatus();
}

void HostSite::Start(const Caller& caller, const Problem& problem, const CallBuffers& io,
                     std::function<void(const Status&)> done) {
  const char* op = CollectiveName(problem.op);
  const int64_t device = caller.device;
  std::shared_ptr<const BoundCall> bound;
  Status status = Guarded(op, [&] {
    return bound_.Get(
        caller, [&](BoundCall* out) { return BindCall(caller, problem, out); }, &bound);
  });
  if (!status.ok()) {
    done(status);
    return;
  }
  WaitContext ctx;
  ctx.op = op;
  ctx.rank = bound->call.place.rank;
  ctx.epoch = bound->clique->NextEpoch(ctx.rank);  // here: this device's order of executions
  ctx.timeout = Millis(desc_.timeout_ms);
  std::function<Status()> run = [bound, ctx, device, io]() -> Status {
    HostClique& clique = *bound->clique;
    WaitContext call = ctx;  // ClaimRank makes the count the clique's epoch
    JO_CHECK(clique.ClaimRank(&call, device));
    struct Release {  // the rank is free again however the call ends
      HostClique& clique;
      const WaitContext& call;
      ~Release() { clique.ReleaseRank(call); }
    } release{clique, call};
    JO_CHECK(clique.Agree(clique.Where(call), call.rank, call.epoch, bound->call.signature));
    JO_CHECK(clique.Reserve(call, bound->call.needs));
    return RunProgram(bound->call.program, clique, call, io);
  };
  std::shared_ptr<HostClique> clique = bound->clique;
  Status posted = Guarded(op, [&] {
    return PostToWorker([run, done, op]() mutable {
      Status status = Guarded(op, run);
      run = nullptr;  // release the bound call and its clique before XLA continues
      done(status);
    });
  });
  if (!posted.ok()) {
    // This rank took an epoch it will not run: let its peers fail fast.
    clique->Break(posted);
    done(posted);
  }
}

std::string DescribeCliques() {
  std::string out;
  for (const auto& clique : Registry().List()) {
    int64_t epoch = 0;  // the furthest call of the ranks in this process
    for (int32_t r = 0; r < clique->nranks(); ++r) epoch = std::max(epoch, clique->Epoch(r));
    out += clique->name() + ": " + std::to_string(clique->nranks()) + " ranks, " + clique->Kind() +
           ", epoch " + std::to_string(epoch) + ", workspace 2 x " +
           std::to_string(clique->WorkspaceBytes()) + " bytes per rank";
    const std::string broken = clique->BrokenReason();
    if (!broken.empty()) out += ", BROKEN: " + broken;
    out += "\n";
  }
  return out + DescribeDomains();
}

}  // namespace jo::host
