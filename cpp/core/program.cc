#include "core/program.h"

#include <sstream>

namespace jo {

int64_t DTypeSize(DType dtype) { return dtype == DType::kF32 ? 4 : 2; }

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kF16:
      return "f16";
  }
  return "?";
}

const char* CollectiveName(Collective op) {
  switch (op) {
    case Collective::kAgMatmul:
      return "ag_matmul";
    case Collective::kMatmulRs:
      return "matmul_rs";
    case Collective::kMatmulAr:
      return "matmul_ar";
  }
  return "?";
}

const char* ArAlgorithmName(ArAlgorithm algorithm) {
  switch (algorithm) {
    case ArAlgorithm::kTwoShot:
      return "two_shot";
    case ArAlgorithm::kOneShot:
      return "one_shot";
  }
  return "?";
}

const char* TransportName(Transport transport) {
  switch (transport) {
    case Transport::kNccl:
      return "nccl";
    case Transport::kP2p:
      return "p2p";
    case Transport::kMulticast:
      return "multicast";
  }
  return "?";
}

const char* BufName(BufId buf) {
  switch (buf) {
    case BufId::kX:
      return "X";
    case BufId::kW:
      return "W";
    case BufId::kY:
      return "Y";
    case BufId::kXGathered:
      return "XGATHERED";
    case BufId::kScratch:
      return "SCRATCH";
    case BufId::kWorkspace:
      return "WORKSPACE";
  }
  return "?";
}

const char* OpKindName(OpKind kind) {
  switch (kind) {
    case OpKind::kGemm:
      return "Gemm";
    case OpKind::kAdd:
      return "Add";
    case OpKind::kCopy:
      return "Copy";
    case OpKind::kSend:
      return "Send";
    case OpKind::kRecv:
      return "Recv";
    case OpKind::kMcStore:
      return "McStore";
    case OpKind::kMcReduce:
      return "McReduce";
    case OpKind::kSignal:
      return "Signal";
    case OpKind::kWait:
      return "Wait";
    case OpKind::kRecord:
      return "Record";
    case OpKind::kStreamWait:
      return "StreamWait";
  }
  return "?";
}

std::string ToString(const Ref& ref) {
  std::ostringstream out;
  out << BufName(ref.buf);
  if (ref.buf == BufId::kWorkspace) out << "@" << ref.rank;
  out << "[+" << ref.offset << ", bs=" << ref.batch_stride << ", ld=" << ref.ld << "]";
  return out.str();
}

std::string ToString(const Op& op) {
  std::ostringstream out;
  out << OpKindName(op.kind) << "(";
  switch (op.kind) {
    case OpKind::kGemm:
      out << "d=" << ToString(op.d) << " <- a=" << ToString(op.a) << " @ W";
      if (op.accumulate) out << " + c=" << ToString(op.c);
      out << ", batch=" << op.batch << " m=" << op.m << " n=" << op.n << " k=" << op.k;
      break;
    case OpKind::kAdd:
    case OpKind::kCopy:
    case OpKind::kMcStore:
    case OpKind::kMcReduce:
      out << "d=" << ToString(op.d) << " <- a=" << ToString(op.a) << ", " << op.batch << "x" << op.m
          << "x" << op.n;
      break;
    case OpKind::kSend:
      out << "to=" << op.peer << " a=" << ToString(op.a) << ", " << op.batch << "x" << op.m << "x"
          << op.n << " tag=" << op.id << " bundle=" << op.bundle;
      break;
    case OpKind::kRecv:
      out << "from=" << op.peer << " d=" << ToString(op.d) << ", " << op.batch << "x" << op.m << "x"
          << op.n << " tag=" << op.id << " bundle=" << op.bundle;
      break;
    case OpKind::kSignal:
      out << "peer=" << op.peer << " flag=" << op.id << " = epoch";
      break;
    case OpKind::kWait:
      out << "flag=" << op.id << " >= epoch, writer=" << op.peer;
      break;
    case OpKind::kRecord:
    case OpKind::kStreamWait:
      out << "event=" << op.id;
      break;
  }
  if (op.shard >= 0) out << " shard=" << op.shard << "." << op.sub;
  out << ")";
  return out.str();
}

std::string Summary(const Program& p) {
  const Problem& q = p.problem;
  std::ostringstream out;
  out << CollectiveName(q.op);
  if (q.op == Collective::kMatmulAr) out << " " << ArAlgorithmName(q.algorithm);
  out << " transport=" << TransportName(q.transport) << " rank=" << q.rank << "/" << q.nranks
      << " batch=" << q.batch << " rows=" << q.rows << " k=" << q.k << " cols=" << q.cols
      << " dtype=" << DTypeName(q.dtype) << " chunks=" << p.chunks << " steps(cw,ccw)=("
      << p.cw_steps << "," << p.ccw_steps << ") streams=" << p.num_streams
      << " ops=" << p.ops.size() << " workspace_elems=" << p.workspace_elems
      << " scratch_elems=" << p.scratch_elems;
  return out.str();
}

std::string ToString(const Program& p) {
  std::ostringstream out;
  out << Summary(p) << "\n";
  for (int32_t s = 0; s < p.num_streams; ++s) {
    out << "  stream " << s << (s == 0 ? " (compute)" : " (comm)") << ":\n";
    for (const Op& op : p.ops)
      if (op.stream == s) out << "    " << ToString(op) << "\n";
  }
  return out.str();
}

int64_t RemoteBytes(const Program& p, const Op& op) {
  const int64_t bytes = op.batch * op.m * op.n * DTypeSize(p.problem.dtype);
  switch (op.kind) {
    case OpKind::kCopy:
      return op.d.buf == BufId::kWorkspace && op.d.rank != p.problem.rank ? bytes : 0;
    case OpKind::kSend:
    case OpKind::kMcStore:
      return bytes;
    default:
      return 0;
  }
}

}  // namespace jo
