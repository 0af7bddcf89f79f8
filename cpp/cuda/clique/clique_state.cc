#include "cuda/clique/clique_state.h"

#include <algorithm>
#include <thread>

#include "cuda/fused/fused_gemm.h"
#include "cuda/gemm/gemm.h"
#include "cuda/transport/peer_handles.h"

namespace jo::cuda {

std::byte* Generation::Workspace(int32_t rank, int64_t epoch, int32_t viewer) const {
  if (halves == 1) epoch = 0;  // one half (a replayable program's, run at epoch 0)
  const size_t parity = static_cast<size_t>(epoch % 2) * static_cast<size_t>(workspace_bytes);
  if (multicast) return reinterpret_cast<std::byte*>(multicast->unicast[rank]) + parity;
  if (workspace[rank]) return static_cast<std::byte*>(workspace[rank]->ptr) + parity;
  return remote[viewer][rank].workspace + parity;
}

std::byte* Generation::MulticastAddress(int64_t epoch) const {
  const size_t parity = static_cast<size_t>(epoch % 2) * static_cast<size_t>(workspace_bytes);
  return multicast ? reinterpret_cast<std::byte*>(multicast->mc_va) + parity : nullptr;
}

CUdeviceptr Generation::Flag(int32_t rank, int64_t epoch, int32_t id, int32_t viewer) const {
  if (halves == 1) epoch = 0;  // one half (a replayable program's, run at epoch 0)
  const int64_t index = (epoch % 2) * num_flags + id;
  void* base = flags[rank] ? flags[rank]->ptr : remote[viewer][rank].flags;
  return reinterpret_cast<CUdeviceptr>(static_cast<uint32_t*>(base) + index);
}

// The free CallEvents of one rank. A pair in use is a shared_ptr whose deleter gives it back
// (or destroys it once the pool is gone: cudaEventDestroy of an event still pending returns at
// once and frees it when it completes).
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  EventPool() = default;
  ~EventPool() {
    for (const CallEvents& e : free_) Destroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // A pair for one call: a free one, or two new events (on the rank's device, current).
  Status Take(const ErrorContext& ctx, std::shared_ptr<const CallEvents>* out) {
    CallEvents e;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        e = free_.back();
        free_.pop_back();
      }
    }
    if (e.done == nullptr) {
      JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e.started, cudaEventDisableTiming));
      const cudaError_t made = cudaEventCreateWithFlags(&e.done, cudaEventDisableTiming);
      if (made != cudaSuccess) {
        (void)cudaEventDestroy(e.started);
        return CudaFailure(made, "cudaEventCreateWithFlags", &ctx);
      }
    }
    std::weak_ptr<EventPool> pool = weak_from_this();
    *out = std::shared_ptr<const CallEvents>(new CallEvents(e), [pool](const CallEvents* p) {
      if (auto owner = pool.lock()) {
        owner->Give(*p);
      } else {
        Destroy(*p);
      }
      delete p;
    });
    return OkStatus();
  }

 private:
  void Give(const CallEvents& e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
  }
  static void Destroy(const CallEvents& e) {
    (void)cudaEventDestroy(e.started);
    (void)cudaEventDestroy(e.done);
  }

  std::mutex mu_;
  std::vector<CallEvents> free_;
};

void Generation::NoteFirstUse(int32_t rank, const std::shared_ptr<const CallEvents>& call) const {
  std::lock_guard<std::mutex> lock(use_mu_);
  first_use_.emplace(rank, call);  // the first one stays
}

std::shared_ptr<const CallEvents> Generation::FirstUse(int32_t rank) const {
  std::lock_guard<std::mutex> lock(use_mu_);
  const auto it = first_use_.find(rank);
  return it == first_use_.end() ? nullptr : it->second;
}

RankResources::~RankResources() {
  if (device < 0) return;  // a rank of another process: nothing here
  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return;
  {
    std::lock_guard<std::mutex> lock(last_mu_);
    last_.reset();
  }
  call_events.reset();
  for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
  for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
  if (setup_done != nullptr) (void)cudaEventDestroy(setup_done);
  if (setup != nullptr) (void)cudaStreamDestroy(setup);
  if (connect_done != nullptr) (void)cudaEventDestroy(connect_done);
  if (connect != nullptr) (void)cudaStreamDestroy(connect);
}

