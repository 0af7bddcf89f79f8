#include "cuda/transport/nccl_comms.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "core/log.h"
#include "cuda/base/device_memory.h"

namespace jo::cuda {

std::mutex& DeviceNcclLock(int device) {
  static auto* mu = new std::mutex;  // never destroyed: handlers may run at exit
  static auto* locks = new std::map<int, std::unique_ptr<std::mutex>>;
  std::lock_guard<std::mutex> lock(*mu);
  auto& slot = (*locks)[device];
  if (!slot) slot = std::make_unique<std::mutex>();
  return *slot;
}

namespace {

// Holds the NCCL locks of several devices (ascending order: no lock-order cycles).
class DeviceLocks {
 public:
  explicit DeviceLocks(std::vector<int> devices) {
    std::sort(devices.begin(), devices.end());
    devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
    for (int d : devices)
      if (d >= 0) held_.emplace_back(DeviceNcclLock(d));
  }

 private:
  std::vector<std::unique_lock<std::mutex>> held_;
};

// Polls every communicator of `comms` until it reports success (AwaitNccl).
Status AwaitAll(const std::vector<ncclComm_t>& comms,
                std::chrono::steady_clock::time_point deadline, const char* what,
                const ErrorContext& ctx) {
  for (ncclComm_t c : comms)
    if (c != nullptr) JO_CHECK(AwaitNccl(c, deadline, what, &ctx));
  return OkStatus();
}

}  // namespace

NcclComms::~NcclComms() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t r = 0; r < comms_.size(); ++r) AbortRankLocked(r);
  }
  (void)AwaitAborts(std::chrono::steady_clock::now() + timeout_);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& task : aborts_) {
    if (task->done) {
      task->thread.join();
    } else {  // never waited for without a bound: left behind, with its task
      JO_WARN("ncclCommAbort of rank " + std::to_string(task->rank) + " on GPU " +
              std::to_string(task->device) +
              " did not return within JAXOVERLAP_TIMEOUT_S; left running");
      task->thread.detach();
    }
  }
}

void NcclComms::StartAbortLocked(ncclComm_t comm, int32_t rank, int device) {
  auto task = std::make_shared<AbortTask>();
  task->comm = comm;
  task->rank = rank;
  task->device = device;
  task->started = std::chrono::steady_clock::now();
  task->thread = std::thread([task] {
    (void)ncclCommAbort(task->comm);  // frees the communicator; may wait for the device
    task->done = true;
  });
  aborts_.push_back(std::move(task));
}

bool NcclComms::AwaitAborts(std::chrono::steady_clock::time_point deadline) const {
  std::vector<std::shared_ptr<AbortTask>> aborts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    aborts = aborts_;
  }
  for (const auto& task : aborts)
    while (!task->done) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  return true;
}

std::string NcclComms::AbortsOlderThan(std::chrono::steady_clock::duration age) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  const auto now = std::chrono::steady_clock::now();
  for (const auto& task : aborts_)
    if (!task->done && now - task->started > age)
      out += std::string(out.empty() ? "" : ", ") + "rank " + std::to_string(task->rank) +
             " on GPU " + std::to_string(task->device);
  return out;
}

std::string NcclComms::StuckAborts() const {
  const std::string stuck = AbortsOlderThan(timeout_);
  return stuck.empty() ? stuck : "ncclCommAbort stuck for " + stuck;
}

std::string NcclComms::RunningAborts() const {
  return AbortsOlderThan(std::chrono::steady_clock::duration::min());
}

bool NcclComms::created() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !comms_.empty();
}

