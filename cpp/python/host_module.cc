// jaxoverlap._host: the always-built native module.
//
// Exposes (1) the CPU FFI handlers as capsules through registrations(),
// (2) the program builder, so Python tests and jaxoverlap.sim read the very
// programs the executors run, (3) the multi-process bootstrap's pieces
// (shared-memory domains, fd passing) and (4) build information. Test-only
// helpers live in a module of their own that is not installed
// (cpp/python/testing_module.cc).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "core/allreduce_layout.h"
#include "core/build.h"
#include "core/check_program.h"
#include "core/deadline.h"
#include "core/program.h"
#include "core/trace.h"
#include "ffi/ffi_call.h"
#include "host/blas.h"
#include "host/fd_share.h"
#include "host/ffi_handlers.h"
#include "host/host_site.h"
#include "host/shm.h"
#include "host/shm_domain.h"
#include "python/ffi_capsule.h"
#include "python/kinds_bindings.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

std::string CompilerName() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return "gcc " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
         std::to_string(__GNUC_PATCHLEVEL__);
#else
  return "unknown";
#endif
}

// The transports' names, in id order (core/kinds.h).
nb::tuple Transports() {
  nb::list names;
  for (const jo::TransportRow& row : jo::kTransports) names.append(row.name);
  return nb::tuple(names);
}

nb::dict BuildInfo() {
  nb::dict info;
  info["version"] = JO_VERSION;
  info["compiler"] = CompilerName();
  info["cxx_standard"] = static_cast<long>(__cplusplus);
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["jaxlib_headers"] = JO_JAXLIB_VERSION;
  info["blas"] = JO_BLAS_NAME;
  info["gemm"] = jo::host::BlasName();
  info["transports"] = Transports();
  // heap for in-process cliques; POSIX shm for cliques spanning processes.
  info["workspace"] = "heap in one process, POSIX shared memory across processes";
  return info;
}

using jo::python::Encapsulate;

// name -> {stage: capsule}, the dict form of jax.ffi.register_ffi_target. Every
// target runs the same handler (the `op` attribute tells the ops apart); one
// name per op keeps them apart in HLO and in profiles.
nb::dict Registrations() {
  nb::dict out;
  for (const jo::OpRow& row : jo::kOps) {
    nb::dict stages;
    stages["instantiate"] = Encapsulate(jo::host::InstantiateHandler);
    stages["execute"] = Encapsulate(jo::host::ExecuteHandler);
    out[(std::string("jaxoverlap_") + row.name).c_str()] = stages;
  }
  return out;
}

// name -> {"type_id", "type_info"} for jax.ffi.register_ffi_type (register
// these before the targets, and after the CPU backend exists).
nb::dict Types() {
  nb::dict site;
  site["type_id"] = nb::capsule(jo::host::SiteTypeId());
  site["type_info"] = nb::capsule(const_cast<void*>(jo::host::SiteTypeInfo()));
  nb::dict out;
  out["jaxoverlap_call_site"] = site;
  return out;
}

// The canonical problem of a call (core/call.h CanonicalProblem) as a dict:
// batch, rows, k, n and the results' shapes; ValueError for shapes the op
// does not take.
nb::dict CanonicalProblemDict(const std::string& op, const std::vector<int64_t>& x_shape,
                              const std::vector<int64_t>& w_shape, int64_t axis, int nranks,
                              const std::string& algorithm) {
  jo::Problem base;
  base.op = jo::python::ParseOpArg("op", op);
  base.algorithm = jo::python::ParseAlgorithmArg("algorithm", algorithm);
  base.nranks = nranks;
  jo::Problem q;
  jo::ResultShapes shapes;
  const jo::Status status = jo::CanonicalProblem(base, x_shape, w_shape, axis, &q, &shapes);
  if (!status.ok()) throw nb::value_error(status.message().c_str());
  nb::dict d;
  d["batch"] = q.batch;
  d["rows"] = q.rows;
  d["k"] = q.k;
  d["n"] = q.cols;
  d["y"] = nb::tuple(nb::cast(shapes.y));
  d["x_gathered"] = nb::tuple(nb::cast(shapes.x_gathered));
  return d;
}

jo::Program Build(const jo::Problem& q) {
  jo::Program program;
  jo::Status status = jo::BuildProgram(q, &program);
  if (!status.ok()) throw nb::value_error(status.ToString().c_str());
  return program;
}

