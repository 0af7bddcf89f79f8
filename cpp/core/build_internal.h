// Helpers shared by the builders (not part of the core's interface).
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include "core/program.h"
#include "core/status.h"

namespace jo::internal {

inline int32_t Mod(int64_t a, int32_t n) { return static_cast<int32_t>(((a % n) + n) % n); }

// Row range [begin, end) of sub-chunk `sub` of a block of `rows` rows.
inline int64_t SubBegin(int64_t rows, int64_t chunks, int64_t sub) { return rows * sub / chunks; }
inline int64_t SubRows(int64_t rows, int64_t chunks, int64_t sub) {
  return SubBegin(rows, chunks, sub + 1) - SubBegin(rows, chunks, sub);
}

// Appends ops to a program, allocating event ids.
class Emitter {
 public:
  explicit Emitter(Program* program) : p_(program) {}

  Op& Add(OpKind kind, int32_t stream) {
    p_->ops.emplace_back();
    Op& op = p_->ops.back();
    op.kind = kind;
    op.stream = stream;
    if (stream + 1 > p_->num_streams) p_->num_streams = stream + 1;
    return op;
  }
  int32_t NewEvent() { return p_->num_events++; }
  int32_t NewBundle() { return next_bundle_++; }
  void Record(int32_t stream, int32_t event) { Add(OpKind::kRecord, stream).id = event; }
  void StreamWait(int32_t stream, int32_t event) { Add(OpKind::kStreamWait, stream).id = event; }
  void Signal(int32_t stream, int32_t peer, int32_t flag) {
    Op& op = Add(OpKind::kSignal, stream);
    op.peer = peer;
    op.id = flag;
  }
  void Wait(int32_t stream, int32_t writer, int32_t flag) {
    Op& op = Add(OpKind::kWait, stream);
    op.peer = writer;
    op.id = flag;
  }
  // Own flags [first, first + count) <- 0 (replayable programs).
  void Reset(int32_t stream, int32_t first, int32_t count) {
    Op& op = Add(OpKind::kResetFlags, stream);
    op.id = first;
    op.n = count;
  }
  // Block ops (Copy, Add, Send, Recv, McStore, McReduce): batch x rows x cols.
  Op& Block(OpKind kind, int32_t stream, const Ref& src, const Ref& dst, int64_t batch,
            int64_t rows, int64_t cols) {
    Op& op = Add(kind, stream);
    op.a = src;
    op.d = dst;
    op.batch = batch;
    op.m = rows;
    op.n = cols;
    return op;
  }
  Op& Gemm(int32_t stream, const Ref& a, const Ref& d, const Ref* c, int64_t batch, int64_t m) {
    const Problem& q = p_->problem;
    Op& op = Add(OpKind::kGemm, stream);
    op.a = a;
    op.b = Ref{BufId::kW, q.rank, 0, 0, q.cols};
    op.d = d;
    if (c != nullptr) {
      op.c = *c;
      op.accumulate = true;
    }
    op.batch = batch;
    op.m = m;
    op.n = q.cols;
    op.k = q.k;
    // Block scales: a's rows' own, beside them (core/program.h BufId), and w's.
    if (q.block_scaled) {
      op.a_scaled = op.b_scaled = true;
      op.a_scale = BlockScalesOf(q, a);
      op.b_scale = Ref{BufId::kWScale, q.rank, 0, 0, q.cols};
      return op;
    }
    // fp8 operands: this rank's own scales (an all-gather's GEMM on a received
    // shard names that shard's scale instead).
    if (IsFp8(q.x_dtype)) {
      op.a_scaled = true;
      op.a_scale = ScaleRef(BufId::kXScale, q.rank, 0);
    }
    if (IsFp8(q.w_dtype)) {
      op.b_scaled = true;
      op.b_scale = ScaleRef(BufId::kWScale, q.rank, 0);
    }
    return op;
  }
  // One persistent GEMM over every row block of `blocks` (m = blocks.rows.rows()).
  // fp8 operands: w's scale, and x's as the caller sets it (an all-gather's:
  // the shards' scale slots).
  Op& FusedGemm(int32_t stream, const Ref& a, const Ref& d, int64_t batch, FusedBlocks blocks) {
    Op& op = Gemm(stream, a, d, nullptr, batch, blocks.rows.rows());
    op.kind = OpKind::kFusedGemm;
    op.fused = std::move(blocks);
    return op;
  }
  // Scale slot `slot` of a scale buffer (one float32 element).
  static Ref ScaleRef(BufId buf, int32_t owner, int64_t slot) {
    return Ref{buf, owner, slot, 0, 1};
  }

 private:
  Program* p_;
  int32_t next_bundle_ = 0;
};

// Every op's builder (JO_OPS, build): build_ag.cc, build_rs.cc, build_ar.cc.
#define JO_DECLARE_BUILD(e, id, name, collective, communicates, rows, fused, gathered, one_shot, \
                         build)                                                                  \
  Status build(Program* program);
JO_OPS(JO_DECLARE_BUILD)
#undef JO_DECLARE_BUILD

// A replayable program's end (core/program.h Problem::replayable; the argument:
// docs/gpu-internals.md §8), appended once every other op is: flags
// [acks, acks + nranks) are the acknowledgements, flag acks + p of a rank raised
// by reader p. Each stream but the compute stream records that its work is done;
// the compute stream waits for those records (every read of the workspace and
// every wait of the call is then behind it), resets every flag the rank waited
// on, and acknowledges each peer it waited on (the writers into its workspace);
// then, for each peer p the rank wrote into (a push into its workspace, a
// Signal, a multicast store), the last stream that wrote into p (the compute
// stream if it did) waits for the other streams' records, for p's
// acknowledgement, and resets it. Sets Program::num_flags to acks + nranks.
void Acknowledge(Program* program, Emitter& e, int32_t acks);

// Pieces shared by GEMM+RS and GEMM+AR (build_rs.cc).

// One rank (RS and AR alike): y = x @ w, sub-chunk by sub-chunk.
Status BuildSingleRank(Program* program, Emitter& e);

// The fused GEMM + reduce-scatter, p2p and multicast (build_rs_fused.cc).
Status BuildRsFused(Program* program, Emitter& e);

// Where the reduce-scatter ring leaves row block `rank` of the sum: at row
// `y_row0` of each batch of `y_rows` rows of Y (RS: {0, rows}; AR: {rank *
// rows, nranks * rows}).
struct RsTarget {
  int64_t y_row0 = 0;
  int64_t y_rows = 0;
};

// The reduce-scatter ring (transports nccl and p2p). With `reduced`, one
// event per sub-chunk is recorded on the compute stream once that sub-chunk
// of the rank's block is complete in Y (what GEMM+AR's all-gather waits for).
Status BuildRsRing(Program* program, Emitter& e, const RsTarget& target,
                   std::vector<int32_t>* reduced);

}  // namespace jo::internal
