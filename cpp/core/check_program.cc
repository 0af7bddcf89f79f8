#include "core/check_program.h"

#include <algorithm>
#include <string>
#include <vector>

#include "core/call.h"

namespace jo {
namespace {

int64_t SizeOf(const BufferSizes& s, BufId buf) {
  switch (buf) {
    case BufId::kX:
      return s.x;
    case BufId::kW:
      return s.w;
    case BufId::kY:
      return s.y;
    case BufId::kXGathered:
      return s.x_gathered;
    case BufId::kScratch:
      return s.scratch;
    case BufId::kWorkspace:
      return s.workspace;
    case BufId::kXScale:
      return s.x_scale;
    case BufId::kWScale:
      return s.w_scale;
    case BufId::kScratchScales:
      return s.scratch_scales;
    case BufId::kWorkspaceScales:
      return s.workspace_scales;
  }
  return 0;
}

bool IsScales(BufId buf) {
  return buf == BufId::kXScale || buf == BufId::kWScale || buf == BufId::kScratchScales ||
         buf == BufId::kWorkspaceScales;
}

// A batch x rows x cols block at `ref` lies inside its buffer. Sizes are far
// below 2^62 elements, so the sums below cannot overflow once each factor is
// known to be non-negative and below that.
Status CheckRef(const Program& p, const Op& op, const char* role, const Ref& ref, int64_t batch,
                int64_t rows, int64_t cols, const BufferSizes& sizes) {
  const auto where = [&] {
    return std::string(CollectiveName(p.problem.op)) + " program of rank " +
           std::to_string(p.problem.rank) + ": " + ToString(op) + ": operand " + role + " " +
           ToString(ref);
  };
  constexpr int64_t kLimit = int64_t{1} << 40;
  if (batch < 1 || rows < 1 || cols < 1 || batch > kLimit || rows > kLimit || cols > kLimit)
    return Internal(where() + " has an empty or huge block " + std::to_string(batch) + "x" +
                    std::to_string(rows) + "x" + std::to_string(cols));
  if (ref.offset < 0 || ref.batch_stride < 0 || ref.ld < cols || ref.offset > kLimit ||
      ref.batch_stride > kLimit || ref.ld > kLimit)
    return Internal(where() + " has a negative offset or stride, or ld < " + std::to_string(cols) +
                    " columns");
  if ((ref.buf == BufId::kWorkspace || ref.buf == BufId::kWorkspaceScales) &&
      (ref.rank < 0 || ref.rank >= p.problem.nranks))
    return Internal(where() + " names workspace owner " + std::to_string(ref.rank) + " of " +
                    std::to_string(p.problem.nranks) + " ranks");
  const int64_t last = ref.offset + (batch - 1) * ref.batch_stride + (rows - 1) * ref.ld + cols;
  const int64_t size = SizeOf(sizes, ref.buf);
  if (last > size)
    return Internal(where() + " reaches element " + std::to_string(last) + " of a " +
                    std::string(BufName(ref.buf)) + " buffer of " + std::to_string(size) +
                    " elements");
  return OkStatus();
}

// The operand `role` of `op` names a buffer of dtype `want`.
Status CheckDType(const Program& p, const Op& op, const char* role, const Ref& ref, DType want) {
  const DType got = BufDType(p.problem, ref.buf);
  if (got == want) return OkStatus();
  return Internal(std::string(CollectiveName(p.problem.op)) + " program of rank " +
                  std::to_string(p.problem.rank) + ": " + ToString(op) + ": operand " + role +
                  " is " + DTypeName(got) + " (" + BufName(ref.buf) + "), expected " +
                  DTypeName(want));
}

// A Gemm's scale: a float32 scale slot, set exactly when its operand is fp8.
Status CheckScale(const Program& p, const Op& op, const char* role, bool scaled, const Ref& ref,
                  DType operand, const BufferSizes& sizes) {
  if (scaled != IsFp8(operand) || (scaled && !IsScales(ref.buf)))
    return Internal(std::string(CollectiveName(p.problem.op)) + " program of rank " +
                    std::to_string(p.problem.rank) + ": " + ToString(op) + ": operand " + role +
                    (IsFp8(operand) ? " must name a scale slot (its operand is " +
                                          std::string(DTypeName(operand)) + ")"
                                    : " must be unset (its operand is not fp8)"));
  return scaled ? CheckRef(p, op, role, ref, 1, 1, 1, sizes) : OkStatus();
}

// A Gemm's block scales (MXFP8): both set, a's the scale rows beside its rows
// (BlockScalesOf: a starts at a row of whole k), covering its batch x m rows,
// and w's all of w (WSCALE), k/32 per row.
Status CheckBlockScales(const Program& p, const Op& op, const BufferSizes& sizes) {
  const Problem& q = p.problem;
  const Ref beside = BlockScalesOf(q, op.a);
  const bool whole_rows =
      op.a.offset % q.k == 0 && op.a.ld % q.k == 0 && op.a.batch_stride % q.k == 0;
  if (!op.a_scaled || !op.b_scaled || !whole_rows || op.a_scale.buf != beside.buf ||
      op.a_scale.rank != beside.rank || op.a_scale.offset != beside.offset ||
      op.a_scale.ld != beside.ld || op.a_scale.batch_stride != beside.batch_stride ||
      op.b_scale.buf != BufId::kWScale || op.b_scale.offset != 0 || op.b_scale.ld != q.cols)
    return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                    std::to_string(q.rank) + ": " + ToString(op) +
                    ": a block-scaled GEMM reads the scale rows beside a's rows (" +
                    ToString(beside) + ") and all of w's (WSCALE)");
  const int64_t kb = KBlocks(p.problem);
  JO_CHECK(CheckRef(p, op, "a_scale", op.a_scale, op.batch, op.m, kb, sizes));
  return CheckRef(p, op, "b_scale", op.b_scale, 1, kb, op.n, sizes);
}

Status CheckId(const Program& p, const Op& op, const char* what, int64_t value, int64_t limit) {
  if (value >= 0 && value < limit) return OkStatus();
  return Internal(std::string(CollectiveName(p.problem.op)) + " program of rank " +
                  std::to_string(p.problem.rank) + ": " + ToString(op) + ": " + what + " " +
                  std::to_string(value) + " is outside [0, " + std::to_string(limit) + ")");
}

// A FusedGemm's row blocks: they cover its rows, its order is every block
// once, it waits or releases (never both: docs/gpu-internals.md §5), and every flag
// and writer it names is in range.
Status CheckFused(const Program& p, const Op& op) {
  const FusedBlocks& f = op.fused;
  const auto bad = [&](const std::string& what) {
    return Internal(std::string(CollectiveName(p.problem.op)) + " program of rank " +
                    std::to_string(p.problem.rank) + ": " + ToString(op) + ": " + what);
  };
  if (!f.rows.valid() || f.rows.rows() != op.m || f.rows.count() > fused::kMaxBlocks)
    return bad("its row blocks do not cover its " + std::to_string(op.m) + " rows");
  const int32_t count = f.rows.count();
  std::vector<bool> seen(static_cast<size_t>(count), false);
  if (f.sequence.size() != seen.size()) return bad("its order does not list every block");
  for (int32_t b : f.sequence) {
    if (b < 0 || b >= count || seen[static_cast<size_t>(b)])
      return bad("its order is not every block exactly once");
    seen[static_cast<size_t>(b)] = true;
  }
  if ((f.wait_flags >= 0) == (f.release_flags >= 0))
    return bad("a fused GEMM waits or releases, exactly one of the two");
  if (f.wait_flags >= 0) {
    if (f.wait_flags + count > p.num_flags || f.ready_shard < -1 ||
        f.ready_shard >= f.rows.shards || f.writers.size() != seen.size())
      return bad("its waits name flags, a ready shard or writers out of range");
    for (int32_t b = 0; b < count; ++b) {
      const int32_t w = f.writers[static_cast<size_t>(b)];
      if (f.Waits(b) ? (w < 0 || w >= p.problem.nranks) : w != -1)
        return bad("block " + std::to_string(b) + " has writer " + std::to_string(w));
    }
  }
  if (f.release_flags >= 0 && f.release_flags + count > p.num_flags)
    return bad("its releases name flags out of range");
  if (f.spare_sms < 0 || f.spare_sms > kMaxKernelSms || (f.spare_sms > 0 && f.wait_flags >= 0))
    return bad(
        "only a kernel that waits for nothing leaves SMs to others (rule 1 of "
        "docs/gpu-internals.md §5), and at most " +
        std::to_string(kMaxKernelSms));
  fused::TileOrder order;
  if (fused::MakeTileOrder(fused::Tiling{f.rows, fused::kTileRows}, f.sequence.data(), count, f.key,
                           &order) != fused::OrderError::kOk)
    return bad("its tile order cannot be made (too many runs: fewer chunks)");
  return OkStatus();
}

// Happens-before between the ops of one rank's program: stream order and
// Record -> StreamWait (a StreamWait waits for the Record of its event).
class RankOrder {
 public:
  // False when a StreamWait's event is never recorded before it can run.
  bool Make(const Program& p) {
    const size_t streams = static_cast<size_t>(p.num_streams);
    std::vector<std::vector<size_t>> ops(streams);
    for (size_t i = 0; i < p.ops.size(); ++i)
      ops[static_cast<size_t>(p.ops[i].stream)].push_back(i);
    std::vector<std::vector<int64_t>> clock(streams, std::vector<int64_t>(streams, 0));
    std::vector<size_t> next(streams, 0);
    std::vector<std::vector<int64_t>> recorded(static_cast<size_t>(p.num_events));
    clocks_.assign(p.ops.size(), {});
    stream_.resize(p.ops.size());
    for (bool progress = true; progress;) {
      progress = false;
      for (size_t s = 0; s < streams; ++s)
        for (; next[s] < ops[s].size(); ++next[s], progress = true) {
          const size_t i = ops[s][next[s]];
          const Op& op = p.ops[i];
          if (op.kind == OpKind::kStreamWait) {
            const auto& event = recorded[static_cast<size_t>(op.id)];
            if (event.empty()) break;
            for (size_t t = 0; t < streams; ++t) clock[s][t] = std::max(clock[s][t], event[t]);
          }
          ++clock[s][s];
          clocks_[i] = clock[s];
          stream_[i] = s;
          if (op.kind == OpKind::kRecord) recorded[static_cast<size_t>(op.id)] = clock[s];
        }
    }
    for (size_t s = 0; s < streams; ++s)
      if (next[s] < ops[s].size()) return false;
    return true;
  }
  // Op i happens before op j.
  bool Before(size_t i, size_t j) const {
    return i != j && clocks_[i][stream_[i]] <= clocks_[j][stream_[i]];
  }

