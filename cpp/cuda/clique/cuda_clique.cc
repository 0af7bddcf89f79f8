#include "cuda/clique/cuda_clique.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>

#include "core/allreduce_layout.h"
#include "core/deadline.h"
#include "core/log.h"
#include "cuda/fused/fused_gemm_launch.h"
#include "cuda/kernels/allreduce_body.h"
#include "cuda/kernels/flag_wait_body.h"
#include "cuda/transport/transports.h"
#include "cuda/watchdog.h"

namespace jo::cuda {
namespace {

// Whether `event` (of `device`) completes by `deadline`; false on an error too.
bool AwaitEvent(int device, cudaEvent_t event, std::chrono::steady_clock::time_point deadline) {
  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return false;
  for (;;) {
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Buffers a GPU may still touch forever are never freed (KeepForever).
void Leak(std::vector<std::shared_ptr<Generation>> generations,
          std::vector<std::unique_ptr<RankResources>> ranks,
          std::vector<std::shared_ptr<const Generation>> deferred = {}) {
  for (auto& gen : generations) KeepForever(std::move(gen));
  for (auto& res : ranks) KeepForever(std::shared_ptr<RankResources>(std::move(res)));
  for (auto& gen : deferred) KeepForever(std::move(gen));
}

std::atomic<int> g_live{0};

// The least a rank waits for another local rank's growth of the pools (ReserveLocked), and what
// it waits beyond the timeout for another local rank's making of the connection, a generation or
// the kernel area: the work of a thread of this process (allocations that wait for the GPUs,
// zero-fills), not of a peer, which a loaded host may take a while over.
constexpr std::chrono::milliseconds kLocalSetUp(2000);

// The deadline of a wait for what another local rank makes (the connection, a generation, the
// kernel area). The maker's own waits for the peers (the exchanges, NCCL's creation) are each
// bounded by the timeout and break the clique when they fail, which ends this wait with that
// reason; the rest of the maker's work is local. So this wait gets kLocalSetUp beyond the
// timeout: with the timeout alone, a local rank that takes longer than it to allocate (a short
// timeout, a loaded host) broke the clique although every peer was there, and on a missing peer
// the waiters' deadlines raced the maker's, naming a timeout of theirs instead of the peer.
Clock::time_point LocalMakerDeadline(std::chrono::milliseconds timeout) {
  return DeadlineAfter(kLocalSetUp, DeadlineAfter(timeout));
}

}  // namespace

CudaClique::LiveToken::LiveToken() { ++g_live; }
CudaClique::LiveToken::~LiveToken() { --g_live; }
int CudaClique::Live() { return g_live.load(); }

CudaClique::CudaClique(CliqueKey key, Transport transport, std::vector<int> devices,
                       std::vector<int64_t> processes, const ncclUniqueId* nccl_id,
                       std::shared_ptr<Exchange> exchange, std::chrono::milliseconds timeout)
    : Clique(key, static_cast<int32_t>(devices.size())) {
  state_.transport = transport;
  state_.devices = std::move(devices);
  state_.processes = std::move(processes);
  for (int device : state_.devices)
    if (device >= 0) state_.local_devices.push_back(device);
  state_.local_ranks = static_cast<int32_t>(state_.local_devices.size());
  if (nccl_id != nullptr) state_.nccl_id = *nccl_id;
  state_.exchange = std::move(exchange);
  state_.timeout = timeout;
  for (int device : state_.devices) {
    state_.ranks.push_back(std::make_unique<RankResources>());
    state_.ranks.back()->device = device;
  }
}

bool CudaClique::AwaitIdle(std::chrono::steady_clock::time_point deadline) {
  bool idle = true;
  for (const auto& res : state_.ranks) {
    if (res->device < 0) continue;
    const std::shared_ptr<const CallEvents> last = res->Last();
    if (last == nullptr) continue;
    idle = AwaitEvent(res->device, last->done, deadline) && idle;
  }
  return idle;
}

CudaClique::~CudaClique() {
  // Work still queued may use these buffers and communicators: wait for
  // every local rank's last call, bounded (no unbounded device
  // synchronisation: a peer that never came leaves kernels waiting forever).
  const auto deadline = std::chrono::steady_clock::now() + state_.timeout;
  const bool idle = AwaitIdle(deadline);
  if (state_.nccl) {
    if (idle) {
      state_.nccl->Finalize(deadline);  // ncclCommFinalize + poll, then destroy; else abort
    } else {
      state_.nccl->Abort();
    }
  }
  if (!idle) {
    JO_WARN(name() +
            ": GPU work of this clique did not finish within JAXOVERLAP_TIMEOUT_S at "
            "teardown; its buffers are leaked, not freed under it");
    std::lock_guard<std::mutex> lock(deferred_mu_);
    Leak(std::move(generations_), std::move(state_.ranks), std::move(deferred_));
  }
  // A captured one-launch all-reduce may be replayed by a graph we cannot wait for.
  if (kernel_area_ && (!idle || captured_)) KeepForever(std::move(kernel_area_));
  // Likewise a captured replayable program's buffers: kept, never freed under a replay.
  if (!replay_areas_.empty() && (!idle || captured_)) {
    static auto* kept = new std::vector<std::shared_ptr<KernelArea>>;  // never destroyed
    for (auto& [site, area] : replay_areas_) kept->push_back(std::move(area));
  }
}

Status CudaClique::ReplayArea(int64_t site, int64_t epoch, int64_t workspace_bytes,
                              int32_t num_flags, int32_t acks, const ErrorContext& ctx,
                              std::shared_ptr<const KernelArea>* out) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    JO_CHECK(CheckNotBroken(ctx.Describe()));
    const auto it = replay_areas_.find(site);
    if (it != replay_areas_.end()) {
      *out = it->second;
      return OkStatus();
    }
    if (making_replay_) {
      const bool made = made_.wait_until(lock, LocalMakerDeadline(state_.timeout), [&] {
        return !making_replay_ || !BrokenReason().empty();
      });
      if (!made)
        return Status(Code::kTimeout,
                      ctx.Describe() +
                          ": a replayable program's buffers (another rank makes "
                          "them) were not set up within JAXOVERLAP_TIMEOUT_S + 2 s");
      continue;
    }
    for (const auto& res : state_.ranks)
      if (res->device >= 0) JO_CHECK(res->MakeSetup(ctx));
    making_replay_ = true;
    lock.unlock();
    auto made = std::make_shared<KernelArea>();
    made->replay = true;
    made->op = ctx.op;
    made->acks = acks;
    Status status = NewGeneration(epoch, workspace_bytes, num_flags, ctx, &made->gen, /*halves=*/1);
    // The fault records of its bounded flag waits (kernels/flag_wait_body.h) and of its fused
    // GEMM's waits (fused_gemm_launch.h), zeroed.
    made->faults.resize(state_.ranks.size());
    made->fused_faults.resize(state_.ranks.size());
    for (size_t r = 0; status.ok() && r < state_.ranks.size(); ++r) {
      if (state_.ranks[r]->device < 0) continue;
      DeviceGuard guard;
      const cudaError_t set = cudaSetDevice(state_.ranks[r]->device);
      status = set == cudaSuccess ? AllocPinned(sizeof(kernel::fw::Fault), ctx, &made->faults[r])
                                  : CudaFailure(set, "cudaSetDevice", &ctx);
      if (status.ok()) status = AllocPinned(sizeof(FusedGemmFault), ctx, &made->fused_faults[r]);
      if (status.ok()) {
        std::memset(made->faults[r]->ptr, 0, sizeof(kernel::fw::Fault));
        std::memset(made->fused_faults[r]->ptr, 0, sizeof(FusedGemmFault));
      }
    }
    // Zero-fills of the generation may still be queued: free it only after them.
    if (!status.ok() && made->gen && !AwaitSetup(state_, ctx).ok())
      Leak({std::move(made->gen)}, {});
    lock.lock();
    making_replay_ = false;
    if (status.ok()) replay_areas_[site] = std::move(made);
    made_.notify_all();
    JO_CHECK(status);
  }
}

Status CudaClique::NewKernelArea(int64_t epoch, const ErrorContext& ctx,
                                 std::shared_ptr<KernelArea>* out) {
  auto area = std::make_shared<KernelArea>();
  const int64_t words = allreduce::StateWords(nranks());
  JO_CHECK(NewGeneration(epoch, allreduce::kAreaBytes, static_cast<int32_t>((words + 1) / 2), ctx,
                         &area->gen));
  area->faults.resize(state_.ranks.size());
  for (size_t r = 0; r < state_.ranks.size(); ++r) {
    if (state_.ranks[r]->device < 0) continue;
    DeviceGuard guard;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(state_.ranks[r]->device));
    JO_CHECK(AllocPinned(sizeof(kernel::ar::Fault), ctx, &area->faults[r]));
    std::memset(area->faults[r]->ptr, 0, sizeof(kernel::ar::Fault));
  }
  JO_INFO(ctx.Describe() + ": the one-launch all-reduce's area from epoch " +
          std::to_string(epoch) + ": 2 x " + std::to_string(allreduce::kAreaBytes) + " bytes and " +
          std::to_string(words) + " state words per rank");
  *out = std::move(area);
  return OkStatus();
}

