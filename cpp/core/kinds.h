// The kinds of the native path, one table each: the ops, the transports, the
// dtypes (and matmul_ar's algorithms). Every enum, name, parser, size and
// library-type column is generated from these lists; nothing else lists the
// members of a kind. jaxoverlap/_kinds.py has the same rows (the columns both
// sides know): _host.kinds() exports these tables and tests/test_kinds.py
// holds the two equal. docs/native.md §8 says what else a new row needs.
//
// Each list is an X-macro: JO_OPS(X) expands X(...) once per row, so a use
// picks its columns by position (the comment above each list names them).
// Ids are the custom call's attribute values and index the row arrays below:
// they are 0, 1, 2, ... in row order (checked at compile time).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace jo {

// ---- ops ----------------------------------------------------------------
// X(enum, id, name, collective, communicates, rows, fused, gathered, one_shot,
//   build)
//   collective    the collective the op hides behind its GEMMs
//   communicates  which dimension travels: kK, x's rows (k columns each: an
//                 all-gather of the input) or kN, partial sums of y's rows (n
//                 columns each, in the output dtype: a reduction of the output)
//   rows          how the canonical problem's rows come from x (docs/native.md
//                 §1; CanonicalProblem in core/call.h):
//                   kGather   x holds one shard of the rows on `axis`; y has N
//                   kScatter  x holds all N blocks of the rows on `axis`; y one
//                   kAll      every dim of x but the last is a row (axis 0); y
//                             has them all (two-shot splits them into N blocks)
//   fused         the fused GEMM (docs/gpu-internals.md §5) serves it
//   gathered      it may also return the gathered x (return_gathered)
//   one_shot      the one-shot algorithm applies (else two-shot only)
//   build         its program builder (core/build_internal.h declares it)
#define JO_OPS(X)                                                                                 \
  X(kAgMatmul, 0, "ag_matmul", "all_gather", kK, kGather, true, true, false, BuildAgMatmul)       \
  X(kMatmulRs, 1, "matmul_rs", "reduce_scatter", kN, kScatter, true, false, false, BuildMatmulRs) \
  X(kMatmulAr, 2, "matmul_ar", "all_reduce", kN, kAll, false, false, true, BuildMatmulAr)

// ---- transports ---------------------------------------------------------
// X(enum, id, name, auto_rank, fused, mechanism, cuda)
//   auto_rank   transport="auto" takes the lowest rank that can serve a
//               clique (jaxoverlap/_kinds.py says why each cannot)
//   fused       the fused GEMM runs over it (never NCCL: a persistent kernel
//               holding every SM while an NCCL kernel waits for SMs can
//               deadlock, docs/gpu-internals.md §5)
//   mechanism   how its programs move blocks (the builders' choice):
//                 kMessages    Send/Recv round a ring; the transport orders
//                              and moves the data itself (NCCL communicators)
//                 kPeerCopies  copies into the peers' workspace round a ring,
//                              each raising a flag in peer memory
//                 kMulticast   stores and load-reduces through one multicast
//                              object: every transfer is one hop
//   cuda        its set-up in the CUDA executor (cuda/transport/transports.h)
#define JO_TRANSPORTS(X)                             \
  X(kNccl, 0, "nccl", 2, false, kMessages, kNcclOps) \
  X(kP2p, 1, "p2p", 1, true, kPeerCopies, kP2pOps)   \
  X(kMulticast, 2, "multicast", 0, true, kMulticast, kMulticastOps)

