// The XLA FFI boundary, shared by both platforms' handlers: the attributes
// every stage binds (one list), the schema a program's attributes were made
// with, their checks, the operands' checks, the call site's state, the binding
// itself, and turning our Status into an ffi::Error (once, here).
//
// Every native custom call has the operands x, w, x_scale, w_scale, the
// result y and, for ag_matmul with return_gathered, x_gathered. The dtypes
// come from the buffers (core/kinds.h, JO_DTYPES): x and w of one dtype, or
// either fp8; y one allowed as output (x's, or float32 for non-fp8
// operands); x_gathered x's. x_scale and w_scale are float32 of shape () or
// (1,), always passed (1.0 when the operand is not fp8, whose scale no GEMM
// reads): the real value of an fp8 operand is element * scale, and an
// all-gather applies each shard's own. Or both are e8m0 block scales (MXFP8:
// CheckBlockScales). A handler never reads a scale on the
// host (the CUDA executor hands device pointers to cuBLASLt). The attributes
// are JO_CALL_ATTRS below; docs/native.md §6 says what each means. The rank
// table is empty only for a CPU call in one process whose mesh was abstract
// where it lowered; the CPU call then has a fifth operand, coords: int32[2] =
// (rank, group) from lax.axis_index (the GPU handler needs the table: reading
// a device scalar would need a sync).
//
// A serialized program (jax.export, the persistent compilation cache) may be
// run by another version of the library than the one that lowered it: its
// attributes name the schema they were made with (`schema`, a fingerprint of
// the attribute list and of the kinds their values index) and the version
// that made them (`jaxoverlap`). The instantiate stage checks the schema
// before it decodes anything else, and refuses another one naming both
// versions: a program never has its attributes read in another layout.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/build.h"
#include "core/call.h"
#include "core/program.h"
#include "core/status.h"
#include "xla/ffi/api/ffi.h"