void CudaClique::DeferRelease(std::shared_ptr<const Generation> gen) {
  if (!gen) return;
  std::lock_guard<std::mutex> lock(deferred_mu_);
  deferred_.push_back(std::move(gen));
}

Status CudaClique::NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                                 const ErrorContext& ctx, std::shared_ptr<Generation>* out,
                                 int32_t halves) {
  DeviceGuard guard;
  auto gen = std::make_shared<Generation>();
  gen->since_epoch = epoch;
  gen->halves = halves;
  gen->workspace_bytes = RoundUp(static_cast<size_t>(workspace_bytes), 256);  // halves aligned
  gen->num_flags = num_flags;
  const Status made = OpsOf(state_.transport).alloc_buffers(state_, gen.get(), ctx);
  if (!made.ok()) {
    // Zero-fills of what was made may still be queued: free it only after them.
    if (!AwaitSetup(state_, ctx).ok()) Leak({std::move(gen)}, {});
    return made;
  }
  JO_INFO(ctx.Describe() + ": new buffers from epoch " + std::to_string(epoch) + ": workspace " +
          std::to_string(halves) + " x " + std::to_string(gen->workspace_bytes) + " bytes, " +
          std::to_string(num_flags) + " flags per rank");
  *out = std::move(gen);
  return OkStatus();
}

