#include "core/build.h"

#include "core/allreduce_layout.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/build_internal.h"
#include "core/check_program.h"

namespace jo {

void RingSteps(int32_t nranks, bool bidirectional, int32_t* cw, int32_t* ccw) {
  if (!bidirectional) {
    *cw = nranks - 1;
    *ccw = 0;
    return;
  }
  *cw = nranks / 2;         // ceil((N-1)/2)
  *ccw = (nranks - 1) / 2;  // floor((N-1)/2)
}

Status CheckDTypes(const Problem& q) {
  const std::string got = std::string(" (x ") + DTypeName(q.x_dtype) + ", w " +
                          DTypeName(q.w_dtype) + ", y " + DTypeName(q.out_dtype) + ")";
  const std::string op = CollectiveName(q.op);
  const bool fp8 = IsFp8(q.x_dtype) || IsFp8(q.w_dtype);
  JO_REQUIRE(Row(q.out_dtype).out,
             op + ": the output dtype must be " +
                 kinds::Names(kDTypes, [](const DTypeRow& d) { return d.out; }) + got);
  JO_REQUIRE(fp8 || q.x_dtype == q.w_dtype,
             op + ": x and w must have the same dtype unless one of them is float8" + got);
  // Matrices of one type with an output of that type or float32: what cuBLASLt's
  // CUBLAS_COMPUTE_32F GEMMs take (cuBLAS docs, cublasLtMatmul, datatypes supported).
  JO_REQUIRE(fp8 || q.out_dtype == q.x_dtype || q.out_dtype == DType::kF32,
             op + ": the output dtype must be x's or float32" + got);
  return OkStatus();
}

namespace internal {

void Acknowledge(Program* p, Emitter& e, int32_t acks) {
  const Problem& q = p->problem;
  const int32_t N = q.nranks, streams = p->num_streams;
  // What the program so far waits on (flags, and the peers that raise them) and writes into.
  std::vector<bool> waited;
  std::vector<bool> writer(static_cast<size_t>(N), false);
  const auto waits = [&](int32_t flag, int32_t from) {
    if (static_cast<size_t>(flag) >= waited.size()) waited.resize(static_cast<size_t>(flag) + 1);
    waited[static_cast<size_t>(flag)] = true;
    if (from >= 0 && from != q.rank) writer[static_cast<size_t>(from)] = true;
  };
  // last[p]: the last stream that wrote into peer p (-1: none); wrote[s][p]: stream s did.
  std::vector<int32_t> last(static_cast<size_t>(N), -1);
  std::vector<std::vector<bool>> wrote(static_cast<size_t>(streams),
                                       std::vector<bool>(static_cast<size_t>(N), false));
  const auto writes = [&](int32_t stream, int32_t peer) {
    if (peer < 0 || peer == q.rank) return;
    last[static_cast<size_t>(peer)] = stream;
    wrote[static_cast<size_t>(stream)][static_cast<size_t>(peer)] = true;
  };
  for (const Op& op : p->ops) {
    switch (op.kind) {
      case OpKind::kWait:
        waits(op.id, op.peer);
        break;
      case OpKind::kFusedGemm:
        for (int32_t b = 0; b < op.fused.rows.count(); ++b)
          if (op.fused.Waits(b))
            waits(op.fused.wait_flags + b, op.fused.writers[static_cast<size_t>(b)]);
        break;
      case OpKind::kSignal:
        writes(op.stream, op.peer);
        break;
      case OpKind::kCopy:
        if (op.d.buf == BufId::kWorkspace || op.d.buf == BufId::kWorkspaceScales)
          writes(op.stream, op.d.rank);
        break;
      case OpKind::kMcStore:  // every rank's workspace
        for (int32_t peer = 0; peer < N; ++peer) writes(op.stream, peer);
        break;
      default:
        break;
    }
  }
  p->num_flags = acks + N;
  // Each other stream's work done (its reads of the workspace, its waits), recorded before
  // its acknowledgement waits: nothing the compute stream's resets and acknowledgements wait
  // for waits for an acknowledgement, so they never wait round the ring for each other.
  std::vector<int32_t> done(static_cast<size_t>(streams), -1);
  for (int32_t s = 1; s < streams; ++s) {
    done[static_cast<size_t>(s)] = e.NewEvent();
    e.Record(s, done[static_cast<size_t>(s)]);
  }
  for (int32_t s = 1; s < streams; ++s) e.StreamWait(0, done[static_cast<size_t>(s)]);
  for (size_t f = 0; f < waited.size();) {  // every flag waited on, in runs
    if (!waited[f]) {
      ++f;
      continue;
    }
    size_t end = f;
    while (end < waited.size() && waited[end]) ++end;
    e.Reset(0, static_cast<int32_t>(f), static_cast<int32_t>(end - f));
    f = end;
  }
  for (int32_t peer = 0; peer < N; ++peer)
    if (writer[static_cast<size_t>(peer)]) e.Signal(0, peer, acks + q.rank);
  // The stream that waits for peer p's acknowledgement: the compute stream if it wrote into p
  // (it is behind every other stream's record already), else the last stream that did, behind
  // the records of every other stream (so every write of the rank — into p, and into its own
  // workspace, which a multicast reduction of p reads — comes before the wait). Its joins
  // first, then the waits: after an acknowledgement wait its stream has only waits and resets
  // (check_program.cc rule 4).
  std::vector<int32_t> tail(static_cast<size_t>(N), -1);
  std::vector<std::vector<bool>> joined(static_cast<size_t>(streams),
                                        std::vector<bool>(static_cast<size_t>(streams), false));
  for (int32_t peer = 0; peer < N; ++peer) {
    const int32_t s = wrote[0][static_cast<size_t>(peer)] ? 0 : last[static_cast<size_t>(peer)];
    tail[static_cast<size_t>(peer)] = s;
    for (int32_t other = 1; other < streams && s > 0; ++other)
      if (other != s && !joined[static_cast<size_t>(s)][static_cast<size_t>(other)]) {
        e.StreamWait(s, done[static_cast<size_t>(other)]);
        joined[static_cast<size_t>(s)][static_cast<size_t>(other)] = true;
      }
  }
  for (int32_t peer = 0; peer < N; ++peer) {
    const int32_t s = tail[static_cast<size_t>(peer)];
    if (s < 0) continue;
    e.Wait(s, peer, acks + peer);
    e.Reset(s, acks + peer, 1);
  }
}

}  // namespace internal

Status BuildProgram(const Problem& q, Program* program) {
  const OpRow* row = RowOf(q.op);
  JO_REQUIRE(row != nullptr && RowOf(q.transport) != nullptr && RowOf(q.algorithm) != nullptr &&
                 RowOf(q.x_dtype) != nullptr && RowOf(q.w_dtype) != nullptr &&
                 RowOf(q.out_dtype) != nullptr,
             "jaxoverlap: a problem whose op, transport, algorithm or dtypes are outside their "
             "tables (core/kinds.h)");
  const std::string op = row->name;
  JO_REQUIRE(q.nranks >= 1, op + ": nranks must be >= 1, got " + std::to_string(q.nranks));
  JO_REQUIRE(q.rank >= 0 && q.rank < q.nranks, op + ": rank must be in [0, " +
                                                   std::to_string(q.nranks) + "), got " +
                                                   std::to_string(q.rank));
  JO_REQUIRE(q.batch >= 1 && q.rows >= 1 && q.k >= 1 && q.cols >= 1,
             op + ": batch, rows, k, cols must be >= 1, got " + std::to_string(q.batch) + ", " +
                 std::to_string(q.rows) + ", " + std::to_string(q.k) + ", " +
                 std::to_string(q.cols));
  JO_REQUIRE(q.chunks >= 1, op + ": chunks must be >= 1, got " + std::to_string(q.chunks));
  JO_REQUIRE(row->gathered || !q.return_gathered,
             op + ": return_gathered applies to " +
                 kinds::Names(kOps, [](const OpRow& o) { return o.gathered; }) + " only");
  JO_REQUIRE(row->one_shot || q.algorithm == ArAlgorithm::kTwoShot,
             op + ": the one-shot and kernel algorithms apply to " +
                 kinds::Names(kOps, [](const OpRow& o) { return o.one_shot; }) + " only");
  if (OneLaunch(q.algorithm)) {
    JO_REQUIRE(!Row(q.transport).messages(),
               op + ": the kernel algorithm " + ArAlgorithmName(q.algorithm) +
                   " writes into its peers' memory: transport " +
                   kinds::Names(kTransports, [](const TransportRow& t) { return !t.messages(); }) +
                   ", not " + TransportName(q.transport));
    const int64_t y_bytes = q.batch * q.rows * q.cols * DTypeSize(q.out_dtype);
    JO_REQUIRE(q.nranks <= allreduce::kMaxRanks &&
                   allreduce::Fits(Row(q.transport).mechanism == Mechanism::kMulticast,
                                   q.algorithm == ArAlgorithm::kTwoShotKernel, q.nranks, y_bytes),
               op + ": the kernel algorithm " + ArAlgorithmName(q.algorithm) + " moves at most " +
                   std::to_string(allreduce::kAreaBytes) + " bytes per rank and call (" +
                   std::to_string(y_bytes) + " bytes of y from " + std::to_string(q.nranks) +
                   " ranks do not fit; at most " + std::to_string(allreduce::kMaxRanks) +
                   " ranks): use algorithm='two_shot' or 'one_shot'");
  }
  JO_CHECK(CheckDTypes(q));
  if (q.block_scaled) {
    JO_REQUIRE(IsFp8(q.x_dtype) && IsFp8(q.w_dtype),
               op + ": block scales (MXFP8) dequantize fp8 operands: x and w must both be fp8 (" +
                   DTypesName(q) + ")");
    JO_REQUIRE(q.k % kScaleBlock == 0, op + ": block scales cover " + std::to_string(kScaleBlock) +
                                           " elements of k each: k must be a multiple of " +
                                           std::to_string(kScaleBlock) + ", got " +
                                           std::to_string(q.k));
    JO_REQUIRE(!q.fused, op + ": the fused GEMM takes no block scales (MXFP8): its kernels are "
                              "16-bit and per-tensor FP8 only; take the chunked path");
  }
  if (q.fused) {
    JO_REQUIRE(
        row->fused,
        op + ": the fused GEMM serves " +
            kinds::Names(kOps, [](const OpRow& o) { return o.fused; }, " and ") + ", not " + op);
    JO_REQUIRE(Row(q.transport).fused,
               op + ": the fused GEMM never runs with transport " + TransportName(q.transport) +
                   ": a persistent kernel holding every SM while an NCCL kernel waits for SMs "
                   "can deadlock (CUDA does not guarantee that two kernels run concurrently; "
                   "docs/gpu-internals.md §5). Use " +
                   kinds::Names(kTransports, [](const TransportRow& t) { return t.fused; }) +
                   ", or the chunked path");
    JO_REQUIRE(FusedServes(q.x_dtype, q.w_dtype, q.out_dtype),
               op + ": the fused GEMM is compiled for " + FusedServedNames() + "; " +
                   DTypesName(q) + " takes the chunked path");
    const int64_t k_unit = 16 / DTypeSize(q.x_dtype), cols_unit = 16 / DTypeSize(q.out_dtype);
    JO_REQUIRE(
        q.k % k_unit == 0 && q.cols % cols_unit == 0,
        op + ": the fused GEMM loads and stores rows of whole 16-byte units (TMA): k (" +
            std::to_string(q.k) + ") and the output columns (" + std::to_string(q.cols) +
            ") must be multiples of " +
            (k_unit == cols_unit ? std::to_string(k_unit)
                                 : std::to_string(k_unit) + " and " + std::to_string(cols_unit)) +
            "; take the chunked path");
  }
  // A replayable program's sequencing (acknowledged flags of constant value, core/program.h)
  // is built for every program over p2p and multicast (docs/gpu.md §6); matmul_ar's kernel
  // algorithms replay as they are (their sequence lives on the device, §7).
  JO_REQUIRE(!q.replayable ||
                 (Row(q.transport).mechanism != Mechanism::kMessages && !OneLaunch(q.algorithm)),
             op +
                 ": a replayable program (no host-side epoch in what it enqueues) is built over "
                 "p2p and multicast only, and not for the kernel algorithms (they replay as they "
                 "are), not " +
                 op + " over " + TransportName(q.transport) +
                 (OneLaunch(q.algorithm) ? std::string(" ") + ArAlgorithmName(q.algorithm)
                                         : std::string(q.fused ? " fused" : " chunked")));

  *program = Program();
  program->problem = q;
  // The kernel algorithms are one GEMM and one kernel: no sub-chunks.
  program->chunks = OneLaunch(q.algorithm) ? 1 : std::min<int64_t>(q.chunks, q.rows);
  if (!Row(q.transport).ring() || !SplitsRows(q.algorithm)) {
    // Multicast and one-shot have no ring: every transfer is one hop.
    program->cw_steps = q.nranks - 1;
    program->ccw_steps = 0;
  } else {
    RingSteps(q.nranks, q.bidirectional, &program->cw_steps, &program->ccw_steps);
  }
  switch (q.op) {
#define JO_BUILD_CASE(e, id, name, collective, communicates, rows, fused, gathered, one_shot, \
                      build)                                                                  \
  case Collective::e:                                                                         \
    JO_CHECK(internal::build(program));                                                       \
    break;
    JO_OPS(JO_BUILD_CASE)
#undef JO_BUILD_CASE
  }
  // Everything the program touches lies inside the sizes it declares.
  return CheckProgram(*program, BufferSizes::Of(*program));
}

}  // namespace jo
