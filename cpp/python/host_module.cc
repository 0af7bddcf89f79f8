// jaxoverlap._host: the always-built native module.
//
// Exposes (1) the CPU FFI handlers as capsules through registrations(),
// (2) the program builder, so Python tests and jaxoverlap.sim read the very
// programs the executors run, and (3) build information and test hooks.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "core/build.h"
#include "core/program.h"
#include "host/blas.h"
#include "host/ffi_handlers.h"
#include "host/host_call.h"
#include "host/workers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

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

nb::dict BuildInfo() {
  nb::dict info;
  info["version"] = JO_VERSION;
  info["compiler"] = CompilerName();
  info["cxx_standard"] = static_cast<long>(__cplusplus);
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["jaxlib_headers"] = JO_JAXLIB_VERSION;
  info["blas"] = JO_BLAS_NAME;
  info["gemm"] = jo::host::BlasName();
  info["transports"] = nb::make_tuple("nccl", "p2p", "multicast");
  info["workspace_allocator"] = "heap";
  return info;
}

template <typename Fn>
nb::capsule Encapsulate(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "Encapsulate takes an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// name -> {stage: capsule}, the dict form of jax.ffi.register_ffi_target.
nb::dict Registrations() {
  nb::dict out;
  nb::dict ag, rs;
  ag["instantiate"] = Encapsulate(jo::host::InstantiateHandler);
  ag["execute"] = Encapsulate(jo::host::AgMatmulHandler);
  rs["instantiate"] = Encapsulate(jo::host::InstantiateHandler);
  rs["execute"] = Encapsulate(jo::host::MatmulRsHandler);
  out["jaxoverlap_ag_matmul"] = ag;
  out["jaxoverlap_matmul_rs"] = rs;
  return out;
}

// name -> {"type_id", "type_info"} for jax.ffi.register_ffi_type (register
// these before the targets, and after the CPU backend exists).
nb::dict Types() {
  nb::dict site;
  site["type_id"] = nb::capsule(jo::host::CallSiteTypeId());
  site["type_info"] = nb::capsule(const_cast<void*>(jo::host::CallSiteTypeInfo()));
  nb::dict out;
  out["jaxoverlap_call_site"] = site;
  return out;
}

nb::dict Workers() {
  int alive = 0, idle = 0;
  jo::host::WorkerCounts(&alive, &idle);
  nb::dict out;
  out["alive"] = alive;
  out["idle"] = idle;
  return out;
}

jo::Problem MakeProblem(const std::string& op, const std::string& transport, int nranks, int rank,
                        int64_t batch, int64_t rows, int64_t k, int64_t n, const std::string& dtype,
                        int64_t chunks, bool bidirectional, bool return_gathered) {
  jo::Problem q;
  if (op == "ag_matmul") q.op = jo::Collective::kAgMatmul;
  else if (op == "matmul_rs") q.op = jo::Collective::kMatmulRs;
  else throw nb::value_error(("op: expected 'ag_matmul' or 'matmul_rs', got '" + op + "'").c_str());
  if (transport == "nccl") q.transport = jo::Transport::kNccl;
  else if (transport == "p2p") q.transport = jo::Transport::kP2p;
  else if (transport == "multicast") q.transport = jo::Transport::kMulticast;
  else throw nb::value_error(("transport: expected nccl, p2p or multicast, got '" + transport + "'").c_str());
  if (dtype == "float32" || dtype == "f32") q.dtype = jo::DType::kF32;
  else if (dtype == "bfloat16" || dtype == "bf16") q.dtype = jo::DType::kBF16;
  else if (dtype == "float16" || dtype == "f16") q.dtype = jo::DType::kF16;
  else throw nb::value_error(("dtype: expected float32, bfloat16 or float16, got '" + dtype + "'").c_str());
  q.nranks = nranks;
  q.rank = rank;
  q.batch = batch;
  q.rows = rows;
  q.k = k;
  q.n = n;
  q.chunks = chunks;
  q.bidirectional = bidirectional;
  q.return_gathered = return_gathered;
  return q;
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
  d["group"] = op.group;
  d["chunk"] = op.chunk;
  d["sub"] = op.sub;
  d["accumulate"] = op.accumulate;
  d["bytes"] = op.batch * op.m * op.n * jo::DTypeSize(p.problem.dtype);
  d["remote_bytes"] = jo::RemoteBytes(p, op);
  const bool has_a = op.kind == jo::OpKind::kGemm || op.kind == jo::OpKind::kAdd ||
                     op.kind == jo::OpKind::kCopy || op.kind == jo::OpKind::kSend ||
                     op.kind == jo::OpKind::kMcStore || op.kind == jo::OpKind::kMcReduce;
  const bool has_d = has_a ? op.kind != jo::OpKind::kSend : op.kind == jo::OpKind::kRecv;
  d["a"] = has_a ? nb::object(RefDict(op.a)) : nb::none();
  d["b"] = op.kind == jo::OpKind::kGemm ? nb::object(RefDict(op.b)) : nb::none();
  d["c"] = op.accumulate ? nb::object(RefDict(op.c)) : nb::none();
  d["d"] = has_d ? nb::object(RefDict(op.d)) : nb::none();
  d["text"] = jo::ToString(op);
  return d;
}

nb::dict BuildProgramDict(const std::string& op, const std::string& transport, int nranks, int rank,
                          int64_t batch, int64_t rows, int64_t k, int64_t n,
                          const std::string& dtype, int64_t chunks, bool bidirectional,
                          bool return_gathered) {
  const jo::Program p = Build(MakeProblem(op, transport, nranks, rank, batch, rows, k, n, dtype,
                                          chunks, bidirectional, return_gathered));
  nb::dict out;
  out["op"] = op;
  out["transport"] = transport;
  out["nranks"] = nranks;
  out["rank"] = rank;
  out["batch"] = batch;
  out["rows"] = rows;
  out["k"] = k;
  out["n"] = n;
  out["dtype"] = jo::DTypeName(p.problem.dtype);
  out["elem_bytes"] = jo::DTypeSize(p.problem.dtype);
  out["chunks"] = p.chunks;
  out["cw_steps"] = p.cw_steps;
  out["ccw_steps"] = p.ccw_steps;
  out["num_streams"] = p.num_streams;
  out["num_events"] = p.num_events;
  out["num_flags"] = p.num_flags;
  out["workspace_elems"] = p.workspace_elems;
  out["scratch_elems"] = p.scratch_elems;
  nb::list ops;
  for (const jo::Op& o : p.ops) ops.append(OpDict(p, o));
  out["ops"] = ops;
  out["text"] = jo::ToString(p);
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
  m.def("_workers", &Workers, "Tests only: host worker threads alive and idle.");
  m.def("build_program", &BuildProgramDict, nb::arg("op"), nb::arg("transport"),
        nb::arg("nranks"), nb::arg("rank"), nb::arg("batch"), nb::arg("rows"), nb::arg("k"),
        nb::arg("n"), nb::arg("dtype") = "float32", nb::arg("chunks") = 1,
        nb::arg("bidirectional") = false, nb::arg("return_gathered") = false,
        "The program of one rank as a dict: header fields, 'ops' (list of op dicts, each with "
        "its stream; per-stream order is list order) and 'text' (printable form).");
  m.def("cliques", &jo::host::DescribeCliques, "One line per live clique.");
  m.def("_set_test_skip", &jo::host::SetTestSkip, nb::arg("rank"), nb::arg("calls"),
        "Tests only: the next `calls` calls of `rank` skip the protocol (peers time out).");
  m.def("_reset_cliques", &jo::host::ResetCliques, "Tests only: forget every clique.");
}
