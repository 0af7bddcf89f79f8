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

#include <chrono>
#include <cstdint>
#include <cstring>
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
#include "cuda/fake/fp8_accumulator.h"
#include "cuda/watchdog.h"
#include "python/cuda_bootstrap_bindings.h"
#include "python/cuda_fake_kernels.h"
#include "python/cuda_loopback_bindings.h"
#include "python/kinds_bindings.h"

namespace nb = nanobind;

namespace {

using jo::fake::Config;

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
  field("fused_scale_shard_shift", &Config::fused_scale_shard_shift,
        "Tests: the FP8 fused GEMM scales each row by the scale of the shard this many after "
        "its own (a tile with the wrong shard's scale).");
  field("fused_pair_leader_waits_only", &Config::fused_pair_leader_waits_only,
        "Tests: the sm100 fused GEMM's 2-SM pairs wait in the leader CTA only, for its own "
        "rows; the peer CTA loads its half unwaited.");
  field("allreduce_misuse", &Config::allreduce_misuse,
        "Tests: the one-launch all-reduce's phases run wrongly: 'release_early' or "
        "'read_early' (fake_allreduce.cc); 'rank0_gives_up': rank 0's waits time out at once.");
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

// Sets the fields of PlayedCalls beside its problem (fake_harness.h) from
// keyword arguments of the same names; xs and ws are lists of bytes.
void SetPlayed(jo::fake::PlayedCalls& played, const nb::kwargs& kwargs) {
  using Played = jo::fake::PlayedCalls;
  using Setter = std::function<void(Played&, nb::handle)>;
  static const auto* setters = [] {
    auto* s = new std::map<std::string, Setter>;
    const auto field = [&](const char* name, auto Played::* member) {
      using T = std::remove_reference_t<decltype(std::declval<Played&>().*member)>;
      (*s)[name] = [member](Played& p, nb::handle value) { p.*member = nb::cast<T>(value); };
    };
    const auto bytes = [&](const char* name, std::vector<std::string> Played::* member) {
      (*s)[name] = [member](Played& p, nb::handle value) {
        for (nb::handle b : value) {
          const nb::bytes data = nb::cast<nb::bytes>(b);
          (p.*member).emplace_back(data.c_str(), data.size());
        }
      };
    };
    bytes("xs", &Played::xs);
    bytes("ws", &Played::ws);
    bytes("x_block_scales", &Played::x_block_scales);
    bytes("w_block_scales", &Played::w_block_scales);
    field("x_scales", &Played::x_scales);
    field("w_scales", &Played::w_scales);
    field("devices", &Played::devices);
    field("processes", &Played::processes);
    (*s)["hosts"] = [](Played& p, nb::handle value) {
      if (!value.is_none()) p.hosts = nb::cast<std::map<int32_t, std::string>>(value);
    };
    field("clique_key", &Played::clique_key);
    field("site_keys", &Played::site_keys);
    field("calls", &Played::calls);
    field("chunks_per_call", &Played::chunks_per_call);
    field("skew_rank", &Played::skew_rank);
    field("skip_rank", &Played::skip_rank);
    field("timeout_ms", &Played::timeout_ms);
    field("capture", &Played::capture);
    field("hold_ms", &Played::hold_ms);
    field("setup_pause_ms", &Played::setup_pause_ms);
    field("replays", &Played::replays);
    (*s)["replay_xs"] = [](Played& p, nb::handle value) {
      for (nb::handle per_rank : value) {
        std::vector<std::string>& replay = p.replay_xs.emplace_back();
        for (nb::handle b : per_rank) {
          const nb::bytes data = nb::cast<nb::bytes>(b);
          replay.emplace_back(data.c_str(), data.size());
        }
      }
    };
    field("replay_late_rank", &Played::replay_late_rank);
    field("replay_skip_rank", &Played::replay_skip_rank);
    field("y_offsets", &Played::y_offsets);
    field("capture_any", &Played::capture_any);
    field("late_rank", &Played::late_rank);
    field("late_from", &Played::late_from);
    return s;
  }();
  for (auto [key, value] : kwargs) {
    const std::string name = nb::cast<std::string>(key);
    const auto setter = setters->find(name);
    if (setter == setters->end())
      throw nb::type_error(
          ("run: no argument '" + name + "' (fake_harness.h PlayedCalls)").c_str());
    try {
      setter->second(played, value);
    } catch (const nb::cast_error&) {
      throw nb::type_error(("run: argument '" + name + "' got a value of the wrong type: " +
                            nb::cast<std::string>(nb::repr(value)))
                               .c_str());
    }
  }
}

// Plays the calls of `problem` (a dict as _host.build_program returns it; tf32
// as given: the executor itself must drop it for half types) on every rank
// (fake_harness.h, PlayCalls); returns ys, x_gathered (per rank, bytes or
// None), statuses (per rank: None or the error text) and drained.
nb::dict Run(const nb::dict& problem, const nb::kwargs& kwargs) {
  jo::fake::PlayedCalls played;
  played.problem = jo::python::ProblemFromDict(problem);
  SetPlayed(played, kwargs);
  const jo::Problem& q = played.problem;
  const int nranks = q.nranks;
  const bool return_gathered = q.return_gathered;
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
  nb::list replay_ys;
  for (const auto& per_rank : outcome.replay_ys) {
    nb::list one;
    for (const std::string& y : per_rank) one.append(nb::bytes(y.data(), y.size()));
    replay_ys.append(one);
  }
  out["replay_ys"] = replay_ys;
  out["replay_drained"] = outcome.replay_drained;
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

nb::dict WatchdogQueryRace() {
  jo::fake::WatchdogQueryRaceOutcome outcome;
  jo::Status status;
  {
    nb::gil_scoped_release release;
    status = jo::fake::WatchdogQueryRace(&outcome);
  }
  if (!status.ok()) throw std::runtime_error(status.message());
  nb::dict out;
  out["query_blocked"] = outcome.query_blocked;
  out["watch_waited"] = outcome.watch_waited;
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

// The fake's FP8 tensor core of compute capability `arch` (fp8_accumulator.h).
nb::dict Fp8TensorCore(int arch) {
  const jo::fake::Fp8TensorCore core = jo::fake::Fp8TensorCoreOf(arch);
  nb::dict out;
  out["block"] = core.block;
  out["fraction_bits"] = core.FractionBits();
  out["promotion"] = core.promotion;
  return out;
}

// sum_p a[p] * b[p] as that tensor core accumulates it (a in `a_dtype`, b in `b_dtype`: their
// smallest normal exponents matter).
float Fp8Dot(int arch, const std::vector<float>& a, const std::vector<float>& b,
             const std::string& a_dtype, const std::string& b_dtype) {
  if (a.size() != b.size()) throw nb::value_error("fp8_dot: a and b need the same length");
  const auto min_exponent = [](const std::string& d) {
    const jo::DType t = jo::python::ParseDTypeArg("dtype", d);
    if (!jo::IsFp8(t)) throw nb::value_error("fp8_dot: float8_e4m3fn or float8_e5m2 only");
    return t == jo::DType::kF8E5M2 ? jo::fake::kE5M2MinExponent : jo::fake::kE4M3MinExponent;
  };
  jo::fake::Fp8Accumulator acc(jo::fake::Fp8TensorCoreOf(arch), min_exponent(a_dtype),
                               min_exponent(b_dtype));
  for (size_t i = 0; i < a.size(); ++i) acc.Add(a[i], b[i]);
  return acc.Result();
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
  m.def("run", &Run, nb::arg("problem"), nb::arg("kwargs"),
        "run(problem, *, xs, ws, devices, **played): plays the calls of `problem` (a dict with "
        "the keys of _host.build_program's) on every rank (fake_harness.h, PlayCalls). The "
        "keywords are PlayedCalls' fields: xs and ws bytes per rank as the handler receives "
        "them (an fp8 w K-major: [cols, k] row-major); x_scales / w_scales one float32 per "
        "rank (empty: 1); devices, processes, hosts; clique_key, site_keys (per rank, the key "
        "of a call site of its own; none: one site shared by every rank); calls, "
        "chunks_per_call (per call, its chunks: a call site per number of chunks); skew_rank, "
        "skip_rank, timeout_ms, capture, hold_ms, setup_pause_ms (real time the first event "
        "poll of a set-up pauses); late_rank (that rank starts each call from late_from on only "
        "once the others have returned from it); capture: then each rank's "
        "thread captures one more call into a graph, launched `replays` times (replay_xs[i]: x "
        "per rank before replay i; replay_late_rank: launched once the others ran as far as "
        "they can; replay_skip_rank: not launched in the last replay; capture_any: record a "
        "program that does not replay); y_offsets (per rank: "
        "y that many bytes into its allocation) -> replay_ys, replay_drained.");
  m.def("fp8_tensor_core", &Fp8TensorCore, nb::arg("arch"),
        "The FP8 accumulator the fake models for compute capability `arch` (10 * major + "
        "minor): block, fraction_bits, promotion (cpp/cuda/fake/fp8_accumulator.h).");
  m.def("fp8_dot", &Fp8Dot, nb::arg("arch"), nb::arg("a"), nb::arg("b"), nb::arg("a_dtype"),
        nb::arg("b_dtype"),
        "sum(a * b) in K order as that FP8 tensor core accumulates it (a and b: fp8 values).");
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
  m.def("watchdog_query_race", &WatchdogQueryRace,
        "A handler's Watch while the watchdog's pass is inside a CUDA query that blocks: "
        "whether the pass reached it and whether Watch waited for it.");
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
  m.def("flag_wait_misuse_checks", &jo::fake::FlagWaitMisuseChecks,
        "The bounded flag-wait kernel: launches the fake refuses, a wait that gives up (its "
        "record) and the control: what the fake recorded for each.");
  m.def("reduce_misuse_checks", &jo::fake::ReduceMisuseChecks,
        "The fused GEMM + reduce-scatter's reduction beside the kernel: a block read before its "
        "release, a reduction sized to SMs the kernel does not leave (and the control): what the "
        "fake recorded for each.");
  m.def("graph_checks", &jo::fake::GraphChecks,
        "Stream capture of two streams and graph replay: a misuse (a fork not joined back) and "
        "the controls; what the fake recorded for each.");
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
  // The loopback runner on the fake: each rank's thread is a HostThread (the fake's deadlock
  // accounting), each call a handler (what runs between its first enqueue and its return is
  // checked), and the fake's device memory is host memory.
  jo::python::BindLoopback(m, [] {
    jo::cuda::LoopbackHooks hooks;
    hooks.rank_thread = [] {
      return std::shared_ptr<void>(std::make_shared<jo::fake::HostThread>());
    };
    hooks.begin_handler = [](cudaStream_t s) { jo::fake::BeginHandler(s); };
    hooks.end_handler = [](cudaStream_t s, const std::string& who) {
      jo::fake::EndHandler(s, who);
    };
    hooks.upload = [](void* device, const void* host, size_t bytes) {
      std::memcpy(device, host, bytes);
      return jo::OkStatus();
    };
    hooks.download = [](void* host, const void* device, size_t bytes) {
      std::memcpy(host, device, bytes);
      return jo::OkStatus();
    };
    // One pass of the watchdog, as its thread makes one every 20 ms (as PlayCalls does).
    hooks.finished = [] { jo::cuda::AdvanceWatchdogClock(std::chrono::milliseconds(20)); };
    return hooks;
  });
}
