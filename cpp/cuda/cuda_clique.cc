#include "cuda/cuda_clique.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <thread>

#include "core/log.h"
#include "cuda/transports.h"

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

// Buffers a GPU may still touch forever are never freed (freeing memory
// under a hung kernel is worse than leaking it).
void Leak(std::vector<std::shared_ptr<Generation>> generations,
          std::vector<std::unique_ptr<RankResources>> ranks) {
  static auto* mu = new std::mutex;
  static auto* kept = new std::vector<std::shared_ptr<void>>;
  std::lock_guard<std::mutex> lock(*mu);
  for (auto& gen : generations) kept->push_back(std::move(gen));
  for (auto& res : ranks) kept->push_back(std::shared_ptr<RankResources>(std::move(res)));
}

std::atomic<int> g_live{0};

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
    const int64_t last = res->last_epoch.load();
    if (res->device < 0 || last <= 0) continue;
    const cudaEvent_t done = res->done[static_cast<size_t>(last % RankResources::kDoneSlots)];
    idle = AwaitEvent(res->device, done, deadline) && idle;
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
    Leak(std::move(generations_), std::move(state_.ranks));
  }
}

Status CudaClique::NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                                 const ErrorContext& ctx, std::shared_ptr<Generation>* out) {
  DeviceGuard guard;
  auto gen = std::make_shared<Generation>();
  gen->since_epoch = epoch;
  gen->workspace_bytes = RoundUp(static_cast<size_t>(workspace_bytes), 256);  // halves aligned
  gen->num_flags = num_flags;
  const Status made = OpsOf(state_.transport).alloc_buffers(state_, gen.get(), ctx);
  if (!made.ok()) {
    // Zero-fills of what was made may still be queued: free it only after them.
    if (!AwaitSetup(state_, ctx).ok()) Leak({std::move(gen)}, {});
    return made;
  }
  JO_INFO(ctx.Describe() + ": new buffers from epoch " + std::to_string(epoch) +
          ": workspace 2 x " + std::to_string(gen->workspace_bytes) + " bytes, " +
          std::to_string(num_flags) + " flags per rank");
  *out = std::move(gen);
  return OkStatus();
}

void CudaClique::AbortComms(std::optional<std::chrono::steady_clock::time_point> await_until) {
  // No lock of the clique: the communicators are made once (at connect) and
  // guard themselves (leases); the watchdog must never wait for a set-up.
  if (!state_.nccl) return;
  state_.nccl->Abort();
  if (await_until) (void)state_.nccl->AwaitAborts(*await_until);
}

void CudaClique::TakePast(std::vector<std::shared_ptr<Generation>>* out) {
  while (generations_.size() > 1) {
    const std::shared_ptr<Generation>& oldest = generations_.front();
    // Held elsewhere: an enqueue in progress, or the watchdog watching a call on it.
    if (oldest.use_count() > 1) return;
    // Every local rank has finished, on the GPU, a call of a newer generation:
    // its calls on this one are done, and so are the peers' uses of its
    // buffers (a peer writes a rank's buffers only before signalling it in
    // the same call, which that rank waits for).
    const int64_t next = generations_[1]->since_epoch;
    for (const auto& res : state_.ranks) {
      if (res->device < 0) continue;
      const int64_t last = res->last_epoch.load();
      if (last < next) return;
      DeviceGuard guard;
      if (cudaSetDevice(res->device) != cudaSuccess) return;
      const cudaError_t q =
          cudaEventQuery(res->done[static_cast<size_t>(last % RankResources::kDoneSlots)]);
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

Status CudaClique::Reserve(const Program& program, const CallNeeds& needs, int64_t epoch,
                           const ErrorContext& ctx, Reservation* out) {
  Status status;
  {
    std::unique_lock<std::mutex> lock(mu_);
    status = ReserveLocked(lock, program, needs, epoch, ctx, out);
    // Broken before the lock is released: a rank next in line must not start a set-up (an
    // exchange with the peers) that the failing one will never join.
    if (!status.ok() && status.code() != Code::kAborted) Break(status);
  }
  if (!status.ok()) return status;
  // The rank's own streams, events and scratch, without the lock: allocating waits for the
  // device (its earlier calls), which must never hold up the other ranks' reservations.
  status = out->resources->Reserve(program, ctx);
  if (!status.ok()) Break(status);
  return status;
}

Status CudaClique::ReserveLocked(std::unique_lock<std::mutex>& lock, const Program& program,
                                 const CallNeeds& needs, int64_t epoch, const ErrorContext& ctx,
                                 Reservation* out) {
  const int32_t rank = program.problem.rank;
  const int64_t ws_bytes = needs.workspace_bytes;
  // NCCL moves the data itself: its programs signal and wait on no flag.
  const int32_t flags = state_.transport == Transport::kNccl ? 0 : needs.num_flags;
  JO_CHECK(CheckNotBroken(ctx.Describe()));
  if (!connected_) {
    JO_CHECK(OpsOf(state_.transport).connect(state_, ctx));
    connected_ = true;
  }
  for (;;) {
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
      const bool made = made_.wait_for(lock, state_.timeout,
                                       [&] { return making_ < 0 || !BrokenReason().empty(); });
      JO_CHECK(CheckNotBroken(ctx.Describe()));
      if (!made)
        return Status(Code::kTimeout, ctx.Describe() + ": new buffers for epoch " +
                                          std::to_string(epoch) +
                                          " were not set up within JAXOVERLAP_TIMEOUT_S");
      continue;
    }
    // Make it, without the lock: its zero-fill waits for the GPU and its
    // handles for the peers, and ranks still on earlier epochs must go on.
    for (const auto& res : state_.ranks)
      if (res->device >= 0) JO_CHECK(res->MakeSetup(ctx));
    const int64_t grow_ws = std::max<int64_t>(ws_bytes, use ? use->workspace_bytes : 0);
    const int32_t grow_flags = std::max<int32_t>(flags, use ? use->num_flags : 0);
    making_ = epoch;
    // The generations every local rank is past are freed here, and only here: no local rank
    // has enqueued anything of this epoch (each needs the new generation first), so the
    // device work a free waits for is of earlier calls, which every rank has enqueued or
    // will without waiting for this one (docs/gpu.md §3, "What may run on the enqueue path").
    std::vector<std::shared_ptr<Generation>> past;
    TakePast(&past);
    lock.unlock();
    past.clear();
    std::shared_ptr<Generation> made;
    const Status status = NewGeneration(epoch, grow_ws, grow_flags, ctx, &made);
    lock.lock();
    making_ = -1;
    if (status.ok()) generations_.push_back(std::move(made));
    made_.notify_all();
    JO_CHECK(status);
  }
  out->resources = state_.ranks[rank].get();
  if (state_.nccl) JO_CHECK(state_.nccl->Acquire(rank, ctx, &out->comms));
  return OkStatus();
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
  if (state_.handles != Handles::kUnset)
    out += state_.handles == Handles::kFabric ? ", peers through fabric handles"
                                              : ", peers through CUDA IPC";
  const std::string broken = BrokenReason();
  if (!broken.empty()) out += ", BROKEN: " + broken;
  if (state_.nccl) {
    const std::string stuck = state_.nccl->StuckAborts();
    if (!stuck.empty()) out += ", " + stuck;
  }
  if (!generations_.empty())
    out += ", workspace 2 x " + std::to_string(generations_.back()->workspace_bytes) +
           " bytes per rank (" + std::to_string(generations_.size()) + " generation(s) live, " +
           std::to_string(freed_) + " freed)";
  return out;
}

}  // namespace jo::cuda
