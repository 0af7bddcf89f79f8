// GEMM+RS programs: y = sum over ranks of (x[row block rank] @ w).
//
// Ring: an accumulator for row block j starts cw_steps ranks before j
// (clockwise chain) and ccw_steps ranks after it (counter-clockwise chain);
// each rank on the way adds its partial with a beta=1 GEMM on the received
// buffer and forwards it. Rank j adds its own partial to both chains' results.
// Unidirectional (cw_steps = N-1): at step t rank r computes block
// (r - t - 1) mod N (docs/native.md §3). The ring is also the first half of
// GEMM+AR's (build_ar.cc).
#include <utility>
#include <vector>

#include "core/build_internal.h"

namespace jo::internal {
namespace {

Status BuildMulticast(Program* p, Emitter& e);

}  // namespace

Status BuildSingleRank(Program* p, Emitter& e) {
  const Problem& q = p->problem;
  for (int64_t s = 0; s < p->chunks; ++s) {
    const int64_t begin = SubBegin(q.rows, p->chunks, s);
    Op& op = e.Gemm(0, Ref{BufId::kX, 0, begin * q.k, q.rows * q.k, q.k},
                    Ref{BufId::kY, 0, begin * q.cols, q.rows * q.cols, q.cols}, nullptr, q.batch,
                    SubRows(q.rows, p->chunks, s));
    op.shard = 0;
    op.sub = static_cast<int32_t>(s);
  }
  return OkStatus();
}

Status BuildMatmulRs(Program* p) {
  const Problem& q = p->problem;
  Emitter e(p);
  if (q.nranks == 1) return BuildSingleRank(p, e);
  if (q.fused) {
    JO_CHECK(BuildRsFused(p, e));
  } else if (Row(q.transport).mechanism == Mechanism::kMulticast) {
    JO_CHECK(BuildMulticast(p, e));
  } else {
    JO_CHECK(BuildRsRing(p, e, RsTarget{0, q.rows}, nullptr));
  }
  // Replayable: the acknowledgements after the data flags (docs/gpu-internals.md §8).
  if (q.replayable) Acknowledge(p, e, p->num_flags);
  return OkStatus();
}

namespace {

struct Geometry {
  int32_t N, r;
  int64_t P, R, K, Nw, C;
  RsTarget target;  // where the reduced block goes in Y
  int64_t rows(int64_t s) const { return SubRows(R, C, s); }
  int64_t begin(int64_t s) const { return SubBegin(R, C, s); }
  Ref x(int32_t block, int64_t s) const {
    return Ref{BufId::kX, r, (block * R + begin(s)) * K, N * R * K, K};
  }
  Ref y(int64_t s) const {
    return Ref{BufId::kY, r, (target.y_row0 + begin(s)) * Nw, target.y_rows * Nw, Nw};
  }
  // Slot `slot` of [P, R, Nw] accumulators in `buf` of rank `owner`.
  Ref slot(BufId buf, int32_t owner, int64_t slot, int64_t s) const {
    return Ref{buf, owner, slot * P * R * Nw + begin(s) * Nw, R * Nw, Nw};
  }
};

// `target`: where the reduced block goes; by default all of Y ([batch, rows, cols]).
Geometry MakeGeometry(const Program* p, const RsTarget* target = nullptr) {
  const Problem& q = p->problem;
  return Geometry{q.nranks, q.rank, q.batch,   q.rows,
                  q.k,      q.cols, p->chunks, target != nullptr ? *target : RsTarget{0, q.rows}};
}

void Label(Op& op, int32_t block, int64_t s) {
  op.shard = block;
  op.sub = static_cast<int32_t>(s);
}

}  // namespace

Status BuildRsRing(Program* p, Emitter& e, const RsTarget& target, std::vector<int32_t>* reduced) {
  const Geometry g = MakeGeometry(p, &target);
  const bool nccl = Row(p->problem.transport).messages();
  const int32_t steps[2] = {p->cw_steps, p->ccw_steps};
  const int32_t total = steps[0] + steps[1];
  const int32_t max_steps = steps[0] > steps[1] ? steps[0] : steps[1];
  auto prev_of = [&](int32_t dir) { return Mod(dir == 0 ? g.r - 1 : g.r + 1, g.N); };
  auto next_of = [&](int32_t dir) { return Mod(dir == 0 ? g.r + 1 : g.r - 1, g.N); };
  auto block_of = [&](int32_t dir, int32_t t) {
    return dir == 0 ? Mod(g.r + steps[0] - t, g.N) : Mod(g.r - steps[1] + t, g.N);
  };
  // Partial computed at step t (sent), in SCRATCH slots [0, total).
  auto send_slot = [&](int32_t dir, int32_t t) { return dir == 0 ? t : steps[0] + t; };
  // Accumulator received for step t (1..steps), in WORKSPACE (p2p) or in
  // SCRATCH after the send slots (nccl).
  auto recv_ref = [&](int32_t owner, int32_t dir, int32_t t, int64_t s) {
    const int64_t slot = (dir == 0 ? t - 1 : steps[0] + t - 1);
    return nccl ? g.slot(BufId::kScratch, owner, total + slot, s)
                : g.slot(BufId::kWorkspace, owner, slot, s);
  };
  auto flag = [&](int32_t dir, int32_t t, int64_t s) {
    return static_cast<int32_t>((dir * g.N + t) * g.C + s);
  };
  auto idx = [&](int32_t dir, int32_t t, int64_t s) { return (dir * g.N + t) * g.C + s; };

  p->num_flags = static_cast<int32_t>(2 * g.N * g.C);
  const int64_t slot_elems = g.P * g.R * g.Nw;
  p->scratch_elems = (nccl ? 2 : 1) * total * slot_elems;
  if (!nccl) p->workspace_elems = total * slot_elems;

  std::vector<int32_t> gemm_done(2 * g.N * g.C, -1), received(2 * g.N * g.C, -1);
  for (auto& ev : gemm_done) ev = e.NewEvent();
  for (auto& ev : received) ev = e.NewEvent();

  auto wait_received = [&](int32_t stream, int32_t dir, int32_t t, int64_t s) {
    if (nccl)
      e.StreamWait(stream, received[idx(dir, t, s)]);
    else
      e.Wait(stream, prev_of(dir), flag(dir, t, s));
  };

  // Compute stream: partials of both chains, interleaved, then the own block.
  for (int32_t t = 0; t < max_steps; ++t)
    for (int32_t dir = 0; dir < 2; ++dir) {
      if (t >= steps[dir]) continue;
      const int32_t block = block_of(dir, t);
      for (int64_t s = 0; s < g.C; ++s) {
        Ref acc;
        if (t > 0) {
          wait_received(0, dir, t, s);
          acc = recv_ref(g.r, dir, t, s);
        }
        Label(e.Gemm(0, g.x(block, s), g.slot(BufId::kScratch, g.r, send_slot(dir, t), s),
                     t > 0 ? &acc : nullptr, g.P, g.rows(s)),
              block, s);
        e.Record(0, gemm_done[idx(dir, t, s)]);
      }
    }
  for (int64_t s = 0; s < g.C; ++s) {
    Ref cw_acc = recv_ref(g.r, 0, steps[0], s);
    wait_received(0, 0, steps[0], s);
    if (steps[1] > 0) wait_received(0, 1, steps[1], s);
    Label(e.Gemm(0, g.x(g.r, s), g.y(s), &cw_acc, g.P, g.rows(s)), g.r, s);
    if (steps[1] > 0)
      Label(e.Block(OpKind::kAdd, 0, recv_ref(g.r, 1, steps[1], s), g.y(s), g.P, g.rows(s), g.Nw),
            g.r, s);
    if (reduced != nullptr) {
      reduced->push_back(e.NewEvent());
      e.Record(0, reduced->back());
    }
  }

  // Comm streams: forward each partial as soon as its GEMM is done.
  for (int32_t dir = 0; dir < 2; ++dir) {
    const int32_t stream = 1 + dir;
    for (int32_t t = 0; t < steps[dir]; ++t) {
      const int32_t block = block_of(dir, t);
      for (int64_t s = 0; s < g.C; ++s) {
        e.StreamWait(stream, gemm_done[idx(dir, t, s)]);
        Ref partial = g.slot(BufId::kScratch, g.r, send_slot(dir, t), s);
        if (nccl) {
          const int32_t bundle = e.NewBundle();
          Op& send = e.Block(OpKind::kSend, stream, partial, Ref{}, g.P, g.rows(s), g.Nw);
          send.peer = next_of(dir);
          send.id = flag(dir, t + 1, s);
          send.bundle = bundle;
          Label(send, block, s);
          Op& recv = e.Block(OpKind::kRecv, stream, Ref{}, recv_ref(g.r, dir, t + 1, s), g.P,
                             g.rows(s), g.Nw);
          recv.peer = prev_of(dir);
          recv.id = flag(dir, t + 1, s);
          recv.bundle = bundle;
          Label(recv, block_of(dir, t + 1), s);
          e.Record(stream, received[idx(dir, t + 1, s)]);
        } else {
          Label(e.Block(OpKind::kCopy, stream, partial, recv_ref(next_of(dir), dir, t + 1, s), g.P,
                        g.rows(s), g.Nw),
                block, s);
          e.Signal(stream, next_of(dir), flag(dir, t + 1, s));
        }
      }
    }
  }
  return OkStatus();
}

namespace {

Status BuildMulticast(Program* p, Emitter& e) {
  const Geometry g = MakeGeometry(p);
  // Partials of every block land in the own workspace [P, N*R, Nw]; the
  // owner of block j load-reduces it over all ranks once all flags are up.
  p->workspace_elems = g.P * g.N * g.R * g.Nw;
  p->num_flags = static_cast<int32_t>(g.N * g.C);
  auto part = [&](int32_t block, int64_t s) {
    return Ref{BufId::kWorkspace, g.r, (block * g.R + g.begin(s)) * g.Nw, g.N * g.R * g.Nw, g.Nw};
  };
  auto flag = [&](int32_t writer, int64_t s) { return static_cast<int32_t>(writer * g.C + s); };
  for (int32_t t = 0; t < g.N; ++t) {
    const int32_t block = Mod(g.r - 1 - t, g.N);  // own block last
    for (int64_t s = 0; s < g.C; ++s) {
      Label(e.Gemm(0, g.x(block, s), part(block, s), nullptr, g.P, g.rows(s)), block, s);
      if (block != g.r) e.Signal(0, block, flag(g.r, s));
    }
  }
  for (int64_t s = 0; s < g.C; ++s) {
    for (int32_t peer = 0; peer < g.N; ++peer)
      if (peer != g.r) e.Wait(0, peer, flag(peer, s));
    Label(e.Block(OpKind::kMcReduce, 0, part(g.r, s), g.y(s), g.P, g.rows(s), g.Nw), g.r, s);
  }
  return OkStatus();
}

}  // namespace
}  // namespace jo::internal