nb::dict RefDict(const jo::Ref& ref) {
  nb::dict d;
  d["buf"] = jo::BufName(ref.buf);
  d["rank"] = ref.rank;
  d["offset"] = ref.offset;
  d["batch_stride"] = ref.batch_stride;
  d["ld"] = ref.ld;
  return d;
}

// A FusedGemm's row blocks (core/program.h FusedBlocks): shards x chunks
// blocks of the rows, their order, waits (flag wait_flags + b, -1: none) and
// releases (flag release_flags + b, -1: none), fp8 x's scale slot per shard
// (x_scale_stride 1) or one for all rows (0).
nb::dict FusedDict(const jo::FusedBlocks& f) {
  nb::dict d;
  d["shards"] = f.rows.shards;
  d["chunks"] = f.rows.chunks;
  d["shard_rows"] = f.rows.shard_rows;
  d["order"] = f.key == jo::fused::OrderKey::kLastArrival ? "last_arrival" : "first_departure";
  d["sequence"] = f.sequence;
  d["wait_flags"] = f.wait_flags;
  d["ready_shard"] = f.ready_shard;
  d["writers"] = f.writers;
  d["release_flags"] = f.release_flags;
  d["spare_sms"] = f.spare_sms;
  d["x_scale_stride"] = f.x_scale_stride;
  return d;
}

jo::FusedBlocks FusedFromDict(nb::handle d) {
  jo::FusedBlocks f;
  f.rows.shards = nb::cast<int32_t>(d["shards"]);
  f.rows.chunks = nb::cast<int32_t>(d["chunks"]);
  f.rows.shard_rows = nb::cast<int64_t>(d["shard_rows"]);
  const std::string order = nb::cast<std::string>(d["order"]);
  if (order != "last_arrival" && order != "first_departure")
    throw nb::value_error(("unknown fused order '" + order + "'").c_str());
  f.key = order == "last_arrival" ? jo::fused::OrderKey::kLastArrival
                                  : jo::fused::OrderKey::kFirstDeparture;
  f.sequence = nb::cast<std::vector<int32_t>>(d["sequence"]);
  f.wait_flags = nb::cast<int32_t>(d["wait_flags"]);
  f.ready_shard = nb::cast<int32_t>(d["ready_shard"]);
  f.writers = nb::cast<std::vector<int32_t>>(d["writers"]);
  f.release_flags = nb::cast<int32_t>(d["release_flags"]);
  const nb::dict fd = nb::cast<nb::dict>(d);
  f.spare_sms = fd.contains("spare_sms") ? nb::cast<int32_t>(fd["spare_sms"]) : 0;
  f.x_scale_stride = fd.contains("x_scale_stride") ? nb::cast<int32_t>(fd["x_scale_stride"]) : 1;
  return f;
}

nb::dict OpDict(const jo::Program& p, const jo::Op& op) {
  nb::dict d;
  d["kind"] = jo::OpKindName(op.kind);
  d["stream"] = op.stream;
  d["batch"] = op.batch;
  d["m"] = op.m;
  d["n"] = op.n;
  d["k"] = op.k;
  d["peer"] = op.peer;
  d["id"] = op.id;
  d["bundle"] = op.bundle;
  d["shard"] = op.shard;
  d["sub"] = op.sub;
  d["accumulate"] = op.accumulate;
  d["bytes"] = jo::BlockBytes(p, op);
  d["remote_bytes"] = jo::RemoteBytes(p, op);
  const bool gemm = op.kind == jo::OpKind::kGemm || op.kind == jo::OpKind::kFusedGemm;
  const bool has_a = gemm || op.kind == jo::OpKind::kAdd || op.kind == jo::OpKind::kCopy ||
                     op.kind == jo::OpKind::kSend || op.kind == jo::OpKind::kMcStore ||
                     op.kind == jo::OpKind::kMcReduce;
  const bool has_d = has_a ? op.kind != jo::OpKind::kSend
                           : op.kind == jo::OpKind::kRecv || op.kind == jo::OpKind::kAllReduce;
  d["a"] = has_a ? nb::object(RefDict(op.a)) : nb::none();
  d["b"] = gemm ? nb::object(RefDict(op.b)) : nb::none();
  d["c"] = op.accumulate ? nb::object(RefDict(op.c)) : nb::none();
  d["d"] = has_d ? nb::object(RefDict(op.d)) : nb::none();
  d["a_scale"] = op.a_scaled ? nb::object(RefDict(op.a_scale)) : nb::none();
  d["b_scale"] = op.b_scaled ? nb::object(RefDict(op.b_scale)) : nb::none();
  if (op.kind == jo::OpKind::kFusedGemm) d["fused"] = FusedDict(op.fused);
  const bool reduce = op.kind == jo::OpKind::kReduce;
  if (reduce) d["d"] = RefDict(op.d);
  nb::list sources;  // Reduce: the blocks summed, in order
  for (const jo::Ref& src : op.sources) sources.append(RefDict(src));
  d["sources"] = reduce ? nb::object(sources) : nb::none();
  d["sms"] = op.sms;
  d["text"] = jo::ToString(op, p.problem.replayable);
  return d;
}

