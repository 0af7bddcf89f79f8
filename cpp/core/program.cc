#include "core/program.h"

#include <sstream>

namespace jo {

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
    case BufId::kXScale:
      return "XSCALE";
    case BufId::kWScale:
      return "WSCALE";
    case BufId::kScratchScales:
      return "SCRATCH_SCALES";
    case BufId::kWorkspaceScales:
      return "WORKSPACE_SCALES";
  }
  return "?";
}

DType BufDType(const Problem& q, BufId buf) {
  switch (buf) {
    case BufId::kX:
    case BufId::kXGathered:
      return q.x_dtype;
    case BufId::kW:
      return q.w_dtype;
    case BufId::kY:
      return q.out_dtype;
    case BufId::kScratch:
    case BufId::kWorkspace:
      return Row(q.op).communicates == CommDim::kK ? q.x_dtype : q.out_dtype;
    case BufId::kXScale:
    case BufId::kWScale:
    case BufId::kScratchScales:
    case BufId::kWorkspaceScales:
      return q.block_scaled ? DType::kF8E4M3 : DType::kF32;  // e8m0 bytes: see BufId
  }
  return DType::kF32;
}

Ref BlockScalesOf(const Problem& q, const Ref& a) {
  BufId buf = BufId::kXScale;
  if (a.buf == BufId::kScratch || a.buf == BufId::kXGathered) buf = BufId::kScratchScales;
  if (a.buf == BufId::kWorkspace) buf = BufId::kWorkspaceScales;
  const int64_t kb = KBlocks(q);
  return Ref{buf, a.rank, a.offset / q.k * kb, a.batch_stride / q.k * kb, a.ld / q.k * kb};
}

std::string DTypesName(const Problem& q) {
  if (q.x_dtype == q.w_dtype && q.x_dtype == q.out_dtype) return DTypeName(q.x_dtype);
  return std::string("x ") + DTypeName(q.x_dtype) + " w " + DTypeName(q.w_dtype) + " y " +
         DTypeName(q.out_dtype);
}

int64_t ElemBytes(const Problem& q, BufId buf) { return DTypeSize(BufDType(q, buf)); }

int64_t ScalesOffset(const Program& p, BufId scales) {
  const bool ws = scales == BufId::kWorkspaceScales;
  const int64_t bytes = ws ? p.workspace_elems * ElemBytes(p.problem, BufId::kWorkspace)
                           : p.scratch_elems * ElemBytes(p.problem, BufId::kScratch);
  return (bytes + 255) / 256 * 256;
}

int64_t WorkspaceBytes(const Program& p) {
  if (p.workspace_scales == 0) return p.workspace_elems * ElemBytes(p.problem, BufId::kWorkspace);
  return ScalesOffset(p, BufId::kWorkspaceScales) +
         p.workspace_scales * ElemBytes(p.problem, BufId::kWorkspaceScales);
}

int64_t ScratchBytes(const Program& p) {
  if (p.scratch_scales == 0) return p.scratch_elems * ElemBytes(p.problem, BufId::kScratch);
  return ScalesOffset(p, BufId::kScratchScales) +
         p.scratch_scales * ElemBytes(p.problem, BufId::kScratchScales);
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
    case OpKind::kFusedGemm:
      return "FusedGemm";
    case OpKind::kReduce:
      return "Reduce";
    case OpKind::kAllReduce:
      return "AllReduce";
    case OpKind::kResetFlags:
      return "ResetFlags";
  }
  return "?";
}

std::string ToString(const Ref& ref) {
  std::ostringstream out;
  out << BufName(ref.buf);
  if (ref.buf == BufId::kWorkspace || ref.buf == BufId::kWorkspaceScales) out << "@" << ref.rank;
  out << "[+" << ref.offset << ", bs=" << ref.batch_stride << ", ld=" << ref.ld << "]";
  return out.str();
}

