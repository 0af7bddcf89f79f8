// jaxoverlap._cuda_fake: the CUDA executor linked against the host-side fake
// (cpp/cuda/fake). run() drives CudaSite::Enqueue — what the
// CUDA FFI handlers call — for every rank of a clique, one host thread per
// rank as XLA does, then lets the fake "GPU" run the queued work.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
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
#include <vector>

#include <unistd.h>

#include "core/call.h"
#include "core/log.h"
#include "cuda/cuda_bootstrap.h"
#include "cuda/cuda_clique.h"
#include "cuda/cuda_site.h"
#include "cuda/driver.h"
#include "cuda/fake/fake_kernels.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/nccl_comms.h"
#include "cuda/peer_handles.h"
#include "cuda/watchdog.h"
#include "python/cuda_bootstrap_bindings.h"
#include "python/cuda_fake_kernels.h"

namespace nb = nanobind;

namespace {

// The jo::Exchange of played processes (tests): one board shared by every
// played process of a clique; a call's n-th use of a tag meets the other
// processes' n-th use, like StoreExchange's fresh keys per use. A process that
// does not post is named, as the store's exchange does after its timeout;
// here as soon as every rank thread of that process has returned from run()'s
// call (it can post nothing more), so that no test's outcome depends on how
// fast the machine runs the other threads.
struct Board {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::tuple<std::string, int64_t, int32_t>, std::string> posts;  // (tag, use, process)
  std::map<std::pair<std::string, int32_t>, int64_t> uses;
  std::map<int32_t, int> running;  // process -> its rank threads still in this run()'s call

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

class PlayedExchange : public jo::Exchange {
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
  std::string host() const override { return host_.empty() ? jo::Exchange::host() : host_; }
  std::vector<int32_t> processes() const override { return procs_; }
  jo::Status Broadcast(const std::string& tag, int32_t root, std::string* data) override {
    std::map<int32_t, std::string> all;
    JO_CHECK(AllGather(tag, me_ == root ? *data : std::string(), &all));
    *data = all[root];
    return jo::OkStatus();
  }
  jo::Status AllGather(const std::string& tag, const std::string& mine,
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
        return jo::Status(jo::Code::kTimeout, "exchange allgather '" + tag + "': process " +
                                                  std::to_string(p) + " did not answer (played)");
      (*all)[p] = board_->posts[key];
    }
    return jo::OkStatus();
  }
  // Played processes share one OS process: the "duplicate" of a peer's fd is dup() of it,
  // taken before the owner may close it (the done round), as share_fds guarantees.
  jo::Status ShareFds(const std::string& tag, const std::vector<int>& fds,
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
          return jo::Internal("played share_fds '" + tag + "': dup failed");
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

jo::DType ParseDType(const std::string& s) {
  if (s == "float32") return jo::DType::kF32;
  if (s == "bfloat16") return jo::DType::kBF16;
  if (s == "float16") return jo::DType::kF16;
  throw nb::value_error(("dtype: expected float32, bfloat16 or float16, got " + s).c_str());
}

jo::Transport ParseTransport(const std::string& s) {
  if (s == "nccl") return jo::Transport::kNccl;
  if (s == "p2p") return jo::Transport::kP2p;
  if (s == "multicast") return jo::Transport::kMulticast;
  throw nb::value_error(("transport: expected nccl, p2p or multicast, got " + s).c_str());
}

// The XLA streams of run(), per (played process, device); forgotten by Reset.
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

void Reset(int devices, int cc_major, bool multicast,
           std::optional<std::vector<std::vector<bool>>> peer, uint64_t seed, int grace_ms,
           bool shareable, bool fabric, bool imex_channel, int connections, int cc_minor,
           bool flush_remote_writes,
           std::optional<std::map<std::string, std::vector<std::string>>> kernel_images,
           int module_loading = 0, uint64_t host_jitter = 0) {
  jo::cuda::ResetCudaCliques();
  jo::cuda::ForgetNcclIds();
  jo::cuda::ReleaseGemmCaches();
  jo::cuda::ForgetFabricProbes();
  jo::cuda::ForgetKernelVerdicts();
  jo::cuda::ForgetDeviceAttributes();
  {
    std::lock_guard<std::mutex> lock(g_xla_mu);
    g_xla.clear();
  }
  jo::fake::Config config;
  config.devices = devices;
  config.cc_major = cc_major;
  config.multicast = multicast;
  if (peer) config.peer = *peer;
  config.seed = seed;
  config.grace_ms = grace_ms;
  config.pass_time = jo::cuda::AdvanceWatchdogClock;
  config.shareable = shareable;
  config.fabric = fabric;
  config.imex_channel = imex_channel;
  config.connections = connections;
  config.cc_minor = cc_minor;
  config.flush_remote_writes = flush_remote_writes;
  config.module_loading = module_loading;
  config.host_jitter = host_jitter;
  jo::fake::Reset(config);
  // Which compiled variants each kernel has: this build's record unless a test says otherwise.
  jo::fake::SetKernelImages(kernel_images ? *kernel_images : jo::cuda::KernelImages());
}

// Runs `calls` back-to-back calls on every rank; returns ys, x_gathered (per
// rank, bytes), statuses (per rank: None or the error text) and drained.
nb::dict Run(const std::string& op, const std::string& transport, int nranks, int64_t batch,
             int64_t rows, int64_t k, int64_t n, const std::string& dtype, int64_t chunks,
             bool bidirectional, bool return_gathered, std::vector<nb::bytes> xs,
             std::vector<nb::bytes> ws, std::vector<int64_t> devices, int64_t clique_key, int calls,
             int skew_rank, int skip_rank, int64_t timeout_ms,
             std::optional<std::vector<int64_t>> processes,
             std::optional<std::map<int32_t, std::string>> hosts, bool capture, bool tf32,
             int64_t hold_ms, const std::string& algorithm,
             std::optional<std::vector<int64_t>> site_keys) {
  const bool ag = op == "ag_matmul", rs = op == "matmul_rs", ar = op == "matmul_ar";
  if (!ag && !rs && !ar) throw nb::value_error("op: expected ag_matmul, matmul_rs or matmul_ar");
  if (static_cast<int>(xs.size()) != nranks || static_cast<int>(ws.size()) != nranks ||
      static_cast<int>(devices.size()) != nranks ||
      (processes && static_cast<int>(processes->size()) != nranks) ||
      (site_keys && static_cast<int>(site_keys->size()) != nranks))
    throw nb::value_error("xs, ws, devices, processes and site_keys need one entry per rank");
  jo::Problem q;
  q.op = ag   ? jo::Collective::kAgMatmul
         : rs ? jo::Collective::kMatmulRs
              : jo::Collective::kMatmulAr;
  q.transport = ParseTransport(transport);
  q.nranks = nranks;
  q.batch = batch;
  q.rows = rows;
  q.k = k;
  q.n = n;
  q.dtype = ParseDType(dtype);
  q.chunks = chunks;
  q.bidirectional = bidirectional;
  q.return_gathered = return_gathered;
  q.tf32 = tf32;  // as given: the executor itself must drop it for half types
  if (algorithm == "one_shot")
    q.algorithm = jo::ArAlgorithm::kOneShot;
  else if (algorithm != "two_shot")
    throw nb::value_error("algorithm: expected two_shot or one_shot");
  const bool one_shot = q.algorithm == jo::ArAlgorithm::kOneShot;
  const size_t es = static_cast<size_t>(jo::DTypeSize(q.dtype));
  const size_t x_elems = static_cast<size_t>(batch * (ag || one_shot ? rows : rows * nranks) * k);
  const size_t y_elems = static_cast<size_t>(batch * (rs || one_shot ? rows : rows * nranks) * n);
  const size_t g_elems = static_cast<size_t>(batch * rows * nranks * k);
  std::vector<void*> x(nranks), w(nranks), y(nranks), g(nranks, nullptr);
  for (int r = 0; r < nranks; ++r) {
    if (xs[r].size() != x_elems * es || ws[r].size() != static_cast<size_t>(k * n) * es)
      throw nb::value_error("xs/ws: wrong byte size");
    const int dev = static_cast<int>(devices[r]);
    x[r] = jo::fake::Malloc(dev, x_elems * es);
    w[r] = jo::fake::Malloc(dev, static_cast<size_t>(k * n) * es);
    y[r] = jo::fake::Malloc(dev, y_elems * es);
    std::memcpy(x[r], xs[r].c_str(), x_elems * es);
    std::memcpy(w[r], ws[r].c_str(), static_cast<size_t>(k * n) * es);
    std::memset(y[r], 0x7F, y_elems * es);  // unwritten output shows up as huge values
    if (return_gathered) {
      g[r] = jo::fake::Malloc(dev, g_elems * es);
      std::memset(g[r], 0x7F, g_elems * es);
    }
  }
  auto board = std::make_shared<Board>();
  if (processes && q.transport != jo::Transport::kNccl) {
    // Each played process gets its exchange for this clique (group 0), unless the test
    // registered its own (set_exchange); those of an earlier run keep their board.
    std::vector<int32_t> procs(processes->begin(), processes->end());
    std::sort(procs.begin(), procs.end());
    procs.erase(std::unique(procs.begin(), procs.end()), procs.end());
    for (int32_t p : procs)
      if (auto* played =
              dynamic_cast<PlayedExchange*>(jo::cuda::FindExchange(clique_key, 0, p).get()))
        board = played->board();
    for (int32_t p : procs)
      if (!jo::cuda::FindExchange(clique_key, 0, p))
        (void)jo::cuda::RegisterExchange(
            clique_key, 0, p,
            std::make_shared<PlayedExchange>(board, p, procs, timeout_ms,
                                             hosts && hosts->count(p) ? hosts->at(p) : ""));
  }
  // One call site, as one custom call of one executable: every rank's calls go through it.
  jo::CallDesc desc;
  desc.op = q.op;
  desc.transport = q.transport;
  desc.clique_key = clique_key;
  desc.axis = 0;
  desc.chunks = chunks;
  desc.bidirectional = bidirectional;
  desc.tf32 = tf32;
  desc.algorithm = q.algorithm;
  desc.timeout_ms = timeout_ms;
  desc.table.axis_size = nranks;
  // processes: which (played) process each rank belongs to; a clique spanning
  // them is one clique object per process, as in real life.
  desc.table.processes = processes ? *processes : std::vector<int64_t>(devices.size(), 0);
  desc.table.ordinals = devices;
  desc.table.device_ids = devices;
  desc.site_key = clique_key != 0 ? clique_key : 1;
  jo::cuda::CudaSite shared_site(desc, jo::CallSite::Instantiate(desc.site_key));
  std::vector<std::string> statuses(nranks);
  // hold_ms: XLA's stream of every rank first waits for a flag the host raises only after the
  // watchdog's clock moved on by hold_ms (earlier work the GPU is still busy with).
  std::vector<uint32_t*> holds(static_cast<size_t>(nranks), nullptr);
  {
    nb::gil_scoped_release release;
    std::vector<std::thread> threads;
    for (int r = 0; r < nranks; ++r)
      board->Start(static_cast<int32_t>(desc.table.processes[static_cast<size_t>(r)]));
    for (int r = 0; r < nranks; ++r)
      threads.emplace_back([&, r] {
        struct Stop {  // whichever way the thread returns
          Board& board;
          int32_t process;
          ~Stop() { board.Stop(process); }
        } stop{*board, static_cast<int32_t>(desc.table.processes[static_cast<size_t>(r)])};
        const jo::fake::HostThread host;  // a rank's thread, as XLA's per device
        const int dev = static_cast<int>(devices[r]);
        jo::fake::SetPlayedProcess(static_cast<int>(desc.table.processes[static_cast<size_t>(r)]));
        if (cudaSetDevice(dev) != cudaSuccess) {
          statuses[r] = "cudaSetDevice failed";
          return;
        }
        // Stands for XLA's stream of this device: one per (played process, device) until
        // reset(), as XLA keeps its compute stream (cuBLASLt workspaces are per stream).
        cudaStream_t xla =
            XlaStream(static_cast<int>(desc.table.processes[static_cast<size_t>(r)]), dev);
        if (xla == nullptr) {
          statuses[r] = "stream creation failed";
          return;
        }
        // tests: XLA captures this stream into a CUDA graph (a command buffer).
        if (capture) (void)cudaStreamBeginCapture(xla, cudaStreamCaptureModeThreadLocal);
        const jo::cuda::DriverApi* drv = nullptr;
        if (hold_ms > 0 && jo::cuda::LoadDriver(&drv).ok()) {
          holds[static_cast<size_t>(r)] = static_cast<uint32_t*>(jo::fake::Malloc(dev, 4));
          (void)drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(xla),
                                         reinterpret_cast<CUdeviceptr>(holds[r]), 1,
                                         CU_STREAM_WAIT_VALUE_GEQ);
        }
        jo::Problem problem = q;
        if (r == skew_rank) ++problem.chunks;  // tests: this rank disagrees on the call
        if (r == skip_rank) return;            // tests: this rank never makes the call
        jo::Caller caller;
        caller.process = desc.table.processes[static_cast<size_t>(r)];
        caller.device = dev;
        caller.naming = jo::DeviceNaming::kLocalOrdinal;
        const jo::CallBuffers io{x[r], w[r], y[r], g[r]};
        // site_keys: each rank calls through a site of its own, instantiated on its thread as
        // each process compiles its own program (equal keys: the same site).
        std::optional<jo::cuda::CudaSite> own;
        if (site_keys) {
          jo::CallDesc mine = desc;
          mine.site_key = (*site_keys)[static_cast<size_t>(r)];
          own.emplace(mine, jo::CallSite::Instantiate(mine.site_key));
        }
        jo::cuda::CudaSite& site = own ? *own : shared_site;
        for (int c = 0; c < calls && statuses[r].empty(); ++c) {
          // As XLA runs a thunk: the handler's work on other streams must be joined into
          // XLA's stream (or complete) when it returns, whatever its status.
          jo::fake::BeginHandler(xla);
          jo::Status status = site.Enqueue(caller, problem, io, xla);
          jo::fake::EndHandler(xla, "CudaSite::Enqueue (rank " + std::to_string(r) + ")");
          if (!status.ok()) statuses[r] = status.ToString();
        }
        if (capture) {
          cudaGraph_t graph = nullptr;
          (void)cudaStreamEndCapture(xla, &graph);
        }
      });
    for (auto& t : threads) t.join();
    if (hold_ms > 0) {
      jo::cuda::AdvanceWatchdogClock(std::chrono::milliseconds(hold_ms));
      for (uint32_t* flag : holds)
        if (flag != nullptr) *flag = 1;
    }
  }
  const bool drained = jo::fake::Drain();
  nb::list ys, gs, st;
  for (int r = 0; r < nranks; ++r) {
    ys.append(nb::bytes(static_cast<const char*>(y[r]), y_elems * es));
    gs.append(return_gathered ? nb::object(nb::bytes(static_cast<const char*>(g[r]), g_elems * es))
                              : nb::none());
    st.append(statuses[r].empty() ? nb::none() : nb::object(nb::str(statuses[r].c_str())));
  }
  nb::dict out;
  out["ys"] = ys;
  out["x_gathered"] = gs;
  out["statuses"] = st;
  out["drained"] = drained;
  return out;
}

// The watchdog's Abort racing an enqueue, as NcclComms orders them: an
// "enqueue" thread takes rank 0's lease (hold_lease) or takes the
// communicators and drops the lease at once (the misuse a lease prevents);
// then a "watchdog" thread aborts the clique's communicators while the
// enqueue thread waits; then the enqueue thread issues NCCL calls on the
// communicators it got and drops the lease. Returns the aborts done when
// Abort returned and at the end, a new Acquire's error, and the fake's record.
nb::dict LeaseRace(bool hold_lease) {
  Reset(2, 9, true, std::nullopt, 1, 0, true, false, true, 0, 0, false, std::nullopt);
  jo::cuda::ErrorContext ctx;
  ctx.op = "lease_race";
  ncclUniqueId id{};
  ncclGetUniqueId(&id);
  jo::cuda::NcclComms comms;
  const jo::Status made = comms.Create(
      {0, 1}, id, std::chrono::steady_clock::now() + std::chrono::seconds(10), "test", ctx);
  if (!made.ok()) throw std::runtime_error("NcclComms::Create failed: " + made.message());
  std::mutex mu;
  std::condition_variable cv;
  int stage = 0;  // 1: the enqueue thread has its communicators; 2: Abort returned
  auto wait_for = [&](int s) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return stage >= s; });
  };
  auto reach = [&](int s) {
    std::lock_guard<std::mutex> lock(mu);
    stage = s;
    cv.notify_all();
  };
  int64_t aborts_when_abort_returned = 0;
  std::thread enqueue([&] {
    jo::cuda::NcclComms::Lease lease;
    if (!comms.Acquire(0, ctx, &lease).ok()) return reach(1);
    const std::vector<ncclComm_t> mine = lease.ForStreams(3);
    if (!hold_lease) lease.Drop();
    reach(1);
    wait_for(2);
    cudaSetDevice(0);
    for (ncclComm_t comm : mine) {
      ncclResult_t state = ncclSuccess;
      if (comm != nullptr) (void)ncclCommGetAsyncError(comm, &state);
    }
    lease.Drop();
  });
  wait_for(1);
  std::thread watchdog([&] {
    comms.Abort();  // starts the aborts on threads of their own: await them here
    (void)comms.AwaitAborts(std::chrono::steady_clock::now() + std::chrono::seconds(10));
    aborts_when_abort_returned = jo::fake::Counters()["ncclCommAbort"];
  });
  watchdog.join();
  reach(2);
  enqueue.join();
  (void)comms.AwaitAborts(std::chrono::steady_clock::now() + std::chrono::seconds(10));
  jo::cuda::NcclComms::Lease again;
  const jo::Status late = comms.Acquire(0, ctx, &again);
  nb::dict out;
  out["aborts_when_abort_returned"] = aborts_when_abort_returned;
  out["aborts_at_end"] = jo::fake::Counters()["ncclCommAbort"];
  out["acquire_after_abort"] = late.ok() ? std::string() : late.message();
  out["errors"] = jo::fake::Errors();
  return out;
}