void RankResources::SetLast(std::shared_ptr<const CallEvents> events) {
  std::lock_guard<std::mutex> lock(last_mu_);
  last_ = std::move(events);
}

std::shared_ptr<const CallEvents> RankResources::Last() const {
  std::lock_guard<std::mutex> lock(last_mu_);
  return last_;
}

Status RankResources::TakeEvents(const ErrorContext& ctx,
                                 std::shared_ptr<const CallEvents>* events) {
  DeviceGuard guard;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  if (!call_events) call_events = std::make_shared<EventPool>();
  return call_events->Take(ctx, events);
}

Status RankResources::MakeSetup(const ErrorContext& ctx) {
  if (setup != nullptr) return OkStatus();
  DeviceGuard guard;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&setup_done, cudaEventDisableTiming));
  JO_CUDA_CHECK(&ctx, cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking));
  return OkStatus();
}

Status RankResources::MakeConnect(int32_t nranks, const ErrorContext& ctx) {
  if (connect != nullptr) return OkStatus();
  DeviceGuard guard;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CHECK(Alloc(device, static_cast<size_t>(nranks + 1) * sizeof(float), nullptr, ctx,
                 &connect_buffer));
  JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&connect_done, cudaEventDisableTiming));
  JO_CUDA_CHECK(&ctx, cudaStreamCreateWithFlags(&connect, cudaStreamNonBlocking));
  return OkStatus();
}

Status RankResources::Reserve(const Program& p, const ErrorContext& ctx,
                              std::shared_ptr<const CallEvents>* call) {
  DeviceGuard guard;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  int least = 0, greatest = 0;
  JO_CUDA_CHECK(&ctx, cudaDeviceGetStreamPriorityRange(&least, &greatest));
  while (static_cast<int32_t>(streams.size()) < p.num_streams - 1) {
    cudaStream_t s = nullptr;
    // Communication streams run at the highest priority: a transfer should
    // not queue behind the GEMMs it is meant to overlap.
    JO_CUDA_CHECK(&ctx, cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, greatest));
    streams.push_back(s);
  }
  if (!call_events) call_events = std::make_shared<EventPool>();
  JO_CHECK(call_events->Take(ctx, call));
  // Program events, then 1 fork event and one join event per comm stream.
  const size_t need = static_cast<size_t>(p.num_events + p.num_streams);
  while (events.size() < need) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events.push_back(e);
  }
  return OkStatus();
}

bool RankResources::PoolCovers(const PoolNeeds& n) const {
  const std::shared_ptr<const RankPool> pool = Pool();
  return pool->scratch_bytes >= n.scratch && pool->fused_bytes >= n.fused_state &&
         (n.fused_state == 0 || pool->fault_read != nullptr) &&
         static_cast<int32_t>(pool->workspaces.size()) >= n.workspaces &&
         (n.workspaces == 0 || pool->warm_workspace != nullptr) && pool->warm_bytes >= n.warm &&
         (n.connect_ranks == 0 || pool->connect);
}