void CudaClique::AbortComms(std::optional<std::chrono::steady_clock::time_point> await_until) {
  // No lock of the clique: the communicators are made once (at connect) and
  // guard themselves (leases); the watchdog must never wait for a set-up.
  if (!state_.nccl) return;
  state_.nccl->Abort();
  WatchAborts(state_.nccl, name(), state_.timeout);  // a stuck one is reported while it hangs
  if (await_until) (void)state_.nccl->AwaitAborts(*await_until);
}

void CudaClique::TakePast(std::vector<std::shared_ptr<const Generation>>* out) {
  while (generations_.size() > 1) {
    const std::shared_ptr<Generation>& oldest = generations_.front();
    // Held elsewhere: an enqueue in progress, or the watchdog watching a call on it.
    if (oldest.use_count() > 1) return;
    // Every local rank has finished, on the GPU, a call of a newer generation
    // (its first on the next one: a rank's calls complete in order): its calls
    // on this one are done, and so are the peers' uses of its buffers (a peer
    // writes a rank's buffers only before signalling it in the same call,
    // which that rank waits for).
    const Generation& next = *generations_[1];
    for (size_t r = 0; r < state_.ranks.size(); ++r) {
      const auto& res = state_.ranks[r];
      if (res->device < 0) continue;
      const std::shared_ptr<const CallEvents> first = next.FirstUse(static_cast<int32_t>(r));
      if (!first) return;
      DeviceGuard guard;
      if (cudaSetDevice(res->device) != cudaSuccess) return;
      const cudaError_t q = cudaEventQuery(first->done);
      if (q != cudaSuccess) {
        if (q != cudaErrorNotReady) (void)cudaGetLastError();
        return;
      }
    }
    out->push_back(oldest);
    generations_.erase(generations_.begin());
    ++freed_;
  }
}