// ---- dtypes -------------------------------------------------------------
// X(enum, id, name, short, bytes, fp8, out, fused, elem, ffi, nccl, cublaslt)
//   name        JAX's (NumPy's) name; short: the programs' ("bf16")
//   fp8         an operand with a float32 dequantization scale (OCP FP8)
//   out         allowed as y's dtype
//   fused       the fused GEMM is compiled for it
//   elem        the block kernels' element class (cuda/kernels/kernel_body.h
//               Elem): fp8 kinds share one, they only move bytes
//   ffi         xla::ffi::DataType
//   nccl        ncclDataType_t of its Send/Recv: they only move bytes, so an
//               fp8 moves as ncclUint8 (every NCCL version has it; the fp8
//               types exist from NCCL 2.24 on)
//   cublaslt    cudaDataType of its cuBLASLt matrices
#define JO_DTYPES(X)                                                                            \
  X(kF32, 0, "float32", "f32", 4, false, true, false, kF32, F32, ncclFloat32, CUDA_R_32F)       \
  X(kBF16, 1, "bfloat16", "bf16", 2, false, true, true, kBF16, BF16, ncclBfloat16, CUDA_R_16BF) \
  X(kF16, 2, "float16", "f16", 2, false, true, true, kF16, F16, ncclFloat16, CUDA_R_16F)        \
  X(kF8E4M3, 3, "float8_e4m3fn", "f8e4m3fn", 1, true, false, false, kF8, F8E4M3FN, ncclUint8,   \
    CUDA_R_8F_E4M3)                                                                             \
  X(kF8E5M2, 4, "float8_e5m2", "f8e5m2", 1, true, false, false, kF8, F8E5M2, ncclUint8,         \
    CUDA_R_8F_E5M2)

// ---- matmul_ar's algorithms (docs/native.md §3) -------------------------
// Two-shot: a reduce-scatter of N row blocks, then an all-gather of the
// reduced blocks (a ring on nccl and p2p; a load-reduce and a store through
// the switch on multicast): each rank moves 2(N-1)/N of y, the bandwidth
// bound. One-shot: every rank's whole partial goes to every rank (or, on
// multicast, is load-reduced by every rank), which sums all of them itself:
// (N-1) partials per rank, but one round of transfers, whatever N — the
// latency bound, for small calls. Rows need not split into N blocks.
//
// The kernel algorithms do the same in ONE kernel launch after the GEMM (the
// AllReduce op; docs/gpu-internals.md §7): its flags and sequence numbers live
// on the device, so the call can be captured into a CUDA graph and replayed.
// One-shot kernel: every rank's partial to every rank (p2p pushes, or
// multicast's load-reduce); two-shot kernel: a reduce-scatter and an
// all-gather of N slices of y inside the kernel. Rows need not split (the
// kernel splits y's elements); only over transports with peer memory (not
// kMessages).
// X(enum, id, name, splits_rows, kernel)
//   splits_rows  x's rows split into N blocks (the two-shot ring's canonical
//                problem: rows divisible by N); else every rank has them all
//   kernel       one kernel launch with device-side sequence numbers (an
//                AllReduce op): the call replays
#define JO_AR_ALGORITHMS(X)                            \
  X(kTwoShot, 0, "two_shot", true, false)              \
  X(kOneShot, 1, "one_shot", false, false)             \
  X(kOneShotKernel, 2, "one_shot_kernel", false, true) \
  X(kTwoShotKernel, 3, "two_shot_kernel", false, true)

// ---- what the lists generate ----------------------------------------------

#define JO_KIND_ENUM(e, id, ...) e = id,
enum class Collective : int32_t { JO_OPS(JO_KIND_ENUM) };
enum class Transport : int32_t { JO_TRANSPORTS(JO_KIND_ENUM) };
enum class DType : int32_t { JO_DTYPES(JO_KIND_ENUM) };
enum class ArAlgorithm : int32_t { JO_AR_ALGORITHMS(JO_KIND_ENUM) };
#undef JO_KIND_ENUM

// The values of the columns that are kinds of their own: which dimension an
// op communicates and how its rows come from x (JO_OPS), how a transport's
// programs move blocks (JO_TRANSPORTS). X(enum, name).
#define JO_COMM_DIMS(X) \
  X(kK, "k")            \
  X(kN, "n")
#define JO_ROWS_RULES(X) \
  X(kGather, "gather")   \
  X(kScatter, "scatter") \
  X(kAll, "all")
