// AG+GEMM programs: y[:, shard j rows] = x_j @ w for every shard j, the local
// shard first (it needs no transfer), then shards in arrival order: a GEMM per
// row block after its wait, or (fused, p2p and multicast) one persistent GEMM
// over the gathered rows in the workspace whose tiles wait for their blocks'
// flags in the kernel (docs/gpu-internals.md §5). One function per transport mechanism
// (core/kinds.h): Send/Recv rings (nccl), copies into the peers' workspace
// round a ring (p2p), stores through the multicast object (multicast).
//
// An fp8 x moves as fp8, and each shard's float32 scale travels with it: one
// more 1-element transfer per shard and hop, next to the shard's first
// sub-chunk (in its NCCL group; before its flag on p2p and multicast; on p2p
// on the shard's own stream, just before its data), into the shard's scale
// slot; the shard's GEMMs read that slot. The fused GEMM (fp8: the pairs
// core/kinds.h JO_FUSED_FP8 lists) reads every shard's slot, each row its own
// shard's, so the own scale joins the slots before it starts (p2p: a copy
// beside the own shard's; multicast stores it there).
//
// Block scales (MXFP8, core/program.h BufId): each sub-chunk's scale rows
// ([rows, k/32] e8m0) travel with its data rows, by the same mechanism, into
// the gathered scale layout (NCCL: in the same group; p2p and multicast:
// before its flag); each GEMM reads the scales beside its rows. No fused GEMM
// takes them (BuildProgram refuses).
#include <utility>
#include <vector>

#include "core/build_internal.h"

namespace jo::internal {
namespace {

struct Arrival {
  int32_t shard;
  int32_t dir;  // 0: came clockwise from rank-1; 1: counter-clockwise from rank+1
};

// One rank's AG+GEMM program being built: its geometry, where each block
// lives, and the pieces every mechanism's program is made of.
struct Ag {
  explicit Ag(Program* program)
      : p(program),
        q(program->problem),
        e(program),
        N(q.nranks),
        r(q.rank),
        P(q.batch),
        R(q.rows),
        K(q.k),
        Nw(q.cols),
        C(program->chunks),
        // fp8 x: each shard's scale travels with it (block scales: each sub-chunk's).
        scaled(IsFp8(q.x_dtype) && !q.block_scaled),
        blocks(q.block_scaled),
        // Fused: the kernel reads every shard from the own workspace [P, N*R, K].
        fused(q.fused && q.nranks > 1) {
    const int32_t steps = p->cw_steps > p->ccw_steps ? p->cw_steps : p->ccw_steps;
    for (int32_t t = 0; t < steps; ++t) {
      if (t < p->cw_steps) arrivals.push_back({Mod(r - 1 - t, N), 0});
      if (t < p->ccw_steps) arrivals.push_back({Mod(r + 1 + t, N), 1});
    }
  }

  Program* p;
  const Problem& q;
  Emitter e;
  const int32_t N, r;
  const int64_t P, R, K, Nw, C;
  const bool scaled, blocks, fused;
  std::vector<Arrival> arrivals;  // the other shards, in the order they arrive