nb::dict BuildProgramDict(const std::string& op, const std::string& transport, int nranks, int rank,
                          int64_t batch, int64_t rows, int64_t k, int64_t cols,
                          const std::string& dtype, int64_t chunks, bool bidirectional,
                          bool return_gathered, const std::string& algorithm,
                          const std::string& w_dtype, const std::string& out_dtype, bool fused,
                          bool block_scaled, bool replayable) {
  nb::dict problem;
  problem["op"] = op;
  problem["transport"] = transport;
  problem["nranks"] = nranks;
  problem["rank"] = rank;
  problem["batch"] = batch;
  problem["rows"] = rows;
  problem["k"] = k;
  problem["n"] = cols;
  problem["dtype"] = dtype;
  problem["chunks"] = chunks;
  problem["bidirectional"] = bidirectional;
  problem["return_gathered"] = return_gathered;
  problem["algorithm"] = algorithm;
  problem["w_dtype"] = w_dtype;
  problem["out_dtype"] = out_dtype;
  problem["fused"] = fused;
  problem["block_scaled"] = block_scaled;
  problem["replayable"] = replayable;
  const jo::Program p = Build(jo::python::ProblemFromDict(problem));
  nb::dict out = jo::python::ProblemDict(p.problem);
  out["elem_bytes"] = jo::DTypeSize(p.problem.x_dtype);
  nb::dict dtypes;  // the dtype of each buffer's elements (core/program.h, BufDType)
  for (int b = 0; b <= static_cast<int>(jo::BufId::kWorkspaceScales); ++b)
    dtypes[jo::BufName(static_cast<jo::BufId>(b))] =
        jo::DTypeName(jo::BufDType(p.problem, static_cast<jo::BufId>(b)));
  out["buffer_dtypes"] = dtypes;
  out["chunks"] = p.chunks;  // the effective chunks (clamped to the rows)
  out["cw_steps"] = p.cw_steps;
  out["ccw_steps"] = p.ccw_steps;
  out["num_streams"] = p.num_streams;
  out["num_events"] = p.num_events;
  out["num_flags"] = p.num_flags;
  out["workspace_elems"] = p.workspace_elems;
  out["scratch_elems"] = p.scratch_elems;
  out["workspace_scales"] = p.workspace_scales;
  out["scratch_scales"] = p.scratch_scales;
  out["workspace_bytes"] = jo::WorkspaceBytes(p);
  out["scratch_bytes"] = jo::ScratchBytes(p);
  nb::list ops;
  for (const jo::Op& o : p.ops) ops.append(OpDict(p, o));
  out["ops"] = ops;
  out["text"] = jo::ToString(p);
  return out;
}

void ThrowIfError(const jo::Status& status) {
  if (!status.ok()) throw std::runtime_error(status.ToString());
}

// Why the builder does not build `problem` (a dict as ProblemFromDict takes it) replayable, ""
// when it does: the one word on which calls replay (BuildProgram's acceptance, core/build.cc),
// asked by the lowering and the performance model alike.
std::string ReplayRefusal(const nb::dict& problem) {
  jo::Problem q = jo::python::ProblemFromDict(problem);
  q.replayable = true;
  jo::Program program;
  const jo::Status status = jo::BuildProgram(q, &program);
  return status.ok() ? std::string() : status.message();
}

