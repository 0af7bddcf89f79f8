#include "core/build.h"

#include "core/allreduce_layout.h"

#include <algorithm>
#include <string>

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
  // is built for the fused all-gather's p2p ring only so far (docs/gpu.md §6 lists the rest).
  JO_REQUIRE(
      !q.replayable || (q.op == Collective::kAgMatmul && q.transport == Transport::kP2p && q.fused),
      op +
          ": a replayable program (no host-side epoch in what it enqueues) is built for "
          "ag_matmul over p2p with the fused GEMM only, not " +
          op + " over " + TransportName(q.transport) + (q.fused ? " fused" : " chunked"));

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
