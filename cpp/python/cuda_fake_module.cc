// jaxoverlap._cuda_fake: the CUDA executor linked against the host-side fake
// (cpp/cuda/fake), for the tests. It only binds: the fake's configuration and
// reset, calls played on every rank of a clique (cuda/fake/fake_harness.h),
// the misuse suites (cuda/fake/fake_checks.h), what the fake recorded, and the
// rank-table lookup.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/call.h"
#include "core/log.h"
#include "cuda/cuda_site.h"
#include "cuda/fake/fake_checks.h"
#include "cuda/fake/fake_harness.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/watchdog.h"
#include "python/cuda_bootstrap_bindings.h"
#include "python/cuda_fake_kernels.h"

namespace nb = nanobind;

namespace {

using jo::fake::Config;

jo::Collective ParseOp(const std::string& s) {
  if (s == "ag_matmul") return jo::Collective::kAgMatmul;
  if (s == "matmul_rs") return jo::Collective::kMatmulRs;
  if (s == "matmul_ar") return jo::Collective::kMatmulAr;
  throw nb::value_error("op: expected ag_matmul, matmul_rs or matmul_ar");
}

jo::DType ParseDType(const char* what, const std::string& s) {
  if (s == "float32") return jo::DType::kF32;
  if (s == "bfloat16") return jo::DType::kBF16;
  if (s == "float16") return jo::DType::kF16;
  if (s == "float8_e4m3fn") return jo::DType::kF8E4M3;
  if (s == "float8_e5m2") return jo::DType::kF8E5M2;
  throw nb::value_error((std::string(what) +
                         ": expected float32, bfloat16, float16, float8_e4m3fn or float8_e5m2, "
                         "got " +
                         s)
                            .c_str());
}

jo::Transport ParseTransport(const std::string& s) {
  if (s == "nccl") return jo::Transport::kNccl;
  if (s == "p2p") return jo::Transport::kP2p;
  if (s == "multicast") return jo::Transport::kMulticast;
  throw nb::value_error(("transport: expected nccl, p2p or multicast, got " + s).c_str());
}

jo::ArAlgorithm ParseAlgorithm(const std::string& s) {
  if (s == "two_shot") return jo::ArAlgorithm::kTwoShot;
  if (s == "one_shot") return jo::ArAlgorithm::kOneShot;
  throw nb::value_error("algorithm: expected two_shot or one_shot");
}

// Config as _cuda_fake.Config: each field an attribute and a keyword argument
// of the constructor (Config(devices=4, grace_ms=100)); fake_runtime.h says
// what each means. pass_time is the harness's (the watchdog's clock).
void BindConfig(nb::module_& m) {
  nb::class_<Config> cls(m, "Config",
                         "The fake machine reset() makes (cpp/cuda/fake/fake_runtime.h, Config).");
  using Setter = std::function<void(Config&, nb::handle)>;
  auto setters = std::make_shared<std::map<std::string, Setter>>();
  auto field = [&](const char* name, auto Config::* member, const char* doc) {
    using T = std::remove_reference_t<decltype(std::declval<Config&>().*member)>;
    cls.def_rw(name, member, doc);
    (*setters)[name] = [member](Config& c, nb::handle value) { c.*member = nb::cast<T>(value); };
  };
  field("devices", &Config::devices, "GPUs per played process.");
  field("cc_major", &Config::cc_major, "Compute capability, major.");
  field("cc_minor", &Config::cc_minor, "Compute capability, minor.");
  field("sms", &Config::sms, "Multiprocessors per GPU (the fused GEMM's persistent CTAs).");
  field("multicast", &Config::multicast, "The driver has the multicast entry points.");
  field("shareable", &Config::shareable, "Memory exports to POSIX fds.");
  field("fabric", &Config::fabric, "Fabric handles are supported (multi-node NVLink).");
  field("imex_channel", &Config::imex_channel, "This user may use fabric handles.");
  field("flush_remote_writes", &Config::flush_remote_writes,
        "CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES.");
  field("peer", &Config::peer, "peer[a][b]: GPU a may access GPU b ([]: all pairs).");
  field("seed", &Config::seed, "Seeds the order the fake GPU runs startable work in.");
  field("grace_ms", &Config::grace_ms,
        "The time a stuck GPU lets pass on the watchdog's virtual clock before the fake calls "
        "it a deadlock.");
  field("connections", &Config::connections,
        "Hardware work queues per device; 0: CUDA_DEVICE_MAX_CONNECTIONS from the environment.");
  field("module_loading", &Config::module_loading,
        "0: CUDA_MODULE_LOADING from the environment (lazy unless EAGER), 1 lazy, 2 eager.");
  field("host_jitter", &Config::host_jitter,
        "Nonzero: seeds uneven speeds of the ranks' host threads.");
  field("kernel_images", &Config::kernel_images,
        "The fatbinary's variants per kernel family; None: this build's.");
  field("fused_flag_shift", &Config::fused_flag_shift,
        "Tests: the fused GEMM waits for the flag of block b + this (an off-by-one mapping).");
  cls.def(
      "__init__",
      [setters](Config* self, nb::kwargs kwargs) {
        Config config;
        for (auto [key, value] : kwargs) {
          const std::string name = nb::cast<std::string>(key);
          const auto setter = setters->find(name);
          if (setter == setters->end())
            throw nb::type_error(("Config: no field '" + name + "'").c_str());
          try {
            setter->second(config, value);
          } catch (const nb::cast_error&) {
            throw nb::type_error(("Config: field '" + name + "' got a value of the wrong type: " +
                                  nb::cast<std::string>(nb::repr(value)))
                                     .c_str());
          }
        }
        new (self) Config(std::move(config));
      },
      "Config(**fields): the defaults but for the fields given.");
}

// Runs `calls` back-to-back calls on every rank (fake_harness.h, PlayCalls);
// returns ys, x_gathered (per rank, bytes or None), statuses (per rank: None
// or the error text) and drained.
nb::dict Run(const std::string& op, const std::string& transport, int nranks, int64_t batch,
             int64_t rows, int64_t k, int64_t cols, const std::string& dtype, int64_t chunks,
             bool bidirectional, bool return_gathered, std::vector<nb::bytes> xs,
             std::vector<nb::bytes> ws, std::vector<int64_t> devices, int64_t clique_key, int calls,
             int skew_rank, int skip_rank, int64_t timeout_ms,
             std::optional<std::vector<int64_t>> processes,
             std::optional<std::map<int32_t, std::string>> hosts, bool capture, bool tf32,
             int64_t hold_ms, const std::string& algorithm, const std::string& w_dtype,
             const std::string& out_dtype, std::vector<float> x_scales, std::vector<float> w_scales,
             std::vector<int64_t> chunks_per_call, bool fused,
             std::optional<std::vector<int64_t>> site_keys) {
  jo::fake::PlayedCalls played;
  jo::Problem& q = played.problem;
  q.op = ParseOp(op);
  q.transport = ParseTransport(transport);
  q.nranks = nranks;
  q.batch = batch;
  q.rows = rows;
  q.k = k;
  q.cols = cols;
  // dtype is x's; w's and y's default to it.
  q.x_dtype = ParseDType("dtype", dtype);
  q.w_dtype = w_dtype.empty() ? q.x_dtype : ParseDType("w_dtype", w_dtype);
  q.out_dtype = out_dtype.empty() ? q.x_dtype : ParseDType("out_dtype", out_dtype);
  q.chunks = chunks;
  q.bidirectional = bidirectional;
  q.return_gathered = return_gathered;
  q.tf32 = tf32;  // as given: the executor itself must drop it for half types
  q.algorithm = ParseAlgorithm(algorithm);
  q.fused = fused;
  for (const nb::bytes& x : xs) played.xs.emplace_back(x.c_str(), x.size());
  for (const nb::bytes& w : ws) played.ws.emplace_back(w.c_str(), w.size());
  played.x_scales = std::move(x_scales);
  played.w_scales = std::move(w_scales);
  played.devices = std::move(devices);
  played.processes = std::move(processes);
  if (hosts) played.hosts = std::move(*hosts);
  played.clique_key = clique_key;
  played.site_keys = std::move(site_keys);
  played.calls = calls;
  played.skew_rank = skew_rank;
  played.skip_rank = skip_rank;
  played.timeout_ms = timeout_ms;
  played.capture = capture;
  played.hold_ms = hold_ms;
  played.chunks_per_call = std::move(chunks_per_call);
  jo::fake::PlayedOutcome outcome;
  jo::Status status;
  {
    nb::gil_scoped_release release;
    status = jo::fake::PlayCalls(played, &outcome);
  }
  if (status.code() == jo::Code::kInvalidArgument) throw nb::value_error(status.message().c_str());
  if (!status.ok()) throw std::runtime_error(status.message());
  nb::list ys, gs, st;
  for (int r = 0; r < nranks; ++r) {
    ys.append(nb::bytes(outcome.ys[r].data(), outcome.ys[r].size()));
    gs.append(return_gathered ? nb::object(nb::bytes(outcome.x_gathered[r].data(),
                                                     outcome.x_gathered[r].size()))
                              : nb::none());
    st.append(outcome.statuses[r].empty() ? nb::none()
                                          : nb::object(nb::str(outcome.statuses[r].c_str())));
  }
  nb::dict out;
  out["ys"] = ys;
  out["x_gathered"] = gs;
  out["statuses"] = st;
  out["drained"] = outcome.drained;
  return out;
}

nb::dict LeaseRace(bool hold_lease) {
  jo::fake::LeaseRaceOutcome outcome;
  const jo::Status status = jo::fake::LeaseRace(hold_lease, &outcome);
  if (!status.ok()) throw std::runtime_error(status.message());
  nb::dict out;
  out["aborts_when_abort_returned"] = outcome.aborts_when_abort_returned;
  out["aborts_at_end"] = outcome.aborts_at_end;
  out["acquire_after_abort"] = outcome.acquire_after_abort;
  out["errors"] = outcome.errors;
  return out;
}

nb::dict StuckAbort(bool stuck) {
  jo::fake::StuckAbortOutcome outcome;
  jo::Status status;
  {
    nb::gil_scoped_release release;
    status = jo::fake::StuckAbort(stuck, &outcome);
  }
  if (!status.ok()) throw std::runtime_error(status.message());
  nb::dict out;
  out["warning"] = outcome.warning;
  out["errors"] = outcome.errors;
  return out;
}

nb::dict LateCall(bool finish) {
  jo::fake::LateCallOutcome outcome;
  jo::Status status;
  {
    nb::gil_scoped_release release;
    status = jo::fake::LateCall(finish, &outcome);
  }
  if (!status.ok()) throw std::runtime_error(status.message());
  nb::dict out;
  out["warning"] = outcome.warning;
  out["broken"] = outcome.broken;
  out["gen_alive_after_watchdog"] = outcome.gen_alive_after_watchdog;
  out["gen_freed_with_clique"] = outcome.gen_freed_with_clique;
  out["pending_after"] = outcome.pending_after;
  out["errors"] = outcome.errors;
  return out;
}

nb::dict GemmSetUpRace() {
  jo::fake::GemmSetUpRaceOutcome outcome;
  jo::Status status;
  {
    nb::gil_scoped_release release;
    status = jo::fake::GemmSetUpRace(&outcome);
  }
  if (!status.ok()) throw std::runtime_error(status.message());
  nb::dict out;
  out["enqueue_waited"] = outcome.enqueue_waited;
  out["set_up"] = outcome.set_up;
  out["enqueue"] = outcome.enqueue;
  out["errors"] = outcome.errors;
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
  // The watchdog's time is what the fake lets pass while its GPU is stuck (Config.grace_ms).
  jo::cuda::UseVirtualWatchdogClock();
  BindConfig(m);
  m.def("reset", &jo::fake::ResetExecutorAndFake, nb::arg("config") = Config(),
        "Forget every clique, cache and fake object; the fake machine is `config` (a Config).");
  m.def("connections", &jo::fake::Connections,
        "Hardware work queues per device the fake models now.");
  m.def("run", &Run, nb::arg("op"), nb::arg("transport"), nb::arg("nranks"), nb::arg("batch"),
        nb::arg("rows"), nb::arg("k"), nb::arg("cols"), nb::arg("dtype"), nb::arg("chunks"),
        nb::arg("bidirectional"), nb::arg("return_gathered"), nb::arg("xs"), nb::arg("ws"),
        nb::arg("devices"), nb::arg("clique_key") = 1, nb::arg("calls") = 1,
        nb::arg("skew_rank") = -1, nb::arg("skip_rank") = -1, nb::arg("timeout_ms") = 120000,
        nb::arg("processes") = nb::none(), nb::arg("hosts") = nb::none(),
        nb::arg("capture") = false, nb::arg("tf32") = false, nb::arg("hold_ms") = 0,
        nb::arg("algorithm") = "two_shot", nb::arg("w_dtype") = "", nb::arg("out_dtype") = "",
        nb::arg("x_scales") = std::vector<float>(), nb::arg("w_scales") = std::vector<float>(),
        nb::arg("chunks_per_call") = std::vector<int64_t>(), nb::arg("fused") = false,
        nb::arg("site_keys") = nb::none(),
        "Plays `calls` calls on every rank (fake_harness.h, PlayCalls). dtype is x's (w_dtype "
        "and out_dtype default to it); xs and ws are bytes as the handler receives them (an "
        "fp8 w K-major: [cols, k] row-major); x_scales / w_scales: one float32 per rank "
        "(empty: 1); chunks_per_call: per call, its chunks (a call site per number of chunks); "
        "fused: the fused GEMM's program (docs/gpu.md §10); site_keys: per rank, the key of a "
        "call site of its own (none: one site shared by every rank).");
  m.def("place", &PlaceCheck, nb::arg("axis_size"), nb::arg("processes"), nb::arg("devices"),
        nb::arg("process_index"), nb::arg("device"),
        "Rank-table lookup as the handlers do it: 'rank R group G' or the error text.");
  m.def("lease_race", &LeaseRace, nb::arg("hold_lease"),
        "The watchdog's NcclComms::Abort on another thread while an enqueue has the "
        "communicators (with or without its lease); what the fake recorded.");
  m.def("stuck_abort", &StuckAbort, nb::arg("stuck"),
        "An ncclCommAbort that cannot return (stuck=True) or can: the watchdog's warning, and "
        "what the fake recorded.");
  m.def("late_call", &LateCall, nb::arg("finish"),
        "A call the watchdog found late; with finish=True it finishes (and the test drops its "
        "generation reference) between the pass and the firing: what the watchdog did.");
  m.def("gemm_set_up_race", &GemmSetUpRace,
        "A GEMM enqueued (prepared before) while another thread's GEMM set-up waits for the "
        "device: whether the enqueue waited for it, both statuses, what the fake recorded.");
  m.def("misuse_checks", &jo::fake::MisuseChecks,
        "Does one wrong thing per check through the faked APIs; what the fake recorded for each.");
  m.def("last_warning", &jo::LastWarning, "The last JO_WARN text (where an error started).");
  m.def("pending_watches", &jo::cuda::PendingWatches,
        "Ranks with calls the watchdog still watches.");
  m.def(
      "lazy_loading", &jo::fake::LazyLoading,
      "Whether the fake loads functions lazily (CUDA_MODULE_LOADING, or Config(module_loading=)).");
  m.def("wait_misuse_checks", &jo::fake::WaitMisuseChecks,
        "One deliberate misuse (and control) per rule about host calls that wait for the GPU: "
        "what the fake recorded for each.");
  m.def("reduce_misuse_checks", &jo::fake::ReduceMisuseChecks,
        "The fused GEMM + reduce-scatter's reduction beside the kernel: a block read before its "
        "release, a reduction sized to SMs the kernel does not leave (and the control): what the "
        "fake recorded for each.");
  m.def("fp8_misuse_checks", &jo::fake::Fp8MisuseChecks,
        "One deliberate misuse (and controls) per cuBLASLt FP8 rule the fake models: what the "
        "fake recorded for each.");
  m.def("errors", &jo::fake::Errors, "Every misuse the fake saw since reset().");
  m.def("counters", &jo::fake::Counters, "API calls made since reset(), by name.");
  m.def("drain", &jo::fake::Drain, "Run the fake streams to completion (False on deadlock).");
  m.def("cliques", &jo::cuda::DescribeCudaCliques, "One line per live GPU clique.");
  m.def("_reset_cliques", &jo::cuda::ResetCudaCliques,
        "Forget every clique (the fake keeps its state).");
  jo::python::BindCudaBootstrap(m);
  jo::python::BindFakeKernels(m);
}
