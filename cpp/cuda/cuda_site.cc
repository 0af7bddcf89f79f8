#include "cuda/cuda_site.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "core/deadline.h"
#include "core/hash.h"
#include "core/log.h"
#include "cuda/clique/cuda_bootstrap.h"
#include "cuda/executor.h"
#include "cuda/watchdog.h"

namespace jo::cuda {
namespace {

// One registry per process index: a real process only ever uses its own;
// the host-side fake plays several processes in one (cliques spanning them
// must then be distinct objects, as they are in distinct processes). Never
// destroyed: handlers and the watchdog may run late.
std::mutex g_registries_mu;
std::map<int64_t, CliqueRegistry<CudaClique>*>& Registries() {
  static auto* registries = new std::map<int64_t, CliqueRegistry<CudaClique>*>();
  return *registries;
}

CliqueRegistry<CudaClique>& Registry(int64_t process) {
  std::lock_guard<std::mutex> lock(g_registries_mu);
  CliqueRegistry<CudaClique>*& r = Registries()[process];
  if (r == nullptr) r = new CliqueRegistry<CudaClique>();
  return *r;
}

std::vector<CliqueRegistry<CudaClique>*> AllRegistries() {
  std::lock_guard<std::mutex> lock(g_registries_mu);
  std::vector<CliqueRegistry<CudaClique>*> out;
  for (auto& [process, r] : Registries()) out.push_back(r);
  return out;
}

// Makes the group's clique (first call of any of its sites on this process).
Status MakeClique(const CallDesc& desc, const PlacedCall& call, const Caller& caller,
                  std::unique_ptr<CudaClique>* out) {
  const Placement& place = call.place;
  const CliqueKey key{desc.clique_key, place.group, 0};
  ErrorContext ctx;
  ctx.op = CollectiveName(desc.problem.op);
  ctx.rank = place.rank;
  ctx.clique = CliqueName(key);
  // Cliques spanning processes: nccl with the id exchanged at trace time; p2p
  // and multicast with the clique's exchange (buffer handles; the multicast
  // object's handle).
  // Several ranks on one GPU (the loopback runner): p2p reaches a peer as the same device's
  // memory; NCCL refuses two ranks of a communicator on one device ("Duplicate GPU detected"),
  // and a multicast object binds one memory per device.
  std::set<int> seen;
  bool shared_gpu = false;
  for (int ordinal : place.ordinals)
    shared_gpu = shared_gpu || (ordinal >= 0 && !seen.insert(ordinal).second);
  if (shared_gpu && Row(desc.problem.transport).mechanism != Mechanism::kPeerCopies)
    return InvalidArgument(ctx.Describe() + ": transport " + TransportName(desc.problem.transport) +
                           " needs every rank on a GPU of its own (here ranks share one: the "
                           "loopback runs transport p2p only)");
  ncclUniqueId nccl_id{};
  std::shared_ptr<Exchange> exchange;
  const bool spans = place.spans_processes();
  const bool messages = Row(desc.problem.transport).messages();
  if (spans && messages)
    JO_CHECK(FindNcclId(desc.clique_key, place.group, caller.process, ctx.Describe(), &nccl_id));
  if (spans && !messages) {
    exchange = FindExchange(desc.clique_key, place.group, caller.process);
    if (!exchange)
      return InvalidArgument(ctx.Describe() + ": this " + TransportName(desc.problem.transport) +
                             " clique spans processes but process " +
                             std::to_string(caller.process) +
                             " has no exchange for it: jaxoverlap registers one when the call "
                             "lowers (jax.distributed.initialize() first, and lower in this "
                             "process)");
  }
  *out =
      std::make_unique<CudaClique>(key, desc.problem.transport, place.ordinals, place.processes,
                                   spans ? &nccl_id : nullptr, exchange, Millis(desc.timeout_ms));
  return OkStatus();
}

// The flags `program` waits for, (flag id, writer), each once: its Waits' and its fused GEMMs'
// (inside the kernel). A flag may be waited on by two streams.
std::vector<std::pair<int32_t, int32_t>> WaitedFlags(const Program& program) {
  std::set<std::pair<int32_t, int32_t>> waits;
  for (const Op& o : program.ops) {
    if (o.kind == OpKind::kWait) waits.emplace(o.id, o.peer);
    if (o.kind == OpKind::kFusedGemm)
      for (int32_t b = 0; b < o.fused.rows.count(); ++b)
        if (o.fused.Waits(b)) waits.emplace(o.fused.wait_flags + b, o.fused.writers[b]);
  }
  return {waits.begin(), waits.end()};
}

}  // namespace

CudaSite::CudaSite(CallDesc desc, CallSite site) : desc_(std::move(desc)), site_(std::move(site)) {}

namespace {

// What the kernel compares with its peers' flags: the call's signature (site included), hashed
// to 32 bits, never 0 (a zeroed flag's).
uint32_t DeviceSignature(const std::string& signature) {
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (unsigned char c : signature) h = Mix64(h ^ c);
  const auto out = static_cast<uint32_t>(h ^ (h >> 32));
  return out == 0 ? 1 : out;
}

}  // namespace

Status CudaSite::BindCall(const Caller& caller, const Problem& problem, BoundCall* out) {
  JO_CHECK(PlaceCall(desc_, problem, site_.id(), caller, &out->call));
  out->device_signature = DeviceSignature(out->call.signature);
  JO_CHECK(IssueOrder(out->call.program.problem, &out->issue));
  out->waits = WaitedFlags(out->call.program);
  JO_CHECK(PoolNeedsOf(out->call.program.problem, &out->pool_needs));
  for (const Op& op : out->call.program.ops)
    if (op.kind == OpKind::kFusedGemm && op.fused.wait_flags >= 0)
      out->fused_wait_flags = op.fused.wait_flags;
  out->nccl = Row(problem.transport).messages() && problem.nranks > 1;
  JO_REQUIRE(!desc_.table.processes.empty(), std::string(CollectiveName(desc_.problem.op)) +
                                                 ": the GPU handler needs the rank table");
  const CliqueKey key{desc_.clique_key, out->call.place.group, 0};
  Status made = OkStatus();
  Status got = Registry(caller.process)
                   .GetOrCreate(
                       key, problem.nranks,
                       [&] {
                         std::unique_ptr<CudaClique> clique;
                         made = MakeClique(desc_, out->call, caller, &clique);
                         return clique;
                       },
                       &out->clique);
  JO_CHECK(made);
  JO_CHECK(got);
  if (out->clique->transport() != desc_.problem.transport ||
      out->clique->devices() != out->call.place.ordinals)
    return Internal(CliqueName(key) + ": clique key collision (transport or devices differ)");
  return OkStatus();
}

namespace {

std::atomic<bool> g_capture_any{false};  // AllowCapturingAnyCallForTests

// Whether XLA is capturing its stream into a CUDA graph (a command buffer: the handler of a
// command-buffer compatible target runs under capture when XLA records it).
Status Capturing(cudaStream_t stream, bool* capturing) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  JO_CUDA_CHECK(nullptr, cudaStreamGetCaptureInfo(stream, &capture, &id));
  *capturing = capture != cudaStreamCaptureStatusNone;
  return OkStatus();
}

// A program with host-side epochs baked into what it enqueues (the flag values, the workspace
// half) must not be captured: its replays would skip the host side (epochs, the agreement
// check, the watchdog) and reuse the epoch of the capture. Its targets are registered without
// the command-buffer trait; should XLA capture it anyway, refuse rather than record.
Status RefuseCapture(const char* op, const Problem& problem) {
  return Status(
      Code::kInvalidArgument,
      std::string(op) + " (" + TransportName(problem.transport) +
          (problem.op == Collective::kMatmulAr
               ? std::string(", ") + ArAlgorithmName(problem.algorithm)
               : std::string()) +
          "): XLA's stream is being captured into a CUDA graph (a command buffer), "
          "but this program's host side would not replay (docs/gpu-internals.md §7 lists what "
          "can be replayed: matmul_ar's one_shot_kernel and two_shot_kernel). Run "
          "without command buffers for it, e.g. XLA_FLAGS=--xla_gpu_enable_command_buffer= "
          "(empty list)");
}

}  // namespace

