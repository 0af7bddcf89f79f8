// The XLA FFI boundary, shared by both platforms' handlers: the attributes
// every stage binds (one struct), their checks, the operands' checks, the
// call site's state, the binding itself, and turning our Status into an
// ffi::Error (once, here).
//
// Every native custom call has the operands x, w, x_scale, w_scale, the
// result y and, for ag_matmul with return_gathered, x_gathered. The dtypes
// come from the buffers: x and w float32, bfloat16, float16 (the same) or
// either float8_e4m3fn / float8_e5m2; y float32, bfloat16 or float16 (x's, or
// float32 for non-fp8 operands); x_gathered x's. x_scale and w_scale are
// float32 of shape () or (1,), always passed (1.0 when the operand is not
// fp8, whose scale no GEMM reads): the real value of an fp8 operand is
// element * scale, and an all-gather applies each shard's own. A handler never
// reads a scale on the host (the CUDA executor hands device pointers to
// cuBLASLt). The attributes:
//   op i32 (0 ag_matmul, 1 matmul_rs, 2 matmul_ar), clique_key i64, site_key
//   i64 (what the call is: core/call.h CallSite; never 0), axis i64
//   (matmul_ar: 0; it splits the rows of x, all dims but the last, into N
//   blocks),
//   axis_size i64, transport i32 (0 nccl, 1 p2p, 2 multicast), chunks i64,
//   bidirectional bool, tf32 bool (float32 GEMMs may use TF32: the op's
//   precision allows it), algorithm i32 (matmul_ar: 0 two-shot, 1 one-shot,
//   whose rows need not split; 0 for the others), fused bool (one persistent
//   GEMM: ag_matmul and matmul_rs over p2p or multicast), timeout_ms i64, and the
//   rank table in (group, rank) order: processes i64[], device_ids i64[]
//   (JAX's global ids), ordinals i64[] (local ordinals). The table is empty
//   only for a CPU call in one process whose mesh was abstract where it
//   lowered; the CPU call then has a fifth operand, coords: int32[2] =
//   (rank, group) from lax.axis_index (the GPU handler needs the table:
//   reading a device scalar would need a sync).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/build.h"
#include "core/call.h"
#include "core/program.h"
#include "core/status.h"
#include "xla/ffi/api/ffi.h"

namespace jo::ffi_call {

namespace ffi = xla::ffi;

struct CallAttrs {
  int32_t op;
  int64_t clique_key, site_key, axis, axis_size;
  int32_t transport;
  int64_t chunks;
  bool bidirectional;
  bool tf32;
  int32_t algorithm;
  bool fused;
  int64_t timeout_ms;
  ffi::Span<const int64_t> processes, device_ids, ordinals;
};

}  // namespace jo::ffi_call

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    ::jo::ffi_call::CallAttrs, ::xla::ffi::StructMember<int32_t>("op"),
    ::xla::ffi::StructMember<int64_t>("clique_key"), ::xla::ffi::StructMember<int64_t>("site_key"),
    ::xla::ffi::StructMember<int64_t>("axis"), ::xla::ffi::StructMember<int64_t>("axis_size"),
    ::xla::ffi::StructMember<int32_t>("transport"), ::xla::ffi::StructMember<int64_t>("chunks"),
    ::xla::ffi::StructMember<bool>("bidirectional"), ::xla::ffi::StructMember<bool>("tf32"),
    ::xla::ffi::StructMember<int32_t>("algorithm"), ::xla::ffi::StructMember<bool>("fused"),
    ::xla::ffi::StructMember<int64_t>("timeout_ms"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("processes"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("device_ids"),
    ::xla::ffi::StructMember<::xla::ffi::Span<const int64_t>>("ordinals"));

namespace jo::ffi_call {

inline std::string Dims(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? "," : "") + std::to_string(dims[i]);
  return out + "]";
}

inline ffi::Error ToFfi(const Status& status) {
  switch (status.code()) {
    case Code::kOk:
      return ffi::Error::Success();
    case Code::kInvalidArgument:
      return ffi::Error(ffi::ErrorCode::kInvalidArgument, status.message());
    case Code::kTimeout:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message());
    case Code::kAborted:
      return ffi::Error(ffi::ErrorCode::kAborted, status.message());
    case Code::kResource:
      return ffi::Error(ffi::ErrorCode::kResourceExhausted, status.message());
    case Code::kInternal:
      break;
  }
  return ffi::Error::Internal(status.message());
}

