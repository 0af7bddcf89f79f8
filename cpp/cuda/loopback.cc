#include "cuda/loopback.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>

#include "core/call.h"
#include "core/issue_order.h"
#include "cuda/base/check.h"
#include "cuda/base/device_memory.h"
#include "cuda/cuda_site.h"
#include "cuda/executor.h"

namespace jo::cuda {
namespace {

// The global order of every rank's units, call after call: within a call, by the play's round,
// then rank, then the rank's own order (IssueRounds). Threads wait (bounded) for their turn.
class Sequencer {
 public:
  Sequencer(std::vector<std::vector<std::vector<int32_t>>> rounds, std::chrono::milliseconds bound)
      : bound_(bound) {
    // rounds[call][rank][unit]
    for (size_t c = 0; c < rounds.size(); ++c) {
      std::vector<std::tuple<int32_t, int32_t, int32_t>> call;
      for (size_t r = 0; r < rounds[c].size(); ++r)
        for (size_t u = 0; u < rounds[c][r].size(); ++u)
          call.emplace_back(rounds[c][r][u], static_cast<int32_t>(r), static_cast<int32_t>(u));
      std::sort(call.begin(), call.end());
      for (const auto& [round, rank, unit] : call) order_.push_back({c, rank, unit});
    }
  }

  void Before(size_t call, int32_t rank, size_t unit) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, bound_, [&] {
      Skip();
      return next_ >= order_.size() ||
             order_[next_] == Turn{call, rank, static_cast<int32_t>(unit)};
    });
  }

  void After(size_t call, int32_t rank, size_t unit) {
    std::lock_guard<std::mutex> lock(mu_);
    if (next_ < order_.size() && order_[next_] == Turn{call, rank, static_cast<int32_t>(unit)})
      ++next_;
    Skip();
    cv_.notify_all();
  }

  void Leave(size_t call, int32_t rank) {
    std::lock_guard<std::mutex> lock(mu_);
    left_.insert({call, rank});
    Skip();
    cv_.notify_all();
  }

 private:
  struct Turn {
    size_t call;
    int32_t rank, unit;
    bool operator==(const Turn& o) const {
      return call == o.call && rank == o.rank && unit == o.unit;
    }
  };
  // Past the turns of ranks that issue nothing more of their call. Requires mu_.
  void Skip() {
    while (next_ < order_.size() && left_.count({order_[next_].call, order_[next_].rank}) > 0)
      ++next_;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Turn> order_;
  size_t next_ = 0;
  std::set<std::pair<size_t, int32_t>> left_;
  std::chrono::milliseconds bound_;
};

// One rank's call through the sequencer.
class Gate : public IssueGate {
 public:
  Gate(Sequencer* sequencer, size_t call, int32_t rank)
      : sequencer_(sequencer), call_(call), rank_(rank) {}
  void Before(size_t unit) override { sequencer_->Before(call_, rank_, unit); }
  void After(size_t unit) override { sequencer_->After(call_, rank_, unit); }
  void Leave() override { sequencer_->Leave(call_, rank_); }

 private:
  Sequencer* sequencer_;
  size_t call_;
  int32_t rank_;
};

// Device memory of the run, freed at the end unless the GPU may still use it.
struct Buffers {
  std::vector<std::unique_ptr<DeviceAlloc>> memory;
  Status Add(int device, size_t bytes, void** out, const ErrorContext& ctx) {
    std::unique_ptr<DeviceAlloc> alloc;
    JO_CHECK(Alloc(device, bytes, nullptr, ctx, &alloc));
    *out = alloc->ptr;
    memory.push_back(std::move(alloc));
    return OkStatus();
  }
};

}  // namespace

