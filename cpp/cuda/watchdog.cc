#include "cuda/watchdog.h"

#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "core/log.h"
#include "cuda/driver.h"

namespace jo::cuda {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(20);

struct Entry {
  std::deque<WatchedCall> calls;  // pending, oldest first
  Clock::time_point front_since;  // when calls.front() became the oldest pending call
};

class Watchdog {
 public:
  void Add(WatchedCall call) {
    std::lock_guard<std::mutex> lock(mu_);
    const Key key{call.clique.lock().get(), call.rank};
    Entry& e = entries_[key];
    if (e.calls.empty()) e.front_since = Clock::now();
    e.calls.push_back(std::move(call));
    // A done event is reused every `slots` epochs: stop watching calls whose
    // event a newer call has re-recorded (the host ran that far ahead).
    while (static_cast<int64_t>(e.calls.size()) > e.calls.back().slots - 1) {
      e.calls.pop_front();
      e.front_since = Clock::now();
    }
    if (!thread_started_) {
      thread_started_ = true;
      std::thread([this] { Loop(); }).detach();  // lives for the process; idle when nothing pends
    }
    cv_.notify_all();
  }

  int Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(entries_.size());
  }

 private:
  using Key = std::pair<const void*, int32_t>;

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return !entries_.empty(); });
      for (auto it = entries_.begin(); it != entries_.end();) {
        Entry& e = it->second;
        std::shared_ptr<CudaClique> clique =
            e.calls.empty() ? nullptr : e.calls.front().clique.lock();
        if (!clique) {  // nothing pending, or the clique is gone (tests reset them)
          it = entries_.erase(it);
          continue;
        }
        const WatchedCall& front = e.calls.front();
        int prev = 0;
        (void)cudaGetDevice(&prev);
        (void)cudaSetDevice(front.device);
        const cudaError_t q = cudaEventQuery(front.done);
        (void)cudaSetDevice(prev);
        if (q == cudaSuccess) {
          e.calls.pop_front();
          e.front_since = Clock::now();
          continue;  // look at the next one (or erase the entry) on this same pass
        }
        if (q != cudaErrorNotReady) {
          (void)cudaGetLastError();  // e.g. the runtime is shutting down: stop watching
          it = entries_.erase(it);
          continue;
        }
        if (Clock::now() - e.front_since > front.timeout) {
          const WatchedCall late = front;
          const int64_t latest_epoch = e.calls.back().epoch;
          it = entries_.erase(it);
          lock.unlock();
          Fire(clique.get(), late, latest_epoch);
          lock.lock();
          it = entries_.begin();  // the map may have changed meanwhile
          continue;
        }
        ++it;
      }
      cv_.wait_for(lock, kPoll);
    }
  }

  // Report, break, release (see the header). Best effort: every step goes on
  // even if an earlier one failed, and failures are added to the report.
  static void Fire(CudaClique* clique, const WatchedCall& c, int64_t latest_epoch) {
    char seconds[32];
    std::snprintf(seconds, sizeof(seconds), "%.1f",
                  std::chrono::duration<double>(c.timeout).count());
    std::string text = c.op + " rank " + std::to_string(c.rank) + " (" + clique->name() +
                       ") epoch " + std::to_string(c.epoch) + ": not finished on GPU " +
                       std::to_string(c.device) + " after " + seconds + " s; ";
    int prev = 0;
    (void)cudaGetDevice(&prev);
    (void)cudaSetDevice(c.device);
    cudaStream_t side = nullptr;
    std::vector<uint32_t> flags;
    if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess &&
        c.gen != nullptr && c.gen->num_flags > 0) {
      flags.assign(static_cast<size_t>(2 * c.gen->num_flags), 0);
      const void* base = reinterpret_cast<const void*>(c.gen->Flag(c.rank, 0, 0, c.rank));
      if (cudaMemcpyAsync(flags.data(), base, flags.size() * sizeof(uint32_t),
                          cudaMemcpyDeviceToHost, side) != cudaSuccess ||
          cudaStreamSynchronize(side) != cudaSuccess)
        flags.clear();
    }
    std::string missing;
    for (const auto& [id, writer] : c.waits) {
      const size_t index = static_cast<size_t>((c.epoch % 2) * c.gen->num_flags + id);
      if (index < flags.size() &&
          static_cast<int32_t>(flags[index] - static_cast<uint32_t>(c.epoch)) >= 0)
        continue;
      const size_t w = static_cast<size_t>(writer);
      const bool elsewhere = clique->devices()[w] < 0;  // a rank of another process
      missing += (missing.empty() ? "" : ", ") + std::string("flag ") + std::to_string(id) +
                 " from rank " + std::to_string(writer) +
                 (elsewhere ? " (process " + std::to_string(clique->processes()[w]) + ")" : "") +
                 (index < flags.size() ? " (is " + std::to_string(flags[index]) + ")" : "");
    }
    if (!missing.empty()) text += "waiting for " + missing + "; ";
    if (c.nccl) text += "waiting inside NCCL (a peer did not make the matching send/recv); ";
    text +=
        "the peer did not arrive (ranks disagree on the calls, or a peer failed). "
        "This call's results are invalid; the clique is broken.";
    JO_WARN(text);
    clique->Break(Status(Code::kTimeout, text));
    // Release the GPU so that the process does not hang.
    const DriverApi* drv = nullptr;
    if (side != nullptr && c.gen != nullptr && c.gen->num_flags > 0 && LoadDriver(&drv).ok()) {
      for (int32_t i = 0; i < 2 * c.gen->num_flags; ++i)
        (void)drv->cuStreamWriteValue32(
            reinterpret_cast<CUstream>(side),
            c.gen->Flag(c.rank, i / c.gen->num_flags, i % c.gen->num_flags, c.rank),
            static_cast<cuuint32_t>(latest_epoch), CU_STREAM_WRITE_VALUE_DEFAULT);
    }
    if (c.nccl) clique->AbortComms();
    if (side != nullptr) (void)cudaStreamDestroy(side);
    (void)cudaSetDevice(prev);
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Entry> entries_;
  bool thread_started_ = false;
};

Watchdog& Instance() {
  static auto* watchdog = new Watchdog();  // never destroyed: its thread is detached
  return *watchdog;
}

}  // namespace

void Watch(WatchedCall call) { Instance().Add(std::move(call)); }

int PendingWatches() { return Instance().Pending(); }

}  // namespace jo::cuda