Status CudaClique::Reserve(const Program& program, const CallNeeds& needs,
                           const PoolNeeds& pool_needs, int64_t epoch, const ErrorContext& ctx,
                           Reservation* out, bool kernel_area, bool generation) {
  Status status;
  {
    std::unique_lock<std::mutex> lock(mu_);
    status =
        ReserveLocked(lock, program, needs, pool_needs, epoch, ctx, out, kernel_area, generation);
    // Broken before the lock is released: a rank next in line must not start a set-up (an
    // exchange with the peers) that the failing one will never join.
    if (!status.ok() && status.code() != Code::kAborted) Break(status);
  }
  if (!status.ok()) return status;
  // The rank's own streams and events, without the lock.
  status = out->resources->Reserve(program, ctx, &out->events);
  if (status.ok() && state_.nccl) status = ConnectPeers(program, ctx, out->resources);
  if (!status.ok() && status.code() != Code::kAborted) Break(status);
  return status;
}

Status CudaClique::ConnectPeers(const Program& program, const ErrorContext& ctx,
                                RankResources* res) {
  NcclComms::Peers peers;
  for (const Op& op : program.ops) {
    if (op.kind != OpKind::kSend && op.kind != OpKind::kRecv) continue;
    if (op.stream < 1 || op.stream > NcclComms::kChannels)
      return Internal(ctx.Describe() + ": NCCL ops on stream " + std::to_string(op.stream) +
                      ", which has no communicator");
    auto& side = op.kind == OpKind::kSend ? peers.sends : peers.recvs;
    side[op.stream - 1].insert(op.peer);
  }
  if (!res->Pool()->connect)  // made with the pool (GrowPool), under the first reserver's barrier
    return Internal(ctx.Describe() + ": NCCL connect buffer missing from the rank's pool");
  auto* buffer = static_cast<float*>(res->connect_buffer->ptr);
  // Given up as soon as the clique breaks (a peer failed: it will not connect).
  bool in_flight = false;
  const Status status = state_.nccl->Connect(
      program.problem.rank, peers, res->connect, res->connect_done, buffer, buffer + 1,
      std::chrono::steady_clock::now() + state_.timeout,
      [&] { return CheckNotBroken(ctx.Describe()); }, ctx, &in_flight);
  if (in_flight) {
    // A connecting group waits on the GPU for a peer that will not come: the clique is broken
    // and its communicators of no more use; aborting them lets the group exit, which is awaited
    // (bounded), so that the failed call leaves nothing of its own running.
    Break(status);
    AbortComms();
    (void)AwaitEvent(res->device, res->connect_done,
                     std::chrono::steady_clock::now() + state_.timeout);
  }
  return status;
}