Status RunLoopback(const LoopbackCalls& in, const LoopbackHooks& hooks, LoopbackOutcome* out) {
  const Problem& q = in.problem;
  const int n = q.nranks;
  JO_REQUIRE(n >= 1 && static_cast<int>(in.xs.size()) == n && static_cast<int>(in.ws.size()) == n,
             "loopback: xs and ws need one entry per rank");
  for (const auto* scales : {&in.x_scales, &in.w_scales})
    JO_REQUIRE(scales->empty() || static_cast<int>(scales->size()) == n,
               "loopback: x_scales / w_scales: one per rank, or none");
  const OperandRows rows = OperandRowsOf(q);  // by the op's rows rule (core/kinds.h)
  const size_t x_bytes = static_cast<size_t>(q.batch * rows.x * q.k * DTypeSize(q.x_dtype));
  const size_t w_bytes = static_cast<size_t>(q.k * q.cols * DTypeSize(q.w_dtype));
  const size_t y_bytes = static_cast<size_t>(q.batch * rows.y * q.cols * DTypeSize(q.out_dtype));
  for (int r = 0; r < n; ++r)
    JO_REQUIRE(in.xs[r].size() == x_bytes && in.ws[r].size() == w_bytes,
               "loopback: xs/ws of rank " + std::to_string(r) + ": wrong byte size");
  ErrorContext ctx;
  ctx.op = "loopback";
  JO_CUDA_CHECK(&ctx, cudaSetDevice(in.device));

  // Every rank's buffers on the one device.
  Buffers buffers;
  std::vector<CallBuffers> io(static_cast<size_t>(n));
  std::vector<void*> y(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    CallBuffers& b = io[static_cast<size_t>(r)];
    void *x = nullptr, *w = nullptr, *sx = nullptr, *sw = nullptr;
    JO_CHECK(buffers.Add(in.device, x_bytes, &x, ctx));
    JO_CHECK(buffers.Add(in.device, w_bytes, &w, ctx));
    JO_CHECK(buffers.Add(in.device, y_bytes, &y[static_cast<size_t>(r)], ctx));
    JO_CHECK(buffers.Add(in.device, sizeof(float), &sx, ctx));
    JO_CHECK(buffers.Add(in.device, sizeof(float), &sw, ctx));
    JO_CHECK(hooks.upload(x, in.xs[static_cast<size_t>(r)].data(), x_bytes));
    JO_CHECK(hooks.upload(w, in.ws[static_cast<size_t>(r)].data(), w_bytes));
    const float scale_x = in.x_scales.empty() ? 1.0f : in.x_scales[static_cast<size_t>(r)];
    const float scale_w = in.w_scales.empty() ? 1.0f : in.w_scales[static_cast<size_t>(r)];
    JO_CHECK(hooks.upload(sx, &scale_x, sizeof(float)));
    JO_CHECK(hooks.upload(sw, &scale_w, sizeof(float)));
    b = CallBuffers{x, w, sx, sw, y[static_cast<size_t>(r)], nullptr};
  }

  // One call site, as one custom call of one executable; the rank table lists the device once
  // per rank.
  CallDesc desc;
  desc.problem = q;  // its shapes and dtypes are the inputs'
  desc.clique_key = in.clique_key;
  desc.axis = 0;
  desc.timeout_ms = in.timeout_ms;
  desc.table.axis_size = n;
  desc.table.processes.assign(static_cast<size_t>(n), 0);
  desc.table.ordinals.assign(static_cast<size_t>(n), in.device);
  desc.table.device_ids.assign(static_cast<size_t>(n), in.device);
  desc.site_key = in.clique_key != 0 ? in.clique_key : 1;
  CudaSite site(desc, CallSite::Instantiate(desc.site_key));

  // The global issue order: every call's rounds, per rank.
  std::vector<std::vector<int32_t>> rounds(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    Problem mine = q;
    mine.rank = r;
    JO_CHECK(IssueRounds(mine, &rounds[static_cast<size_t>(r)]));
  }
  const std::chrono::milliseconds timeout(in.timeout_ms);
  Sequencer sequencer(std::vector<std::vector<std::vector<int32_t>>>(
                          static_cast<size_t>(std::max(in.calls, 0)), rounds),
                      timeout);

  // Each rank's stream standing for XLA's, and the event recorded after its last call.
  std::vector<cudaStream_t> streams(static_cast<size_t>(n), nullptr);
  std::vector<cudaEvent_t> done(static_cast<size_t>(n), nullptr);
  const auto destroy = [&] {
    for (cudaEvent_t e : done)
      if (e != nullptr) (void)cudaEventDestroy(e);
    for (cudaStream_t s : streams)
      if (s != nullptr) (void)cudaStreamDestroy(s);
  };
  for (int r = 0; r < n; ++r) {
    const cudaError_t made =
        cudaStreamCreateWithFlags(&streams[static_cast<size_t>(r)], cudaStreamNonBlocking);
    const cudaError_t event =
        made == cudaSuccess
            ? cudaEventCreateWithFlags(&done[static_cast<size_t>(r)], cudaEventDisableTiming)
            : made;
    if (event != cudaSuccess) {
      destroy();
      return CudaFailure(event, "loopback streams", &ctx);
    }
  }

  std::vector<std::string> statuses(static_cast<size_t>(n));
  // Written by the ranks' threads at once: one byte each (std::vector<bool> packs its elements
  // into shared words, so concurrent writes to different ranks' flags race and can lose one).
  std::vector<unsigned char> recorded(static_cast<size_t>(n), 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const std::shared_ptr<void> thread = hooks.rank_thread();
      std::string& status = statuses[static_cast<size_t>(r)];
      cudaStream_t xla = streams[static_cast<size_t>(r)];
      if (cudaSetDevice(in.device) != cudaSuccess) {
        status = "cudaSetDevice failed";
        for (int c = 0; c < in.calls; ++c) sequencer.Leave(static_cast<size_t>(c), r);
        return;
      }
      Caller caller;
      caller.process = 0;
      caller.device = in.device;
      caller.naming = DeviceNaming::kLocalOrdinal;
      caller.rank = r;  // the device is every rank's: the rank says which one this is
      caller.group = 0;
      for (int c = 0; c < in.calls; ++c) {
        Gate gate(&sequencer, static_cast<size_t>(c), r);
        if (!status.empty()) {  // a failed rank makes no more calls
          gate.Leave();
          continue;
        }
        hooks.begin_handler(xla);
        const Status called =
            site.Enqueue(caller, q, io[static_cast<size_t>(r)], xla, in.ordered ? &gate : nullptr);
        hooks.end_handler(xla, "CudaSite::Enqueue (loopback rank " + std::to_string(r) + ")");
        if (!called.ok()) status = called.ToString();
      }
      recorded[static_cast<size_t>(r)] =
          cudaEventRecord(done[static_cast<size_t>(r)], xla) == cudaSuccess ? 1 : 0;
    });
    if (!in.ordered) threads.back().join();  // tests: one rank after the other (loopback.h)
  }
  for (auto& t : threads)
    if (t.joinable()) t.join();

  // The GPU's work, awaited by polling, bounded (loopback.h).
  const auto deadline = std::chrono::steady_clock::now() + 2 * timeout +
                        std::min<std::chrono::milliseconds>(timeout, std::chrono::seconds(10));
  bool completed = true;
  for (int r = 0; r < n; ++r) {
    if (recorded[static_cast<size_t>(r)] == 0) {
      completed = false;
      continue;
    }
    for (;;) {
      const cudaError_t q_done = cudaEventQuery(done[static_cast<size_t>(r)]);
      if (q_done == cudaSuccess) break;
      if (q_done != cudaErrorNotReady || std::chrono::steady_clock::now() >= deadline) {
        (void)cudaGetLastError();
        completed = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  if (hooks.finished) hooks.finished();
  out->statuses = std::move(statuses);
  out->completed = completed;
  out->ys.assign(static_cast<size_t>(n), std::string());
  if (!completed) {
    // The GPU may still write these buffers: never freed under it.
    for (auto& memory : buffers.memory)
      KeepForever(std::shared_ptr<DeviceAlloc>(std::move(memory)));
    destroy();
    return OkStatus();
  }
  for (int r = 0; r < n; ++r) {
    std::string& bytes = out->ys[static_cast<size_t>(r)];
    bytes.resize(y_bytes);
    JO_CHECK(hooks.download(bytes.data(), y[static_cast<size_t>(r)], y_bytes));
  }
  destroy();
  return OkStatus();
}

}  // namespace jo::cuda
