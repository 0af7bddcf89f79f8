#include "cuda/watchdog.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/log.h"
#include "cuda/base/device_memory.h"
#include "cuda/base/driver.h"
#include "cuda/kernels/allreduce_body.h"

namespace jo::cuda {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kPoll = std::chrono::milliseconds(20);
constexpr auto kFlagRead = std::chrono::milliseconds(500);  // bound on reading the flags

// A clique to break, found under the lock, broken after it.
struct Breaking {
  std::shared_ptr<CudaClique> clique;
  std::string text;
};

// "12.0": a timeout as the messages give it, in seconds.
std::string Seconds(std::chrono::milliseconds timeout) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", std::chrono::duration<double>(timeout).count());
  return text;
}

// A fault record a kernel writes in page-locked host memory (its fields, a system fence, then
// its word `ready`: flag_wait_body.h, allreduce_body.h, fused_gemm_sync.cuh), read while the
// kernel may still write it: false while that word is 0, else its `n` words. Atomic loads,
// `ready`'s with acquire, so that the fields read are the ones written before it (C++: an
// acquire load that reads a value stored after a release fence synchronizes with it; the GPU's
// side is a fence then a strong store, PTX ISA "Release and Acquire Patterns"; 4-byte aligned
// accesses to host memory from the device are single accesses for the host, CUDA programming
// guide).
bool ReadRecord(const void* record, uint32_t* words, int n, int ready = 0) {
  const auto* at = static_cast<const uint32_t*>(record);
  words[ready] = __atomic_load_n(&at[ready], __ATOMIC_ACQUIRE);
  if (words[ready] == 0) return false;
  for (int i = 0; i < n; ++i)
    if (i != ready) words[i] = __atomic_load_n(&at[i], __ATOMIC_RELAXED);
  return true;
}

// "rank 3", or "rank 3 (process 1)" for a rank of another process.
std::string RankName(const CudaClique& clique, size_t rank) {
  const bool elsewhere = rank < clique.devices().size() && clique.devices()[rank] < 0;
  return "rank " + std::to_string(rank) +
         (elsewhere ? " (process " + std::to_string(clique.processes()[rank]) + ")" : "");
}

struct Entry {
  std::deque<WatchedCall> calls;  // pending, oldest first
  bool front_started = false;     // calls.front()'s `started` event was seen complete ...
  Clock::time_point front_since;  // ... at this time: its clock
};

class Watchdog {
 public:
  void Add(WatchedCall call) {
    std::lock_guard<std::mutex> lock(mu_);
    // Keyed by the clique's control block (owner_before), never by its address: a clique made
    // where a gone one was is another key, and the gone one's calls (their events) are dropped by
    // a pass, not here on an enqueue path.
    Entry& e = entries_[Key{call.clique, call.rank}];
    if (e.calls.empty()) e.front_started = false;
    e.calls.push_back(std::move(call));
    StartThread();
    cv_.notify_all();
  }

  void AddAborts(std::weak_ptr<const NcclComms> comms, std::string clique,
                 std::chrono::milliseconds timeout) {
    std::lock_guard<std::mutex> lock(mu_);
    aborts_.push_back({std::move(comms), std::move(clique), Now() + timeout, timeout});
    StartThread();
    cv_.notify_all();
  }