// Checks the attributes and copies them out of XLA's storage (the call site
// outlives the instantiate stage that sees them).
inline Status DecodeDesc(const CallAttrs& a, CallDesc* out) {
  const bool known = a.op >= 0 && a.op <= 2;
  const std::string op = known ? CollectiveName(static_cast<Collective>(a.op)) : "jaxoverlap";
  const size_t n = a.processes.size();
  const auto bad = [&](const std::string& text) { return InvalidArgument(op + ": " + text); };
  if (!known)
    return bad("attribute op expected 0 (ag_matmul), 1 (matmul_rs) or 2 (matmul_ar), got " +
               std::to_string(a.op));
  if (a.site_key == 0) return bad("attribute site_key expected a nonzero hash, got 0");
  if (a.axis_size < 1)
    return bad("attribute axis_size expected >= 1, got " + std::to_string(a.axis_size));
  if (a.transport < 0 || a.transport > 2)
    return bad("attribute transport expected 0 (nccl), 1 (p2p) or 2 (multicast), got " +
               std::to_string(a.transport));
  if (a.chunks < 1) return bad("attribute chunks expected >= 1, got " + std::to_string(a.chunks));
  if (a.algorithm < 0 || a.algorithm > 3 || (a.algorithm != 0 && a.op != 2))
    return bad(
        "attribute algorithm expected 0 (two-shot) or, for matmul_ar, 1 (one-shot), 2 (one-shot "
        "kernel) or 3 (two-shot kernel), got " +
        std::to_string(a.algorithm));
  if (OneLaunch(static_cast<ArAlgorithm>(a.algorithm)) && a.transport == 0)
    return bad("attribute algorithm " + std::to_string(a.algorithm) +
               " (a kernel algorithm) needs transport p2p or multicast, not nccl");
  if (a.fused && (a.op == 2 || a.transport == 0))
    return bad(
        "attribute fused applies to ag_matmul and matmul_rs over p2p or multicast, never "
        "nccl (docs/gpu.md §10)");
  if (a.timeout_ms < 1)
    return bad("attribute timeout_ms expected >= 1, got " + std::to_string(a.timeout_ms));
  if (a.device_ids.size() != n || a.ordinals.size() != n ||
      n % static_cast<size_t>(a.axis_size) != 0)  // (n == 0: coords place the caller)
    return bad(
        "the rank table attributes (processes, device_ids, ordinals) expected "
        "axis_size * groups entries each, got " +
        std::to_string(n) + ", " + std::to_string(a.device_ids.size()) + ", " +
        std::to_string(a.ordinals.size()) + " for axis_size " + std::to_string(a.axis_size));
  out->op = static_cast<Collective>(a.op);
  out->transport = static_cast<Transport>(a.transport);
  out->clique_key = a.clique_key;
  out->site_key = a.site_key;
  out->axis = a.axis;
  out->chunks = a.chunks;
  out->bidirectional = a.bidirectional;
  out->tf32 = a.tf32;
  out->algorithm = static_cast<ArAlgorithm>(a.algorithm);
  out->fused = a.fused;
  out->timeout_ms = a.timeout_ms;
  out->table.axis_size = a.axis_size;
  out->table.processes.assign(a.processes.begin(), a.processes.end());
  out->table.device_ids.assign(a.device_ids.begin(), a.device_ids.end());
  out->table.ordinals.assign(a.ordinals.begin(), a.ordinals.end());
  return OkStatus();
}

inline std::optional<DType> ToDType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32:
      return DType::kF32;
    case ffi::DataType::BF16:
      return DType::kBF16;
    case ffi::DataType::F16:
      return DType::kF16;
    case ffi::DataType::F8E4M3FN:
      return DType::kF8E4M3;
    case ffi::DataType::F8E5M2:
      return DType::kF8E5M2;
    default:
      return std::nullopt;
  }
}

// A result must have x's dims with dim `axis` made `axis_dim` and the last
// dim `last` (its dtype is checked by the caller).
inline Status CheckResult(const char* op, const char* name, const ffi::AnyBuffer& x,
                          const ffi::AnyBuffer& got, int64_t axis, int64_t axis_dim, int64_t last) {
  auto xd = x.dimensions();
  std::vector<int64_t> want(xd.begin(), xd.end());
  want[axis] = axis_dim;
  want.back() = last;
  auto gd = got.dimensions();
  const bool same = std::vector<int64_t>(gd.begin(), gd.end()) == want;
  if (!same)
    return InvalidArgument(std::string(op) + ": result " + name + " expected shape " +
                           Dims(ffi::Span<const int64_t>(want.data(), want.size())) + ", got " +
                           Dims(gd));
  return OkStatus();
}