  int64_t rows(int64_t sub) const { return SubRows(R, C, sub); }
  Ref x_ref(int64_t sub) const { return Ref{BufId::kX, r, SubBegin(R, C, sub) * K, R * K, K}; }
  // A shard's sub-chunk inside a gathered-layout buffer [P, N*R, K].
  Ref g_ref(BufId buf, int32_t owner, int32_t shard, int64_t sub) const {
    return Ref{buf, owner, (shard * R + SubBegin(R, C, sub)) * K, N * R * K, K};
  }
  Ref y_ref(int32_t shard, int64_t sub) const {
    return Ref{BufId::kY, r, (shard * R + SubBegin(R, C, sub)) * Nw, N * R * Nw, Nw};
  }
  int32_t flag(int32_t shard, int64_t sub) const { return static_cast<int32_t>(shard * C + sub); }
  int32_t tag(int32_t dir, int32_t shard, int64_t sub) const {
    return static_cast<int32_t>((dir * N + shard) * C + sub);
  }
  static Op& Label(Op& op, int32_t shard, int64_t sub) {
    op.shard = shard;
    op.sub = static_cast<int32_t>(sub);
    return op;
  }
  // On nccl a rank holds shard j's scale in ScratchScales slot j, its own in
  // the XScale operand.
  Ref held_scale(int32_t shard) const {
    return shard == r ? Emitter::ScaleRef(BufId::kXScale, r, 0)
                      : Emitter::ScaleRef(BufId::kScratchScales, r, shard);
  }
  int32_t scale_tag(int32_t dir, int32_t shard) const {
    return static_cast<int32_t>(2 * N * C + dir * N + shard);
  }
  // Block scales: the scale rows beside a block of data rows, and their tag.
  Ref scales_of(const Ref& data) const { return BlockScalesOf(q, data); }
  int32_t block_scale_tag(int32_t dir, int32_t shard, int64_t sub) const {
    return static_cast<int32_t>(2 * N * C + tag(dir, shard, sub));
  }
  // Moves sub-chunk s's block scales as `kind` moves its data from `src` to
  // `dst` (the data's refs; null: a Send's destination, a Recv's source).
  Op& MoveScales(OpKind kind, int32_t stream, const Ref* src, const Ref* dst, int32_t shard,
                 int64_t s) {
    return Label(e.Block(kind, stream, src != nullptr ? scales_of(*src) : Ref{},
                         dst != nullptr ? scales_of(*dst) : Ref{}, P, rows(s), KBlocks(q)),
                 shard, s);
  }
  int32_t prev_of(int32_t dir) const { return Mod(dir == 0 ? r - 1 : r + 1, N); }
  int32_t next_of(int32_t dir) const { return Mod(dir == 0 ? r + 1 : r - 1, N); }
  int32_t dir_steps(int32_t dir) const { return dir == 0 ? p->cw_steps : p->ccw_steps; }

  // The local shard first: no transfer to wait for.
  void Local() {
    if (fused) return;
    for (int64_t s = 0; s < C; ++s) {
      Label(e.Gemm(0, x_ref(s), y_ref(r, s), nullptr, P, rows(s)), r, s);
      if (q.return_gathered)
        Label(e.Block(OpKind::kCopy, 0, x_ref(s), g_ref(BufId::kXGathered, r, r, s), P, rows(s), K),
              r, s);
    }
  }

  // Gemms on arrived shards, optionally copying them out to XGATHERED.
  void Consume(BufId buf, const Arrival& a, int64_t s) {
    Ref src = g_ref(buf, r, a.shard, s);
    Op& gemm = Label(e.Gemm(0, src, y_ref(a.shard, s), nullptr, P, rows(s)), a.shard, s);
    if (scaled)
      gemm.a_scale = Emitter::ScaleRef(
          buf == BufId::kWorkspace ? BufId::kWorkspaceScales : BufId::kScratchScales, r, a.shard);
    if (q.return_gathered && buf != BufId::kXGathered)
      Label(e.Block(OpKind::kCopy, 0, src, g_ref(BufId::kXGathered, r, a.shard, s), P, rows(s), K),
            a.shard, s);
  }