// An attribute's value from Python, of its exact C++ type (ffi_call.h CallAttrs); strings and
// spans point into `keep`, which outlives the decoding.
struct AttrStorage {
  std::deque<std::string> strings;
  std::deque<std::vector<int64_t>> spans;
};
template <typename T>
void AttrFromPy(nb::handle value, T* out, AttrStorage&) {
  *out = nb::cast<T>(value);
}
void AttrFromPy(nb::handle value, std::string_view* out, AttrStorage& keep) {
  *out = keep.strings.emplace_back(nb::cast<std::string>(value));
}
void AttrFromPy(nb::handle value, xla::ffi::Span<const int64_t>* out, AttrStorage& keep) {
  const std::vector<int64_t>& v = keep.spans.emplace_back(nb::cast<std::vector<int64_t>>(value));
  *out = xla::ffi::Span<const int64_t>(v.data(), v.size());
}

// A native call's attributes (name -> value, as the lowering emits them) decoded as the CUDA
// handlers decode them (ffi_call.h DecodeDesc), then checked against the target the call came
// through (CheckTarget: command_buffer_compatible for jaxoverlap_cuda_replayable): the problem
// the handler runs (no shapes: its operands give them). ValueError with the handler's text.
nb::dict DecodeCallDict(const nb::dict& attrs, bool command_buffer_compatible) {
  jo::ffi_call::CallAttrs a;
  AttrStorage keep;
  std::string missing;
#define JO_ATTR_FROM_PY(type, name)          \
  if (attrs.contains(#name))                 \
    AttrFromPy(attrs[#name], &a.name, keep); \
  else                                       \
    missing += std::string(missing.empty() ? "" : ", ") + #name;
  JO_CALL_ATTRS(JO_ATTR_FROM_PY)
#undef JO_ATTR_FROM_PY
  if (!missing.empty()) throw nb::value_error(("attributes missing: " + missing).c_str());
  jo::CallDesc desc;
  jo::Status status = jo::ffi_call::DecodeDesc(a, &desc);
  if (status.ok()) status = jo::ffi_call::CheckTarget(desc, command_buffer_compatible);
  if (!status.ok()) throw nb::value_error(status.message().c_str());
  return jo::python::ProblemDict(desc.problem);
}

// The inverse of BuildProgramDict (what check_program takes back).
jo::Ref RefFromDict(nb::handle d) {
  jo::Ref ref;
  if (d.is_none()) return ref;
  const std::string buf = nb::cast<std::string>(d["buf"]);
  bool known = false;
  for (int b = 0; b <= static_cast<int>(jo::BufId::kWorkspaceScales); ++b)
    if (buf == jo::BufName(static_cast<jo::BufId>(b)))
      ref.buf = static_cast<jo::BufId>(b), known = true;
  if (!known) throw nb::value_error(("unknown buffer '" + buf + "'").c_str());
  ref.rank = nb::cast<int32_t>(d["rank"]);
  ref.offset = nb::cast<int64_t>(d["offset"]);
  ref.batch_stride = nb::cast<int64_t>(d["batch_stride"]);
  ref.ld = nb::cast<int64_t>(d["ld"]);
  return ref;
}

jo::Program ProgramFromDict(const nb::dict& d) {
  jo::Program p;
  p.problem = jo::python::ProblemFromDict(d);
  p.chunks = nb::cast<int64_t>(d["chunks"]);
  p.cw_steps = nb::cast<int32_t>(d["cw_steps"]);
  p.ccw_steps = nb::cast<int32_t>(d["ccw_steps"]);
  p.num_streams = nb::cast<int32_t>(d["num_streams"]);
  p.num_events = nb::cast<int32_t>(d["num_events"]);
  p.num_flags = nb::cast<int32_t>(d["num_flags"]);
  p.workspace_elems = nb::cast<int64_t>(d["workspace_elems"]);
  p.scratch_elems = nb::cast<int64_t>(d["scratch_elems"]);
  p.workspace_scales =
      d.contains("workspace_scales") ? nb::cast<int64_t>(d["workspace_scales"]) : 0;
  p.scratch_scales = d.contains("scratch_scales") ? nb::cast<int64_t>(d["scratch_scales"]) : 0;
  for (nb::handle o : nb::cast<nb::list>(d["ops"])) {
    jo::Op op;
    const std::string kind = nb::cast<std::string>(o["kind"]);
    bool known = false;
    for (int k = 0; k <= static_cast<int>(jo::OpKind::kResetFlags); ++k)
      if (kind == jo::OpKindName(static_cast<jo::OpKind>(k)))
        op.kind = static_cast<jo::OpKind>(k), known = true;
    if (!known) throw nb::value_error(("unknown op kind '" + kind + "'").c_str());
    op.stream = nb::cast<int32_t>(o["stream"]);
    op.a = RefFromDict(o["a"]);
    op.b = RefFromDict(o["b"]);
    op.c = RefFromDict(o["c"]);
    op.d = RefFromDict(o["d"]);
    op.accumulate = nb::cast<bool>(o["accumulate"]);
    op.batch = nb::cast<int64_t>(o["batch"]);
    op.m = nb::cast<int64_t>(o["m"]);
    op.n = nb::cast<int64_t>(o["n"]);
    op.k = nb::cast<int64_t>(o["k"]);
    op.peer = nb::cast<int32_t>(o["peer"]);
    op.id = nb::cast<int32_t>(o["id"]);
    op.bundle = nb::cast<int32_t>(o["bundle"]);
    op.shard = nb::cast<int32_t>(o["shard"]);
    op.sub = nb::cast<int32_t>(o["sub"]);
    const nb::dict od = nb::cast<nb::dict>(o);
    op.a_scaled = od.contains("a_scale") && !od["a_scale"].is_none();
    op.b_scaled = od.contains("b_scale") && !od["b_scale"].is_none();
    if (op.a_scaled) op.a_scale = RefFromDict(od["a_scale"]);
    if (op.b_scaled) op.b_scale = RefFromDict(od["b_scale"]);
    if (op.kind == jo::OpKind::kFusedGemm) op.fused = FusedFromDict(o["fused"]);
    if (od.contains("sources") && !od["sources"].is_none())
      for (nb::handle src : nb::cast<nb::list>(od["sources"]))
        op.sources.push_back(RefFromDict(src));
    op.sms = od.contains("sms") ? nb::cast<int32_t>(od["sms"]) : 0;
    p.ops.push_back(op);
  }
  return p;
}

// Raises ValueError naming the first op that reaches outside its buffer (or
// names a peer, flag, event or stream out of range).
void CheckProgramDict(const nb::dict& d) {
  const jo::Program p = ProgramFromDict(d);
  const jo::Status status = jo::CheckProgram(p, jo::BufferSizes::Of(p));
  if (!status.ok()) throw nb::value_error(status.ToString().c_str());
}

// The calls recorded since the last take (core/trace.h), oldest first; times
// in nanoseconds of the steady clock.
nb::list TakeCalls() {
  std::vector<jo::CallSpan> calls;
  {
    nb::gil_scoped_release release;
    calls = jo::TakeCalls();
  }
  nb::list out;
  for (const jo::CallSpan& call : calls) {
    const jo::Problem& q = call.problem;
    nb::dict d;
    d["executor"] = call.executor;
    d["clique"] = call.clique;
    d["epoch"] = call.epoch;
    for (auto [key, value] : jo::python::ProblemDict(q)) d[key] = value;
    d["start_ns"] = call.start_ns;
    d["end_ns"] = call.end_ns;
    d["ok"] = call.ok;
    nb::list ops;
    for (const jo::OpSpan& s : call.ops) {
      nb::dict o;
      o["index"] = s.index;
      o["stream"] = s.stream;
      o["kind"] = jo::OpKindName(s.kind);
      o["shard"] = s.shard;
      o["sub"] = s.sub;
      o["peer"] = s.peer;
      o["bytes"] = s.bytes;
      o["start_ns"] = s.start_ns;
      o["ready_ns"] = s.ready_ns;
      o["end_ns"] = s.end_ns;
      ops.append(o);
    }
    d["ops"] = ops;
    out.append(d);
  }
  return out;
}

// Descriptors parked out of this process's fd table (host/fd_share.h), for Python.
struct ParkedHandle {
  jo::host::ParkedFds parked;
  size_t Count() const { return parked.count(); }
  // The descriptors, owned by the caller (close them with os.close); leaves this empty.
  std::vector<int> Take() {
    std::vector<jo::host::UniqueFd> fds;
    ThrowIfError(parked.Take(&fds));
    std::vector<int> out;
    for (auto& fd : fds) out.push_back(fd.release());
    return out;
  }
};

// The leader's control segment, parked: served to the other processes (_fd_serve) without
// ever being in this process's fd table.
ParkedHandle* ShmDomainCreate(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                              int32_t process, int64_t attempt) {
  jo::host::HiddenFromPeers hidden;  // until the fd is parked
  jo::host::UniqueFd fd;
  ThrowIfError(jo::host::CreateShmDomain(key, group, rank_process, process, attempt, &fd));
  std::vector<jo::host::UniqueFd> one;
  one.push_back(std::move(fd));
  auto handle = std::make_unique<ParkedHandle>();
  ThrowIfError(jo::host::ParkedFds::Park(std::move(one), &handle->parked));
  return handle.release();
}

void ShmDomainAttach(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                     int32_t process, int64_t attempt, int fd) {
  ThrowIfError(jo::host::AttachShmDomain(key, group, rank_process, process, attempt, fd));
}

// Receives the leader's control segment from `_fd_serve` @name of `owner_pid` and attaches
// to it; its fd is in this process's table only in between.
void ShmDomainReceive(int64_t key, int64_t group, const std::vector<int32_t>& rank_process,
                      int32_t process, int64_t attempt, const std::string& name, int owner_pid,
                      int64_t timeout_ms) {
  jo::host::HiddenFromPeers hidden;  // while the fd is in this process's table
  std::vector<jo::host::UniqueFd> fds;
  ThrowIfError(jo::host::ReceiveFds(name, 1, owner_pid, jo::Millis(timeout_ms), &fds));
  ThrowIfError(
      jo::host::AttachShmDomain(key, group, rank_process, process, attempt, fds.front().get()));
}

// How many segment fds this process's server still holds for its peers.
size_t SegmentOffers() {
  jo::host::SegmentServer* server = nullptr;
  ThrowIfError(jo::host::SegmentServer::Instance(&server));
  return server->offers();
}

// Sharing fds between processes (host/fd_share.h); fds returned to Python are
// owned by the caller (close them with os.close).
int FdDupFromProcess(int pid, int fd) {
  jo::host::UniqueFd out;
  ThrowIfError(jo::host::DupFromProcess(pid, fd, &out));
  return out.release();
}

struct FdServerHandle {
  std::unique_ptr<jo::host::FdServer> server;
  void Finish() {
    if (server == nullptr) return;
    jo::Status status = server->Finish();
    server.reset();
    ThrowIfError(status);
  }
};

FdServerHandle* FdServeParked(const std::string& name, ParkedHandle* fds,
                              const std::vector<int>& allowed_pids, int64_t timeout_ms) {
  auto handle = std::make_unique<FdServerHandle>();
  ThrowIfError(jo::host::FdServer::Start(name, std::move(fds->parked), allowed_pids,
                                         jo::Millis(timeout_ms), &handle->server));
  return handle.release();
}

FdServerHandle* FdServe(const std::string& name, const std::vector<int>& fds,
                        const std::vector<int>& allowed_pids, int64_t timeout_ms) {
  ParkedHandle copies;
  ThrowIfError(jo::host::ParkedFds::ParkCopies(fds, &copies.parked));
  return FdServeParked(name, &copies, allowed_pids, timeout_ms);
}

std::vector<int> FdReceive(const std::string& name, size_t count, int owner_pid,
                           int64_t timeout_ms) {
  std::vector<jo::host::UniqueFd> fds;
  ThrowIfError(jo::host::ReceiveFds(name, count, owner_pid, jo::Millis(timeout_ms), &fds));
  std::vector<int> out;
  for (auto& fd : fds) out.push_back(fd.release());
  return out;
}

}  // namespace

NB_MODULE(_host, m) {
  m.doc() = "jaxoverlap host extension: program builder, host executor and CPU FFI handlers.";
  m.attr("__version__") = JO_VERSION;
  jo::host::ConfigureBlas();
  m.def("build_info", &BuildInfo, "What this extension was built with.");
  m.def("registrations", &Registrations,
        "FFI target name -> {stage: handler capsule} (platform cpu).");
  m.def("types", &Types, "FFI type name -> {'type_id', 'type_info'} capsules (platform cpu).");
  m.attr("TRANSPORTS") = Transports();
  m.def(
      "kinds", [] { return jo::python::KindsDict(); },
      "The kinds' tables (cpp/core/kinds.h): {'ops', 'transports', 'dtypes', 'algorithms'}, "
      "each a list of rows (dicts), in id order.");
  m.def("canonical_problem", &CanonicalProblemDict, nb::arg("op"), nb::arg("x_shape"),
        nb::arg("w_shape"), nb::arg("axis"), nb::arg("nranks"), nb::arg("algorithm") = "two_shot",
        "The canonical problem of a call on x and w (docs/native.md §1), as the handlers make "
        "it: {'batch', 'rows', 'k', 'n', 'y', 'x_gathered'}; ValueError for shapes the op does "
        "not take.");
  jo::ffi_call::LibraryVersion() = JO_VERSION;
  m.attr("ATTRIBUTE_SCHEMA") = jo::ffi_call::SchemaId();
  m.attr("ATTRIBUTE_SCHEMA_TEXT") = jo::ffi_call::SchemaText();
  m.def("set_process_index", &jo::SetProcessIndex, nb::arg("index"),
        "This process's index in the jax.distributed job (placement, shared memory).");
  m.def("build_program", &BuildProgramDict, nb::arg("op"), nb::arg("transport"), nb::arg("nranks"),
        nb::arg("rank"), nb::arg("batch"), nb::arg("rows"), nb::arg("k"), nb::arg("n"),
        nb::arg("dtype") = "float32", nb::arg("chunks") = 1, nb::arg("bidirectional") = false,
        nb::arg("return_gathered") = false, nb::arg("algorithm") = "two_shot",
        nb::arg("w_dtype") = "", nb::arg("out_dtype") = "", nb::arg("fused") = false,
        nb::arg("block_scaled") = false, nb::arg("replayable") = false,
        "The program of one rank as a dict: header fields, 'ops' (list of op dicts, each with "
        "its stream; per-stream order is list order) and 'text' (printable form). n: the "
        "output columns (w's); dtype: x's (a name of the kinds' dtypes: kinds()), w_dtype and "
        "out_dtype default to it; block_scaled: fp8 x and w with e8m0 block scales (MXFP8, "
        "k a multiple of 32); replayable: the same work every call (core/program.h).");
  m.def("replay_refusal", &ReplayRefusal, nb::arg("problem"),
        "Why the program builder does not build `problem` (a dict of build_program's keys) "
        "replayable (core/program.h Problem::replayable), '' when it does: which calls replay.");
  m.def("decode_call", &DecodeCallDict, nb::arg("attributes"), nb::arg("command_buffer_compatible"),
        "A native call's attributes decoded as the CUDA handlers decode them, checked against "
        "the target it came through (command_buffer_compatible: jaxoverlap_cuda_replayable): "
        "the problem its handler runs, without shapes; ValueError with the handler's text.");
  m.def(
      "allreduce_fits",
      [](const std::string& transport, const std::string& algorithm, int nranks, int64_t bytes) {
        const jo::Transport t = jo::python::ParseTransportArg("transport", transport);
        const jo::ArAlgorithm a = jo::python::ParseAlgorithmArg("algorithm", algorithm);
        return jo::OneLaunch(a) && !jo::Row(t).messages() &&
               jo::allreduce::Fits(jo::Row(t).mechanism == jo::Mechanism::kMulticast,
                                   a == jo::ArAlgorithm::kTwoShotKernel, nranks, bytes);
      },
      nb::arg("transport"), nb::arg("algorithm"), nb::arg("nranks"), nb::arg("bytes"),
      "Whether a one-launch all-reduce (a kernel algorithm over a transport with peer memory) "
      "of y's `bytes` over `nranks` ranks fits the kernel's area (core/allreduce_layout.h): "
      "the plan offers the kernel algorithms only then.");
  m.def("check_program", &CheckProgramDict, nb::arg("program"),
        "Checks a program dict (as build_program returns it): every operand inside its buffer, "
        "every peer, flag, event and stream in range; raises ValueError naming the op.");
  m.def("cliques", &jo::host::DescribeCliques, "One line per live clique.");
  m.def("set_recording", &jo::SetRecording, nb::arg("on"),
        "Turns the recording of native calls' timelines on or off (off by default).");
  m.def("recording", &jo::Recording, "Whether native calls' timelines are being recorded.");
  m.def("take_calls", &TakeCalls,
        "The calls recorded since the last take, as dicts (problem, clique, epoch, start_ns, "
        "end_ns, ok, 'ops': one dict per op with stream, kind, shard, sub, peer, bytes, "
        "start_ns, ready_ns, end_ns), and forgets them.");
  m.def("now_ns", &jo::NowNs, "The clock of the recorded spans (steady, nanoseconds).");
  // Multi-process bootstrap (jaxoverlap/_executors/bootstrap.py); errors are RuntimeError.
  m.def("note_lowering", &jo::NoteLowering, nb::arg("site_key"),
        "The native call `site_key` was lowered: its next instance belongs to a new program "
        "(core/call.h CallSite).");
  nb::class_<ParkedHandle>(m, "_ParkedFds")
      .def_prop_ro("count", &ParkedHandle::Count)
      .def("take", &ParkedHandle::Take,
           "The parked fds, back in this process's table and owned by the caller.");
  m.def("_shm_domain_create", &ShmDomainCreate, nb::arg("clique_key"), nb::arg("group"),
        nb::arg("rank_process"), nb::arg("process"), nb::arg("attempt"),
        nb::rv_policy::take_ownership,
        "Leader: creates and registers the domain of a group spanning processes; returns its "
        "control segment (a memfd) parked, for _fd_serve to hand to the other processes.");
  m.def("_shm_domain_attach", &ShmDomainAttach, nb::arg("clique_key"), nb::arg("group"),
        nb::arg("rank_process"), nb::arg("process"), nb::arg("attempt"), nb::arg("fd"),
        "Other processes: maps the leader's control segment `fd` (checked) and registers the "
        "domain; the caller keeps and closes `fd`.");
  m.def("_shm_domain_receive", &ShmDomainReceive, nb::arg("clique_key"), nb::arg("group"),
        nb::arg("rank_process"), nb::arg("process"), nb::arg("attempt"), nb::arg("name"),
        nb::arg("owner_pid"), nb::arg("timeout_ms"), nb::call_guard<nb::gil_scoped_release>(),
        "Other processes: receives the leader's control segment (its _fd_serve @name, of "
        "owner_pid) and maps it as _shm_domain_attach does; the fd is closed at once.");
  m.def("_segment_offers", &SegmentOffers,
        "How many shared-memory fds this process still holds (parked) for peers to fetch.");
  nb::class_<FdServerHandle>(m, "_FdServer")
      .def("finish", &FdServerHandle::Finish, nb::call_guard<nb::gil_scoped_release>(),
           "Waits until every expected peer fetched the fds (or the deadline): raises if not.");
  m.def("_fd_dup_from_process", &FdDupFromProcess, nb::arg("pid"), nb::arg("fd"),
        "pidfd_getfd: a new fd in this process duplicating `fd` of process `pid`.");
  m.def("_fd_serve", &FdServeParked, nb::arg("name"), nb::arg("fds"), nb::arg("allowed_pids"),
        nb::arg("timeout_ms"), nb::rv_policy::take_ownership,
        "Serves the parked `fds` (taken from the object) over the abstract Unix socket `name` "
        "to each of `allowed_pids` once.");
  m.def("_fd_serve", &FdServe, nb::arg("name"), nb::arg("fds"), nb::arg("allowed_pids"),
        nb::arg("timeout_ms"), nb::rv_policy::take_ownership,
        "Serves copies of `fds` (parked between hand-outs; the caller keeps its own) over the "
        "abstract Unix socket `name` to each of `allowed_pids` once.");
  m.def("_fd_receive", &FdReceive, nb::arg("name"), nb::arg("count"), nb::arg("owner_pid"),
        nb::arg("timeout_ms"), nb::call_guard<nb::gil_scoped_release>(),
        "Receives `count` fds from `_fd_serve`.");
  m.def("_domain_state", &jo::host::DomainState, nb::arg("clique_key"), nb::arg("group"),
        "'absent', 'ok' or 'broken': the domain of a group spanning processes here.");
  m.def("_break_domain", &jo::host::BreakDomain, nb::arg("clique_key"), nb::arg("group"),
        nb::arg("reason"));
  m.def("_forget_domain", &jo::host::ForgetDomain, nb::arg("clique_key"), nb::arg("group"));
}