// The fake must fail loudly on what it does not model and on misuse, or the
// executor tests prove nothing. Each check does one wrong thing through the
// real API names and returns what the fake recorded ("" = not caught).
std::map<std::string, std::string> MisuseChecks() {
  std::map<std::string, std::string> out;
  auto check = [&](const std::string& name, auto&& body, int connections = 8) {
    Reset(4, 9, true, std::nullopt, 1, 0, true, true, true, connections, 0, false, std::nullopt);
    cudaSetDevice(0);
    body();
    jo::fake::Drain();
    const auto errors = jo::fake::Errors();
    out[name] = errors.empty() ? "" : errors.front();
  };
  auto stream_on = [](int device) {
    cudaSetDevice(device);
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    return s;
  };
  check("unmodeled cuBLASLt attribute", [] {
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const int32_t epilogue = CUBLASLT_EPILOGUE_RELU;
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
  });
  // A valid 4x4 f32 GEMM set-up, then one thing changed.
  auto gemm = [&](int32_t order, int64_t ld_d, bool misalign, bool c_differs) {
    cudaStream_t s = stream_on(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t la, lb, lc, ldd;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 4, 4, 4);
    cublasLtMatrixLayoutCreate(&ldd, CUDA_R_32F, 4, 4, ld_d);
    cublasLtMatrixLayoutSetAttribute(la, CUBLASLT_MATRIX_LAYOUT_ORDER, &order, sizeof(order));
    cublasLtMatmulPreference_t p = nullptr;
    cublasLtMatmulPreferenceCreate(&p);
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, ldd, p, 1, &r, &found);
    float* a = static_cast<float*>(jo::fake::Malloc(0, 64 * sizeof(float)));
    float* c = static_cast<float*>(jo::fake::Malloc(0, 64 * sizeof(float)));
    float* dst = static_cast<float*>(jo::fake::Malloc(0, 64 * sizeof(float)));
    const float one = 1.0f;
    cublasLtMatmul(h, d, &one, misalign ? a + 1 : a, la, a, lb, &one, c_differs ? c : dst, lc, dst,
                   ldd, &r.algo, nullptr, 0, s);
  };
  check("row-major layout", [&] { gemm(CUBLASLT_ORDER_ROW, 4, false, false); });
  check("leading dim below rows", [&] { gemm(CUBLASLT_ORDER_COL, 2, false, false); });
  check("misaligned pointer", [&] { gemm(CUBLASLT_ORDER_COL, 4, true, false); });
  check("C != D with different layouts", [&] { gemm(CUBLASLT_ORDER_COL, 8, false, true); });
  // A valid batched 4x4 f32 GEMM promising `align` bytes for every matrix, B's batch
  // stride `b_stride` elements: the promise must hold for leading dims and strides too.
  auto batched = [&](uint32_t align, int64_t b_stride) {
    cudaStream_t s = stream_on(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayout_t l[4];
    const int32_t batch = 2;
    for (int i = 0; i < 4; ++i) {
      cublasLtMatrixLayoutCreate(&l[i], CUDA_R_32F, 4, 4, 4);
      const int64_t stride = i == 1 ? b_stride : 16;
      cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch,
                                       sizeof(batch));
      cublasLtMatrixLayoutSetAttribute(l[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                       sizeof(stride));
    }
    cublasLtMatmulPreference_t p = nullptr;
    cublasLtMatmulPreferenceCreate(&p);
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      cublasLtMatmulPreferenceSetAttribute(p, attr, &align, sizeof(align));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, d, l[0], l[1], l[2], l[3], p, 1, &r, &found);
    float* a = static_cast<float*>(jo::fake::Malloc(0, 64 * sizeof(float)));
    float* dst = static_cast<float*>(jo::fake::Malloc(0, 64 * sizeof(float)));
    const float one = 1.0f;
    cublasLtMatmul(h, d, &one, a, l[0], a, l[1], &one, dst, l[2], dst, l[3], &r.algo, nullptr, 0,
                   s);
  };
  check("leading dim less aligned than promised", [&] { batched(32, 16); });
  check("batch stride less aligned than promised", [&] { batched(16, 17); });
  check("cublasLt tf32 with bf16", [&] {
    cudaStream_t s = stream_on(0);
    cublasLtHandle_t h = nullptr;
    cublasLtCreate(&h);
    cublasLtMatmulDesc_t d = nullptr;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F);
    cublasLtMatrixLayout_t l[4];
    for (auto& layout : l) cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 4, 4, 4);
    cublasLtMatmulPreference_t p = nullptr;
    cublasLtMatmulPreferenceCreate(&p);
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, d, l[0], l[1], l[2], l[3], p, 1, &r, &found);
    void* a = jo::fake::Malloc(0, 64 * sizeof(float));
    void* dst = jo::fake::Malloc(0, 64 * sizeof(float));
    const float one = 1.0f, zero = 0.0f;
    cublasLtMatmul(h, d, &one, a, l[0], a, l[1], &zero, dst, l[2], dst, l[3], &r.algo, nullptr, 0,
                   s);
  });
  check("copy out of range", [&] {
    cudaStream_t s = stream_on(0);
    void* a = jo::fake::Malloc(0, 64);
    void* b = jo::fake::Malloc(0, 64);
    cudaMemcpyAsync(static_cast<char*>(b) + 32, a, 64, cudaMemcpyDefault, s);
  });
  check("peer copy without peer access", [&] {
    cudaStream_t s = stream_on(0);
    void* a = jo::fake::Malloc(0, 64);
    void* b = jo::fake::Malloc(1, 64);
    cudaMemcpyAsync(b, a, 64, cudaMemcpyDefault, s);
  });
  check("wait on an event never recorded", [&] {
    cudaStream_t s = stream_on(0);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaStreamWaitEvent(s, e, 0);
  });
  check("flag never raised (deadlock)", [&] {
    const jo::cuda::DriverApi* drv = nullptr;
    (void)jo::cuda::LoadDriver(&drv);
    cudaStream_t s = stream_on(0);
    void* flag = jo::fake::Malloc(0, 4);
    if (drv != nullptr)
      drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag),
                               1, CU_STREAM_WAIT_VALUE_GEQ);
  });
  check("wait with FLUSH where remote writes cannot be flushed", [&] {
    const jo::cuda::DriverApi* drv = nullptr;
    (void)jo::cuda::LoadDriver(&drv);
    cudaStream_t s = stream_on(0);
    void* flag = jo::fake::Malloc(0, 4);
    if (drv != nullptr)
      drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag),
                               0, CU_STREAM_WAIT_VALUE_GEQ | CU_STREAM_WAIT_VALUE_FLUSH);
  });
  check("mismatched send/recv sizes", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    cudaStream_t s0 = stream_on(0), s1 = stream_on(1);
    void* a = jo::fake::Malloc(0, 64);
    void* b = jo::fake::Malloc(1, 64);
    cudaSetDevice(0);
    ncclSend(a, 16, ncclFloat32, 1, comms[0], s0);
    cudaSetDevice(1);
    ncclRecv(b, 8, ncclFloat32, 0, comms[1], s1);
  });
  check("multicast address outside a multimem kernel", [&] {
    const jo::cuda::DriverApi* drv = nullptr;
    (void)jo::cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    CUmulticastObjectProp prop{};
    prop.numDevices = 1;
    prop.size = size_t{2} << 20;
    CUmemGenericAllocationHandle mc = 0;
    drv->cuMulticastCreate(&mc, &prop);
    CUdeviceptr va = 0;
    drv->cuMemAddressReserve(&va, prop.size, 0, 0, 0);
    drv->cuMemMap(va, prop.size, 0, mc, 0);
    cudaStream_t s = stream_on(0);
    void* a = jo::fake::Malloc(0, 64);
    cudaMemcpyAsync(reinterpret_cast<void*>(va), a, 64, cudaMemcpyDefault, s);
  });
  check("IPC mapping touched by a device that did not open it", [&] {
    void* a = jo::fake::Malloc(0, 64);
    cudaIpcMemHandle_t handle{};
    cudaIpcGetMemHandle(&handle, a);
    cudaSetDevice(1);
    void* mapped = nullptr;
    cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess);
    cudaStream_t s = stream_on(2);
    void* b = jo::fake::Malloc(2, 64);
    cudaMemcpyAsync(b, mapped, 64, cudaMemcpyDefault, s);
  });
  check("cuMemMap mapping touched without cuMemSetAccess", [&] {
    const jo::cuda::DriverApi* drv = nullptr;
    (void)jo::cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
    const size_t bytes = size_t{2} << 20;
    CUmemGenericAllocationHandle h = 0, imported = 0;
    drv->cuMemCreate(&h, bytes, &prop, 0);
    CUmemFabricHandle fabric{};
    drv->cuMemExportToShareableHandle(&fabric, h, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    drv->cuMemImportFromShareableHandle(&imported, &fabric, CU_MEM_HANDLE_TYPE_FABRIC);
    CUdeviceptr va = 0;
    drv->cuMemAddressReserve(&va, bytes, 0, 0, 0);
    drv->cuMemMap(va, bytes, 0, imported, 0);
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = 1;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    drv->cuMemSetAccess(va, bytes, &desc, 1);  // device 1 only
    cudaStream_t s = stream_on(2);
    void* b = jo::fake::Malloc(2, 64);
    cudaMemcpyAsync(b, reinterpret_cast<void*>(va), 64, cudaMemcpyDefault, s);
  });
  // Two streams of one device share its only work queue (CUDA_DEVICE_MAX_CONNECTIONS=1):
  // the wait enqueued first blocks the write behind it that would satisfy it.
  auto wait_then_write = [&] {
    const jo::cuda::DriverApi* drv = nullptr;
    (void)jo::cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    cudaStream_t waits = stream_on(0), writes = stream_on(0);
    void* flag = jo::fake::Malloc(0, 4);
    drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(waits), reinterpret_cast<CUdeviceptr>(flag),
                             1, CU_STREAM_WAIT_VALUE_GEQ);
    drv->cuStreamWriteValue32(reinterpret_cast<CUstream>(writes),
                              reinterpret_cast<CUdeviceptr>(flag), 1,
                              CU_STREAM_WRITE_VALUE_DEFAULT);
  };
  check("blocked wait holds up its work queue", wait_then_write, 1);
  check("blocked wait, one work queue per stream (control)", wait_then_write, 8);
  // One communicator on two streams: rank 0 issues a receive on stream A,
  // then a send on stream B; rank 1 the same. Concurrent streams would
  // complete; NCCL serialises a communicator, so each receive waits for a
  // send the peer issued after its own receive.
  check("one communicator on two streams", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    for (int r = 0; r < 2; ++r) {
      cudaStream_t a = stream_on(r), b = stream_on(r);
      void* in = jo::fake::Malloc(r, 64);
      void* out = jo::fake::Malloc(r, 64);
      cudaSetDevice(r);
      ncclRecv(in, 16, ncclFloat32, 1 - r, comms[r], a);
      ncclSend(out, 16, ncclFloat32, 1 - r, comms[r], b);
    }
  });
  check("handler returns with a forked stream not joined", [&] {
    cudaStream_t xla = stream_on(0), side = stream_on(0);
    cudaEvent_t fork = nullptr;
    cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
    void* a = jo::fake::Malloc(0, 64);
    void* b = jo::fake::Malloc(0, 64);
    jo::fake::BeginHandler(xla);
    cudaEventRecord(fork, xla);
    cudaStreamWaitEvent(side, fork, 0);
    cudaMemcpyAsync(b, a, 64, cudaMemcpyDefault, side);  // ... and no join back into xla
    jo::fake::EndHandler(xla, "a deliberately broken handler");
  });
  check("communicator used after ncclCommAbort", [&] {
    ncclComm_t comms[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(comms, 2, devs);
    cudaStream_t s = stream_on(0);
    void* a = jo::fake::Malloc(0, 64);
    ncclCommAbort(comms[0]);  // as a watchdog would, from another thread
    cudaSetDevice(0);
    ncclSend(a, 16, ncclFloat32, 1, comms[0], s);
  });
  check("non-blocking communicator destroyed without finalize", [&] {
    ncclUniqueId id{};
    ncclGetUniqueId(&id);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t comm = nullptr;
    cudaSetDevice(0);
    ncclCommInitRankConfig(&comm, 1, id, 0, &config);
    ncclResult_t state = ncclInProgress;
    while (state == ncclInProgress) ncclCommGetAsyncError(comm, &state);
    ncclCommDestroy(comm);
  });
  check("host query of an event recorded in a stream capture", [&] {
    cudaStream_t s = stream_on(0);
    cudaEvent_t e = nullptr;
    cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    cudaEventRecord(e, s);
    (void)cudaEventQuery(e);
  });
  check("device synchronisation behind a wait that never ends", [&] {
    const jo::cuda::DriverApi* drv = nullptr;
    (void)jo::cuda::LoadDriver(&drv);
    if (drv == nullptr) return;
    cudaStream_t s = stream_on(0);
    void* flag = jo::fake::Malloc(0, 4);
    drv->cuStreamWaitValue32(reinterpret_cast<CUstream>(s), reinterpret_cast<CUdeviceptr>(flag), 1,
                             CU_STREAM_WAIT_VALUE_GEQ);
    (void)cudaDeviceSynchronize();
  });
  Reset(8, 9, true, std::nullopt, 1, 0, true, false, true, 0, 0, false, std::nullopt);
  return out;
}