  // The fused GEMM over the own workspace: the local shard first (in place
  // before the kernel), then the shards in arrival order, each block waiting
  // for its flag from `writer(arrival)`; then the gathered x, if returned.
  template <typename Writer>
  void FusedGemm(Writer writer) {
    FusedBlocks f;
    f.rows = fused::RowBlocks{N, static_cast<int32_t>(C), R};
    f.key = fused::OrderKey::kLastArrival;
    f.wait_flags = 0;  // flag(shard, s) is block shard * C + s
    f.ready_shard = r;
    f.writers.assign(static_cast<size_t>(N * C), -1);
    for (int64_t s = 0; s < C; ++s) f.sequence.push_back(flag(r, s));
    for (const Arrival& a : arrivals)
      for (int64_t s = 0; s < C; ++s) {
        f.sequence.push_back(flag(a.shard, s));
        f.writers[static_cast<size_t>(flag(a.shard, s))] = writer(a);
      }
    const Ref gathered{BufId::kWorkspace, r, 0, N * R * K, K};
    Op& op = e.FusedGemm(0, gathered, Ref{BufId::kY, r, 0, N * R * Nw, Nw}, P, std::move(f));
    if (scaled) op.a_scale = Emitter::ScaleRef(BufId::kWorkspaceScales, r, 0);  // shard s: slot s
    if (q.return_gathered)
      e.Block(OpKind::kCopy, 0, gathered, Ref{BufId::kXGathered, r, 0, N * R * K, K}, P, N * R, K);
  }
};

// nccl: receive straight into the gathered buffer (XGATHERED if returned, else
// private scratch); forward from there on the next step.
void Messages(Ag& g) {
  Program* p = g.p;
  const bool returned = g.q.return_gathered;
  const BufId gbuf = returned ? BufId::kXGathered : BufId::kScratch;
  if (!returned) p->scratch_elems = g.P * g.N * g.R * g.K;
  if (g.scaled) p->scratch_scales = g.N;
  if (g.blocks) p->scratch_scales = g.P * g.N * g.R * KBlocks(g.q);
  std::vector<int32_t> arrived(g.N * g.C, -1);  // event per (shard, sub)
  for (int32_t dir = 0; dir < 2; ++dir) {
    const int32_t stream = 1 + dir;
    for (int32_t t = 0; t < g.dir_steps(dir); ++t) {
      const int32_t send_shard = Mod(dir == 0 ? g.r - t : g.r + t, g.N);
      const int32_t recv_shard = Mod(dir == 0 ? g.r - 1 - t : g.r + 1 + t, g.N);
      for (int64_t s = 0; s < g.C; ++s) {
        const int32_t bundle = g.e.NewBundle();
        Ref src = t == 0 ? g.x_ref(s) : g.g_ref(gbuf, g.r, send_shard, s);
        Op& send = g.e.Block(OpKind::kSend, stream, src, Ref{}, g.P, g.rows(s), g.K);
        send.peer = g.next_of(dir);
        send.id = g.tag(dir, send_shard, s);
        send.bundle = bundle;
        Ag::Label(send, send_shard, s);
        const Ref dst = g.g_ref(gbuf, g.r, recv_shard, s);
        Op& recv = g.e.Block(OpKind::kRecv, stream, Ref{}, dst, g.P, g.rows(s), g.K);
        recv.peer = g.prev_of(dir);
        recv.id = g.tag(dir, recv_shard, s);
        recv.bundle = bundle;
        Ag::Label(recv, recv_shard, s);
        if (g.blocks) {  // the sub-chunk's block scales, in its group
          Op& send_scales = g.MoveScales(OpKind::kSend, stream, &src, nullptr, send_shard, s);
          send_scales.peer = send.peer;
          send_scales.id = g.block_scale_tag(dir, send_shard, s);
          send_scales.bundle = bundle;
          Op& recv_scales = g.MoveScales(OpKind::kRecv, stream, nullptr, &dst, recv_shard, s);
          recv_scales.peer = recv.peer;
          recv_scales.id = g.block_scale_tag(dir, recv_shard, s);
          recv_scales.bundle = bundle;
        }
        if (g.scaled && s == 0) {  // the shard's scale, in its first sub-chunk's group
          Op& send_scale =
              g.e.Block(OpKind::kSend, stream, g.held_scale(send_shard), Ref{}, 1, 1, 1);
          send_scale.peer = g.next_of(dir);
          send_scale.id = g.scale_tag(dir, send_shard);
          send_scale.bundle = bundle;
          Ag::Label(send_scale, send_shard, s);
          Op& recv_scale =
              g.e.Block(OpKind::kRecv, stream, Ref{}, g.held_scale(recv_shard), 1, 1, 1);
          recv_scale.peer = g.prev_of(dir);
          recv_scale.id = g.scale_tag(dir, recv_shard);
          recv_scale.bundle = bundle;
          Ag::Label(recv_scale, recv_shard, s);
        }
        arrived[recv_shard * g.C + s] = g.e.NewEvent();
        g.e.Record(stream, arrived[recv_shard * g.C + s]);
      }
    }
  }
  for (const Arrival& a : g.arrivals)
    for (int64_t s = 0; s < g.C; ++s) {
      g.e.StreamWait(0, arrived[a.shard * g.C + s]);
      g.Consume(gbuf, a, s);
    }
}

// p2p: push each sub-chunk into the next rank's workspace, then raise its flag.
void PeerCopies(Ag& g) {
  Program* p = g.p;
  p->workspace_elems = g.P * g.N * g.R * g.K;
  if (g.scaled) p->workspace_scales = g.N;
  if (g.blocks) p->workspace_scales = g.P * g.N * g.R * KBlocks(g.q);
  // Fused: the local shard joins the others in the own workspace first (copy engine),
  // and its scale the others' scale slots (no peer writes the own slot).
  if (g.fused)
    for (int64_t s = 0; s < g.C; ++s) {
      const Ref own = g.g_ref(BufId::kWorkspace, g.r, g.r, s);
      Ag::Label(g.e.Block(OpKind::kCopy, 0, g.x_ref(s), own, g.P, g.rows(s), g.K), g.r, s);
      if (g.scaled && s == 0)
        Ag::Label(g.e.Block(OpKind::kCopy, 0, Emitter::ScaleRef(BufId::kXScale, g.r, 0),
                            Emitter::ScaleRef(BufId::kWorkspaceScales, g.r, g.r), 1, 1, 1),
                  g.r, s);
    }
  // An fp8 shard's scale crosses on the data stream, with the shard's first
  // sub-chunk: after the stream's wait for the shard's flag, the scale's copy
  // into the next rank's slot, then the data's copy, then the flag. Stream
  // order completes both copies before the flag's write starts, so no peer
  // reads the slot before the scale is in it, at one op per hop (a stream of
  // its own would cost a Wait, a Record and a StreamWait more: host enqueue).
  // Block scales (MXFP8) cross the same way, before every sub-chunk's data:
  // its scale rows.
  //
  // Replayable and fused: no forwarding. Each rank pushes its own shard straight into every
  // peer's workspace, the nearest first in each direction (step t of direction d goes to the
  // rank t+1 hops away), so every rank receives the shards in the ring's arrival order and the
  // fused GEMM's block order is the ring's. A forwarding wait would need, to be bounded, a wait
  // kernel, and so an SM, while the rank's fused GEMM may hold every SM waiting for the shards
  // its peers forward the same way (docs/gpu-internals.md §5 rule 1, §8 "A dead peer"); with no
  // forwarding the comm streams wait only for the acknowledgements at their ends.
  const bool direct = g.fused && g.q.replayable;
  for (int32_t dir = 0; dir < 2; ++dir) {
    const int32_t stream = 1 + dir;
    for (int32_t t = 0; t < g.dir_steps(dir); ++t) {
      const int32_t shard = direct ? g.r : Mod(dir == 0 ? g.r - t : g.r + t, g.N);
      const int32_t to = direct ? Mod(dir == 0 ? g.r + 1 + t : g.r - 1 - t, g.N) : g.next_of(dir);
      for (int64_t s = 0; s < g.C; ++s) {
        const bool own = t == 0 || direct;  // pushing the own shard, from x
        const Ref src = own ? g.x_ref(s) : g.g_ref(BufId::kWorkspace, g.r, shard, s);
        const Ref dst = g.g_ref(BufId::kWorkspace, to, shard, s);
        if (!own) g.e.Wait(stream, g.prev_of(dir), g.flag(shard, s));
        if (g.blocks)
          g.MoveScales(OpKind::kCopy, stream, &src, &dst, shard, s);
        else if (g.scaled && s == 0)
          Ag::Label(g.e.Block(OpKind::kCopy, stream,
                              own ? Emitter::ScaleRef(BufId::kXScale, g.r, 0)
                                  : Emitter::ScaleRef(BufId::kWorkspaceScales, g.r, shard),
                              Emitter::ScaleRef(BufId::kWorkspaceScales, to, shard), 1, 1, 1),
                    shard, s);
        Ag::Label(g.e.Block(OpKind::kCopy, stream, src, dst, g.P, g.rows(s), g.K), shard, s);
        g.e.Signal(stream, to, g.flag(shard, s));
      }
    }
  }
  if (g.fused) {
    if (direct)
      g.FusedGemm([](const Arrival& a) { return a.shard; });
    else
      g.FusedGemm([&](const Arrival& a) { return g.prev_of(a.dir); });
  } else {
    for (const Arrival& a : g.arrivals)
      for (int64_t s = 0; s < g.C; ++s) {
        g.e.Wait(0, g.prev_of(a.dir), g.flag(a.shard, s));
        g.Consume(BufId::kWorkspace, a, s);
      }
  }
  if (g.q.replayable) Acknowledge(p, g.e, static_cast<int32_t>(g.N * g.C));
}

// multicast: store the own shard once through the multicast mapping; every
// rank multiplies shards as their flags arrive.
void Multicast(Ag& g) {
  Program* p = g.p;
  p->workspace_elems = g.P * g.N * g.R * g.K;
  if (g.scaled) p->workspace_scales = g.N;
  if (g.blocks) p->workspace_scales = g.P * g.N * g.R * KBlocks(g.q);
  for (int64_t s = 0; s < g.C; ++s) {
    const Ref src = g.x_ref(s), dst = g.g_ref(BufId::kWorkspace, g.r, g.r, s);
    Ag::Label(g.e.Block(OpKind::kMcStore, 1, src, dst, g.P, g.rows(s), g.K), g.r, s);
    if (g.blocks)  // the sub-chunk's block scales, before its flag
      g.MoveScales(OpKind::kMcStore, 1, &src, &dst, g.r, s);
    if (g.scaled && s == 0)  // the own scale, before the first flag
      Ag::Label(g.e.Block(OpKind::kMcStore, 1, Emitter::ScaleRef(BufId::kXScale, g.r, 0),
                          Emitter::ScaleRef(BufId::kWorkspaceScales, g.r, g.r), 1, 1, 1),
                g.r, s);
    for (int32_t peer = 0; peer < g.N; ++peer)
      if (peer != g.r) g.e.Signal(1, peer, g.flag(g.r, s));
  }
  if (g.fused) {
    // The own multimem stores are kernels: they need SMs, which the fused GEMM holds
    // until it ends, so they finish before it starts (docs/gpu-internals.md §5, rule 1).
    const int32_t stored = g.e.NewEvent();
    g.e.Record(1, stored);
    g.e.StreamWait(0, stored);
    // Arrival order: shards r-1, r-2, ... (multicast has cw_steps = N-1), each from its owner.
    g.FusedGemm([](const Arrival& a) { return a.shard; });
  } else {
    for (int32_t t = 1; t < g.N; ++t) {
      const Arrival a{Mod(g.r - t, g.N), 0};
      for (int64_t s = 0; s < g.C; ++s) {
        g.e.Wait(0, a.shard, g.flag(a.shard, s));
        g.Consume(BufId::kWorkspace, a, s);
      }
    }
  }
  if (g.q.replayable) Acknowledge(p, g.e, static_cast<int32_t>(g.N * g.C));
}

}  // namespace

Status BuildAgMatmul(Program* p) {
  Ag g(p);
  g.Local();
  if (g.N == 1) return OkStatus();
  p->num_flags = static_cast<int32_t>(g.N * g.C);  // replayable: N more (Acknowledge)
  switch (Row(p->problem.transport).mechanism) {
    case Mechanism::kMessages:
      Messages(g);
      break;
    case Mechanism::kPeerCopies:
      PeerCopies(g);
      break;
    case Mechanism::kMulticast:
      Multicast(g);
      break;
  }
  return OkStatus();
}

}  // namespace jo::internal
