#include "cuda/cuda_clique.h"

#include <algorithm>
#include <string>

#include "core/log.h"
#include "cuda/transports.h"

namespace jo::cuda {

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

CudaClique::~CudaClique() {
  // Work still queued may use these buffers; wait for it (best effort).
  for (int device : state_.devices) {
    if (device >= 0 && cudaSetDevice(device) == cudaSuccess) (void)cudaDeviceSynchronize();
  }
  for (ncclComm_t comm : state_.comms)
    if (comm != nullptr) (void)ncclCommDestroy(comm);
}

Status CudaClique::NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                                 const ErrorContext& ctx) {
  DeviceGuard guard;
  auto gen = std::make_unique<Generation>();
  gen->since_epoch = epoch;
  gen->workspace_bytes = RoundUp(static_cast<size_t>(workspace_bytes), 256);  // halves aligned
  gen->num_flags = num_flags;
  JO_CHECK(OpsOf(state_.transport).alloc_buffers(state_, gen.get(), ctx));
  JO_INFO(ctx.Describe() + ": new buffers from epoch " + std::to_string(epoch) +
          ": workspace 2 x " + std::to_string(gen->workspace_bytes) + " bytes, " +
          std::to_string(num_flags) + " flags per rank");
  generations_.push_back(std::move(gen));
  return OkStatus();
}

void CudaClique::AbortComms() {
  std::lock_guard<std::mutex> lock(mu_);
  for (ncclComm_t& comm : state_.comms) {
    if (comm != nullptr) (void)ncclCommAbort(comm);  // frees the communicator
    comm = nullptr;
  }
}

Status CudaClique::Reserve(const Program& program, const CallNeeds& needs, int64_t epoch,
                           const ErrorContext& ctx, const Generation** gen,
                           RankResources** resources, ncclComm_t* comm) {
  std::lock_guard<std::mutex> lock(mu_);
  // Broken before the lock is released: a rank next in line must not start a set-up (an
  // exchange with the peers) that the failing one will never join.
  Status status = ReserveLocked(program, needs, epoch, ctx, gen, resources, comm);
  if (!status.ok() && status.code() != Code::kAborted) Break(status);
  return status;
}

Status CudaClique::ReserveLocked(const Program& program, const CallNeeds& needs, int64_t epoch,
                                 const ErrorContext& ctx, const Generation** gen,
                                 RankResources** resources, ncclComm_t* comm) {
  const int32_t rank = program.problem.rank;
  const int64_t ws_bytes = needs.workspace_bytes;
  JO_CHECK(CheckNotBroken(ctx.Describe()));
  if (!connected_) {
    JO_CHECK(OpsOf(state_.transport).connect(state_, ctx));
    connected_ = true;
  }
  // The newest generation valid at this epoch (see the header).
  const Generation* use = nullptr;
  for (auto it = generations_.rbegin(); it != generations_.rend(); ++it)
    if ((*it)->since_epoch <= epoch) {
      use = it->get();
      break;
    }
  if (use == nullptr || use->workspace_bytes < ws_bytes || use->num_flags < needs.num_flags) {
    if (!generations_.empty() && generations_.back()->since_epoch > epoch)
      return Internal(ctx.Describe() + ": epoch " + std::to_string(epoch) +
                      " needs more workspace than a later epoch already set up: ranks disagree "
                      "on the call sequence");
    const int64_t grow_ws = std::max<int64_t>(ws_bytes, use ? use->workspace_bytes : 0);
    const int32_t grow_flags = std::max<int32_t>(needs.num_flags, use ? use->num_flags : 0);
    JO_CHECK(NewGeneration(epoch, grow_ws, grow_flags, ctx));
    use = generations_.back().get();
  }
  JO_CHECK(state_.ranks[rank]->Reserve(program, ctx));
  *gen = use;
  *resources = state_.ranks[rank].get();
  *comm = state_.comms.empty() ? nullptr : state_.comms[rank];
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
  if (!generations_.empty())
    out += ", workspace 2 x " + std::to_string(generations_.back()->workspace_bytes) +
           " bytes per rank (" + std::to_string(generations_.size()) + " generation(s))";
  return out;
}

}  // namespace jo::cuda
