// GEMM+AR programs: y = sum over ranks of (x @ w), every rank gets all of it.
//
// Ring (transports nccl and p2p): the reduce-scatter ring of GEMM+RS
// (build_rs.cc) leaves row block r of the sum in rank r's Y; an all-gather
// ring of those blocks then fills the other blocks of Y. Block (r - t) mod N
// leaves rank r clockwise at step t (and (r + t) mod N counter-clockwise, for
// ccw_steps), sub-chunk by sub-chunk: a sub-chunk's first hop starts as soon
// as its reduction is done, while the GEMMs of the later sub-chunks still
// run, and goes all the way round before the next sub-chunk starts. Every
// rank sends N-1 partial blocks and N-1 reduced blocks: 2(N-1)/N of Y, the
// bound of a ring all-reduce.
//
// Multicast: every rank computes block b at step b (the same block on every
// rank at once) into its own workspace and signals b's owner; the owner, on a
// communication stream, load-reduces block b through the switch into its Y
// (McReduce, multimem.ld_reduce), stores the result back through the switch
// into every rank's workspace over the consumed partials (McStore,
// multimem.st) and signals every rank, which copies it into its Y. Block b's
// reduction runs while the GEMMs of the blocks after it run.
//
// One-shot (every transport; rows need not split into N blocks): every rank
// multiplies all its rows into its own partial, sub-chunk by sub-chunk, and
// the partials cross in one round. p2p: a comm stream pushes the partial into
// slot r of every peer's workspace and raises the peer's flag r. nccl: one
// Send/Recv group per sub-chunk exchanges it with every peer into SCRATCH.
// Then each rank sums the N slots into Y in rank order 0..N-1 (a Copy and N-1
// Adds on the compute stream), so every rank rounds alike and gets the same
// bits. Multicast: the partial stays in the own workspace and raises every
// peer's flag; each rank load-reduces all rows through the switch into its Y
// (one McReduce per sub-chunk). Each rank receives (N-1) partials of all of
// y (the two-shot algorithm moves 2(N-1)/N of y), in one hop instead of
// 2(N-1): the latency-bound choice for small M.
//
// Kernel algorithms (one_shot_kernel, two_shot_kernel; p2p and multicast): the
// GEMM of all rows into Y, then one AllReduce op — on the GPU one kernel launch
// whose flags and sequence numbers live on the device (docs/gpu-internals.md §7), so
// the call is two launches and can be captured into a CUDA graph.
#include <vector>

#include "core/build_internal.h"

