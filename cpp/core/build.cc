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
  JO_REQUIRE(!IsFp8(q.out_dtype),
             op + ": the output dtype must be float32, bfloat16 or float16" + got);
  JO_REQUIRE(fp8 || q.x_dtype == q.w_dtype,
             op + ": x and w must have the same dtype unless one of them is float8" + got);
  // Matrices of one type with an output of that type or float32: what cuBLASLt's
  // CUBLAS_COMPUTE_32F GEMMs take (cuBLAS docs, cublasLtMatmul, datatypes supported).
  JO_REQUIRE(fp8 || q.out_dtype == q.x_dtype || q.out_dtype == DType::kF32,
             op + ": the output dtype must be x's or float32" + got);
  return OkStatus();
}

Status BuildProgram(const Problem& q, Program* program) {
  const std::string op = CollectiveName(q.op);
  JO_REQUIRE(q.nranks >= 1, op + ": nranks must be >= 1, got " + std::to_string(q.nranks));
  JO_REQUIRE(q.rank >= 0 && q.rank < q.nranks, op + ": rank must be in [0, " +
                                                   std::to_string(q.nranks) + "), got " +
                                                   std::to_string(q.rank));
  JO_REQUIRE(q.batch >= 1 && q.rows >= 1 && q.k >= 1 && q.cols >= 1,
             op + ": batch, rows, k, cols must be >= 1, got " + std::to_string(q.batch) + ", " +
                 std::to_string(q.rows) + ", " + std::to_string(q.k) + ", " +
                 std::to_string(q.cols));
  JO_REQUIRE(q.chunks >= 1, op + ": chunks must be >= 1, got " + std::to_string(q.chunks));
  JO_REQUIRE(q.op == Collective::kAgMatmul || !q.return_gathered,
             op + ": return_gathered applies to ag_matmul only");
  JO_REQUIRE(q.op == Collective::kMatmulAr || q.algorithm == ArAlgorithm::kTwoShot,
             op + ": the one-shot and kernel algorithms apply to matmul_ar only");
  if (OneLaunch(q.algorithm)) {
    JO_REQUIRE(q.transport != Transport::kNccl,
               op + ": the kernel algorithms (" + ArAlgorithmName(q.algorithm) +
                   ") write into their peers' memory: transport p2p or multicast, not nccl");
    const int64_t y_bytes = q.batch * q.rows * q.cols * DTypeSize(q.out_dtype);
    JO_REQUIRE(q.nranks <= allreduce::kMaxRanks &&
                   allreduce::Fits(q.transport == Transport::kMulticast,
                                   q.algorithm == ArAlgorithm::kTwoShotKernel, q.nranks, y_bytes),
               op + ": the kernel algorithm " + ArAlgorithmName(q.algorithm) + " moves at most " +
                   std::to_string(allreduce::kAreaBytes) + " bytes per rank and call (" +
                   std::to_string(y_bytes) + " bytes of y from " + std::to_string(q.nranks) +
                   " ranks do not fit; at most " + std::to_string(allreduce::kMaxRanks) +
                   " ranks): use algorithm='two_shot' or 'one_shot'");
  }
  JO_CHECK(CheckDTypes(q));
  if (q.fused) {
    JO_REQUIRE(q.op != Collective::kMatmulAr,
               op + ": the fused GEMM serves ag_matmul and matmul_rs, not matmul_ar");
    JO_REQUIRE(q.transport != Transport::kNccl,
               op + ": the fused GEMM never runs with transport nccl: a persistent kernel holding "
                    "every SM while an NCCL kernel waits for SMs can deadlock (CUDA does not "
                    "guarantee that two kernels run concurrently; docs/gpu.md §10). Use p2p or "
                    "multicast, or the chunked path");
    JO_REQUIRE((q.x_dtype == DType::kBF16 || q.x_dtype == DType::kF16) && q.w_dtype == q.x_dtype &&
                   q.out_dtype == q.x_dtype,
               op + ": the fused GEMM is compiled for bfloat16 and float16 (x, w and y alike); " +
                   DTypesName(q) + " takes the chunked path");
    JO_REQUIRE(q.k % 8 == 0 && q.cols % 8 == 0,
               op + ": the fused GEMM loads and stores rows of whole 16-byte units (TMA): k (" +
                   std::to_string(q.k) + ") and the output columns (" + std::to_string(q.cols) +
                   ") must be multiples of 8; take the chunked path");
  }

  *program = Program();
  program->problem = q;
  // The kernel algorithms are one GEMM and one kernel: no sub-chunks.
  program->chunks = OneLaunch(q.algorithm) ? 1 : std::min<int64_t>(q.chunks, q.rows);
  if (q.transport == Transport::kMulticast || !SplitsRows(q.algorithm)) {
    // Multicast and one-shot have no ring: every transfer is one hop.
    program->cw_steps = q.nranks - 1;
    program->ccw_steps = 0;
  } else {
    RingSteps(q.nranks, q.bidirectional, &program->cw_steps, &program->ccw_steps);
  }
  switch (q.op) {
    case Collective::kAgMatmul:
      JO_CHECK(internal::BuildAgMatmul(program));
      break;
    case Collective::kMatmulRs:
      JO_CHECK(internal::BuildMatmulRs(program));
      break;
    case Collective::kMatmulAr:
      JO_CHECK(internal::BuildMatmulAr(program));
      break;
    default:
      return InvalidArgument(op + ": unknown collective " +
                             std::to_string(static_cast<int32_t>(q.op)));
  }
  // Everything the program touches lies inside the sizes it declares.
  return CheckProgram(*program, BufferSizes::Of(*program));
}

}  // namespace jo