#define JO_MECHANISMS(X)        \
  X(kMessages, "messages")      \
  X(kPeerCopies, "peer_copies") \
  X(kMulticast, "multicast")

#define JO_COLUMN_ENUM(e, name) e,
enum class CommDim : int32_t { JO_COMM_DIMS(JO_COLUMN_ENUM) };
enum class RowsRule : int32_t { JO_ROWS_RULES(JO_COLUMN_ENUM) };
enum class Mechanism : int32_t { JO_MECHANISMS(JO_COLUMN_ENUM) };
#undef JO_COLUMN_ENUM

// Their names (what Python's tables hold: _host.kinds()).
#define JO_COLUMN_NAME(e, name) \
  if (value == decltype(value)::e) return name;
inline const char* ColumnName(CommDim value) {
  JO_COMM_DIMS(JO_COLUMN_NAME)
  return "?";
}
inline const char* ColumnName(RowsRule value) {
  JO_ROWS_RULES(JO_COLUMN_NAME)
  return "?";
}
inline const char* ColumnName(Mechanism value) {
  JO_MECHANISMS(JO_COLUMN_NAME)
  return "?";
}
#undef JO_COLUMN_NAME

struct OpRow {
  Collective op;
  const char* name;
  const char* collective;
  CommDim communicates;
  RowsRule rows;
  bool fused, gathered, one_shot;
};
struct TransportRow {
  Transport transport;
  const char* name;
  int32_t auto_rank;
  bool fused;
  Mechanism mechanism;
  // Two-shot programs pass blocks round a ring (else every transfer is one hop).
  constexpr bool ring() const { return mechanism != Mechanism::kMulticast; }
  // The transport moves the data itself (Send/Recv): no flags, no peer memory.
  constexpr bool messages() const { return mechanism == Mechanism::kMessages; }
};
struct DTypeRow {
  DType dtype;
  const char* name;
  const char* short_name;
  int32_t bytes;
  bool fp8, out, fused;
};
struct ArAlgorithmRow {
  ArAlgorithm algorithm;
  const char* name;
  bool splits_rows, kernel;
};

#define JO_OP_ROW(e, id, name, collective, communicates, rows, fused, gathered, one_shot, ...) \
  {Collective::e,  name,  collective, CommDim::communicates,                                   \
   RowsRule::rows, fused, gathered,   one_shot},
inline constexpr OpRow kOps[] = {JO_OPS(JO_OP_ROW)};
#undef JO_OP_ROW
#define JO_TRANSPORT_ROW(e, id, name, auto_rank, fused, mechanism, ...) \
  {Transport::e, name, auto_rank, fused, Mechanism::mechanism},
inline constexpr TransportRow kTransports[] = {JO_TRANSPORTS(JO_TRANSPORT_ROW)};
#undef JO_TRANSPORT_ROW
#define JO_DTYPE_ROW(e, id, name, short_name, bytes, fp8, out, fused, ...) \
  {DType::e, name, short_name, bytes, fp8, out, fused},
inline constexpr DTypeRow kDTypes[] = {JO_DTYPES(JO_DTYPE_ROW)};
#undef JO_DTYPE_ROW
#define JO_AR_ALGORITHM_ROW(e, id, name, splits_rows, kernel) \
  {ArAlgorithm::e, name, splits_rows, kernel},
inline constexpr ArAlgorithmRow kArAlgorithms[] = {JO_AR_ALGORITHMS(JO_AR_ALGORITHM_ROW)};
#undef JO_AR_ALGORITHM_ROW

