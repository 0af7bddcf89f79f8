#include "cuda/clique_state.h"

#include <thread>

#include "cuda/peer_handles.h"

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

RankResources::~RankResources() {
  if (device < 0) return;  // a rank of another process: nothing here
  DeviceGuard guard;
  if (cudaSetDevice(device) != cudaSuccess) return;
  for (cudaEvent_t e : events) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : done) (void)cudaEventDestroy(e);
  for (cudaEvent_t e : started) (void)cudaEventDestroy(e);
  for (cudaStream_t s : streams) (void)cudaStreamDestroy(s);
  if (setup_done != nullptr) (void)cudaEventDestroy(setup_done);
  if (setup != nullptr) (void)cudaStreamDestroy(setup);
}

Status RankResources::MakeSetup(const ErrorContext& ctx) {
  if (setup != nullptr) return OkStatus();
  DeviceGuard guard;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&setup_done, cudaEventDisableTiming));
  JO_CUDA_CHECK(&ctx, cudaStreamCreateWithFlags(&setup, cudaStreamNonBlocking));
  return OkStatus();
}

Status RankResources::Reserve(const Program& p, const ErrorContext& ctx) {
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
  while (static_cast<int64_t>(started.size()) < kDoneSlots) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    started.push_back(e);
  }
  while (static_cast<int64_t>(done.size()) < kDoneSlots) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    done.push_back(e);
  }
  // Program events, then 1 fork event and one join event per comm stream.
  const size_t need = static_cast<size_t>(p.num_events + p.num_streams);
  while (events.size() < need) {
    cudaEvent_t e = nullptr;
    JO_CUDA_CHECK(&ctx, cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events.push_back(e);
  }
  const size_t scratch_bytes = static_cast<size_t>(ScratchBytes(p));  // elements, then scales
  if (scratch_bytes > 0 && (!scratch || scratch->bytes < scratch_bytes)) {
    // The old scratch may still be read by queued work: retire, do not free.
    if (scratch) retired_scratch.push_back(std::move(scratch));
    JO_CHECK(Alloc(device, scratch_bytes, nullptr, ctx, &scratch));
  }
  return OkStatus();
}

Status AllocLocalBuffers(CliqueState& s, Generation* gen, bool with_workspace,
                         const ErrorContext& ctx) {
  for (size_t r = 0; r < s.devices.size(); ++r) {
    RankResources& res = *s.ranks[r];
    if (res.device < 0) {  // another process's rank: its buffers are there
      gen->flags.push_back(nullptr);
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