// A scale operand: float32 of shape () or (1,).
inline Status CheckScale(const char* op, const char* name, const ffi::AnyBuffer& scale) {
  auto dims = scale.dimensions();
  if (scale.element_type() != ffi::DataType::F32 || scale.element_count() != 1 || dims.size() > 1)
    return InvalidArgument(std::string(op) + ": operand " + name +
                           " expected a float32 scalar (shape () or (1,)), got shape " +
                           Dims(dims));
  return OkStatus();
}

// Checks the operands against the call and gives its canonical problem
// (docs/native.md §1; everything but the rank) and buffers.
inline Status DecodeOperands(const CallDesc& d, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                             const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w_scale,
                             const ffi::AnyBuffer& y, const ffi::AnyBuffer* x_gathered, Problem* q,
                             CallBuffers* io) {
  const char* op = CollectiveName(d.op);
  const auto bad = [&](const std::string& text) {
    return InvalidArgument(std::string(op) + ": " + text);
  };
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  const int64_t n = d.table.axis_size;
  if (xd.size() < 2)
    return bad("operand x expected rank >= 2, got rank " + std::to_string(xd.size()) + " (shape " +
               Dims(xd) + ")");
  if (wd.size() != 2)
    return bad("operand w expected rank 2, got rank " + std::to_string(wd.size()) + " (shape " +
               Dims(wd) + ")");
  const char* inputs = "float32, bfloat16, float16, float8_e4m3fn or float8_e5m2";
  if (!ToDType(x.element_type())) return bad(std::string("operand x expected dtype ") + inputs);
  if (!ToDType(w.element_type())) return bad(std::string("operand w expected dtype ") + inputs);
  const std::optional<DType> out = ToDType(y.element_type());
  if (!out || IsFp8(*out)) return bad("result y expected dtype float32, bfloat16 or float16");
  if (x_gathered != nullptr && x_gathered->element_type() != x.element_type())
    return bad("result x_gathered expected the dtype of x");
  JO_CHECK(CheckScale(op, "x_scale", x_scale));
  JO_CHECK(CheckScale(op, "w_scale", w_scale));
  if (wd[0] != xd[xd.size() - 1])
    return bad("operand w expected " + std::to_string(xd[xd.size() - 1]) +
               " rows (x's last dim), got shape " + Dims(wd));
  if (d.axis < 0 || d.axis > static_cast<int64_t>(xd.size()) - 2)
    return bad("attribute axis expected in [0, " + std::to_string(xd.size() - 2) + "], got " +
               std::to_string(d.axis));
  q->op = d.op;
  q->transport = d.transport;
  q->nranks = static_cast<int32_t>(n);
  q->x_dtype = *ToDType(x.element_type());
  q->w_dtype = *ToDType(w.element_type());
  q->out_dtype = *out;
  JO_CHECK(CheckDTypes(*q));
  q->chunks = d.chunks;
  q->bidirectional = d.bidirectional;
  q->tf32 = d.tf32;  // the GEMM ignores it but for float32 operands (cuda/gemm/gemm.cc)
  q->algorithm = d.algorithm;
  q->fused = d.fused;
  q->k = xd[xd.size() - 1];
  q->cols = wd[1];
  q->batch = 1;
  for (int64_t i = 0; i < d.axis; ++i) q->batch *= xd[i];
  int64_t post = 1;
  for (size_t i = static_cast<size_t>(d.axis) + 1; i + 1 < xd.size(); ++i) post *= xd[i];
  if (d.op == Collective::kAgMatmul) {
    q->rows = xd[d.axis] * post;
    JO_CHECK(CheckResult(op, "y", x, y, d.axis, xd[d.axis] * n, q->cols));
    q->return_gathered = x_gathered != nullptr;
    if (x_gathered != nullptr)
      JO_CHECK(CheckResult(op, "x_gathered", x, *x_gathered, d.axis, xd[d.axis] * n, q->k));
  } else if (d.op == Collective::kMatmulAr) {
    // Every dim but the last is a row: [1, N*rows, k] -> [1, N*rows, cols]
    // (one-shot: [1, rows, k] -> [1, rows, cols], any number of rows).
    int64_t total = 1;
    for (size_t i = 0; i + 1 < xd.size(); ++i) total *= xd[i];
    if (d.axis != 0) return bad("attribute axis expected 0, got " + std::to_string(d.axis));
    const bool one_shot = !SplitsRows(d.algorithm);  // one-shot and the kernels: all rows
    if (!one_shot && total % n != 0)
      return bad("operand x expected rows (the product of all dims but the last, " +
                 std::to_string(total) + ") divisible by axis_size " + std::to_string(n));
    if (x_gathered != nullptr) return bad("matmul_ar has one result");
    q->batch = 1;
    q->rows = one_shot ? total : total / n;
    JO_CHECK(CheckResult(op, "y", x, y, 0, xd[0], q->cols));
  } else {
    if (xd[d.axis] % n != 0)
      return bad("operand x dim " + std::to_string(d.axis) + " (" + std::to_string(xd[d.axis]) +
                 ") expected divisible by axis_size " + std::to_string(n));
    if (x_gathered != nullptr) return bad("matmul_rs has one result");
    q->rows = xd[d.axis] / n * post;
    JO_CHECK(CheckResult(op, "y", x, y, d.axis, xd[d.axis] / n, q->cols));
  }
  io->x = x.untyped_data();
  io->w = w.untyped_data();
  io->x_scale = x_scale.untyped_data();
  io->w_scale = w_scale.untyped_data();
  io->y = y.untyped_data();
  io->x_gathered = x_gathered != nullptr ? x_gathered->untyped_data() : nullptr;
  return OkStatus();
}