std::optional<std::string> PlaceCheck(int64_t axis_size, std::vector<int64_t> processes,
                                      std::vector<int64_t> devices, int64_t process_index,
                                      int device) {
  jo::RankTable table{axis_size, std::move(processes), devices, devices};
  jo::Caller caller;
  caller.process = process_index;
  caller.device = device;
  caller.naming = jo::DeviceNaming::kLocalOrdinal;
  jo::Placement place;
  jo::Status status = jo::Place(table, caller, "ag_matmul", &place);
  if (!status.ok()) return status.message();
  return "rank " + std::to_string(place.rank) + " group " + std::to_string(place.group);
}

}  // namespace

NB_MODULE(_cuda_fake, m) {
  m.doc() =
      "Tests only: the CUDA executor linked against a host-side fake of CUDA, cuBLASLt and NCCL.";
  // The watchdog's time is what the fake lets pass while its GPU is stuck (reset's grace_ms).
  jo::cuda::UseVirtualWatchdogClock();
  m.def("reset", &Reset, nb::arg("devices") = 8, nb::arg("cc_major") = 9,
        nb::arg("multicast") = true, nb::arg("peer") = nb::none(), nb::arg("seed") = 1,
        nb::arg("grace_ms") = 0, nb::arg("shareable") = true, nb::arg("fabric") = false,
        nb::arg("imex_channel") = true, nb::arg("connections") = 0, nb::arg("cc_minor") = 0,
        nb::arg("flush_remote_writes") = false, nb::arg("kernel_images") = nb::none(),
        nb::arg("module_loading") = 0, nb::arg("host_jitter") = 0,
        "Forget every clique and fake object; configure the fake machine (connections: hardware "
        "work queues per device, 0: CUDA_DEVICE_MAX_CONNECTIONS from the environment; "
        "module_loading: 0 CUDA_MODULE_LOADING from the environment (lazy unless EAGER), 1 "
        "lazy, 2 eager; host_jitter: nonzero seeds uneven speeds of the ranks' host threads; "
        "kernel_images: the fatbinary's variants per kernel family, default this build's; "
        "grace_ms: the time a stuck GPU lets pass on the watchdog's virtual clock before the "
        "fake calls it a deadlock).");
  m.def("connections", &jo::fake::Connections,
        "Hardware work queues per device the fake models now.");
  m.def("run", &Run, nb::arg("op"), nb::arg("transport"), nb::arg("nranks"), nb::arg("batch"),
        nb::arg("rows"), nb::arg("k"), nb::arg("n"), nb::arg("dtype"), nb::arg("chunks"),
        nb::arg("bidirectional"), nb::arg("return_gathered"), nb::arg("xs"), nb::arg("ws"),
        nb::arg("devices"), nb::arg("clique_key") = 1, nb::arg("calls") = 1,
        nb::arg("skew_rank") = -1, nb::arg("skip_rank") = -1, nb::arg("timeout_ms") = 120000,
        nb::arg("processes") = nb::none(), nb::arg("hosts") = nb::none(),
        nb::arg("capture") = false, nb::arg("tf32") = false, nb::arg("hold_ms") = 0,
        nb::arg("algorithm") = "two_shot", nb::arg("site_keys") = nb::none());
  m.def("place", &PlaceCheck, nb::arg("axis_size"), nb::arg("processes"), nb::arg("devices"),
        nb::arg("process_index"), nb::arg("device"),
        "Rank-table lookup as the handlers do it: 'rank R group G' or the error text.");
  m.def("lease_race", &LeaseRace, nb::arg("hold_lease"),
        "The watchdog's NcclComms::Abort on another thread while an enqueue has the "
        "communicators (with or without its lease); what the fake recorded.");
  m.def("misuse_checks", &MisuseChecks,
        "Does one wrong thing per check through the faked APIs; what the fake recorded for each.");
  m.def("last_warning", &jo::LastWarning, "The last JO_WARN text (where an error started).");
  m.def("pending_watches", &jo::cuda::PendingWatches,
        "Ranks with calls the watchdog still watches.");
  m.def(
      "lazy_loading", &jo::fake::LazyLoading,
      "Whether the fake loads functions lazily (CUDA_MODULE_LOADING, or reset(module_loading=)).");
  m.def("wait_misuse_checks", &jo::fake::WaitMisuseChecks,
        "One deliberate misuse (and control) per rule about host calls that wait for the GPU: "
        "what the fake recorded for each.");
  m.def("errors", &jo::fake::Errors, "Every misuse the fake saw since reset().");
  m.def("counters", &jo::fake::Counters, "API calls made since reset(), by name.");
  m.def("drain", &jo::fake::Drain, "Run the fake streams to completion (False on deadlock).");
  m.def("cliques", &jo::cuda::DescribeCudaCliques, "One line per live GPU clique.");
  m.def("_reset_cliques", &jo::cuda::ResetCudaCliques,
        "Forget every clique (the fake keeps its state).");
  jo::python::BindCudaBootstrap(m);
  jo::python::BindFakeKernels(m);
}
