#include "cuda/fake/fake_harness.h"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "core/call.h"
#include "core/exchange.h"
#include "cuda/base/driver.h"
#include "cuda/clique/cuda_bootstrap.h"
#include "cuda/cuda_site.h"
#include "cuda/fake/fake_internal.h"
#include "cuda/fused/fused_gemm.h"
#include "cuda/gemm/gemm.h"
#include "cuda/kernels/kernels.h"
#include "cuda/transport/peer_handles.h"
#include "cuda/watchdog.h"

namespace jo::fake {
namespace {

// The Exchange of played processes: one board shared by every played
// process of a clique; a call's n-th use of a tag meets the other processes'
// n-th use, like StoreExchange's fresh keys per use. A process that does not
// post is named, as the store's exchange does after its timeout; here as soon
// as every rank thread of that process has returned from its calls (it can
// post nothing more), so that no test's outcome depends on how fast the
// machine runs the other threads.
struct Board {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::tuple<std::string, int64_t, int32_t>, std::string> posts;  // (tag, use, process)
  std::map<std::pair<std::string, int32_t>, int64_t> uses;
  std::map<int32_t, int> running;  // process -> its rank threads still making calls

  void Start(int32_t process) {
    std::lock_guard<std::mutex> lock(mu);
    ++running[process];
  }
  void Stop(int32_t process) {
    std::lock_guard<std::mutex> lock(mu);
    --running[process];
    cv.notify_all();
  }
};

class PlayedExchange : public Exchange {
 public:
  PlayedExchange(std::shared_ptr<Board> board, int32_t me, std::vector<int32_t> procs,
                 int64_t timeout_ms, std::string host)
      : board_(std::move(board)),
        me_(me),
        procs_(std::move(procs)),
        timeout_ms_(timeout_ms),
        host_(std::move(host)) {}
  const std::shared_ptr<Board>& board() const { return board_; }
  int32_t process() const override { return me_; }
  std::string host() const override { return host_.empty() ? Exchange::host() : host_; }
  std::vector<int32_t> processes() const override { return procs_; }
  Status Broadcast(const std::string& tag, int32_t root, std::string* data) override {
    std::map<int32_t, std::string> all;
    JO_CHECK(AllGather(tag, me_ == root ? *data : std::string(), &all));
    *data = all[root];
    return OkStatus();
  }
  Status AllGather(const std::string& tag, const std::string& mine,
                   std::map<int32_t, std::string>* all) override {
    std::unique_lock<std::mutex> lock(board_->mu);
    const int64_t use = board_->uses[{tag, me_}]++;
    board_->posts[{tag, use, me_}] = mine;
    board_->cv.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms_);
    for (int32_t p : procs_) {
      const auto key = std::make_tuple(tag, use, p);
      const auto posted = [&] { return board_->posts.count(key) > 0; };
      board_->cv.wait_until(lock, deadline, [&] { return posted() || board_->running[p] <= 0; });
      if (!posted())
        return Status(Code::kTimeout, "exchange allgather '" + tag + "': process " +
                                          std::to_string(p) + " did not answer (played)");
      (*all)[p] = board_->posts[key];
    }
    return OkStatus();
  }
  // Played processes share one OS process: the "duplicate" of a peer's fd is dup() of it,
  // taken before the owner may close it (the done round), as share_fds guarantees.
  Status ShareFds(const std::string& tag, const std::vector<int>& fds,
                  std::map<int32_t, std::vector<int>>* got) override {
    got->clear();
    std::string mine;
    for (int fd : fds) mine += std::to_string(fd) + " ";
    std::map<int32_t, std::string> all;
    JO_CHECK(AllGather("fds/" + tag, mine, &all));
    for (const auto& [p, text] : all) {
      if (p == me_ || text.empty()) continue;
      std::vector<int>& out = (*got)[p];
      size_t pos = 0;
      while (pos < text.size()) {
        const size_t end = text.find(' ', pos);
        const int dup = ::dup(std::stoi(text.substr(pos, end - pos)));
        if (dup < 0) {
          for (auto& [q, list] : *got)
            for (int f : list) ::close(f);
          got->clear();
          return Internal("played share_fds '" + tag + "': dup failed");
        }
        out.push_back(dup);
        pos = end + 1;
      }
    }
    std::map<int32_t, std::string> done;
    return AllGather("fds/" + tag + "/done", "", &done);
  }