namespace kinds {

// Every row's id is its index (rows are looked up by id).
template <typename Row, size_t N, typename Kind>
constexpr bool Dense(const Row (&rows)[N], Kind Row::* kind) {
  for (size_t i = 0; i < N; ++i)
    if (static_cast<size_t>(rows[i].*kind) != i) return false;
  return true;
}

template <typename Row, size_t N, typename Kind>
constexpr const Row* Find(const Row (&rows)[N], Kind kind) {
  const auto i = static_cast<size_t>(kind);
  return i < N ? &rows[i] : nullptr;
}

// The member named `name`; nullopt if none.
template <typename Row, size_t N, typename Kind>
std::optional<Kind> Parse(const Row (&rows)[N], Kind Row::* kind, std::string_view name) {
  for (const Row& row : rows)
    if (name == row.name) return row.*kind;
  return std::nullopt;
}

// "a, b or c" (or `last` = " and ": "a, b and c"): the names of the rows that
// satisfy `pred`, for an error that says what is expected.
template <typename Row, size_t N, typename Pred>
std::string Names(const Row (&rows)[N], Pred pred, const char* last = " or ") {
  std::string out;
  size_t total = 0, seen = 0;
  for (const Row& row : rows) total += pred(row) ? 1 : 0;
  for (const Row& row : rows) {
    if (!pred(row)) continue;
    out += std::string(seen == 0 ? "" : seen + 1 == total ? last : ", ") + row.name;
    ++seen;
  }
  return out;
}
template <typename Row, size_t N>
std::string Names(const Row (&rows)[N]) {
  return Names(rows, [](const Row&) { return true; });
}

// "0 (a), 1 (b) or 2 (c)": the ids and names of the rows that satisfy `pred`,
// for an attribute's error.
template <typename Row, size_t N, typename Pred>
std::string Ids(const Row (&rows)[N], Pred pred) {
  std::string out;
  size_t total = 0, seen = 0;
  for (const Row& row : rows) total += pred(row) ? 1 : 0;
  for (size_t i = 0; i < N; ++i) {
    if (!pred(rows[i])) continue;
    out += std::string(seen == 0           ? ""
                       : seen + 1 == total ? " or "
                                           : ", ") +
           std::to_string(i) + " (" + rows[i].name + ")";
    ++seen;
  }
  return out;
}
template <typename Row, size_t N>
std::string Ids(const Row (&rows)[N]) {
  return Ids(rows, [](const Row&) { return true; });
}

}  // namespace kinds

static_assert(kinds::Dense(kOps, &OpRow::op), "JO_OPS: ids must be 0, 1, ... in row order");
static_assert(kinds::Dense(kTransports, &TransportRow::transport),
              "JO_TRANSPORTS: ids must be 0, 1, ... in row order");
static_assert(kinds::Dense(kDTypes, &DTypeRow::dtype),
              "JO_DTYPES: ids must be 0, 1, ... in row order");
static_assert(kinds::Dense(kArAlgorithms, &ArAlgorithmRow::algorithm),
              "JO_AR_ALGORITHMS: ids must be 0, 1, ... in row order");

// The row of a member; nullptr for a value outside its table.
constexpr const OpRow* RowOf(Collective op) { return kinds::Find(kOps, op); }
constexpr const TransportRow* RowOf(Transport transport) {
  return kinds::Find(kTransports, transport);
}
constexpr const DTypeRow* RowOf(DType dtype) { return kinds::Find(kDTypes, dtype); }
constexpr const ArAlgorithmRow* RowOf(ArAlgorithm algorithm) {
  return kinds::Find(kArAlgorithms, algorithm);
}
// The row of a valid member.
constexpr const OpRow& Row(Collective op) { return *RowOf(op); }
constexpr const TransportRow& Row(Transport transport) { return *RowOf(transport); }
constexpr const DTypeRow& Row(DType dtype) { return *RowOf(dtype); }
constexpr const ArAlgorithmRow& Row(ArAlgorithm algorithm) { return *RowOf(algorithm); }

// Names ("?" outside the table); a dtype's is the programs' short name ("bf16").
template <typename Kind>
const char* NameOf(Kind kind) {
  const auto* row = RowOf(kind);
  return row != nullptr ? row->name : "?";
}
inline const char* CollectiveName(Collective op) { return NameOf(op); }
inline const char* TransportName(Transport transport) { return NameOf(transport); }
inline const char* ArAlgorithmName(ArAlgorithm algorithm) { return NameOf(algorithm); }
inline const char* DTypeName(DType dtype) {
  const DTypeRow* row = RowOf(dtype);
  return row != nullptr ? row->short_name : "?";
}

