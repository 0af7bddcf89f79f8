#include "cuda/cuda_call.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "core/build.h"
#include "core/call.h"
#include "core/clique.h"
#include "core/log.h"
#include "cuda/cuda_bootstrap.h"
#include "cuda/cuda_clique.h"
#include "cuda/watchdog.h"

namespace jo::cuda {
namespace {

std::atomic<int64_t> g_process_index{0};

// One registry per process index: a real process only ever uses its own;
// the host-side fake test plays several processes in one (cliques spanning
// them must then be distinct objects, as they are in distinct processes).
std::mutex g_registries_mu;
std::map<int64_t, CliqueRegistry*>& Registries() {
  static auto* registries = new std::map<int64_t, CliqueRegistry*>();  // outlives static destructors
  return *registries;
}

CliqueRegistry& Registry(int64_t process) {
  std::lock_guard<std::mutex> lock(g_registries_mu);
  CliqueRegistry*& r = Registries()[process];
  if (r == nullptr) r = new CliqueRegistry();  // never freed: handlers may run late
  return *r;
}

std::vector<CliqueRegistry*> AllRegistries() {
  std::lock_guard<std::mutex> lock(g_registries_mu);
  std::vector<CliqueRegistry*> out;
  for (auto& [process, r] : Registries()) out.push_back(r);
  return out;
}

}  // namespace

void SetProcessIndex(int64_t index) { g_process_index = index; }
int64_t ProcessIndex() { return g_process_index; }

Status Place(const RankTable& t, int64_t process_index, int device_ordinal, const char* op,
             Placement* out) {
  const std::string who = std::string(op) + ": ";
  if (t.axis_size < 1 || t.devices.empty() || t.devices.size() != t.processes.size() ||
      t.devices.size() % static_cast<size_t>(t.axis_size) != 0)
    return InvalidArgument(who + "rank table attribute expected axis_size * groups entries of "
                           "(process, device), got " + std::to_string(t.devices.size()) +
                           " devices and " + std::to_string(t.processes.size()) + " processes");
  int64_t found = -1;
  for (size_t i = 0; i < t.devices.size(); ++i) {
    if (t.processes[i] != process_index || t.devices[i] != device_ordinal) continue;
    if (found >= 0)
      return InvalidArgument(who + "the rank table lists process " + std::to_string(process_index) +
                             " GPU " + std::to_string(device_ordinal) + " twice");
    found = static_cast<int64_t>(i);
  }
  if (found < 0)
    return InvalidArgument(who + "this call runs on process " + std::to_string(process_index) +
                           " GPU " + std::to_string(device_ordinal) +
                           ", which the rank table (the mesh of the enclosing shard_map) does not "
                           "contain");
  out->group = found / t.axis_size;
  out->rank = static_cast<int32_t>(found % t.axis_size);
  out->clique_devices.clear();
  out->clique_processes.clear();
  out->remote_process = -1;
  for (int64_t r = 0; r < t.axis_size; ++r) {
    const size_t i = static_cast<size_t>(out->group * t.axis_size + r);
    const bool here = t.processes[i] == process_index;
    if (!here && out->remote_process < 0) out->remote_process = t.processes[i];
    out->clique_devices.push_back(here ? static_cast<int>(t.devices[i]) : -1);
    out->clique_processes.push_back(t.processes[i]);
  }
  return OkStatus();
}

Status CudaCall(const CudaCallArgs& args) {
  const char* op = CollectiveName(args.problem.op);
  Placement place;
  JO_CHECK(Place(args.table, args.process_index, args.device, op, &place));
  Problem q = args.problem;
  q.rank = place.rank;
  JO_REQUIRE(q.nranks == static_cast<int32_t>(args.table.axis_size),
             std::string(op) + ": nranks does not match the rank table");

  CallSite site;
  site.op = op;
  site.rank = q.rank;
  const CliqueKey key{args.clique_key, place.group};
  site.clique = CliqueName(key);

  // Cliques spanning processes: nccl with the id exchanged at trace time; p2p
  // and multicast with the clique's exchange (buffer handles; the multicast
  // object's handle).
  ncclUniqueId nccl_id{};
  std::shared_ptr<Exchange> exchange;
  const bool spans = place.remote_process >= 0;
  const std::string elsewhere = "this clique has a rank in process " +
                                std::to_string(place.remote_process);
  const bool direct = q.transport == Transport::kP2p || q.transport == Transport::kMulticast;
  if (spans && q.transport == Transport::kNccl)
    JO_CHECK(FindNcclId(args.clique_key, place.group, args.process_index, site.Describe(),
                        &nccl_id));
  if (spans && direct) {
    exchange = FindExchange(args.clique_key, place.group, args.process_index);
    if (!exchange)
      return Status(Code::kInvalidArgument,
                    site.Describe() + ": this " + TransportName(q.transport) +
                        " clique spans processes (" + elsewhere +
                        ") but process " + std::to_string(args.process_index) +
                        " has no exchange for it: jaxoverlap registers one when it traces the "
                        "call (jax.distributed.initialize() first, and trace in this process)");
  }

  Program program;
  JO_CHECK(BuildProgram(q, &program));
  std::shared_ptr<Clique> clique;
  JO_CHECK(Registry(args.process_index).GetOrCreate(key, q.nranks, [&] {
    return std::make_unique<CudaClique>(key, q.transport, place.clique_devices,
                                        place.clique_processes, spans ? &nccl_id : nullptr, exchange,
                                        std::chrono::milliseconds(args.timeout_ms));
  }, &clique));
  auto* cuda = static_cast<CudaClique*>(clique.get());
  if (cuda->transport() != q.transport || cuda->devices() != place.clique_devices)
    return Internal(site.Describe() + ": clique key collision (transport or devices differ)");
  LogPlanOnce(program, key, "cuda");

  RunArgs run;
  run.program = &program;
  run.device = args.device;
  run.stream = args.stream;
  run.epoch = clique->NextEpoch(q.rank);
  run.io = args.io;
  run.site = site;
  run.timeout = std::chrono::milliseconds(args.timeout_ms);
  Status status = cuda->Prepare(program, run.epoch, CallSignature(q), site, &run.gen, &run.resources,
                                &run.comm);
  if (status.ok()) status = EnqueueProgram(run);
  if (status.ok()) {
    // The watchdog turns a peer that never arrives into an error, not a hang.
    WatchedCall watched;
    watched.clique = clique;
    watched.rank = q.rank;
    watched.device = args.device;
    watched.done = run.resources->done[static_cast<size_t>(run.epoch % RankResources::kDoneSlots)];
    watched.epoch = run.epoch;
    watched.gen = run.gen;
    std::set<std::pair<int32_t, int32_t>> waits;  // a flag may be waited on by two streams
    for (const Op& o : program.ops)
      if (o.kind == OpKind::kWait) waits.emplace(o.id, o.peer);
    watched.waits.assign(waits.begin(), waits.end());
    watched.nccl = q.transport == Transport::kNccl && q.nranks > 1;
    watched.op = op;
    watched.timeout = std::chrono::milliseconds(args.timeout_ms);
    watched.slots = RankResources::kDoneSlots;
    const cudaError_t recorded = cudaEventRecord(watched.done, args.stream);
    if (recorded == cudaSuccess) {
      Watch(std::move(watched));
    } else {
      status = CudaFailure(recorded, "cudaEventRecord(done)", &site);
    }
  }
  if (!status.ok() && status.code() != Code::kAborted) cuda->Break(status);
  // NCCL did not get its peers in time (AwaitNccl): abort the communicators,
  // so that no NCCL thread keeps waiting for them.
  if (status.code() == Code::kTimeout && q.transport == Transport::kNccl) cuda->AbortComms();
  JO_CHECK(status);
  return OkStatus();
}

std::string DescribeCudaCliques() {
  std::string out;
  for (CliqueRegistry* registry : AllRegistries())
    for (const auto& clique : registry->List())
      out += static_cast<CudaClique*>(clique.get())->Describe() + "\n";
  return out;
}

void ResetCudaCliques() {
  // The watchdog may hold a clique for a moment while it polls; wait (bounded)
  // until every clique is really gone, so its buffers are freed before the
  // caller (the fake's reset) forgets the allocations they came from.
  std::vector<std::weak_ptr<Clique>> gone;
  for (CliqueRegistry* registry : AllRegistries()) {
    for (const auto& clique : registry->List()) gone.push_back(clique);
    registry->Clear();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (const auto& weak : gone)
    while (!weak.expired() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

}  // namespace jo::cuda
