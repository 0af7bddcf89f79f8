#include "cuda/clique/clique_state.h"

#include <algorithm>
#include <thread>

#include "cuda/fused/fused_gemm.h"
#include "cuda/transport/peer_handles.h"

namespace jo::cuda {

std::byte* Generation::Workspace(int32_t rank, int64_t epoch, int32_t viewer) const {
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
  // Retired scratch the GPU is done with: freed here, at set-up (cudaFree waits for the device's
  // earlier work, which needs only the peers' earlier calls: docs/gpu-internals.md §1).
  for (auto it = retired_scratch.begin(); it != retired_scratch.end();) {
    const cudaError_t q = it->last_user ? cudaEventQuery(it->last_user->done) : cudaSuccess;
    if (q == cudaSuccess) {
      it = retired_scratch.erase(it);
      continue;
    }
    if (q != cudaErrorNotReady) (void)cudaGetLastError();
    ++it;
  }
  // An outgrown buffer may still be used by queued work (this rank's calls so far): retired,
  // with the last of those calls.
  const auto retire = [&](std::unique_ptr<DeviceAlloc> old) {
    retired_scratch.push_back({std::move(old), Last()});
  };
  const size_t scratch_bytes = static_cast<size_t>(ScratchBytes(p));  // elements, then scales
  if (scratch_bytes > 0 && (!scratch || scratch->bytes < scratch_bytes)) {
    if (scratch) retire(std::move(scratch));
    JO_CHECK(Alloc(device, scratch_bytes, nullptr, ctx, &scratch));
  }
  size_t fused_bytes = 0;
  for (const Op& op : p.ops)
    if (op.kind == OpKind::kFusedGemm)
      fused_bytes = std::max(fused_bytes, FusedStateBytes(op.fused.rows.count()));
  if (fused_bytes > 0 && (!fused_state || fused_state->bytes < fused_bytes)) {
    if (fused_state) retire(std::move(fused_state));
    JO_CHECK(Alloc(device, fused_bytes, nullptr, ctx, &fused_state));
  }
  return OkStatus();
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
                           static_cast<size_t>(2 * gen->num_flags) * sizeof(uint32_t), ctx,
                           &flags));
    gen->flags.push_back(std::move(flags));
    std::unique_ptr<PinnedHost> read;
    if (gen->num_flags > 0)
      JO_CHECK(AllocPinned(static_cast<size_t>(2 * gen->num_flags) * sizeof(uint32_t), ctx, &read));
    gen->flag_reads.push_back(std::move(read));
    if (with_workspace) {
      std::unique_ptr<DeviceAlloc> ws;
      JO_CHECK(AllocShared(s, static_cast<int32_t>(r),
                           static_cast<size_t>(2 * gen->workspace_bytes), ctx, &ws));
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