 private:
  std::vector<std::vector<int64_t>> clocks_;
  std::vector<size_t> stream_;
};

// A replayable program's sequencing (core/program.h Problem::replayable;
// docs/gpu-internals.md §8), what this rank alone can show:
//  1. only ops whose sequencing is argued there (no NCCL or one-launch
//     all-reduce); a releasing fused GEMM raises own flags, which only this
//     rank waits on (a Wait for the rank's own flag is for one of them);
//  2. every flag the rank waits on (a Wait, a fused GEMM's block) is reset by
//     exactly one ResetFlags, after every wait on it, and a ResetFlags resets
//     only flags the rank waited on: the next call's signal finds it 0;
//  3. every write into a peer p (a push into its workspace, a Signal) on a
//     stream is either after a wait for a flag p raised (p is in this call, so
//     it finished the last one, reads and resets included), or the stream ends
//     with a wait for p's flag after its last write to p, or the wait is on
//     another stream after that one's last write to p in the rank's order
//     (p's acknowledgement: the next call's writes come after p consumed this
//     one, since the call ends after every wait of its streams);
//  4. with a fused GEMM that waits, a wait for a peer's flag has only waits,
//     resets and stream waits after it on its stream: nothing of the call but
//     its end depends on it, so the bounded wait kernel it runs as may wait
//     for the SMs the fused GEMM holds (never the other way round);
//  5. a McReduce (it reads every rank's workspace) comes after a wait for every
//     peer's flag and before a Signal to every peer (its acknowledgement), and
//     every write of the rank's own workspace, which the peers' McReduce reads,
//     comes before a wait for every peer's flag (their acknowledgements).
Status CheckReplayable(const Program& p) {
  const Problem& q = p.problem;
  const auto bad = [&](const std::string& what) {
    return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                    std::to_string(q.rank) + " (replayable): " + what);
  };
  RankOrder order;
  if (!order.Make(p)) return bad("a StreamWait waits for an event no op before it records");
  struct FlagWait {
    size_t op;
    int32_t writer;
  };
  std::vector<std::vector<FlagWait>> waits(static_cast<size_t>(p.num_flags));
  std::vector<int> resets(static_cast<size_t>(p.num_flags), 0);
  std::vector<bool> released(static_cast<size_t>(p.num_flags), false);
  bool waiting_fused = false;
  std::vector<size_t> mc_reads;  // McReduce: reads every rank's workspace
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const Op& op = p.ops[i];
    switch (op.kind) {
      case OpKind::kSend:
      case OpKind::kRecv:
      case OpKind::kAllReduce:
        return bad(ToString(op) + ": its sequencing across replays is not argued");
      case OpKind::kMcReduce:
        mc_reads.push_back(i);
        break;
      case OpKind::kFusedGemm:
        if (op.fused.release_flags >= 0)
          for (int32_t b = 0; b < op.fused.rows.count(); ++b)
            released[static_cast<size_t>(op.fused.release_flags + b)] = true;
        waiting_fused = waiting_fused || op.fused.wait_flags >= 0;
        for (int32_t b = 0; b < op.fused.rows.count(); ++b)
          if (op.fused.Waits(b))
            waits[static_cast<size_t>(op.fused.wait_flags + b)].push_back(
                {i, op.fused.writers[static_cast<size_t>(b)]});
        break;
      case OpKind::kWait:
        waits[static_cast<size_t>(op.id)].push_back({i, op.peer});
        break;
      default:
        break;
    }
  }
  for (size_t i = 0; i < p.ops.size(); ++i) {
    const Op& op = p.ops[i];
    if (op.kind == OpKind::kWait && op.peer == q.rank && !released[static_cast<size_t>(op.id)])
      return bad(ToString(op) + ": waits for an own flag that no fused GEMM of the rank releases");
    if (op.kind == OpKind::kWait && op.peer != q.rank && waiting_fused)
      for (size_t j = i + 1; j < p.ops.size(); ++j) {
        const Op& after = p.ops[j];
        if (after.stream == op.stream && after.kind != OpKind::kWait &&
            after.kind != OpKind::kResetFlags && after.kind != OpKind::kStreamWait)
          return bad(ToString(op) + " on stream " + std::to_string(op.stream) + " has " +
                     ToString(after) +
                     " after it: with a fused GEMM that waits, a wait for a peer's flag must end "
                     "its stream (its bounded wait kernel could otherwise wait for an SM that "
                     "the waiting fused GEMM holds while the GEMM waits for what follows it)");
      }
    if (op.kind != OpKind::kResetFlags) continue;
    for (int32_t f = op.id; f < op.id + op.n; ++f) {
      const auto& mine = waits[static_cast<size_t>(f)];
      if (mine.empty())
        return bad(ToString(op) + ": resets flag " + std::to_string(f) +
                   ", which it never waited on");
      for (const FlagWait& w : mine)
        if (!order.Before(w.op, i))
          return bad(ToString(op) + ": resets flag " + std::to_string(f) + " not after its wait " +
                     ToString(p.ops[w.op]) + " (that wait could then miss its signal)");
      ++resets[static_cast<size_t>(f)];
    }
  }
  for (size_t f = 0; f < resets.size(); ++f)
    if (!waits[f].empty() && resets[f] != 1)
      return bad("flag " + std::to_string(f) + " is waited on and reset " +
                 std::to_string(resets[f]) +
                 " times, not once: the next call's signal would find it raised, or lose it");
  // Rule 3: whether an op writes into peer `peer`.
  const auto writes = [&](const Op& op, int32_t peer) {
    if (peer == q.rank) return false;
    if (op.kind == OpKind::kSignal) return op.peer == peer;
    if (op.kind == OpKind::kMcStore) return true;  // every rank's workspace
    const bool symmetric = op.d.buf == BufId::kWorkspace || op.d.buf == BufId::kWorkspaceScales;
    return op.kind == OpKind::kCopy && symmetric && op.d.rank == peer;
  };
  const auto waits_for = [&](int32_t writer, const auto& pred) {
    for (const auto& flag : waits)
      for (const FlagWait& w : flag)
        if (w.writer == writer && pred(w.op)) return true;
    return false;
  };
  for (size_t i = 0; i < p.ops.size(); ++i)
    for (int32_t peer = 0; peer < q.nranks; ++peer) {
      if (!writes(p.ops[i], peer)) continue;
      if (waits_for(peer, [&](size_t w) { return order.Before(w, i); })) continue;
      // The stream's last write to this peer, then a wait for the peer's flag after it.
      size_t last = i;
      for (size_t j = i + 1; j < p.ops.size(); ++j)
        if (p.ops[j].stream == p.ops[i].stream && writes(p.ops[j], peer)) last = j;
      const bool acked = waits_for(peer, [&](size_t w) { return order.Before(last, w); });
      if (!acked)
        return bad(ToString(p.ops[i]) + " on stream " + std::to_string(p.ops[i].stream) +
                   " writes into rank " + std::to_string(peer) +
                   " with no acknowledgement: no wait for that rank's flag before it, and none "
                   "after the stream's last write to it (the next call could overwrite what "
                   "that rank has not read yet)");
    }
  // Rule 5: a McReduce reads every rank's workspace: it comes after a wait for a flag of every
  // peer (what it reads is in place) and before a Signal to every peer (its acknowledgement:
  // the peer's next writes of the region, its own included, wait for it); and a rank whose
  // workspace peers read so waits, after its last write of its own workspace, for a flag of
  // every peer (their acknowledgements).
  for (size_t i : mc_reads)
    for (int32_t peer = 0; peer < q.nranks; ++peer) {
      if (peer == q.rank) continue;
      bool waited = waits_for(peer, [&](size_t w) { return order.Before(w, i); });
      bool acked = false;
      for (size_t j = 0; j < p.ops.size() && !acked; ++j)
        acked = p.ops[j].kind == OpKind::kSignal && p.ops[j].peer == peer && order.Before(i, j);
      if (!waited || !acked)
        return bad(ToString(p.ops[i]) + " reads rank " + std::to_string(peer) + "'s workspace " +
                   (!waited ? "with no wait for that rank's flag before it"
                            : "with no Signal to that rank after it (its acknowledgement)"));
    }
  // The points after which this rank's own workspace holds what its peers read: every write
  // of it (a releasing fused GEMM's: each wait for one of its releases, the block then stored).
  std::vector<size_t> stored;
  for (size_t j = 0; j < p.ops.size() && !mc_reads.empty(); ++j) {
    const Op& op = p.ops[j];
    const bool own = (op.d.buf == BufId::kWorkspace || op.d.buf == BufId::kWorkspaceScales) &&
                     op.d.rank == q.rank;
    switch (op.kind) {
      case OpKind::kGemm:
      case OpKind::kAdd:
      case OpKind::kCopy:
      case OpKind::kReduce:
      case OpKind::kMcReduce:
        if (own) stored.push_back(j);
        break;
      case OpKind::kMcStore:
        stored.push_back(j);
        break;
      case OpKind::kFusedGemm:
        if (own && op.fused.release_flags < 0) stored.push_back(j);
        break;
      case OpKind::kWait:
        if (op.peer == q.rank) stored.push_back(j);
        break;
      default:
        break;
    }
  }
  for (size_t j : stored)
    for (int32_t peer = 0; peer < q.nranks; ++peer)
      if (peer != q.rank && !waits_for(peer, [&](size_t w) { return order.Before(j, w); }))
        return bad(ToString(p.ops[j]) +
                   " writes this rank's workspace, which its peers' McReduce reads, with no "
                   "wait for rank " +
                   std::to_string(peer) +
                   "'s flag after it (its acknowledgement: the next call could overwrite what "
                   "that rank has not read yet)");
  return OkStatus();
}

}  // namespace