inline int64_t DTypeSize(DType dtype) { return Row(dtype).bytes; }
// Whether the algorithm splits x's rows into N blocks (the two-shot ring's).
inline bool SplitsRows(ArAlgorithm algorithm) { return Row(algorithm).splits_rows; }
// Whether the all-reduce is one kernel launch with device-side sequence
// numbers (an AllReduce op): the call replays. A program built replayable:
// RunsReplayableProgram (core/program.h).
inline bool OneLaunch(ArAlgorithm algorithm) { return Row(algorithm).kernel; }
inline bool IsFp8(DType dtype) { return Row(dtype).fp8; }

// The fused GEMM's FP8 instantiations (cpp/cuda/fused/fused_gemm_sm90_fp8.cu), one row per
// (x, w, y) it is compiled for: X(x, w, y). e4m3 x e4m3 -> bf16 is the forward of the FP8
// recipes (TransformerEngine's, Flax's), -> f16 and -> f32 the same forward for a model kept
// in those dtypes, e5m2 x e4m3 -> bf16 the gradient's dy @ w^T. Every other FP8 triple takes
// the chunked path (each instantiation costs ~10 CPU-s of CI compile).
#define JO_FUSED_FP8(X)      \
  X(kF8E4M3, kF8E4M3, kBF16) \
  X(kF8E4M3, kF8E4M3, kF16)  \
  X(kF8E4M3, kF8E4M3, kF32)  \
  X(kF8E5M2, kF8E4M3, kBF16)

// Whether the fused GEMM is compiled for x, w and y of these dtypes: a 16-bit dtype (the
// dtypes' `fused` column) for all three, or a row of JO_FUSED_FP8.
constexpr bool FusedServes(DType x, DType w, DType y) {
  if (Row(x).fused) return w == x && y == x;
#define JO_FUSED_FP8_MATCH(a, b, d) \
  if (x == DType::a && w == DType::b && y == DType::d) return true;
  JO_FUSED_FP8(JO_FUSED_FP8_MATCH)
#undef JO_FUSED_FP8_MATCH
  return false;
}

// What the fused GEMM is compiled for, for error messages: "bf16 and f16 (x, w and y alike);
// f8e4m3fn x f8e4m3fn -> bf16, ...".
inline std::string FusedServedNames() {
  std::string out = kinds::Names(
                        kDTypes, [](const DTypeRow& d) { return d.fused; }, " and ") +
                    " (x, w and y alike)";
  const char* sep = "; ";
#define JO_FUSED_FP8_NAME(a, b, d)                                                                 \
  out += std::string(sep) + Row(DType::a).short_name + " x " + Row(DType::b).short_name + " -> " + \
         Row(DType::d).short_name;                                                                 \
  sep = ", ";
  JO_FUSED_FP8(JO_FUSED_FP8_NAME)
#undef JO_FUSED_FP8_NAME
  return out;
}

// Parsers: a member by its name (a dtype by JAX's name or the short one).
inline std::optional<Collective> ParseCollective(std::string_view name) {
  return kinds::Parse(kOps, &OpRow::op, name);
}
inline std::optional<Transport> ParseTransport(std::string_view name) {
  return kinds::Parse(kTransports, &TransportRow::transport, name);
}
inline std::optional<ArAlgorithm> ParseArAlgorithm(std::string_view name) {
  return kinds::Parse(kArAlgorithms, &ArAlgorithmRow::algorithm, name);
}
inline std::optional<DType> ParseDType(std::string_view name) {
  for (const DTypeRow& row : kDTypes)
    if (name == row.name || name == row.short_name) return row.dtype;
  return std::nullopt;
}

}  // namespace jo