Status CudaSite::Enqueue(const Caller& caller, const Problem& problem, const CallBuffers& io,
                         cudaStream_t stream, IssueGate* gate) {
  struct LeaveGate {  // whatever happens, the rank issues nothing more of this call
    IssueGate* gate;
    ~LeaveGate() {
      if (gate != nullptr) gate->Leave();
    }
  } leave{gate};
  const char* op = CollectiveName(problem.op);
  const bool one_launch = OneLaunch(problem.algorithm) && problem.nranks > 1;
  const bool replayable = RunsReplayableProgram(problem);
  bool capturing = false;
  JO_CHECK(Capturing(stream, &capturing));
  // Before the call takes an epoch: every rank refuses alike, the clique stays usable.
  if (capturing && !one_launch && !replayable && !g_capture_any) return RefuseCapture(op, problem);
  std::shared_ptr<const BoundCall> bound;
  JO_CHECK(
      bound_.Get(caller, [&](BoundCall* out) { return BindCall(caller, problem, out); }, &bound));
  if (one_launch || replayable) return EnqueueReplaying(caller, *bound, io, stream, capturing);
  const Program& program = bound->call.program;
  CudaClique& clique = *bound->clique;
  ErrorContext ctx;
  ctx.op = op;
  ctx.rank = program.problem.rank;
  ctx.clique = clique.name();

  RunArgs run;
  run.program = &program;
  run.order = &bound->issue;
  run.device = static_cast<int>(caller.device);
  run.stream = stream;
  run.epoch = clique.NextEpoch(ctx.rank);
  run.io = io;
  run.ctx = ctx;
  run.timeout = Millis(desc_.timeout_ms);
  run.gate = gate;
  const std::vector<int>& ordinals = bound->call.place.ordinals;  // this GPU's ranks share it
  run.device_share = static_cast<int32_t>(
      std::max<std::ptrdiff_t>(1, std::count(ordinals.begin(), ordinals.end(), run.device)));
  const std::string where = ctx.Describe() + " epoch " + std::to_string(run.epoch);
  Reservation reserved;
  Status status = clique.Agree(where, ctx.rank, run.epoch, bound->call.signature);
  if (status.ok())
    status =
        clique.Reserve(program, bound->call.needs, bound->pool_needs, run.epoch, ctx, &reserved);
  // Everything is checked and made before anything is enqueued (PrepareProgram);
  // then only enqueueing is left, and once it began the call is always joined
  // into XLA's stream and watched, whatever happens.
  std::unique_ptr<PreparedCall> prepared;
  if (status.ok()) {
    run.gen = reserved.gen.get();
    run.resources = reserved.resources;
    run.pool = reserved.pool.get();
    status = PrepareProgram(run, &prepared);
  }
  // The NCCL communicators are leased only now: everything above may wait for the device.
  NcclComms::Lease comms;
  if (status.ok()) {
    status = clique.AcquireComms(ctx.rank, ctx, &comms);
    if (!status.ok()) prepared->Abandon();
  }
  bool enqueued = false;
  // The first work of the call on XLA's stream: when the GPU gets here, the watchdog's clock of
  // this call starts.
  if (status.ok()) {
    const cudaError_t recorded = cudaEventRecord(reserved.events->started, stream);
    enqueued = recorded == cudaSuccess;
    if (!enqueued) status = CudaFailure(recorded, "cudaEventRecord(started)", &ctx);
  }
  if (status.ok()) status = prepared->Execute(comms.ForStreams(program.num_streams), &enqueued);
  comms.Drop();  // the watchdog may abort the communicators from here on
  if (enqueued) {
    // The watchdog turns a peer that never arrives into an error, not a hang.
    WatchedCall watched;
    watched.clique = bound->clique;
    watched.rank = ctx.rank;
    watched.device = run.device;
    watched.events = reserved.events;
    watched.epoch = run.epoch;
    watched.gen = reserved.gen;
    watched.waits = bound->waits;
    watched.nccl = bound->nccl;
    watched.op = op;
    watched.timeout = Millis(desc_.timeout_ms);
    if (bound->fused_wait_flags >= 0) {  // its fault record: at the start of the fused state
      watched.fault = static_cast<const FusedGemmFault*>(reserved.pool->fused_state);
      watched.fault_read = reserved.pool->fault_read;
      watched.fused_wait_flags = bound->fused_wait_flags;
    }
    const cudaError_t recorded = cudaEventRecord(reserved.events->done, stream);
    if (recorded == cudaSuccess) {
      run.resources->SetLast(reserved.events);
      reserved.gen->NoteFirstUse(ctx.rank, reserved.events);
      Watch(std::move(watched));
    } else if (status.ok()) {
      status = CudaFailure(recorded, "cudaEventRecord(done)", &ctx);
    }
  }
  if (!status.ok() && status.code() != Code::kAborted) clique.Break(status);
  // NCCL did not get its peers in time (AwaitNccl): abort the communicators,
  // so that no NCCL thread keeps waiting for them.
  if (status.code() == Code::kTimeout && Row(problem.transport).messages()) clique.AbortComms();
  return status;
}