BufferSizes BufferSizes::Of(const Program& p) {
  const Problem& q = p.problem;
  const OperandRows rows = OperandRowsOf(q);
  BufferSizes s;
  s.x = q.batch * rows.x * q.k;
  s.w = q.k * q.cols;
  s.y = q.batch * rows.y * q.cols;
  s.x_gathered = q.batch * rows.gathered * q.k;
  s.scratch = p.scratch_elems;
  s.workspace = p.workspace_elems;
  s.x_scale = s.w_scale = 1;
  if (q.block_scaled) {  // one e8m0 scale per 32 elements of k, laid out as the operand
    s.x_scale = q.batch * rows.x * KBlocks(q);
    s.w_scale = KBlocks(q) * q.cols;
  }
  s.scratch_scales = p.scratch_scales;
  s.workspace_scales = p.workspace_scales;
  return s;
}

Status CheckProgram(const Program& p, const BufferSizes& sizes, bool sequencing) {
  const Problem& q = p.problem;
  const int32_t nranks = q.nranks;
  for (const Op& op : p.ops) {
    JO_CHECK(CheckId(p, op, "stream", op.stream, p.num_streams));
    switch (op.kind) {
      case OpKind::kGemm:
        JO_CHECK(CheckRef(p, op, "a", op.a, op.batch, op.m, op.k, sizes));
        JO_CHECK(CheckRef(p, op, "b", op.b, 1, op.k, op.n, sizes));
        if (op.accumulate) JO_CHECK(CheckRef(p, op, "c", op.c, op.batch, op.m, op.n, sizes));
        JO_CHECK(CheckRef(p, op, "d", op.d, op.batch, op.m, op.n, sizes));
        JO_CHECK(CheckDType(p, op, "a", op.a, q.x_dtype));
        JO_CHECK(CheckDType(p, op, "b", op.b, q.w_dtype));
        if (op.accumulate) JO_CHECK(CheckDType(p, op, "c", op.c, q.out_dtype));
        JO_CHECK(CheckDType(p, op, "d", op.d, q.out_dtype));
        if (q.block_scaled) {
          JO_CHECK(CheckBlockScales(p, op, sizes));
          break;
        }
        JO_CHECK(CheckScale(p, op, "a_scale", op.a_scaled, op.a_scale, q.x_dtype, sizes));
        JO_CHECK(CheckScale(p, op, "b_scale", op.b_scaled, op.b_scale, q.w_dtype, sizes));
        break;
      case OpKind::kAdd:
      case OpKind::kCopy:
      case OpKind::kMcReduce:
      case OpKind::kMcStore:  // McStore: d names the offset in EVERY rank's workspace
        JO_CHECK(CheckRef(p, op, "a", op.a, op.batch, op.m, op.n, sizes));
        JO_CHECK(CheckRef(p, op, "d", op.d, op.batch, op.m, op.n, sizes));
        JO_CHECK(CheckDType(p, op, "d", op.d, BufDType(q, op.a.buf)));
        if ((op.kind == OpKind::kAdd || op.kind == OpKind::kMcReduce) &&
            (IsFp8(BufDType(q, op.d.buf)) || IsScales(op.d.buf)))
          return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                          std::to_string(q.rank) + ": " + ToString(op) +
                          ": sums run in float32 or the output type, never on fp8 or scales");
        break;
      case OpKind::kSend:
        JO_CHECK(CheckId(p, op, "peer", op.peer, nranks));
        JO_CHECK(CheckRef(p, op, "a", op.a, op.batch, op.m, op.n, sizes));
        break;
      case OpKind::kRecv:
        JO_CHECK(CheckId(p, op, "peer", op.peer, nranks));
        JO_CHECK(CheckRef(p, op, "d", op.d, op.batch, op.m, op.n, sizes));
        break;
      case OpKind::kSignal:
        JO_CHECK(CheckId(p, op, "peer", op.peer, nranks));
        JO_CHECK(CheckId(p, op, "flag", op.id, p.num_flags));
        break;
      case OpKind::kWait:
        JO_CHECK(CheckId(p, op, "writer", op.peer, nranks));
        JO_CHECK(CheckId(p, op, "flag", op.id, p.num_flags));
        break;
      case OpKind::kRecord:
      case OpKind::kStreamWait:
        JO_CHECK(CheckId(p, op, "event", op.id, p.num_events));
        break;
      case OpKind::kFusedGemm:
        if (q.block_scaled)
          return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                          std::to_string(q.rank) + ": " + ToString(op) +
                          ": no fused GEMM takes block scales");
        JO_CHECK(CheckRef(p, op, "a", op.a, op.batch, op.m, op.k, sizes));
        JO_CHECK(CheckRef(p, op, "b", op.b, 1, op.k, op.n, sizes));
        JO_CHECK(CheckRef(p, op, "d", op.d, op.batch, op.m, op.n, sizes));
        // fp8: a_scale is slot 0 of the shards' scale slots (shard s's: slot s), or the one
        // scale of every row (x_scale_stride 0).
        JO_CHECK(CheckScale(p, op, "a_scale", op.a_scaled, op.a_scale, q.x_dtype, sizes));
        if (op.fused.x_scale_stride != 0 && op.fused.x_scale_stride != 1)
          return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                          std::to_string(q.rank) + ": " + ToString(op) +
                          ": x_scale_stride is 1 (a scale per shard) or 0 (one for every row)");
        if (op.a_scaled)
          JO_CHECK(CheckRef(p, op, "a_scale", op.a_scale, 1,
                            op.fused.x_scale_stride == 0 ? 1 : op.fused.rows.shards, 1, sizes));
        JO_CHECK(CheckScale(p, op, "b_scale", op.b_scaled, op.b_scale, q.w_dtype, sizes));
        JO_CHECK(CheckFused(p, op));
        break;
      case OpKind::kReduce: {
        JO_CHECK(CheckRef(p, op, "d", op.d, op.batch, op.m, op.n, sizes));
        const DType sum = BufDType(q, op.d.buf);
        if (op.sources.empty() || op.sources.size() > static_cast<size_t>(kMaxReduceSources) ||
            IsFp8(sum) || IsScales(op.d.buf))
          return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                          std::to_string(q.rank) + ": " + ToString(op) + ": a Reduce sums 1 to " +
                          std::to_string(kMaxReduceSources) +
                          " blocks in float32 or the output type, never fp8 or scales");
        for (const Ref& src : op.sources) {
          JO_CHECK(CheckRef(p, op, "source", src, op.batch, op.m, op.n, sizes));
          JO_CHECK(CheckDType(p, op, "source", src, sum));
        }
        break;
      }
      case OpKind::kResetFlags:
        break;  // below
      case OpKind::kAllReduce:
        // All of y, in place, dense (the kernel sees it as one run of elements); the host
        // executor's slots: a rank's copy of y from each rank, and a flag per writer.
        JO_CHECK(CheckRef(p, op, "d", op.d, op.batch, op.m, op.n, sizes));
        if (op.d.buf != BufId::kY || op.d.offset != 0 || op.d.ld != op.n ||
            op.d.batch_stride != op.m * op.n || op.batch * op.m * op.n != sizes.y ||
            p.workspace_elems < nranks * sizes.y || p.num_flags < nranks)
          return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                          std::to_string(q.rank) + ": " + ToString(op) +
                          ": reduces all of Y, dense, with a workspace slot and a flag per rank");
        break;
    }
    if (op.kind == OpKind::kResetFlags) {
      JO_CHECK(CheckId(p, op, "flag", op.id, p.num_flags));
      if (op.n < 1 || op.id + op.n > p.num_flags)
        return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                        std::to_string(q.rank) + ": " + ToString(op) +
                        ": resets flags outside [0, " + std::to_string(p.num_flags) + ")");
      if (!q.replayable)
        return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                        std::to_string(q.rank) + ": " + ToString(op) +
                        ": only a replayable program resets flags (epoch flags only grow)");
    }
    if (op.sms < 0 || op.sms > kMaxKernelSms)
      return Internal(std::string(CollectiveName(q.op)) + " program of rank " +
                      std::to_string(q.rank) + ": " + ToString(op) + ": an SM budget of " +
                      std::to_string(op.sms) + " is outside [0, " + std::to_string(kMaxKernelSms) +
                      "]");
  }
  return q.replayable && sequencing ? CheckReplayable(p) : OkStatus();
}

}  // namespace jo