std::string ToString(const Op& op, bool replayable) {
  std::ostringstream out;
  out << OpKindName(op.kind) << "(";
  switch (op.kind) {
    case OpKind::kGemm:
      out << "d=" << ToString(op.d) << " <- a=" << ToString(op.a) << " @ W";
      if (op.accumulate) out << " + c=" << ToString(op.c);
      out << ", batch=" << op.batch << " m=" << op.m << " n=" << op.n << " k=" << op.k;
      if (op.a_scaled) out << ", a_scale=" << ToString(op.a_scale);
      if (op.b_scaled) out << ", b_scale=" << ToString(op.b_scale);
      break;
    case OpKind::kAdd:
    case OpKind::kCopy:
    case OpKind::kMcStore:
    case OpKind::kMcReduce:
      out << "d=" << ToString(op.d) << " <- a=" << ToString(op.a) << ", " << op.batch << "x" << op.m
          << "x" << op.n;
      if (op.sms > 0) out << ", on " << op.sms << " SMs";
      break;
    case OpKind::kReduce:
      out << "d=" << ToString(op.d) << " <- sum of";
      for (const Ref& src : op.sources) out << " " << ToString(src);
      out << ", " << op.batch << "x" << op.m << "x" << op.n;
      if (op.sms > 0) out << ", on " << op.sms << " SMs";
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
      out << "peer=" << op.peer << " flag=" << op.id << (replayable ? " = 1" : " = epoch");
      break;
    case OpKind::kWait:
      out << "flag=" << op.id << (replayable ? " >= 1" : " >= epoch") << ", writer=" << op.peer;
      break;
    case OpKind::kRecord:
    case OpKind::kStreamWait:
      out << "event=" << op.id;
      break;
    case OpKind::kFusedGemm: {
      const FusedBlocks& f = op.fused;
      out << "d=" << ToString(op.d) << " <- a=" << ToString(op.a) << " @ W, batch=" << op.batch
          << " m=" << op.m << " n=" << op.n << " k=" << op.k << "; " << f.rows.count()
          << " blocks of " << f.rows.shards << " shards x " << f.rows.chunks << " chunks";
      if (f.wait_flags >= 0)
        out << ", waits for flag " << f.wait_flags << "+b (ready shard " << f.ready_shard << ")";
      if (f.release_flags >= 0) out << ", releases flag " << f.release_flags << "+b";
      if (f.spare_sms > 0) out << ", leaves " << f.spare_sms << " SMs";
      if (op.a_scaled)
        out << ", a_scale=" << ToString(op.a_scale)
            << (f.x_scale_stride == 0 ? " (every row)" : "+shard");
      if (op.b_scaled) out << ", b_scale=" << ToString(op.b_scale);
      out << ", order";
      for (int32_t b : f.sequence) out << " " << b;
      break;
    }
    case OpKind::kAllReduce:
      out << "d=" << ToString(op.d) << " <- sum over ranks, " << op.batch << "x" << op.m << "x"
          << op.n << ", one launch";
      break;
    case OpKind::kResetFlags:
      out << "flags=[" << op.id << ", " << op.id + op.n << ") <- 0";
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
  if (Row(q.op).one_shot) out << " " << ArAlgorithmName(q.algorithm);
  out << " transport=" << TransportName(q.transport) << " rank=" << q.rank << "/" << q.nranks
      << " batch=" << q.batch << " rows=" << q.rows << " k=" << q.k << " cols=" << q.cols
      << " dtype=" << DTypesName(q) << (q.fused ? " fused" : "")
      << (q.replayable ? " replayable" : "") << (q.block_scaled ? " block-scaled" : "")
      << " chunks=" << p.chunks << " steps(cw,ccw)=(" << p.cw_steps << "," << p.ccw_steps
      << ") streams=" << p.num_streams << " ops=" << p.ops.size()
      << " workspace_elems=" << p.workspace_elems << " scratch_elems=" << p.scratch_elems;
  if (p.workspace_scales > 0) out << " workspace_scales=" << p.workspace_scales;
  if (p.scratch_scales > 0) out << " scratch_scales=" << p.scratch_scales;
  return out.str();
}

std::string ToString(const Program& p) {
  std::ostringstream out;
  out << Summary(p) << "\n";
  for (int32_t s = 0; s < p.num_streams; ++s) {
    out << "  stream " << s << (s == 0 ? " (compute)" : " (comm)") << ":\n";
    for (const Op& op : p.ops)
      if (op.stream == s) out << "    " << ToString(op, p.problem.replayable) << "\n";
  }
  return out.str();
}

int64_t BlockBytes(const Program& p, const Op& op) {
  const bool writes = op.kind == OpKind::kRecv || op.kind == OpKind::kGemm ||
                      op.kind == OpKind::kFusedGemm || op.kind == OpKind::kReduce ||
                      op.kind == OpKind::kAllReduce;
  const BufId buf = writes ? op.d.buf : op.a.buf;
  return op.batch * op.m * op.n * ElemBytes(p.problem, buf);
}

int64_t RemoteBytes(const Program& p, const Op& op) {
  const int64_t bytes = BlockBytes(p, op);
  const bool to_peer = (op.d.buf == BufId::kWorkspace || op.d.buf == BufId::kWorkspaceScales) &&
                       op.d.rank != p.problem.rank;
  switch (op.kind) {
    case OpKind::kCopy:
      return to_peer ? bytes : 0;
    case OpKind::kSend:
    case OpKind::kMcStore:
      return bytes;
    case OpKind::kAllReduce: {
      // One-shot: the whole partial to every peer; two-shot: the peers' slices of it, then the
      // own reduced slice to every peer (core/allreduce_layout.h; the slices of y's elements).
      const int64_t n = p.problem.nranks;
      if (p.problem.algorithm == ArAlgorithm::kOneShotKernel) return (n - 1) * bytes;
      const int64_t es = ElemBytes(p.problem, op.d.buf), elems = bytes / es;
      const int64_t r = p.problem.rank;
      const int64_t own = elems * (r + 1) / n - elems * r / n;
      return ((elems - own) + (n - 1) * own) * es;
    }
    default:
      return 0;
  }
}

}  // namespace jo