 private:
  std::shared_ptr<Board> board_;
  int32_t me_;
  std::vector<int32_t> procs_;
  int64_t timeout_ms_;
  std::string host_;  // the machine this played process pretends to run on ("": this one)
};

// The XLA streams of PlayCalls, per (played process, device); forgotten by
// ResetExecutorAndFake.
std::mutex g_xla_mu;
std::map<std::pair<int, int>, cudaStream_t> g_xla;

// On the calling thread (whose played process and device are set).
cudaStream_t XlaStream(int process, int device) {
  std::lock_guard<std::mutex> lock(g_xla_mu);
  cudaStream_t& s = g_xla[{process, device}];
  if (s == nullptr && cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    s = nullptr;
  return s;
}

}  // namespace

void ResetExecutorAndFake(Config config) {
  cuda::ResetCudaCliques();
  cuda::ForgetNcclIds();
  cuda::ReleaseGemmCaches();
  cuda::ForgetFabricProbes();
  cuda::ForgetKernelVerdicts();
  cuda::ForgetFusedGemmPreparation();
  cuda::ForgetDeviceAttributes();
  {
    std::lock_guard<std::mutex> lock(g_xla_mu);
    g_xla.clear();
  }
  if (!config.pass_time) config.pass_time = cuda::AdvanceWatchdogClock;
  Reset(config);
}

Status PlayCalls(const PlayedCalls& in, PlayedOutcome* out) {
  const Problem& q = in.problem;
  const int nranks = q.nranks;
  if (static_cast<int>(in.xs.size()) != nranks || static_cast<int>(in.ws.size()) != nranks ||
      static_cast<int>(in.devices.size()) != nranks ||
      (in.processes && static_cast<int>(in.processes->size()) != nranks) ||
      (in.site_keys && static_cast<int>(in.site_keys->size()) != nranks))
    return InvalidArgument("xs, ws, devices, processes and site_keys need one entry per rank");
  const OperandRows rows = OperandRowsOf(q);
  const int64_t k = q.k, cols = q.cols;
  const size_t xs = static_cast<size_t>(DTypeSize(q.x_dtype));
  const size_t ws = static_cast<size_t>(DTypeSize(q.w_dtype));
  const size_t ys = static_cast<size_t>(DTypeSize(q.out_dtype));
  const size_t x_elems = static_cast<size_t>(q.batch * rows.x * k);
  const size_t w_elems = static_cast<size_t>(k * cols);
  const size_t y_elems = static_cast<size_t>(q.batch * rows.y * cols);
  const size_t g_elems = static_cast<size_t>(q.batch * rows.gathered * k);
  for (int r = 0; r < nranks; ++r)
    if (in.xs[r].size() != x_elems * xs || in.ws[r].size() != w_elems * ws)
      return InvalidArgument("xs/ws: wrong byte size");
  for (const auto* scales : {&in.x_scales, &in.w_scales})
    if (!scales->empty() && static_cast<int>(scales->size()) != nranks)
      return InvalidArgument("x_scales/w_scales: one per rank, or none");
  // Block scales: one e8m0 byte per 32 of k, as many as the operand's rows (w's: columns).
  const size_t x_blocks = q.block_scaled ? x_elems / 32 : 0;
  const size_t w_blocks = q.block_scaled ? w_elems / 32 : 0;
  if (q.block_scaled) {
    if (static_cast<int>(in.x_block_scales.size()) != nranks ||
        static_cast<int>(in.w_block_scales.size()) != nranks)
      return InvalidArgument("x_block_scales/w_block_scales: one per rank for block scales");
    for (int r = 0; r < nranks; ++r)
      if (in.x_block_scales[r].size() != x_blocks || in.w_block_scales[r].size() != w_blocks)
        return InvalidArgument("x_block_scales/w_block_scales: wrong byte size");
  }
  std::vector<void*> x(nranks), w(nranks), y(nranks), g(nranks, nullptr);
  std::vector<void*> x_scale(nranks), w_scale(nranks);
  for (int r = 0; r < nranks; ++r) {
    const int dev = static_cast<int>(in.devices[r]);
    x[r] = Malloc(dev, x_elems * xs);
    w[r] = Malloc(dev, w_elems * ws);
    const size_t y_offset =
        in.y_offsets.empty() ? 0 : static_cast<size_t>(in.y_offsets.at(static_cast<size_t>(r)));
    y[r] = Malloc(dev, y_elems * ys + y_offset, 0x7F);  // unwritten output shows huge values
    if (y[r] != nullptr) y[r] = static_cast<std::byte*>(y[r]) + y_offset;
    if (q.return_gathered) g[r] = Malloc(dev, g_elems * xs, 0x7F);
    x_scale[r] = Malloc(dev, q.block_scaled ? x_blocks : sizeof(float));
    w_scale[r] = Malloc(dev, q.block_scaled ? w_blocks : sizeof(float));
    if (x[r] == nullptr || w[r] == nullptr || y[r] == nullptr ||
        (q.return_gathered && g[r] == nullptr) || x_scale[r] == nullptr || w_scale[r] == nullptr)
      return Status(Code::kResource, "fake: out of host memory for the calls' buffers");
    std::memcpy(x[r], in.xs[r].data(), x_elems * xs);
    std::memcpy(w[r], in.ws[r].data(), w_elems * ws);
    const float sx = in.x_scales.empty() ? 1.0f : in.x_scales[r];
    const float sw = in.w_scales.empty() ? 1.0f : in.w_scales[r];
    if (q.block_scaled) {
      std::memcpy(x_scale[r], in.x_block_scales[r].data(), x_blocks);
      std::memcpy(w_scale[r], in.w_block_scales[r].data(), w_blocks);
    } else {
      std::memcpy(x_scale[r], &sx, sizeof(float));
      std::memcpy(w_scale[r], &sw, sizeof(float));
    }
  }
  auto board = std::make_shared<Board>();
  if (in.processes && !Row(q.transport).messages()) {
    // Each played process gets its exchange for this clique (group 0), unless the test
    // registered its own (set_exchange); those of an earlier run keep their board.
    std::vector<int32_t> procs(in.processes->begin(), in.processes->end());
    std::sort(procs.begin(), procs.end());
    procs.erase(std::unique(procs.begin(), procs.end()), procs.end());
    for (int32_t p : procs)
      if (auto* played =
              dynamic_cast<PlayedExchange*>(cuda::FindExchange(in.clique_key, 0, p).get()))
        board = played->board();
    for (int32_t p : procs)
      if (!cuda::FindExchange(in.clique_key, 0, p)) {
        const auto host = in.hosts.find(p);
        (void)cuda::RegisterExchange(
            in.clique_key, 0, p,
            std::make_shared<PlayedExchange>(board, p, procs, in.timeout_ms,
                                             host != in.hosts.end() ? host->second : ""));
      }
  }
  // One call site, as one custom call of one executable: every rank's calls go through it.
  CallDesc desc;
  desc.problem = q;  // its shapes and dtypes are the inputs' (the handler's operands')
  desc.clique_key = in.clique_key;
  desc.axis = 0;
  desc.timeout_ms = in.timeout_ms;
  desc.table.axis_size = nranks;
  // processes: which (played) process each rank belongs to; a clique spanning
  // them is one clique object per process, as in real life.
  desc.table.processes = in.processes ? *in.processes : std::vector<int64_t>(in.devices.size(), 0);
  desc.table.ordinals = in.devices;
  desc.table.device_ids = in.devices;
  desc.site_key = in.clique_key != 0 ? in.clique_key : 1;
  cuda::CudaSite shared_site(desc, CallSite::Instantiate(desc.site_key));
  // chunks_per_call: one more call site per other number of chunks (a custom call of its own,
  // so a site key of its own, shared by every rank).
  std::map<int64_t, std::unique_ptr<cuda::CudaSite>> sites;
  for (int64_t chunks : in.chunks_per_call) {
    if (chunks == q.chunks || sites.count(chunks) > 0) continue;
    CallDesc other = desc;
    other.problem.chunks = chunks;
    other.site_key = static_cast<int64_t>(static_cast<uint64_t>(desc.site_key) ^
                                          (static_cast<uint64_t>(chunks) << 40));
    if (other.site_key == 0) other.site_key = 1;
    sites[chunks] = std::make_unique<cuda::CudaSite>(other, CallSite::Instantiate(other.site_key));
  }
  std::vector<std::string> statuses(nranks);
  // hold_ms: XLA's stream of every rank first waits for a flag the host raises only after the
  // watchdog's clock moved on by hold_ms (earlier work the GPU is still busy with).
  std::vector<uint32_t*> holds(static_cast<size_t>(nranks), nullptr);
  const auto process_of = [&](int r) {
    return static_cast<int32_t>(desc.table.processes[static_cast<size_t>(r)]);
  };
  std::vector<cudaGraphExec_t> execs(static_cast<size_t>(nranks), nullptr);  // capture
  cuda::AllowCapturingAnyCallForTests(in.capture_any);
  // late_rank: per call, how many other ranks have returned from it.
  const int calls_per_rank =
      in.chunks_per_call.empty() ? in.calls : static_cast<int>(in.chunks_per_call.size());
  std::mutex returned_mu;
  std::condition_variable returned_cv;
  std::vector<int> returned(static_cast<size_t>(std::max(calls_per_rank, 0)), 0);
  const int others = nranks - 1 - (in.skip_rank >= 0 && in.skip_rank != in.late_rank ? 1 : 0);
  std::atomic<bool> paused{false};
  if (in.setup_pause_ms > 0)
    SetEventQueryHook([&](cudaEvent_t) {
      if (!paused.exchange(true))
        std::this_thread::sleep_for(std::chrono::milliseconds(in.setup_pause_ms));
    });
  std::vector<std::thread> threads;
  for (int r = 0; r < nranks; ++r) board->Start(process_of(r));
  // Every rank's thread is a HostThread before any makes a call: the fake calls a wait a
  // deadlock once no rank's thread is left that is not waiting, which must count them all.
  std::mutex started_mu;
  std::condition_variable started_cv;
  int started = 0;
  for (int r = 0; r < nranks; ++r)
    threads.emplace_back([&, r] {
      struct Stop {  // whichever way the thread returns
        Board& board;
        int32_t process;
        ~Stop() { board.Stop(process); }
      } stop{*board, process_of(r)};
      const HostThread host;  // a rank's thread, as XLA's per device
      {
        std::unique_lock<std::mutex> lock(started_mu);
        ++started;
        started_cv.notify_all();
        started_cv.wait(lock, [&] { return started == nranks; });
      }
      const int dev = static_cast<int>(in.devices[r]);
      SetPlayedProcess(process_of(r));
      if (cudaSetDevice(dev) != cudaSuccess) {
        statuses[r] = "cudaSetDevice failed";
        return;
      }
      // Stands for XLA's stream of this device: one per (played process, device) until
      // reset, as XLA keeps its compute stream (cuBLASLt workspaces are per stream).
      cudaStream_t xla = XlaStream(process_of(r), dev);
      if (xla == nullptr) {
        statuses[r] = "stream creation failed";
        return;
      }
      const cuda::DriverApi* drv = nullptr;
      if (in.hold_ms > 0 && cuda::LoadDriver(&drv).ok()) {
        holds[static_cast<size_t>(r)] = static_cast<uint32_t*>(Malloc(dev, 4));
        (void)drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(xla),
                                       reinterpret_cast<CUdeviceptr>(holds[r]), 1,
                                       CU_STREAM_WAIT_VALUE_GEQ);
      }
      Problem problem = q;
      if (r == in.skew_rank) ++problem.chunks;  // tests: this rank disagrees on the call
      if (r == in.skip_rank) return;            // tests: this rank never makes the call
      Caller caller;
      caller.process = process_of(r);
      caller.device = dev;
      caller.naming = DeviceNaming::kLocalOrdinal;
      const CallBuffers io{x[r], w[r], x_scale[r], w_scale[r], y[r], g[r]};
      // site_keys: each rank calls through a site of its own, instantiated on its thread as
      // each process compiles its own program (equal keys: the same site).
      std::optional<cuda::CudaSite> own;
      if (in.site_keys) {
        CallDesc mine = desc;
        mine.site_key = (*in.site_keys)[static_cast<size_t>(r)];
        own.emplace(mine, CallSite::Instantiate(mine.site_key));
      }
      cuda::CudaSite& site = own ? *own : shared_site;
      const int calls =
          in.chunks_per_call.empty() ? in.calls : static_cast<int>(in.chunks_per_call.size());
      int counted = 0;  // calls counted in `returned`
      for (int c = 0; c < calls && statuses[r].empty(); ++c) {
        if (r == in.late_rank && c >= in.late_from) {  // after its peers' call c
          std::unique_lock<std::mutex> lock(returned_mu);
          returned_cv.wait_for(lock, std::chrono::seconds(20),
                               [&] { return returned[static_cast<size_t>(c)] >= others; });
        }
        if (!in.chunks_per_call.empty())
          problem.chunks = in.chunks_per_call[static_cast<size_t>(c)] + (r == in.skew_rank);
        // As XLA runs a thunk: the handler's work on other streams must be joined into
        // XLA's stream (or complete) when it returns, whatever its status.
        BeginHandler(xla);
        cuda::CudaSite& call_site =
            in.chunks_per_call.empty() || in.chunks_per_call[static_cast<size_t>(c)] == q.chunks
                ? site
                : *sites.at(in.chunks_per_call[static_cast<size_t>(c)]);
        Status status = call_site.Enqueue(caller, problem, io, xla);
        EndHandler(xla, "CudaSite::Enqueue (rank " + std::to_string(r) + ")");
        if (!status.ok()) statuses[r] = status.ToString();
        if (r != in.late_rank) {
          std::lock_guard<std::mutex> lock(returned_mu);
          ++returned[static_cast<size_t>(c)];
          ++counted;
          returned_cv.notify_all();
        }
      }
      if (r != in.late_rank) {  // a failed rank makes no more calls: they count as returned
        std::lock_guard<std::mutex> lock(returned_mu);
        for (int c = counted; c < calls; ++c) ++returned[static_cast<size_t>(c)];
        returned_cv.notify_all();
      }
      // XLA records one more call into a command buffer (the handler runs under capture).
      if (in.capture && statuses[r].empty()) {
        if (cudaStreamBeginCapture(xla, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
          statuses[r] = "cudaStreamBeginCapture failed";
          return;
        }
        BeginHandler(xla);
        const Status status = site.Enqueue(caller, problem, io, xla);
        EndHandler(xla, "CudaSite::Enqueue under capture (rank " + std::to_string(r) + ")");
        cudaGraph_t graph = nullptr;
        const cudaError_t ended = cudaStreamEndCapture(xla, &graph);
        if (!status.ok()) {
          statuses[r] = status.ToString();
        } else if (ended != cudaSuccess ||
                   cudaGraphInstantiate(&execs[static_cast<size_t>(r)], graph, 0) != cudaSuccess) {
          statuses[r] = "capture or instantiation failed";
        }
      }
    });
  for (auto& t : threads) t.join();
  SetEventQueryHook(nullptr);
  if (in.hold_ms > 0) {
    cuda::AdvanceWatchdogClock(std::chrono::milliseconds(in.hold_ms));
    for (uint32_t* flag : holds)
      if (flag != nullptr) *flag = 1;
  }
  out->drained = Drain();
  // One more pass of the watchdog, as its thread makes one every 20 ms: it drops the calls the
  // GPU finished and reads the fault records of fired fused calls now done, and what a kernel
  // recorded while the GPU ran (a one-launch all-reduce that gave up).
  cuda::AdvanceWatchdogClock(std::chrono::milliseconds(20));
  out->ys.clear();
  out->x_gathered.clear();
  for (int r = 0; r < nranks; ++r) {
    out->ys.emplace_back(static_cast<const char*>(y[r]), y_elems * ys);
    out->x_gathered.push_back(
        q.return_gathered ? std::string(static_cast<const char*>(g[r]), g_elems * xs) : "");
  }
  out->replay_ys.clear();
  out->replay_drained.clear();
  const bool captured = std::all_of(statuses.begin(), statuses.end(),
                                    [](const std::string& st) { return st.empty(); });
  for (int i = 0; in.capture && captured && i < in.replays; ++i) {
    if (static_cast<size_t>(i) < in.replay_xs.size())
      for (int r = 0; r < nranks; ++r) {
        const std::string& bytes = in.replay_xs[static_cast<size_t>(i)][static_cast<size_t>(r)];
        if (bytes.size() != x_elems * xs) return InvalidArgument("replay_xs: wrong byte size");
        std::memcpy(x[r], bytes.data(), bytes.size());  // the GPU is idle: drained
      }
    const auto launch = [&](int r) {
      SetPlayedProcess(process_of(r));
      const int dev = static_cast<int>(in.devices[static_cast<size_t>(r)]);
      if (cudaSetDevice(dev) != cudaSuccess ||
          cudaGraphLaunch(execs[static_cast<size_t>(r)], XlaStream(process_of(r), dev)) !=
              cudaSuccess)
        statuses[r] = "cudaGraphLaunch failed (replay " + std::to_string(i) + ")";
    };
    const bool last = i + 1 == in.replays;
    for (int r = 0; r < nranks; ++r)
      if (r != in.replay_late_rank && !(last && r == in.replay_skip_rank)) launch(r);
    if (in.replay_late_rank >= 0 && in.replay_late_rank < nranks) {
      {
        Lock lock(S().mu);
        (void)RunUntil([] { return false; });  // as far as the others can go alone
      }
      launch(in.replay_late_rank);
    }
    SetPlayedProcess(0);
    out->replay_drained.push_back(Drain());
    cuda::AdvanceWatchdogClock(std::chrono::milliseconds(20));
    std::vector<std::string> ys_now;
    for (int r = 0; r < nranks; ++r)
      ys_now.emplace_back(static_cast<const char*>(y[r]), y_elems * ys);
    out->replay_ys.push_back(std::move(ys_now));
  }
  cuda::AllowCapturingAnyCallForTests(false);
  out->statuses = std::move(statuses);
  return OkStatus();
}

}  // namespace jo::fake