Status NcclComms::Create(const std::vector<int>& devices, const ncclUniqueId& id,
                         std::chrono::steady_clock::time_point deadline, const char* joining,
                         const ErrorContext& ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!comms_.empty()) return OkStatus();
  DeviceGuard guard;
  const size_t n = devices.size();
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclComm_t> base(n, nullptr), split(n, nullptr);
  auto abort_all = [&] {
    for (size_t r = 0; r < n; ++r)
      for (ncclComm_t c : {split[r], base[r]})
        if (c != nullptr) StartAbortLocked(c, static_cast<int32_t>(r), devices[r]);
  };
  // One ncclCommInitRankConfig per local rank, in one group (NCCL requires
  // the group when one thread initialises several ranks).
  Status status = OkStatus();
  {
    DeviceLocks locks(devices);
    JO_NCCL_CHECK(&ctx, ncclGroupStart());
    for (size_t r = 0; r < n && status.ok(); ++r) {
      if (devices[r] < 0) continue;
      const cudaError_t set = cudaSetDevice(devices[r]);
      if (set != cudaSuccess) {
        status = CudaFailure(set, "cudaSetDevice", &ctx);
        break;
      }
      const ncclResult_t code =
          ncclCommInitRankConfig(&base[r], static_cast<int>(n), id, static_cast<int>(r), &config);
      if (code != ncclSuccess && code != ncclInProgress)
        status = NcclFailure(code, "ncclCommInitRankConfig", &ctx);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (status.ok() && end != ncclSuccess && end != ncclInProgress)
      status = NcclFailure(end, "ncclGroupEnd", &ctx);
  }
  if (status.ok()) status = AwaitAll(base, deadline, joining, ctx);
  // The second direction's communicator: a split of the first (a collective
  // of the parent: every rank of every process does it, in one group here).
  if (status.ok()) {
    DeviceLocks locks(devices);
    JO_NCCL_CHECK(&ctx, ncclGroupStart());
    for (size_t r = 0; r < n && status.ok(); ++r) {
      if (base[r] == nullptr) continue;
      (void)cudaSetDevice(devices[r]);
      const ncclResult_t code =
          ncclCommSplit(base[r], /*color=*/0, /*key=*/static_cast<int>(r), &split[r], &config);
      if (code != ncclSuccess && code != ncclInProgress)
        status = NcclFailure(code, "ncclCommSplit", &ctx);
    }
    const ncclResult_t end = ncclGroupEnd();
    if (status.ok() && end != ncclSuccess && end != ncclInProgress)
      status = NcclFailure(end, "ncclGroupEnd (split)", &ctx);
  }
  if (status.ok())
    status = AwaitAll(split, deadline, "ncclCommSplit (one communicator per ring direction)", ctx);
  if (!status.ok()) {
    abort_all();
    return status;
  }
  devices_ = devices;
  comms_.assign(n, std::vector<ncclComm_t>(kChannels, nullptr));
  for (size_t r = 0; r < n; ++r) {
    comms_[r][0] = base[r];
    comms_[r][1] = split[r];
  }
  leases_.assign(n, 0);
  connected_.assign(n, Peers());
  return OkStatus();
}

Status NcclComms::Connect(int32_t rank, const Peers& peers, cudaStream_t stream, cudaEvent_t done,
                          float* send, float* recv, std::chrono::steady_clock::time_point deadline,
                          const std::function<Status()>& check, const ErrorContext& ctx,
                          bool* in_flight) {
  *in_flight = false;
  // The peers not connected yet, per channel (only this rank's thread connects its rank).
  Peers fresh;
  bool any = false;
  int device = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (rank < 0 || static_cast<size_t>(rank) >= connected_.size())
      return Internal(ctx.Describe() + ": no NCCL communicator for rank " + std::to_string(rank));
    const Peers& had = connected_[static_cast<size_t>(rank)];
    for (int c = 0; c < kChannels; ++c) {
      for (int32_t p : peers.sends[c])
        if (had.sends[c].count(p) == 0) fresh.sends[c].insert(p);
      for (int32_t p : peers.recvs[c])
        if (had.recvs[c].count(p) == 0) fresh.recvs[c].insert(p);
      any = any || !fresh.sends[c].empty() || !fresh.recvs[c].empty();
    }
    device = devices_[static_cast<size_t>(rank)];
  }
  if (!any) return OkStatus();
  Lease lease;  // the communicators stay alive while we use them (held only while connecting)
  const Status leased = Acquire(rank, ctx, &lease);
  if (!leased.ok()) {
    JO_CHECK(check());  // aborted because the clique broke: its failure says why
    return leased;
  }
  const std::vector<ncclComm_t> comms = lease.ForStreams(kChannels + 1);
  DeviceGuard guard;
  JO_CUDA_CHECK(&ctx, cudaSetDevice(device));
  const char* what = "NCCL's connection to the peers of a new call (set-up)";
  for (int c = 0; c < kChannels; ++c) {
    if (fresh.sends[c].empty() && fresh.recvs[c].empty()) continue;
    const ncclComm_t comm = comms[static_cast<size_t>(c + 1)];
    Status status;
    ncclResult_t closed = ncclSuccess;
    {
      std::lock_guard<std::mutex> device_lock(DeviceNcclLock(device));
      JO_NCCL_CHECK(&ctx, ncclGroupStart());
      auto op = [&](ncclResult_t code, const char* call) {
        if (status.ok() && code != ncclSuccess && code != ncclInProgress)
          status = NcclFailure(code, call, &ctx);
      };
      for (int32_t p : fresh.sends[c])
        op(ncclSend(send, 1, ncclFloat32, p, comm, stream), "ncclSend (connecting)");
      for (int32_t p : fresh.recvs[c])
        op(ncclRecv(recv + p, 1, ncclFloat32, p, comm, stream), "ncclRecv (connecting)");
      closed = ncclGroupEnd();  // always closed, even after a failure inside
    }
    JO_CHECK(status);
    JO_NCCL_CHECK_ASYNC(&ctx, closed);
    // Polled: NCCL's connection (non-blocking communicator), then the group on the GPU. From
    // here the group may be on the GPU: on any way out but its completion it is left in flight,
    // with `done` recorded after it (best effort) for the caller to await once it aborted.
    *in_flight = true;
    bool connected = closed == ncclSuccess, recorded = false;
    const Status polled = [&]() -> Status {
      for (;;) {
        JO_CHECK(check());
        if (!connected) {
          ncclResult_t state = ncclSuccess;
          JO_NCCL_CHECK(&ctx, ncclCommGetAsyncError(comm, &state));
          if (state != ncclSuccess && state != ncclInProgress)
            return NcclFailure(state, what, &ctx);
          connected = state == ncclSuccess;
        }
        if (connected && !recorded) {
          JO_CUDA_CHECK(&ctx, cudaEventRecord(done, stream));
          recorded = true;
        }
        if (recorded) {
          const cudaError_t q = cudaEventQuery(done);
          if (q == cudaSuccess) return OkStatus();
          if (q != cudaErrorNotReady)
            return CudaFailure(q, "cudaEventQuery (NCCL connection)", &ctx);
        }
        if (std::chrono::steady_clock::now() >= deadline)
          return Status(Code::kTimeout, ctx.Describe() + ": " + what +
                                            " did not complete within JAXOVERLAP_TIMEOUT_S: a "
                                            "peer rank did not take part (it failed, exited, or "
                                            "runs different calls)");
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }();
    if (!polled.ok()) {
      if (!recorded) (void)cudaEventRecord(done, stream);
      return polled;
    }
    *in_flight = false;
    std::lock_guard<std::mutex> lock(mu_);
    Peers& had = connected_[static_cast<size_t>(rank)];
    had.sends[c].insert(fresh.sends[c].begin(), fresh.sends[c].end());
    had.recvs[c].insert(fresh.recvs[c].begin(), fresh.recvs[c].end());
  }
  return OkStatus();
}