Status CudaSite::EnqueueReplaying(const Caller& caller, const BoundCall& bound,
                                  const CallBuffers& io, cudaStream_t stream, bool capturing) {
  const Program& program = bound.call.program;
  const bool one_launch = OneLaunch(program.problem.algorithm);
  CudaClique& clique = *bound.clique;
  ErrorContext ctx;
  ctx.op = CollectiveName(program.problem.op);
  ctx.rank = program.problem.rank;
  ctx.clique = clique.name();
  JO_CHECK(clique.CheckNotBroken(ctx.Describe()));
  std::shared_ptr<const KernelArea> area;
  RankResources* resources = nullptr;
  std::shared_ptr<const RankPool> pool;
  {
    std::lock_guard<std::mutex> lock(bound.setup_mu);
    if (!bound.area) {
      // Set-up: an epoch of the clique (every rank's first execution of this site comes at the
      // same place in its calls), the agreement check, the rank's pool and resources, and the
      // call's area (made once per site).
      if (capturing)
        return InvalidArgument(
            ctx.Describe() + ": the first execution of this call on GPU " +
            std::to_string(caller.device) +
            " is under CUDA-graph capture, but it sets up buffers (allocation cannot be "
            "captured); XLA runs an executable once before it captures it, so this is not "
            "XLA's order: run the call once outside the capture first");
      const int64_t epoch = clique.NextEpoch(ctx.rank);
      const std::string where = ctx.Describe() + " epoch " + std::to_string(epoch);
      Reservation reserved;
      Status status = clique.Agree(where, ctx.rank, epoch, bound.call.signature);
      // The kernel algorithms share the clique's kernel area; a replayable program has buffers
      // of its own (no generation of the clique's).
      if (status.ok())
        status = clique.Reserve(program, CallNeeds{}, bound.pool_needs, epoch, ctx, &reserved,
                                /*kernel_area=*/one_launch, /*generation=*/one_launch);
      std::shared_ptr<const KernelArea> made = reserved.area;
      if (status.ok() && !one_launch)
        status = clique.ReplayArea(bound.call.clique.site, epoch, bound.call.needs.workspace_bytes,
                                   bound.call.needs.num_flags, AckFlags(program), ctx, &made);
      if (!status.ok()) {
        if (status.code() != Code::kAborted) clique.Break(status);
        return status;
      }
      bound.area = std::move(made);
      bound.resources = reserved.resources;
      // Kept by the call: an outgrown snapshot's memory stays allocated until teardown, so the
      // addresses a captured call baked in stay valid (clique_state.h RankPool).
      bound.pool = reserved.pool;
      // What the area's kernels record when they give up (the all-reduce kernel's, the flag
      // waits'): watched while the clique lives, eager calls and replays alike (a replay runs
      // no host code).
      WatchKernelArea(bound.clique, bound.area, Millis(desc_.timeout_ms));
    }
    area = bound.area;
    resources = bound.resources;
    pool = bound.pool;
  }
  RunArgs run;
  run.program = &program;
  run.order = &bound.issue;
  run.device = static_cast<int>(caller.device);
  run.stream = stream;
  run.epoch = 0;  // nothing of the call depends on an epoch (a replayable program's: half 0,
                  // flag values 1)
  run.gen = area->gen.get();
  run.resources = resources;
  run.pool = pool.get();
  run.io = io;
  run.ctx = ctx;
  run.timeout = Millis(desc_.timeout_ms);
  if (one_launch) {
    run.area = area.get();
    run.signature = bound.device_signature;
  } else {
    const size_t rank = static_cast<size_t>(ctx.rank);
    run.wait_fault = static_cast<kernel::fw::Fault*>(area->faults[rank]->ptr);
    run.fused_fault = static_cast<FusedGemmFault*>(area->fused_faults[rank]->ptr);
    const std::vector<int>& ordinals = bound.call.place.ordinals;
    run.device_share = static_cast<int32_t>(
        std::max<std::ptrdiff_t>(1, std::count(ordinals.begin(), ordinals.end(), run.device)));
  }
  std::unique_ptr<PreparedCall> prepared;
  Status status = PrepareProgram(run, &prepared);
  // A new cuBLASLt plan's warm-up runs on a stream of its own and is joined into XLA's stream:
  // under capture that join would be a dependency on work outside the graph.
  if (status.ok() && capturing && prepared->WarmedUp()) {
    prepared->Abandon();
    status = InvalidArgument(ctx.Describe() +
                             ": a new GEMM plan (new buffer alignments) is being made while XLA "
                             "captures this call; run it once outside the capture first");
  }
  // Eager: a `done` event after the call, so that teardown waits for it (never under capture:
  // a captured event cannot be queried).
  std::shared_ptr<const CallEvents> events;
  if (status.ok() && !capturing) status = resources->TakeEvents(ctx, &events);
  bool enqueued = false;
  if (status.ok()) status = prepared->Execute({}, &enqueued);
  if (enqueued && events) {
    const cudaError_t recorded = cudaEventRecord(events->done, stream);
    if (recorded == cudaSuccess) {
      resources->SetLast(events);
    } else if (status.ok()) {
      status = CudaFailure(recorded, "cudaEventRecord(done)", &ctx);
    }
  }
  if (enqueued && capturing) clique.NoteCaptured();
  if (!status.ok() && status.code() != Code::kAborted) clique.Break(status);
  return status;
}

void AllowCapturingAnyCallForTests(bool allow) { g_capture_any = allow; }

std::string DescribeCudaCliques() {
  std::string out;
  for (auto* registry : AllRegistries())
    for (const auto& clique : registry->List()) out += clique->Describe() + "\n";
  return out;
}

void ResetCudaCliques() {
  // The watchdog may hold a clique for a moment while it polls; wait (bounded)
  // until every clique is really gone, so its buffers are freed before the
  // caller (the fake's reset) forgets the allocations they came from.
  std::vector<std::weak_ptr<CudaClique>> gone;
  for (auto* registry : AllRegistries()) {
    for (const auto& clique : registry->List()) gone.push_back(clique);
    registry->Clear();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  for (const auto& weak : gone)
    while (!weak.expired() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // Expired is not destroyed: the destructor may still be running on the thread
  // that dropped the last reference.
  while (CudaClique::Live() > 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

}  // namespace jo::cuda