  void AddArea(std::weak_ptr<CudaClique> clique, std::weak_ptr<const KernelArea> area,
               std::chrono::milliseconds timeout) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const WatchedArea& w : areas_)
      if (!w.area.owner_before(area) && !area.owner_before(w.area)) return;
    areas_.push_back({std::move(clique), std::move(area), timeout});
    StartThread();
    cv_.notify_all();
  }

  int Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(entries_.size());
  }

  void SetFireHook(std::function<void()> hook) {
    std::lock_guard<std::mutex> lock(mu_);
    fire_hook_ = std::move(hook);
  }

  void UseVirtualClock() {
    std::lock_guard<std::mutex> lock(mu_);
    virtual_clock_ = true;
  }

  // The passes the thread would make over `by`, one poll interval apart, on this thread.
  void Advance(Clock::duration by) {
    std::unique_lock<std::mutex> lock(mu_);
    const Clock::time_point until = Now() + by;
    while (Now() < until) {
      Sleep(std::min<Clock::duration>(kPoll, until - Now()));
      Pass(lock);
    }
  }

 private:
  struct Key {
    std::weak_ptr<CudaClique> clique;
    int32_t rank = 0;
    bool operator<(const Key& o) const {
      if (clique.owner_before(o.clique)) return true;
      if (o.clique.owner_before(clique)) return false;
      return rank < o.rank;
    }
  };

  Clock::time_point Now() const {
    return virtual_clock_ ? Clock::time_point(Clock::duration(virtual_now_.load())) : Clock::now();
  }

  void Sleep(Clock::duration d) {
    if (virtual_clock_)
      virtual_now_ += d.count();
    else
      std::this_thread::sleep_for(d);
  }

  // Requires mu_.
  void StartThread() {
    if (!virtual_clock_ && !thread_started_) {
      thread_started_ = true;
      std::thread([this] { Loop(); }).detach();  // lives for the process; idle when nothing pends
    }
  }

  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] {
        return !entries_.empty() || !aborts_.empty() || !faults_.empty() || !areas_.empty();
      });
      Pass(lock);
      cv_.wait_for(lock, kPoll);
    }
  }

  // Aborts still running past their deadline: reported once, then no longer watched.
  void PassAborts(std::vector<std::shared_ptr<const void>>* held) {
    for (auto it = aborts_.begin(); it != aborts_.end();) {
      const std::shared_ptr<const NcclComms> comms = it->comms.lock();
      if (comms) held->push_back(comms);  // never the last reference under mu_ (Pass)
      const std::string running = comms ? comms->RunningAborts() : std::string();
      if (running.empty()) {  // all returned (or the clique is gone)
        it = aborts_.erase(it);
        continue;
      }
      if (Now() < it->deadline) {
        ++it;
        continue;
      }
      JO_WARN(it->clique + ": ncclCommAbort of " + running + " has not returned after " +
              Seconds(it->timeout) +
              " s: it frees device memory, which waits for the device's other work (NCCL issue "
              "#549); left running, the clique stays broken (python -m jaxoverlap info names it)");
      it = aborts_.erase(it);
    }
  }

  // The kernel areas' fault records (host memory the kernels write: read, never waited for).
  // Each rank's fault is reported once (a rank that gave up makes its peers give up too: each
  // says why); the area is watched until every rank of this process has reported.
  void PassAreas(std::vector<std::shared_ptr<const void>>* held, std::vector<Breaking>* breaks) {
    for (auto it = areas_.begin(); it != areas_.end();) {
      std::shared_ptr<CudaClique> clique = it->clique.lock();
      std::shared_ptr<const KernelArea> area = it->area.lock();
      if (!clique || !area) {
        it = areas_.erase(it);
        continue;
      }
      held->push_back(clique);
      held->push_back(area);
      it->reported.resize(area->faults.size(), false);
      bool all = true;
      for (size_t r = 0; r < area->faults.size(); ++r) {
        if (area->faults[r] == nullptr || it->reported[r]) continue;
        const int32_t rank = static_cast<int32_t>(r);
        const void* record = area->faults[r]->ptr;
        std::string text;
        if (!area->replay) {
          text = DescribeFault(*clique, rank, record, it->timeout);
        } else {
          text = DescribeWaitFault(*clique, *area, rank, record, it->timeout);
          if (text.empty() && r < area->fused_faults.size() && area->fused_faults[r] != nullptr)
            text = DescribeFusedFault(*clique, area->op, rank, area->fused_faults[r]->ptr,
                                      it->timeout);
        }
        if (text.empty()) {
          all = false;
          continue;
        }
        it->reported[r] = true;
        breaks->push_back({clique, std::move(text)});
      }
      it = all ? areas_.erase(it) : it + 1;
    }
  }

  static std::string DescribeFault(const CudaClique& clique, int32_t rank, const void* record,
                                   std::chrono::milliseconds timeout) {
    uint32_t words[8];
    if (!ReadRecord(record, words, 8)) return "";
    kernel::ar::Fault f{};
    f.code = words[0];
    f.round = words[1], f.block = words[2], f.writer = words[3];
    f.seq = words[4], f.seen = words[5], f.signature = words[6], f.seen_signature = words[7];
    std::string text = "matmul_ar one-launch all-reduce, rank " + std::to_string(rank) + " (" +
                       clique.name() + "), call " + std::to_string(f.seq) +
                       " of the kernel, block " + std::to_string(f.block) + ", round " +
                       std::to_string(f.round) + ": ";
    const std::string who = RankName(clique, f.writer);
    if (f.code == static_cast<uint32_t>(kernel::ar::FaultCode::kDisagree)) {
      text += "ranks disagree: " + who +
              " made a different call at the same point, or split y differently (signature " +
              std::to_string(f.seen_signature) + ", here " + std::to_string(f.signature) + ")";
    } else if (f.code == static_cast<uint32_t>(kernel::ar::FaultCode::kPeerBroken)) {
      text += who + " gave up (its flag says so, at call " + std::to_string(f.seen) +
              "): its data are invalid, so this rank gave up too";
    } else {
      text += "the flag from " + who + " did not reach this call within " + Seconds(timeout) +
              " s (it is at " + std::to_string(f.seen) +
              "): the peer did not arrive (ranks disagree on the calls, or a peer failed)";
    }
    return text +
           ". The kernel gave up; its results and every later one-launch all-reduce's on "
           "this rank are invalid; the clique is broken.";
  }

  // A replayable program's bounded flag wait that gave up (kernels/flag_wait_body.h): "" while
  // the record is empty.
  static std::string DescribeWaitFault(const CudaClique& clique, const KernelArea& area,
                                       int32_t rank, const void* record,
                                       std::chrono::milliseconds timeout) {
    uint32_t words[6];
    if (!ReadRecord(record, words, 6)) return "";
    const uint32_t flag = words[2], writer = words[3], seen = words[4], value = words[5];
    const bool ack = area.acks >= 0 && flag >= static_cast<uint32_t>(area.acks);
    return "replayable " + area.op + ", rank " + std::to_string(rank) + " (" + clique.name() +
           "): its wait for flag " + std::to_string(flag) + " from " + RankName(clique, writer) +
           (ack ? " (its acknowledgement)" : "") + " did not see " + std::to_string(value) +
           " within " + Seconds(timeout) + " s (it is " + std::to_string(seen) +
           "): the peer did not arrive (ranks disagree on the calls, or a peer failed). The wait "
           "gave up and trapped: the GPU's context has a sticky error, so no later work of this "
           "rank runs and every later CUDA call of the process on that GPU fails with it; the "
           "clique is broken.";
  }

  // A replayable program's fused GEMM that gave up waiting and trapped (fused_gemm_sync.cuh,
  // Launch::trap): "" while the record is empty.
  static std::string DescribeFusedFault(const CudaClique& clique, const std::string& op,
                                        int32_t rank, const void* record,
                                        std::chrono::milliseconds timeout) {
    static_assert(sizeof(FusedGemmFault) == 5 * sizeof(uint32_t), "FusedGemmFault's words");
    uint32_t words[5];
    if (!ReadRecord(record, words, 5, /*ready=*/4)) return "";
    const uint32_t block = words[1], seen = words[2], value = words[3];
    return "replayable " + op + ", rank " + std::to_string(rank) + " (" + clique.name() +
           "): its fused GEMM's wait for row block " + std::to_string(block) +
           " did not see its flag reach " + std::to_string(value) + " within " +
           Seconds(2 * timeout + std::chrono::seconds(1)) + " s (it is " + std::to_string(seen) +
           "): the peer that pushes that block did not arrive (ranks disagree on the calls, or "
           "a peer failed). The GEMM gave up and trapped: the GPU's context has a sticky "
           "error, so no later work of this rank runs and every later CUDA call of the process "
           "on that GPU fails with it; the clique is broken.";
  }

  // One look at every rank's oldest pending call: done ones are dropped, late ones fired; at the
  // fault records of fired fused calls now done; and at the aborts started. The calls to look at
  // are taken under mu_ and queried without it (a CUDA query may block, and every handler's Watch
  // takes mu_). The references it takes to cliques and communicators are dropped after mu_ is
  // released: when one is the last (a clique reset meanwhile), its destructor waits for the
  // device and destroys communicators.
  void Pass(std::unique_lock<std::mutex>& lock) {
    std::vector<std::shared_ptr<const void>> held;
    PassAborts(&held);
    std::vector<Breaking> breaks;
    PassAreas(&held, &breaks);
    if (!breaks.empty()) {
      lock.unlock();
      for (const Breaking& b : breaks) {
        JO_WARN(b.text);
        b.clique->Break(Status(Code::kTimeout, b.text));
      }
      lock.lock();
    }
    struct Look {
      Key key;
      WatchedCall call;
      bool started = false;  // its `started` event was seen complete before
      cudaError_t done = cudaErrorNotReady, begun = cudaErrorNotReady;
    };
    // Until no rank's oldest call is found done (each pass drops every call done by now).
    for (bool popped = true; popped;) {
      popped = false;
      std::vector<Look> looks;
      for (auto it = entries_.begin(); it != entries_.end();) {
        Entry& e = it->second;
        std::shared_ptr<CudaClique> clique =
            e.calls.empty() ? nullptr : e.calls.front().clique.lock();
        if (!clique) {  // nothing pending, or the clique is gone (tests reset them)
          it = entries_.erase(it);
          continue;
        }
        held.push_back(std::move(clique));
        looks.push_back({it->first, e.calls.front(), e.front_started});
        ++it;
      }
      lock.unlock();
      for (Look& look : looks) {
        int prev = 0;
        (void)cudaGetDevice(&prev);
        (void)cudaSetDevice(look.call.device);
        look.done = Query(look.call.events->done);
        // The call's clock starts when the GPU got to it (its `started` event).
        look.begun = look.done == cudaErrorNotReady && !look.started
                         ? Query(look.call.events->started)
                         : look.done;
        (void)cudaSetDevice(prev);
      }
      lock.lock();
      for (const Look& look : looks) {
        auto it = entries_.find(look.key);
        // Changed meanwhile (a fire of this pass moved it): looked at again next pass.
        if (it == entries_.end() || it->second.calls.empty() ||
            it->second.calls.front().events != look.call.events)
          continue;
        Entry& e = it->second;
        if (look.done == cudaSuccess) {
          e.calls.pop_front();
          e.front_started = false;
          popped = true;  // look at the next one (or erase the entry) on this same pass
          continue;
        }
        if (look.done != cudaErrorNotReady ||
            (look.begun != cudaSuccess && look.begun != cudaErrorNotReady)) {
          (void)cudaGetLastError();  // e.g. the runtime is shutting down: stop watching
          entries_.erase(it);
          continue;
        }
        if (!e.front_started) {
          if (look.begun == cudaErrorNotReady) continue;  // still queued behind earlier work
          e.front_started = true;
          e.front_since = Now();
        }
        if (Now() - e.front_since <= look.call.timeout) continue;
        std::shared_ptr<CudaClique> clique = look.call.clique.lock();
        if (!clique) continue;
        std::deque<WatchedCall> calls = std::move(e.calls);
        const WatchedCall late = calls.front();
        const int64_t latest_epoch = calls.back().epoch;
        entries_.erase(it);
        lock.unlock();
        const bool fired = Fire(clique.get(), late, latest_epoch);
        lock.lock();
        held.push_back(std::move(clique));
        if (!fired) {  // it finished meanwhile: the rank's later calls are watched on
          calls.pop_front();
          Entry& again = entries_[look.key];
          for (WatchedCall& added : again.calls) calls.push_back(std::move(added));
          again.calls = std::move(calls);
          again.front_started = false;
        }
      }
    }
    PassFaults(lock);
    lock.unlock();
    held.clear();
    lock.lock();
  }

  // A cudaEventQuery (the fake's seam: cuda/fake; on a GPU the query itself).
  static cudaError_t Query(cudaEvent_t event) { return cudaEventQuery(event); }

  // The fault records of fired fused calls, once each call is done (its kernel ended: released
  // by its flags, or by its own bound): a wait that gave up is reported. Requires mu_; looks
  // without it. A call not done when its kernel's bound and then some have passed is dropped
  // (its queue stays blocked: the flags could not be written, nor can the record be read).
  void PassFaults(std::unique_lock<std::mutex>& lock) {
    if (faults_.empty()) return;
    std::vector<Fault> looking;
    looking.swap(faults_);
    lock.unlock();
    std::vector<Fault> again;
    for (Fault& f : looking) {
      std::shared_ptr<CudaClique> clique = f.call.clique.lock();
      if (!clique) continue;
      const DeviceGuard guard;
      (void)cudaSetDevice(f.call.device);
      const cudaError_t done = Query(f.call.events->done);
      if (done == cudaSuccess) {
        const std::string gave_up = ReadFault(clique.get(), f.call);
        if (!gave_up.empty())
          JO_WARN(f.who + ": " + gave_up + "its results are invalid; the clique is broken.");
      } else if (done == cudaErrorNotReady && Now() < f.until) {
        again.push_back(std::move(f));
      } else {
        (void)cudaGetLastError();
      }
    }
    lock.lock();
    for (Fault& f : again) faults_.push_back(std::move(f));
  }

  // Reads `count` bytes of device memory at `src` into the page-locked `host` on a stream of the
  // watchdog's own, awaited at most kFlagRead (that stream may share the blocked hardware queue).
  // True when read. Else `*unreadable` when the memory could not be read (an earlier read into
  // `host` is still queued, or this one did not complete), and `*pending` when this copy was
  // enqueued and did not complete: it may still land, so the caller keeps `host` forever.
  bool ReadBack(const void* src, PinnedHost* host, size_t count, bool* unreadable, bool* pending) {
    *unreadable = *pending = false;
    if (host == nullptr || host->bytes < count) return false;
    if (host->busy.exchange(true)) {  // an earlier read into it is still queued
      *unreadable = true;
      return false;
    }
    cudaStream_t side = nullptr;
    cudaEvent_t read = nullptr;
    bool enqueued =
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess &&
        cudaEventCreateWithFlags(&read, cudaEventDisableTiming) == cudaSuccess &&
        cudaMemcpyAsync(host->ptr, src, count, cudaMemcpyDeviceToHost, side) == cudaSuccess &&
        cudaEventRecord(read, side) == cudaSuccess;
    const auto until = Now() + kFlagRead;
    cudaError_t q = cudaErrorNotReady;
    while (enqueued && (q = Query(read)) == cudaErrorNotReady && Now() < until)
      Sleep(std::chrono::milliseconds(1));
    const bool ok = enqueued && q == cudaSuccess;
    if (ok || !enqueued) host->busy = false;
    if (!ok) (void)cudaGetLastError();
    *unreadable = *pending = enqueued && !ok;
    if (read != nullptr) (void)cudaEventDestroy(read);
    if (side != nullptr) (void)cudaStreamDestroy(side);
    return ok;
  }

  // What the fused GEMM's fault record of `c` says: "" when no wait gave up (or it cannot be
  // read), else the flag it gave up on, from which rank, its value and the epoch it waited for.
  std::string ReadFault(CudaClique* clique, const WatchedCall& c) {
    if (c.fault == nullptr || !c.fault_read) return "";
    bool unreadable = false, pending = false;
    if (!ReadBack(c.fault, c.fault_read.get(), sizeof(FusedGemmFault), &unreadable, &pending)) {
      if (pending) KeepForever(c.fault_read);  // the copy may still land
      return "";
    }
    FusedGemmFault fault;
    std::memcpy(&fault, c.fault_read->ptr, sizeof(fault));
    if (fault.timed_out == 0) return "";
    const int32_t flag = c.fused_wait_flags + static_cast<int32_t>(fault.flag);
    std::string writer;
    for (const auto& [id, w] : c.waits)
      if (id == flag) {
        writer = " from rank " + std::to_string(w);
        if (clique->devices()[static_cast<size_t>(w)] < 0)
          writer +=
              " (process " + std::to_string(clique->processes()[static_cast<size_t>(w)]) + ")";
      }
    return "the fused GEMM gave up waiting for flag " + std::to_string(flag) + writer + " (is " +
           std::to_string(fault.seen) + ", expected epoch " + std::to_string(fault.epoch) +
           ") after its own bound (fused_gemm.h); ";
  }

  // Report, break, release (see the header). Best effort: every step goes on
  // even if an earlier one failed, and failures are added to the report. False when the call
  // turned out to be finished (nothing done).
  bool Fire(CudaClique* clique, const WatchedCall& c, int64_t latest_epoch) {
    // Held while we use it. Pass saw the call unfinished, so its generation was alive then (the
    // clique frees one only after every rank finished a later call); but the call may have
    // finished since, and the clique moved past its generation, so that this reference is the
    // last: it is handed back to the clique (DeferRelease), whose next reservation drops it —
    // never dropped here, where the free would wait for the device on the watchdog's thread.
    std::shared_ptr<const Generation> gen = c.gen.lock();
    struct HandBack {
      CudaClique* clique;
      std::shared_ptr<const Generation>* gen;
      ~HandBack() { clique->DeferRelease(std::move(*gen)); }
    } hand_back{clique, &gen};
    std::function<void()> hook;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hook = fire_hook_;
    }
    if (hook) hook();
    const DeviceGuard guard;  // after hand_back: the device is restored first
    (void)cudaSetDevice(c.device);
    // Finished since the pass looked: not late after all.
    if (Query(c.events->done) == cudaSuccess) return false;
    std::string text = c.op + " rank " + std::to_string(c.rank) + " (" + clique->name() +
                       ") epoch " + std::to_string(c.epoch) + ": not finished on GPU " +
                       std::to_string(c.device) + " after " + Seconds(c.timeout) + " s; ";
    std::vector<uint32_t> flags;
    bool unreadable = false, pending = false;
    // The flags, read into the rank's page-locked buffer (made at set-up: into pageable memory
    // the copy would not return before it completed), awaited with a bound.
    PinnedHost* host =
        gen != nullptr && gen->num_flags > 0 && static_cast<size_t>(c.rank) < gen->flag_reads.size()
            ? gen->flag_reads[static_cast<size_t>(c.rank)].get()
            : nullptr;
    if (host != nullptr) {
      const void* base = reinterpret_cast<const void*>(gen->Flag(c.rank, 0, 0, c.rank));
      if (ReadBack(base, host, host->bytes, &unreadable, &pending)) {
        const auto* words = static_cast<const uint32_t*>(host->ptr);
        flags.assign(words, words + host->bytes / sizeof(uint32_t));
      } else if (pending) {
        KeepForever(gen);  // the copy may still land: its buffer is never freed
      }
    }
    std::string missing;
    for (const auto& [id, writer] : c.waits) {
      const size_t index =
          gen == nullptr ? flags.size() : static_cast<size_t>((c.epoch % 2) * gen->num_flags + id);
      if (index < flags.size() &&
          static_cast<int32_t>(flags[index] - static_cast<uint32_t>(c.epoch)) >= 0)
        continue;
      missing += (missing.empty() ? "" : ", ") + std::string("flag ") + std::to_string(id) +
                 " from " + RankName(*clique, static_cast<size_t>(writer)) +
                 (index < flags.size() ? " (is " + std::to_string(flags[index]) + ")" : "");
    }
    if (!missing.empty()) text += "waiting for " + missing + "; ";
    // A fused GEMM's own bound (twice the timeout) may have ended a wait already; if not — or
    // if the flags could not be read, as the record could not be then — its record is read
    // once the call is done (PassFaults).
    const std::string gave_up = unreadable ? std::string() : ReadFault(clique, c);
    text += gave_up;
    if (c.fault != nullptr && gave_up.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      faults_.push_back({c,
                         c.op + " rank " + std::to_string(c.rank) + " (" + clique->name() +
                             ") epoch " + std::to_string(c.epoch),
                         Now() + 3 * c.timeout + std::chrono::seconds(2)});
    }
    if (unreadable)
      text +=
          "(the flags could not be read: the watchdog's stream waits behind the blocked "
          "work in the GPU's hardware queue, see CUDA_DEVICE_MAX_CONNECTIONS); ";
    if (c.nccl) text += "waiting inside NCCL (a peer did not make the matching send/recv); ";
    text +=
        "the peer did not arrive (ranks disagree on the calls, or a peer failed). "
        "This call's results are invalid; the clique is broken.";
    JO_WARN(text);
    clique->Break(Status(Code::kTimeout, text));
    // Release the GPU so that the process does not hang.
    const DriverApi* drv = nullptr;
    cudaStream_t side = nullptr;
    if (gen != nullptr && gen->num_flags > 0 && LoadDriver(&drv).ok() &&
        cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess) {
      for (int32_t i = 0; i < gen->halves * gen->num_flags; ++i)
        (void)drv->cuStreamWriteValue32(
            reinterpret_cast<CUstream>(side),
            gen->Flag(c.rank, i / gen->num_flags, i % gen->num_flags, c.rank),
            static_cast<cuuint32_t>(latest_epoch), CU_STREAM_WRITE_VALUE_DEFAULT);
    }
    // On a virtual clock (the fake) the pass also waits, bounded, for the aborts it started:
    // the fake GPU must see them before it decides it cannot progress. Never on real time.
    if (c.nccl)
      clique->AbortComms(virtual_clock_ ? std::optional<Clock::time_point>(Clock::now() + c.timeout)
                                        : std::nullopt);
    if (side != nullptr) (void)cudaStreamDestroy(side);
    return true;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Entry> entries_;
  struct WatchedAborts {
    std::weak_ptr<const NcclComms> comms;
    std::string clique;
    Clock::time_point deadline;
    std::chrono::milliseconds timeout;
  };
  std::vector<WatchedAborts> aborts_;
  struct WatchedArea {
    std::weak_ptr<CudaClique> clique;
    std::weak_ptr<const KernelArea> area;
    std::chrono::milliseconds timeout;
    std::vector<bool> reported = {};  // per rank: its fault was reported
  };
  std::vector<WatchedArea> areas_;
  // Fired calls with a fused GEMM whose fault record is to be read once they are done.
  struct Fault {
    WatchedCall call;
    std::string who;
    Clock::time_point until;
  };
  std::vector<Fault> faults_;
  bool thread_started_ = false;
  std::function<void()> fire_hook_;         // SetWatchdogFireHook
  std::atomic<bool> virtual_clock_{false};  // UseVirtualClock: no thread, time from Advance
  std::atomic<Clock::rep> virtual_now_{0};  // since the virtual clock's epoch
};

Watchdog& Instance() {
  static auto* watchdog = new Watchdog();  // never destroyed: its thread is detached
  return *watchdog;
}

}  // namespace

void Watch(WatchedCall call) { Instance().Add(std::move(call)); }

void WatchKernelArea(std::weak_ptr<CudaClique> clique, std::weak_ptr<const KernelArea> area,
                     std::chrono::milliseconds timeout) {
  Instance().AddArea(std::move(clique), std::move(area), timeout);
}

void WatchAborts(std::weak_ptr<const NcclComms> comms, std::string clique,
                 std::chrono::milliseconds timeout) {
  Instance().AddAborts(std::move(comms), std::move(clique), timeout);
}

int PendingWatches() { return Instance().Pending(); }

void UseVirtualWatchdogClock() { Instance().UseVirtualClock(); }

void AdvanceWatchdogClock(std::chrono::milliseconds by) { Instance().Advance(by); }

void SetWatchdogFireHook(std::function<void()> hook) { Instance().SetFireHook(std::move(hook)); }

}  // namespace jo::cuda