namespace jo::internal {
namespace {

struct Geometry {
  int32_t N, r;
  int64_t P, R, K, Nw, C;
  int64_t rows(int64_t s) const { return SubRows(R, C, s); }
  int64_t begin(int64_t s) const { return SubBegin(R, C, s); }
  Ref x(int32_t block, int64_t s) const {
    return Ref{BufId::kX, r, (block * R + begin(s)) * K, N * R * K, K};
  }
  // Sub-chunk s of row block `block` of a [P, N*R, Nw] buffer at `base`.
  Ref block(BufId buf, int32_t owner, int64_t base, int32_t block, int64_t s) const {
    return Ref{buf, owner, base + (block * R + begin(s)) * Nw, N * R * Nw, Nw};
  }
  Ref y(int32_t block_index, int64_t s) const { return block(BufId::kY, r, 0, block_index, s); }
};

Geometry MakeGeometry(const Program* p) {
  const Problem& q = p->problem;
  return Geometry{q.nranks, q.rank, q.batch, q.rows, q.k, q.cols, p->chunks};
}

void Label(Op& op, int32_t block, int64_t s) {
  op.shard = block;
  op.sub = static_cast<int32_t>(s);
}

// The all-gather half of the ring, after BuildRsRing: `reduced[s]` is
// recorded once sub-chunk s of the own block is complete in Y.
Status BuildRingAllGather(Program* p, Emitter& e, const std::vector<int32_t>& reduced) {
  const Geometry g = MakeGeometry(p);
  const bool nccl = Row(p->problem.transport).messages();
  const int32_t steps[2] = {p->cw_steps, p->ccw_steps};
  auto prev_of = [&](int32_t dir) { return Mod(dir == 0 ? g.r - 1 : g.r + 1, g.N); };
  auto next_of = [&](int32_t dir) { return Mod(dir == 0 ? g.r + 1 : g.r - 1, g.N); };
  // The block that leaves at step t (it arrived at step t-1, or is the own one).
  auto block_at = [&](int32_t dir, int32_t t) { return Mod(dir == 0 ? g.r - t : g.r + t, g.N); };
  // Ids after the reduce-scatter's: flags (p2p) per arriving block, tags
  // (nccl) per step; each rank receives every other block exactly once.
  const int32_t base = p->num_flags;
  auto flag = [&](int32_t block, int64_t s) {
    return static_cast<int32_t>(base + block * g.C + s);
  };
  auto tag = [&](int32_t dir, int32_t t, int64_t s) {
    return static_cast<int32_t>(base + (dir * g.N + t) * g.C + s);
  };
  // p2p: arriving blocks land in a [P, N*R, Nw] area after the reduce-scatter's slots.
  const int64_t area = p->workspace_elems;
  if (!nccl) {
    p->workspace_elems += g.P * g.N * g.R * g.Nw;
    p->num_flags += static_cast<int32_t>(g.N * g.C);
  }

  for (int32_t dir = 0; dir < 2; ++dir) {
    const int32_t stream = 1 + dir;
    for (int64_t s = 0; s < g.C; ++s) {
      if (steps[dir] == 0) continue;
      e.StreamWait(stream, reduced[s]);
      if (nccl) {
        // Step t sends the block received at step t-1 straight from Y.
        for (int32_t t = 0; t < steps[dir]; ++t) {
          const int32_t bundle = e.NewBundle();
          const int32_t out = block_at(dir, t), in = block_at(dir, t + 1);
          Op& send = e.Block(OpKind::kSend, stream, g.y(out, s), Ref{}, g.P, g.rows(s), g.Nw);
          send.peer = next_of(dir);
          send.id = tag(dir, t, s);
          send.bundle = bundle;
          Label(send, out, s);
          Op& recv = e.Block(OpKind::kRecv, stream, Ref{}, g.y(in, s), g.P, g.rows(s), g.Nw);
          recv.peer = prev_of(dir);
          recv.id = tag(dir, t, s);
          recv.bundle = bundle;
          Label(recv, in, s);
        }
        continue;
      }
      // p2p: push into the next rank's area and raise its flag; forward what
      // arrives (from the area), then copy it into Y.
      Label(e.Block(OpKind::kCopy, stream, g.y(g.r, s),
                    g.block(BufId::kWorkspace, next_of(dir), area, g.r, s), g.P, g.rows(s), g.Nw),
            g.r, s);
      e.Signal(stream, next_of(dir), flag(g.r, s));
      for (int32_t t = 1; t <= steps[dir]; ++t) {
        const int32_t in = block_at(dir, t);
        const Ref arrived = g.block(BufId::kWorkspace, g.r, area, in, s);
        e.Wait(stream, prev_of(dir), flag(in, s));
        if (t < steps[dir]) {
          Label(
              e.Block(OpKind::kCopy, stream, arrived,
                      g.block(BufId::kWorkspace, next_of(dir), area, in, s), g.P, g.rows(s), g.Nw),
              in, s);
          e.Signal(stream, next_of(dir), flag(in, s));
        }
        Label(e.Block(OpKind::kCopy, stream, arrived, g.y(in, s), g.P, g.rows(s), g.Nw), in, s);
      }
    }
  }
  return OkStatus();
}

Status BuildMulticast(Program* p, Emitter& e) {
  const Geometry g = MakeGeometry(p);
  // Partials of every block in the own workspace [P, N*R, Nw]; the owner's
  // result is stored over them.
  p->workspace_elems = g.P * g.N * g.R * g.Nw;
  p->num_flags = static_cast<int32_t>(2 * g.N * g.C);
  auto part = [&](int32_t owner, int32_t block, int64_t s) {
    return g.block(BufId::kWorkspace, owner, 0, block, s);
  };
  auto partial_flag = [&](int32_t writer, int64_t s) {
    return static_cast<int32_t>(writer * g.C + s);
  };
  auto result_flag = [&](int32_t owner, int64_t s) {
    return static_cast<int32_t>((g.N + owner) * g.C + s);
  };
  std::vector<int32_t> own_done(static_cast<size_t>(g.C));
  for (auto& ev : own_done) ev = e.NewEvent();

  // Compute stream: block b at step b on every rank.
  for (int32_t b = 0; b < g.N; ++b)
    for (int64_t s = 0; s < g.C; ++s) {
      Label(e.Gemm(0, g.x(b, s), part(g.r, b, s), nullptr, g.P, g.rows(s)), b, s);
      if (b == g.r)
        e.Record(0, own_done[s]);
      else
        e.Signal(0, b, partial_flag(g.r, s));
    }
  // Stream 1: the own block, reduced through the switch and stored to everyone.
  for (int64_t s = 0; s < g.C; ++s) {
    e.StreamWait(1, own_done[s]);
    for (int32_t peer = 0; peer < g.N; ++peer)
      if (peer != g.r) e.Wait(1, peer, partial_flag(peer, s));
    Label(e.Block(OpKind::kMcReduce, 1, part(g.r, g.r, s), g.y(g.r, s), g.P, g.rows(s), g.Nw), g.r,
          s);
    Label(e.Block(OpKind::kMcStore, 1, g.y(g.r, s), part(g.r, g.r, s), g.P, g.rows(s), g.Nw), g.r,
          s);
    for (int32_t peer = 0; peer < g.N; ++peer)
      if (peer != g.r) e.Signal(1, peer, result_flag(g.r, s));
  }
  // Stream 2: the other blocks, in the order their owners finish them.
  for (int32_t b = 0; b < g.N; ++b) {
    if (b == g.r) continue;
    for (int64_t s = 0; s < g.C; ++s) {
      e.Wait(2, b, result_flag(b, s));
      Label(e.Block(OpKind::kCopy, 2, part(g.r, b, s), g.y(b, s), g.P, g.rows(s), g.Nw), b, s);
    }
  }
  return OkStatus();
}

// One-shot: q.rows are all the rows; slot j of a [N, P, M, Nw] area holds
// rank j's partial.
Status BuildOneShot(Program* p, Emitter& e) {
  const Problem& q = p->problem;
  const int32_t N = q.nranks, r = q.rank;
  const int64_t P = q.batch, M = q.rows, Nw = q.cols, C = p->chunks;
  const int64_t slot_elems = P * M * Nw;
  auto rows = [&](int64_t s) { return SubRows(M, C, s); };
  auto x = [&](int64_t s) { return Ref{BufId::kX, r, SubBegin(M, C, s) * q.k, M * q.k, q.k}; };
  auto at = [&](BufId buf, int32_t owner, int64_t slot, int64_t s) {
    return Ref{buf, owner, slot * slot_elems + SubBegin(M, C, s) * Nw, M * Nw, Nw};
  };
  auto flag = [&](int32_t writer, int64_t s) { return static_cast<int32_t>(writer * C + s); };
  auto label = [](Op& op, int32_t writer, int64_t s) -> Op& {
    op.shard = writer;
    op.sub = static_cast<int32_t>(s);
    return op;
  };

  if (Row(q.transport).mechanism == Mechanism::kMulticast) {
    p->workspace_elems = slot_elems;
    p->num_flags = static_cast<int32_t>(N * C);
    for (int64_t s = 0; s < C; ++s) {
      label(e.Gemm(0, x(s), at(BufId::kWorkspace, r, 0, s), nullptr, P, rows(s)), r, s);
      for (int32_t peer = 0; peer < N; ++peer)
        if (peer != r) e.Signal(0, peer, flag(r, s));
    }
    for (int64_t s = 0; s < C; ++s) {
      for (int32_t peer = 0; peer < N; ++peer)
        if (peer != r) e.Wait(0, peer, flag(peer, s));
      label(e.Block(OpKind::kMcReduce, 0, at(BufId::kWorkspace, r, 0, s), at(BufId::kY, r, 0, s), P,
                    rows(s), Nw),
            r, s);
    }
    return OkStatus();
  }

  // nccl: the slots are private (SCRATCH); p2p: peers push into WORKSPACE.
  const bool nccl = Row(q.transport).messages();
  const BufId slots = nccl ? BufId::kScratch : BufId::kWorkspace;
  if (nccl) {
    p->scratch_elems = N * slot_elems;
  } else {
    p->workspace_elems = N * slot_elems;
    p->num_flags = static_cast<int32_t>(N * C);
  }
  std::vector<int32_t> computed(static_cast<size_t>(C)), arrived(static_cast<size_t>(C));
  for (int64_t s = 0; s < C; ++s) {
    computed[s] = e.NewEvent();
    label(e.Gemm(0, x(s), at(slots, r, r, s), nullptr, P, rows(s)), r, s);
    e.Record(0, computed[s]);
  }
  // Stream 1: sub-chunk s leaves as soon as its GEMM is done (peers in ring
  // order from r+1, so that not every rank writes to rank 0 first).
  for (int64_t s = 0; s < C; ++s) {
    e.StreamWait(1, computed[s]);
    const int32_t bundle = nccl ? e.NewBundle() : -1;
    for (int32_t i = 1; i < N; ++i) {
      const int32_t peer = Mod(r + i, N);
      if (!nccl) {
        label(e.Block(OpKind::kCopy, 1, at(slots, r, r, s), at(slots, peer, r, s), P, rows(s), Nw),
              r, s);
        e.Signal(1, peer, flag(r, s));
        continue;
      }
      Op& send = label(e.Block(OpKind::kSend, 1, at(slots, r, r, s), Ref{}, P, rows(s), Nw), r, s);
      send.peer = peer;
      send.id = static_cast<int32_t>(s);
      send.bundle = bundle;
      const int32_t from = Mod(r - i, N);
      Op& recv =
          label(e.Block(OpKind::kRecv, 1, Ref{}, at(slots, r, from, s), P, rows(s), Nw), from, s);
      recv.peer = from;
      recv.id = static_cast<int32_t>(s);
      recv.bundle = bundle;
    }
    if (nccl) {
      arrived[s] = e.NewEvent();
      e.Record(1, arrived[s]);
    }
  }
  // Compute stream: Y = slot 0 + slot 1 + ... + slot N-1, the same order on every rank.
  for (int64_t s = 0; s < C; ++s) {
    if (nccl)
      e.StreamWait(0, arrived[s]);
    else
      for (int32_t peer = 0; peer < N; ++peer)
        if (peer != r) e.Wait(0, peer, flag(peer, s));
    label(e.Block(OpKind::kCopy, 0, at(slots, r, 0, s), at(BufId::kY, r, 0, s), P, rows(s), Nw), 0,
          s);
    for (int32_t j = 1; j < N; ++j)
      label(e.Block(OpKind::kAdd, 0, at(slots, r, j, s), at(BufId::kY, r, 0, s), P, rows(s), Nw), j,
            s);
  }
  return OkStatus();
}

// The kernel algorithms: the GEMM of all rows into Y, then ONE AllReduce of Y in place (the
// one-launch kernel on the GPU, docs/gpu-internals.md §7; its data and flags are the kernel's own
// area there). What the program declares is the host executor's: a slot per rank for each rank's
// copy of y in every workspace, and a flag per writer.
Status BuildKernel(Program* p, Emitter& e) {
  const Problem& q = p->problem;
  const int64_t P = q.batch, M = q.rows, Nw = q.cols;
  p->workspace_elems = q.nranks * P * M * Nw;
  p->num_flags = q.nranks;
  const Ref x{BufId::kX, q.rank, 0, M * q.k, q.k};
  const Ref y{BufId::kY, q.rank, 0, M * Nw, Nw};
  Op& gemm = e.Gemm(0, x, y, nullptr, P, M);
  gemm.shard = q.rank;
  gemm.sub = 0;
  Op& all = e.Block(OpKind::kAllReduce, 0, Ref{}, y, P, M, Nw);
  all.shard = q.rank;
  all.sub = 0;
  return OkStatus();
}

}  // namespace

Status BuildMatmulAr(Program* p) {
  const Problem& q = p->problem;
  Emitter e(p);
  if (q.nranks == 1) return BuildSingleRank(p, e);
  if (OneLaunch(q.algorithm)) return BuildKernel(p, e);
  if (q.algorithm == ArAlgorithm::kOneShot) {
    JO_CHECK(BuildOneShot(p, e));
  } else if (Row(q.transport).mechanism == Mechanism::kMulticast) {
    JO_CHECK(BuildMulticast(p, e));
  } else {
    std::vector<int32_t> reduced;
    JO_CHECK(BuildRsRing(p, e, RsTarget{q.rank * q.rows, q.nranks * q.rows}, &reduced));
    JO_CHECK(BuildRingAllGather(p, e, reduced));
  }
  // Replayable: the acknowledgements after the data flags (docs/gpu-internals.md §8).
  if (q.replayable) Acknowledge(p, e, p->num_flags);
  return OkStatus();
}

}  // namespace jo::internal