Status CudaClique::ReserveLocked(std::unique_lock<std::mutex>& lock, const Program& program,
                                 const CallNeeds& needs, const PoolNeeds& pool_needs, int64_t epoch,
                                 const ErrorContext& ctx, Reservation* out, bool kernel_area,
                                 bool generation) {
  const int32_t rank = program.problem.rank;
  const int64_t ws_bytes = needs.workspace_bytes;
  // NCCL moves the data itself: its programs signal and wait on no flag.
  const int32_t flags = Row(state_.transport).messages() ? 0 : needs.num_flags;
  JO_CHECK(CheckNotBroken(ctx.Describe()));
  // Connected once, by the first rank to need it, WITHOUT the lock: NCCL's creation waits for
  // the devices and the peers, the handles' exchange for the peers; meanwhile the others wait
  // here (bounded) and Describe answers.
  while (!connected_) {
    if (connecting_) {
      const bool done = made_.wait_until(lock, LocalMakerDeadline(state_.timeout),
                                         [&] { return !connecting_ || !BrokenReason().empty(); });
      JO_CHECK(CheckNotBroken(ctx.Describe()));
      if (!done)
        return Status(Code::kTimeout, ctx.Describe() +
                                          ": the clique's connection (another rank sets it up) "
                                          "did not complete within JAXOVERLAP_TIMEOUT_S + 2 s");
      continue;
    }
    connecting_ = true;
    lock.unlock();
    const Status status = OpsOf(state_.transport).connect(state_, ctx);
    lock.lock();
    connecting_ = false;
    connected_ = status.ok();
    made_.notify_all();
    JO_CHECK(status);  // Reserve breaks the clique before the lock is released
  }
  // The generations every local rank is past are freed, and every local rank's pool grown, by
  // the first local rank to reserve an epoch, and only then, while the others wait here before
  // they reserve (so enqueue) it: no local rank has enqueued anything of this epoch, so the
  // device work a free or an allocation waits for (its device's, and its peers' that map its
  // memory) is of earlier calls, which every rank has enqueued or will without waiting for this
  // one (docs/gpu-internals.md §1, "What may run on the enqueue path").
  // Bounded by the timeout, but never below kLocalSetUp: what is waited for is a local thread's
  // allocations (every local rank's pool), not a peer, and a loaded host may take a while.
  while (freeing_ >= 0 && epoch >= freeing_) {
    const bool freed = made_.wait_until(
        lock, DeadlineAfter(std::max<std::chrono::milliseconds>(state_.timeout, kLocalSetUp)),
        [&] { return freeing_ < 0 || !BrokenReason().empty(); });
    JO_CHECK(CheckNotBroken(ctx.Describe()));
    if (!freed)
      return Status(Code::kTimeout,
                    ctx.Describe() +
                        ": freeing past buffers and growing the ranks' pools (the first rank to "
                        "reserve this epoch does it; its allocations wait for the GPUs' earlier "
                        "work) did not complete within JAXOVERLAP_TIMEOUT_S (at least 2 s)");
  }
  if (epoch > first_reserved_) {
    first_reserved_ = epoch;
    std::vector<std::shared_ptr<const Generation>> past;
    {
      // The watchdog's references (DeferRelease): one to a generation still kept is not the
      // last and is dropped here (it would keep TakePast from freeing it); one to a generation
      // already taken out of generations_ may be, and is freed with the past ones.
      std::vector<std::shared_ptr<const Generation>> deferred;
      {
        std::lock_guard<std::mutex> deferred_lock(deferred_mu_);
        deferred.swap(deferred_);
      }
      for (auto& gen : deferred)
        if (std::none_of(generations_.begin(), generations_.end(),
                         [&](const auto& kept) { return kept == gen; }))
          past.push_back(std::move(gen));
    }
    TakePast(&past);
    bool grow = false;
    for (const auto& res : state_.ranks) grow = grow || !res->PoolCovers(pool_needs);
    if (!past.empty() || grow) {
      freeing_ = epoch;
      lock.unlock();
      past.clear();
      Status grown = OkStatus();
      {
        DeviceGuard guard;  // Alloc sets each rank's device
        for (const auto& res : state_.ranks)
          if (grown.ok()) grown = res->GrowPool(pool_needs, ctx);
      }
      lock.lock();
      freeing_ = -1;
      made_.notify_all();
      JO_CHECK(grown);  // Reserve breaks the clique before the lock is released
    }
  }
  // The one-launch all-reduce's set-up needs no buffers of a generation: it takes none; the
  // kernel area below is its. Nor does a replayable program's (its own: ReplayArea).
  for (bool none = (kernel_area || !generation) && ws_bytes == 0 && flags == 0; !none;) {
    // The newest generation valid at this epoch (see clique_state.h).
    std::shared_ptr<Generation> use;
    for (auto it = generations_.rbegin(); it != generations_.rend(); ++it)
      if ((*it)->since_epoch <= epoch) {
        use = *it;
        break;
      }
    if (use && use->workspace_bytes >= ws_bytes && use->num_flags >= flags) {
      out->gen = std::move(use);
      break;
    }
    const bool later_exists = !generations_.empty() && generations_.back()->since_epoch > epoch;
    if (later_exists || making_ > epoch)
      return Internal(ctx.Describe() + ": epoch " + std::to_string(epoch) +
                      " needs more workspace than a later epoch already set up: ranks disagree "
                      "on the call sequence");
    if (making_ >= 0) {  // another rank is making it: wait (bounded), then look again
      const bool made = made_.wait_until(lock, LocalMakerDeadline(state_.timeout),
                                         [&] { return making_ < 0 || !BrokenReason().empty(); });
      JO_CHECK(CheckNotBroken(ctx.Describe()));
      if (!made)
        return Status(Code::kTimeout, ctx.Describe() + ": new buffers for epoch " +
                                          std::to_string(epoch) +
                                          " were not set up within JAXOVERLAP_TIMEOUT_S + 2 s");
      continue;
    }
    // Make it, without the lock: its zero-fill waits for the GPU and its
    // handles for the peers, and ranks still on earlier epochs must go on.
    for (const auto& res : state_.ranks)
      if (res->device >= 0) JO_CHECK(res->MakeSetup(ctx));
    const int64_t grow_ws = std::max<int64_t>(ws_bytes, use ? use->workspace_bytes : 0);
    const int32_t grow_flags = std::max<int32_t>(flags, use ? use->num_flags : 0);
    making_ = epoch;
    lock.unlock();
    std::shared_ptr<Generation> made;
    const Status status = NewGeneration(epoch, grow_ws, grow_flags, ctx, &made);
    lock.lock();
    making_ = -1;
    if (status.ok()) generations_.push_back(std::move(made));
    made_.notify_all();
    JO_CHECK(status);
  }
  // The kernel area: made once, by the first rank to need it, without the lock (its
  // allocation waits for the devices, its handles for the peers) while the others wait here,
  // before any of them enqueues this epoch — a generation's discipline (above).
  while (kernel_area && !kernel_area_) {
    if (making_area_) {
      const bool made = made_.wait_until(lock, LocalMakerDeadline(state_.timeout),
                                         [&] { return !making_area_ || !BrokenReason().empty(); });
      JO_CHECK(CheckNotBroken(ctx.Describe()));
      if (!made)
        return Status(Code::kTimeout,
                      ctx.Describe() +
                          ": the one-launch all-reduce's area (another rank "
                          "makes it) was not set up within JAXOVERLAP_TIMEOUT_S + 2 s");
      continue;
    }
    for (const auto& res : state_.ranks)
      if (res->device >= 0) JO_CHECK(res->MakeSetup(ctx));
    making_area_ = true;
    lock.unlock();
    std::shared_ptr<KernelArea> made;
    const Status status = NewKernelArea(epoch, ctx, &made);
    lock.lock();
    making_area_ = false;
    if (status.ok()) kernel_area_ = std::move(made);
    made_.notify_all();
    JO_CHECK(status);
  }
  if (kernel_area) out->area = kernel_area_;
  out->resources = state_.ranks[rank].get();
  out->pool = out->resources->Pool();
  if (!out->resources->PoolCovers(pool_needs))  // grown by this epoch's first reserver
    return Internal(ctx.Describe() + ": epoch " + std::to_string(epoch) +
                    " found its rank's pool smaller than the call needs");
  return OkStatus();
}