Status RankResources::GrowPool(const PoolNeeds& n, const ErrorContext& ctx) {
  if (device < 0 || PoolCovers(n)) return OkStatus();
  auto grown = std::make_shared<RankPool>(*Pool());
  const auto allocate = [&](size_t bytes, void** ptr) {
    std::unique_ptr<DeviceAlloc> memory;
    JO_CHECK(Alloc(device, bytes, nullptr, ctx, &memory));
    *ptr = memory->ptr;
    pool_memory_.push_back(std::move(memory));
    return OkStatus();
  };
  // Doubling at least: what is outgrown (kept until teardown) stays below what is in use.
  const auto grow = [&](size_t need, size_t* have, void** ptr) {
    if (need <= *have) return OkStatus();
    const size_t bytes = std::max(need, 2 * *have);
    JO_CHECK(allocate(bytes, ptr));
    *have = bytes;
    return OkStatus();
  };
  JO_CHECK(grow(n.scratch, &grown->scratch_bytes, &grown->scratch));
  JO_CHECK(grow(n.fused_state, &grown->fused_bytes, &grown->fused_state));
  if (n.fused_state > 0 && grown->fault_read == nullptr) {  // the watchdog's read of the record
    DeviceGuard guard;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
    std::unique_ptr<PinnedHost> pinned;
    JO_CHECK(AllocPinned(sizeof(FusedGemmFault), ctx, &pinned));
    grown->fault_read = std::move(pinned);
  }
  JO_CHECK(grow(n.warm, &grown->warm_bytes, &grown->warm));
  if (n.workspaces > 0 && grown->warm_workspace == nullptr)
    JO_CHECK(allocate(kGemmWorkspaceBytes, &grown->warm_workspace));
  while (static_cast<int32_t>(grown->workspaces.size()) < n.workspaces) {
    void* ws = nullptr;
    JO_CHECK(allocate(kGemmWorkspaceBytes, &ws));
    grown->workspaces.push_back(ws);
  }
  if (n.connect_ranks > 0 && !grown->connect) {
    JO_CHECK(MakeConnect(n.connect_ranks, ctx));
    grown->connect = true;
  }
  std::lock_guard<std::mutex> lock(pool_mu_);
  pool_ = std::move(grown);
  return OkStatus();
}

std::shared_ptr<const RankPool> RankResources::Pool() const {
  std::lock_guard<std::mutex> lock(pool_mu_);
  return pool_;
}

Status AllocLocalBuffers(CliqueState& s, Generation* gen, bool with_workspace,
                         const ErrorContext& ctx) {
  for (size_t r = 0; r < s.devices.size(); ++r) {
    RankResources& res = *s.ranks[r];
    if (res.device < 0) {  // another process's rank: its buffers are there
      gen->flags.push_back(nullptr);
      gen->flag_reads.push_back(nullptr);
      if (with_workspace) gen->workspace.push_back(nullptr);
      continue;
    }
    JO_ASSERT(res.setup != nullptr);  // made before the clique's lock is released (MakeSetup)
    JO_CUDA_CHECK(&ctx, cudaSetDevice(res.device));
    std::unique_ptr<DeviceAlloc> flags;
    if (gen->num_flags > 0)
      JO_CHECK(AllocShared(s, static_cast<int32_t>(r),
                           static_cast<size_t>(gen->halves * gen->num_flags) * sizeof(uint32_t),
                           ctx, &flags));
    gen->flags.push_back(std::move(flags));
    std::unique_ptr<PinnedHost> read;
    if (gen->num_flags > 0)
      JO_CHECK(AllocPinned(static_cast<size_t>(gen->halves * gen->num_flags) * sizeof(uint32_t),
                           ctx, &read));
    gen->flag_reads.push_back(std::move(read));
    if (with_workspace) {
      std::unique_ptr<DeviceAlloc> ws;
      JO_CHECK(AllocShared(s, static_cast<int32_t>(r),
                           static_cast<size_t>(gen->halves * gen->workspace_bytes), ctx, &ws));
      gen->workspace.push_back(std::move(ws));
    }
  }
  return OkStatus();
}

Status AwaitSetup(CliqueState& s, const ErrorContext& ctx) {
  DeviceGuard guard;
  for (const auto& res : s.ranks) {
    if (res->device < 0) continue;
    JO_CUDA_CHECK(&ctx, cudaSetDevice(res->device));
    JO_CUDA_CHECK(&ctx, cudaEventRecord(res->setup_done, res->setup));
  }
  const auto deadline = std::chrono::steady_clock::now() + s.timeout;
  for (const auto& res : s.ranks) {
    if (res->device < 0) continue;
    for (;;) {
      const cudaError_t q = cudaEventQuery(res->setup_done);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) return CudaFailure(q, "cudaEventQuery (buffer set-up)", &ctx);
      if (std::chrono::steady_clock::now() >= deadline)
        return Status(Code::kTimeout,
                      ctx.Describe() + ": zero-filling new buffers on GPU " +
                          std::to_string(res->device) +
                          " did not complete within JAXOVERLAP_TIMEOUT_S: earlier work on that "
                          "GPU is stuck (a peer did not arrive)");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return OkStatus();
}

}  // namespace jo::cuda