// The instantiate stage's state of one call site: the executor's Site
// (HostSite, CudaSite: constructed from (CallDesc, CallSite)) under the type id
// XLA's FFI knows it by. Each executor's handlers export `id` and `type_info`
// for jax.ffi.register_ffi_type; XLA deletes the state with the executable.
template <typename Site>
struct SiteState {
  static ffi::TypeId id;
  static const XLA_FFI_TypeInfo type_info;
  SiteState(CallDesc desc, CallSite call_site) : site(std::move(desc), std::move(call_site)) {}
  Site site;
};
template <typename Site>
ffi::TypeId SiteState<Site>::id = {};
template <typename Site>
const XLA_FFI_TypeInfo SiteState<Site>::type_info = ffi::MakeTypeInfo<SiteState<Site>>();

// The execute stage's binding, in two halves around the platform's extra
// operands: after the platform's own context (the CUDA stream), the device,
// the call-site state and x, w, x_scale, w_scale; then the results and the
// attributes.
template <typename Site, typename Binding>
auto BindOperands(Binding binding) {
  return std::move(binding)
      .template Ctx<ffi::DeviceOrdinal>()
      .template Ctx<ffi::State<SiteState<Site>>>()
      .template Arg<ffi::AnyBuffer>()   // x
      .template Arg<ffi::AnyBuffer>()   // w
      .template Arg<ffi::AnyBuffer>()   // x_scale
      .template Arg<ffi::AnyBuffer>();  // w_scale
}

template <typename Binding>
auto BindResults(Binding binding) {
  return std::move(binding)
      .template Ret<ffi::AnyBuffer>()          // y
      .template OptionalRet<ffi::AnyBuffer>()  // x_gathered (ag_matmul, return_gathered)
      .template Attrs<CallAttrs>();
}

// The instantiate stage: once per call site (one custom call of one
// executable), for every local device; makes the site. Newer XLA passes
// placeholder arguments and results here, older passes none.
inline auto BindInstantiate() {
  return ffi::Ffi::BindInstantiate().RemainingArgs().RemainingRets().Attrs<CallAttrs>();
}

// Makes the state of a call site from its attributes, with the site's
// identity (CallSite: from its site_key, in the order XLA instantiates).
template <typename Site>
ffi::ErrorOr<std::unique_ptr<SiteState<Site>>> Instantiate(ffi::RemainingArgs, ffi::RemainingRets,
                                                           CallAttrs attrs) {
  CallDesc desc;
  if (Status status = DecodeDesc(attrs, &desc); !status.ok())
    return ffi::Unexpected<ffi::Error>(ToFfi(status));
  CallSite site = CallSite::Instantiate(desc.site_key);
  return std::make_unique<SiteState<Site>>(std::move(desc), std::move(site));
}

}  // namespace jo::ffi_call