Status CudaClique::AcquireComms(int32_t rank, const ErrorContext& ctx, NcclComms::Lease* out) {
  // No lock of the clique: the communicators are made once, before any call reserves (connect).
  if (!state_.nccl) return OkStatus();
  const Status leased = state_.nccl->Acquire(rank, ctx, out);
  // Communicators aborted because the clique broke (a peer connecting at set-up when another
  // rank failed): the error names that failure, not only the abort.
  if (leased.code() == Code::kAborted) JO_CHECK(CheckNotBroken(ctx.Describe()));
  return leased;
}

std::string CudaClique::Describe() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out = name() + ": " + TransportName(state_.transport) + ", GPUs [";
  for (size_t i = 0; i < state_.devices.size(); ++i)
    out += (i ? "," : "") +
           (state_.devices[i] < 0 ? std::string("remote") : std::to_string(state_.devices[i]));
  int32_t first_local = 0;
  while (first_local < nranks() && state_.devices[first_local] < 0) ++first_local;
  out += "], epoch " + std::to_string(Epoch(first_local < nranks() ? first_local : 0));
  // What connect makes (without the lock) is read only once it is done.
  if (connecting_) out += ", connecting";
  if (connected_ && state_.handles != Handles::kUnset)
    out += state_.handles == Handles::kFabric ? ", peers through fabric handles"
                                              : ", peers through CUDA IPC";
  const std::string broken = BrokenReason();
  if (!broken.empty()) out += ", BROKEN: " + broken;
  if (connected_ && state_.nccl) {
    const std::string stuck = state_.nccl->StuckAborts();
    if (!stuck.empty()) out += ", " + stuck;
  }
  if (!generations_.empty())
    out += ", workspace 2 x " + std::to_string(generations_.back()->workspace_bytes) +
           " bytes per rank (" + std::to_string(generations_.size()) + " generation(s) live, " +
           std::to_string(freed_) + " freed)";
  if (kernel_area_)
    out += ", one-launch all-reduce area 2 x " + std::to_string(allreduce::kAreaBytes) +
           " bytes per rank" + (captured_ ? " (captured into a graph)" : "");
  return out;
}

}  // namespace jo::cuda