namespace jo::ffi_call {

namespace ffi = xla::ffi;

// The attributes, in the order of jaxoverlap/_native/attributes.py SCHEMA
// (tests/native/test_attributes.py holds the two, and docs/native.md §6,
// equal): X(C++ type, name). Adding one is a row here and an entry there.
#define JO_CALL_ATTRS(X)                  \
  X(int64_t, schema)                      \
  X(std::string_view, jaxoverlap)         \
  X(int32_t, op)                          \
  X(int64_t, clique_key)                  \
  X(int64_t, site_key)                    \
  X(int64_t, axis)                        \
  X(int64_t, axis_size)                   \
  X(int32_t, transport)                   \
  X(int64_t, chunks)                      \
  X(bool, bidirectional)                  \
  X(bool, tf32)                           \
  X(int32_t, algorithm)                   \
  X(bool, fused)                          \
  X(bool, replayable)                     \
  X(int64_t, timeout_ms)                  \
  X(ffi::Span<const int64_t>, processes)  \
  X(ffi::Span<const int64_t>, device_ids) \
  X(ffi::Span<const int64_t>, ordinals)

struct CallAttrs {
#define JO_ATTR_MEMBER(type, name) type name{};
  JO_CALL_ATTRS(JO_ATTR_MEMBER)
#undef JO_ATTR_MEMBER
};

// Bump when an attribute's meaning changes while the list and the kinds stay
// (jaxoverlap/_native/attributes.py SCHEMA_REVISION is the same number).
inline constexpr int kSchemaRevision = 1;

// What the schema fingerprint hashes: the revision, every attribute (name and
// type) in order, and the names of the kinds whose ids attributes carry, in id
// order. jaxoverlap/_native/attributes.py schema_text() writes the same text.
inline std::string SchemaText() {
  std::string text = "jaxoverlap attributes " + std::to_string(kSchemaRevision) + ":";
#define JO_ATTR_TEXT(type, name) text += std::string(" ") + #name + " " + #type + ";";
  JO_CALL_ATTRS(JO_ATTR_TEXT)
#undef JO_ATTR_TEXT
  const auto names = [&](const char* kind, auto& rows) {
    text += std::string(" ") + kind + ":";
    for (const auto& row : rows) text += std::string(" ") + row.name;
    text += ";";
  };
  names("ops", kOps);
  names("transports", kTransports);
  names("algorithms", kArAlgorithms);
  return text;
}

// The fingerprint (FNV-1a, 64 bits, as a signed i64 attribute) of SchemaText.
inline int64_t SchemaId() {
  static const int64_t id = [] {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (unsigned char c : SchemaText()) h = (h ^ c) * 0x100000001b3ULL;
    return static_cast<int64_t>(h);
  }();
  return id;
}

// The version of the library these handlers belong to, set by the module
// that exports them when it loads (JO_VERSION is a module's definition).
inline std::string& LibraryVersion() {
  static std::string version = "(unknown version)";
  return version;
}

inline std::vector<int64_t> DimsOf(ffi::Span<const int64_t> dims) {
  return std::vector<int64_t>(dims.begin(), dims.end());
}

// "[2,3,4]" (core/call.h DimsText).
inline std::string Dims(ffi::Span<const int64_t> dims) { return DimsText(DimsOf(dims)); }

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

// Checks the attributes against the kinds' tables and copies them out of
// XLA's storage (the call site outlives the instantiate stage that sees them).
inline Status DecodeDesc(const CallAttrs& a, CallDesc* out) {
  const OpRow* op_row = RowOf(static_cast<Collective>(a.op));
  const TransportRow* transport_row = RowOf(static_cast<Transport>(a.transport));
  const ArAlgorithmRow* algorithm_row = RowOf(static_cast<ArAlgorithm>(a.algorithm));
  const std::string op = op_row != nullptr ? op_row->name : "jaxoverlap";
  const size_t n = a.processes.size();
  const auto bad = [&](const std::string& text) { return InvalidArgument(op + ": " + text); };
  if (op_row == nullptr)
    return bad("attribute op expected " + kinds::Ids(kOps) + ", got " + std::to_string(a.op));
  if (a.site_key == 0) return bad("attribute site_key expected a nonzero hash, got 0");
  if (a.axis_size < 1)
    return bad("attribute axis_size expected >= 1, got " + std::to_string(a.axis_size));
  if (transport_row == nullptr)
    return bad("attribute transport expected " + kinds::Ids(kTransports) + ", got " +
               std::to_string(a.transport));
  if (a.chunks < 1) return bad("attribute chunks expected >= 1, got " + std::to_string(a.chunks));
  if (algorithm_row == nullptr ||
      (algorithm_row->algorithm != ArAlgorithm::kTwoShot && !op_row->one_shot))
    return bad("attribute algorithm expected " +
               kinds::Ids(kArAlgorithms,
                          [&](const ArAlgorithmRow& r) {
                            return r.algorithm == ArAlgorithm::kTwoShot || op_row->one_shot;
                          }) +
               " for " + op + ", got " + std::to_string(a.algorithm));
  if (OneLaunch(algorithm_row->algorithm) && transport_row->messages())
    return bad("attribute algorithm " + std::to_string(a.algorithm) + " (" + algorithm_row->name +
               ": one kernel writing into its peers' memory) expects transport " +
               kinds::Names(kTransports, [](const TransportRow& r) { return !r.messages(); }) +
               ", not " + transport_row->name);
  if (a.fused && (!op_row->fused || !transport_row->fused))
    return bad("attribute fused applies to " +
               kinds::Names(
                   kOps, [](const OpRow& r) { return r.fused; }, " and ") +
               " over " + kinds::Names(kTransports, [](const TransportRow& r) { return r.fused; }) +
               " (docs/gpu-internals.md §5), not " + op + " over " + transport_row->name);
  if (a.timeout_ms < 1)
    return bad("attribute timeout_ms expected >= 1, got " + std::to_string(a.timeout_ms));
  if (a.device_ids.size() != n || a.ordinals.size() != n ||
      n % static_cast<size_t>(a.axis_size) != 0)  // (n == 0: coords place the caller)
    return bad(
        "the rank table attributes (processes, device_ids, ordinals) expected "
        "axis_size * groups entries each, got " +
        std::to_string(n) + ", " + std::to_string(a.device_ids.size()) + ", " +
        std::to_string(a.ordinals.size()) + " for axis_size " + std::to_string(a.axis_size));
  Problem& q = out->problem;
  q.op = op_row->op;
  q.transport = transport_row->transport;
  q.nranks = static_cast<int32_t>(a.axis_size);
  q.chunks = a.chunks;
  q.bidirectional = a.bidirectional;
  q.tf32 = a.tf32;
  q.algorithm = algorithm_row->algorithm;
  q.fused = a.fused;
  q.replayable = a.replayable;  // the builder refuses what it cannot build so (BuildProgram)
  out->axis = a.axis;
  out->clique_key = a.clique_key;
  out->site_key = a.site_key;
  out->timeout_ms = a.timeout_ms;
  out->table.axis_size = a.axis_size;
  out->table.processes.assign(a.processes.begin(), a.processes.end());
  out->table.device_ids.assign(a.device_ids.begin(), a.device_ids.end());
  out->table.ordinals.assign(a.ordinals.begin(), a.ordinals.end());
  return OkStatus();
}

// Whether a call's program replays: every call enqueues the same work, so XLA may capture the
// call into a command buffer and replay it (docs/gpu.md §6). matmul_ar's one-launch kernel
// algorithms (flags and sequence numbers on the device) and the programs built replayable
// (Problem::replayable); a call of one rank takes the ordinary path whatever it asks
// (CudaSite::Enqueue), so it never does. jaxoverlap/_executors/call.py NativeCall.replays is
// the lowering's side of this rule.
inline bool Replays(const Problem& q) {
  return (q.nranks > 1 && OneLaunch(q.algorithm)) || RunsReplayableProgram(q);
}

// The CUDA handlers' check of the target a call came through: a call that replays through
// jaxoverlap_cuda_replayable (command-buffer compatible: XLA may capture it), every other through
// its op's target (XLA never captures it). A mismatch is a program lowered by another rule than
// this library's (or a custom call written by hand): refused before anything runs, naming both.
inline Status CheckTarget(const CallDesc& desc, bool command_buffer_compatible) {
  const Problem& q = desc.problem;
  const bool replays = Replays(q);
  if (replays == command_buffer_compatible) return OkStatus();
  const std::string op = CollectiveName(q.op);
  const std::string what = "transport " + std::string(TransportName(q.transport)) + ", algorithm " +
                           ArAlgorithmName(q.algorithm) + ", replayable " +
                           (q.replayable ? "true" : "false") + ", " + std::to_string(q.nranks) +
                           " ranks";
  if (command_buffer_compatible)
    return InvalidArgument(
        op +
        ": this call came through jaxoverlap_cuda_replayable, the command-buffer "
        "compatible target, but its program does not replay (" +
        what +
        "): XLA could capture it and replay host-side epochs. Its target is jaxoverlap_cuda_" + op +
        "; lower the program again with this version of jaxoverlap");
  return InvalidArgument(op + ": this call's program replays (" + what +
                         ") but it came through jaxoverlap_cuda_" + op +
                         ", which is not command-buffer compatible; its target is "
                         "jaxoverlap_cuda_replayable. Lower the program again with this version "
                         "of jaxoverlap");
}

// The dtype of an XLA buffer type (core/kinds.h, the ffi column); nullopt for
// one the executors do not take.
inline std::optional<DType> ToDType(ffi::DataType type) {
#define JO_FFI_DTYPE(e, id, name, short_name, bytes, fp8, out, fused, elem, ffi_type, ...) \
  if (type == ffi::DataType::ffi_type) return DType::e;
  JO_DTYPES(JO_FFI_DTYPE)
#undef JO_FFI_DTYPE
  return std::nullopt;
}

// A result must have the shape `want` (its dtype is checked by the caller).
inline Status CheckResult(const std::string& op, const char* name, const ffi::AnyBuffer& got,
                          const std::vector<int64_t>& want) {
  if (DimsOf(got.dimensions()) != want)
    return InvalidArgument(op + ": result " + name + " expected shape " + DimsText(want) +
                           ", got " + Dims(got.dimensions()));
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

// Block scales (MXFP8): x_scale and w_scale e8m0, laid out as x and w with the
// contraction dim divided by 32 (x_scale: x's shape, its last dim k/32;
// w_scale [k/32, cols]), both operands fp8. Sets q->block_scaled.
inline Status CheckBlockScales(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                               const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w_scale,
                               Problem* q) {
  const auto bad = [&](const std::string& text) {
    return InvalidArgument(std::string(op) + ": " + text);
  };
  if (x_scale.element_type() != ffi::DataType::F8E8M0FNU ||
      w_scale.element_type() != ffi::DataType::F8E8M0FNU)
    return bad(
        "operands x_scale and w_scale expected both float8_e8m0fnu (block scales) or both "
        "float32 scalars");
  if (!IsFp8(q->x_dtype) || !IsFp8(q->w_dtype))
    return bad(
        "block scales (float8_e8m0fnu) dequantize fp8 operands: x and w must both be fp8, "
        "got " +
        DTypesName(*q));
  std::vector<int64_t> want = DimsOf(x.dimensions());
  const std::vector<int64_t> w_dims = DimsOf(w.dimensions());
  const int64_t k = want.empty() ? 0 : want.back();
  if (w_dims.size() != 2)
    return bad("block scales need w as a [K, N] matrix (w_scale is [K/" +
               std::to_string(kScaleBlock) + ", N]): operand w must be 2-D, got w " +
               Dims(w.dimensions()) + "; reshape it to [K, N]");
  if (k % kScaleBlock != 0)
    return bad("block scales cover " + std::to_string(kScaleBlock) +
               " elements of the contraction dim: x's last dim must be a multiple of " +
               std::to_string(kScaleBlock) + ", got x " + Dims(x.dimensions()));
  want.back() = k / kScaleBlock;
  if (DimsOf(x_scale.dimensions()) != want)
    return bad("operand x_scale (block scales) expected shape " + DimsText(want) + ", got " +
               Dims(x_scale.dimensions()));
  const std::vector<int64_t> w_want = {k / kScaleBlock, w_dims[1]};
  if (DimsOf(w_scale.dimensions()) != w_want)
    return bad("operand w_scale (block scales) expected shape " + DimsText(w_want) + ", got " +
               Dims(w_scale.dimensions()));
  q->block_scaled = true;
  return OkStatus();
}

// Checks the operands against the call and gives its canonical problem
// (CanonicalProblem: everything but the rank) and buffers.
inline Status DecodeOperands(const CallDesc& d, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                             const ffi::AnyBuffer& x_scale, const ffi::AnyBuffer& w_scale,
                             const ffi::AnyBuffer& y, const ffi::AnyBuffer* x_gathered, Problem* q,
                             CallBuffers* io) {
  const char* op = CollectiveName(d.problem.op);
  const auto bad = [&](const std::string& text) {
    return InvalidArgument(std::string(op) + ": " + text);
  };
  ResultShapes shapes;
  JO_CHECK(CanonicalProblem(d.problem, DimsOf(x.dimensions()), DimsOf(w.dimensions()), d.axis, q,
                            &shapes));
  const std::string inputs = kinds::Names(kDTypes);
  const std::optional<DType> x_dtype = ToDType(x.element_type());
  const std::optional<DType> w_dtype = ToDType(w.element_type());
  const std::optional<DType> out = ToDType(y.element_type());
  if (!x_dtype) return bad("operand x expected dtype " + inputs);
  if (!w_dtype) return bad("operand w expected dtype " + inputs);
  if (!out || !Row(*out).out)
    return bad("result y expected dtype " +
               kinds::Names(kDTypes, [](const DTypeRow& r) { return r.out; }));
  if (x_gathered != nullptr && x_gathered->element_type() != x.element_type())
    return bad("result x_gathered expected the dtype of x");
  q->x_dtype = *x_dtype;
  q->w_dtype = *w_dtype;
  q->out_dtype = *out;
  if (x_scale.element_type() == ffi::DataType::F8E8M0FNU ||
      w_scale.element_type() == ffi::DataType::F8E8M0FNU) {
    JO_CHECK(CheckBlockScales(op, x, w, x_scale, w_scale, q));
  } else {
    JO_CHECK(CheckScale(op, "x_scale", x_scale));
    JO_CHECK(CheckScale(op, "w_scale", w_scale));
  }
  JO_CHECK(CheckDTypes(*q));
  if (x_gathered != nullptr && !Row(q->op).gathered)
    return bad(std::string(op) + " has one result");
  q->return_gathered = x_gathered != nullptr;
  JO_CHECK(CheckResult(op, "y", y, shapes.y));
  if (x_gathered != nullptr)
    JO_CHECK(CheckResult(op, "x_gathered", *x_gathered, shapes.x_gathered));
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
// the call-site state and x, w, x_scale, w_scale; then the results. No
// attributes: the instantiate stage decoded them into the site (XLA checks
// the attributes' number only for a binding that decodes some).
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
      .template Ret<ffi::AnyBuffer>()           // y
      .template OptionalRet<ffi::AnyBuffer>();  // x_gathered (ag_matmul, return_gathered)
}

// The instantiate stage: once per call site (one custom call of one
// executable), for every local device; makes the site. Newer XLA passes
// placeholder arguments and results here, older passes none. The attributes
// come as a dictionary: their schema is checked before anything is decoded.
inline auto BindInstantiate() {
  return ffi::Ffi::BindInstantiate().RemainingArgs().RemainingRets().Attrs<ffi::Dictionary>();
}

// The program's attributes were made with this library's schema (SchemaId);
// else an error naming the version and schema that made them and ours.
inline Status CheckSchema(const ffi::Dictionary& attrs) {
  const auto hex = [](int64_t id) {
    char text[19];
    std::snprintf(text, sizeof(text), "0x%016llx",
                  static_cast<unsigned long long>(static_cast<uint64_t>(id)));
    return std::string(text);
  };
  const std::string ours = "this is jaxoverlap " + LibraryVersion() + ", whose native calls " +
                           "have attribute schema " + hex(SchemaId());
  const std::string fix =
      ". A program exported (jax.export) or cached (the persistent compilation cache) by "
      "another version of jaxoverlap cannot run here: lower it again with this version "
      "(export it again, or clear the compilation cache).";
  std::string theirs = "a jaxoverlap whose native calls carry no attribute schema (older)";
  if (attrs.contains<int64_t>("schema")) {
    const int64_t schema = *attrs.get<int64_t>("schema");
    if (schema == SchemaId()) return OkStatus();
    std::string version = "(unknown version)";
    if (attrs.contains<std::string_view>("jaxoverlap"))
      version = std::string(*attrs.get<std::string_view>("jaxoverlap"));
    theirs = "jaxoverlap " + version + " with attribute schema " + hex(schema);
  }
  return InvalidArgument("jaxoverlap: this program's native call was lowered by " + theirs + "; " +
                         ours + fix);
}

// The attributes, by name, once their schema is ours.
inline Status DecodeAttrs(const ffi::Dictionary& attrs, CallAttrs* out) {
  JO_CHECK(CheckSchema(attrs));
#define JO_ATTR_COUNT(type, name) +1
  constexpr size_t kCount = 0 JO_CALL_ATTRS(JO_ATTR_COUNT);
#undef JO_ATTR_COUNT
  std::string missing;
#define JO_ATTR_DECODE(type, name)                            \
  if (auto value = attrs.get<type>(#name); value.has_value()) \
    out->name = *value;                                       \
  else                                                        \
    missing += std::string(missing.empty() ? "" : ", ") + #name;
  JO_CALL_ATTRS(JO_ATTR_DECODE)
#undef JO_ATTR_DECODE
  if (!missing.empty() || attrs.size() != kCount)
    return InvalidArgument(
        "jaxoverlap: the native call has " + std::to_string(attrs.size()) +
        " attributes, expected " + std::to_string(kCount) +
        (missing.empty() ? "" : " (missing or of another type: " + missing + ")") +
        ", yet names this library's attribute schema");
  return OkStatus();
}

// Makes the state of a call site from its attributes, with the site's
// identity (CallSite: from its site_key, in the order XLA instantiates).
template <typename Site>
ffi::ErrorOr<std::unique_ptr<SiteState<Site>>> Instantiate(ffi::RemainingArgs, ffi::RemainingRets,
                                                           ffi::Dictionary attrs) {
  CallAttrs decoded;
  CallDesc desc;
  Status status = DecodeAttrs(attrs, &decoded);
  if (status.ok()) status = DecodeDesc(decoded, &desc);
  if (!status.ok()) return ffi::Unexpected<ffi::Error>(ToFfi(status));
  CallSite site = CallSite::Instantiate(desc.site_key);
  return std::make_unique<SiteState<Site>>(std::move(desc), std::move(site));
}

}  // namespace jo::ffi_call