NcclComms::Lease& NcclComms::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Drop();
    owner_ = other.owner_;
    rank_ = other.rank_;
    other.owner_ = nullptr;
    other.rank_ = -1;
  }
  return *this;
}

std::vector<ncclComm_t> NcclComms::Lease::ForStreams(int32_t num_streams) const {
  std::vector<ncclComm_t> out(static_cast<size_t>(std::max(num_streams, 0)), nullptr);
  if (owner_ == nullptr) return out;
  std::lock_guard<std::mutex> lock(owner_->mu_);
  const auto& mine = owner_->comms_[static_cast<size_t>(rank_)];
  for (int32_t s = 1; s < num_streams && s <= kChannels; ++s)
    out[static_cast<size_t>(s)] = mine[static_cast<size_t>(s - 1)];
  return out;
}

void NcclComms::Lease::Drop() {
  if (owner_ != nullptr) owner_->Release(rank_);
  owner_ = nullptr;
  rank_ = -1;
}

Status NcclComms::Acquire(int32_t rank, const ErrorContext& ctx, Lease* out) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborting_)
    return Status(Code::kAborted, ctx.Describe() +
                                      ": the clique's NCCL communicators were aborted (an earlier "
                                      "failure or timeout)");
  if (rank < 0 || static_cast<size_t>(rank) >= comms_.size() ||
      comms_[static_cast<size_t>(rank)][0] == nullptr)
    return Internal(ctx.Describe() + ": no NCCL communicator for rank " + std::to_string(rank));
  ++leases_[static_cast<size_t>(rank)];
  out->Drop();
  out->owner_ = this;
  out->rank_ = rank;
  return OkStatus();
}

void NcclComms::Release(int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t r = static_cast<size_t>(rank);
  if (--leases_[r] == 0 && aborting_) AbortRankLocked(r);  // deferred by this lease
}

void NcclComms::Abort() {
  std::lock_guard<std::mutex> lock(mu_);
  aborting_ = true;
  for (size_t r = 0; r < comms_.size(); ++r)
    if (leases_[r] == 0) AbortRankLocked(r);
}

void NcclComms::AbortRankLocked(size_t rank) {
  if (rank >= comms_.size()) return;
  for (ncclComm_t& c : comms_[rank]) {
    if (c != nullptr) StartAbortLocked(c, static_cast<int32_t>(rank), devices_[rank]);
    c = nullptr;  // freed by the abort
  }
}

void NcclComms::Finalize(std::chrono::steady_clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t r = 0; r < comms_.size(); ++r) {
    std::vector<ncclComm_t>& mine = comms_[r];
    bool finalized = true;
    {
      std::lock_guard<std::mutex> device(DeviceNcclLock(devices_[r]));
      for (ncclComm_t c : mine) {
        if (c == nullptr) continue;
        const ncclResult_t code = ncclCommFinalize(c);
        finalized = finalized && (code == ncclSuccess || code == ncclInProgress);
      }
    }
    // Poll (NCCL API: a non-blocking communicator under finalization reports
    // ncclInProgress until its operations are flushed).
    for (ncclComm_t c : mine)
      if (c != nullptr && finalized)
        finalized = AwaitNccl(c, deadline, "ncclCommFinalize", nullptr).ok();
    if (!finalized) {
      AbortRankLocked(r);
      continue;
    }
    // Without the device's NCCL lock, as an abort: ncclCommDestroy frees the communicator's
    // device memory, which may wait for the device (NCCL issue #549), and other cliques'
    // handlers take that lock between their first enqueue and their return.
    for (ncclComm_t& c : mine) {
      if (c != nullptr) (void)ncclCommDestroy(c);
      c = nullptr;
    }
  }
}

}  // namespace jo::cuda
