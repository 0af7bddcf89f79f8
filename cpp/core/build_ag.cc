// AG+GEMM programs: y[:, shard j rows] = x_j @ w for every shard j, the local
// shard first (it needs no transfer), then shards in arrival order: a GEMM per
// row block after its wait, or (fused, p2p and multicast) one persistent GEMM
// over the gathered rows in the workspace whose tiles wait for their blocks'
// flags in the kernel (docs/gpu.md §10).
//
// An fp8 x moves as fp8, and each shard's float32 scale travels with it: one
// more 1-element transfer per shard and hop, next to the shard's first
// sub-chunk (in its NCCL group; before its flag on p2p and multicast), into
// the shard's scale slot; the shard's GEMMs read that slot. (The fused GEMM
// is 16-bit only: no scales.)
#include <utility>
#include <vector>

#include "core/build_internal.h"

namespace jo::internal {
namespace {

struct Arrival {
  int32_t shard;
  int32_t dir;  // 0: came clockwise from rank-1; 1: counter-clockwise from rank+1
};

}  // namespace

Status BuildAgMatmul(Program* p) {
  const Problem& q = p->problem;
  const int32_t N = q.nranks, r = q.rank;
  const int64_t P = q.batch, R = q.rows, K = q.k, Nw = q.cols, C = p->chunks;
  Emitter e(p);

  auto rows = [&](int64_t sub) { return SubRows(R, C, sub); };
  auto x_ref = [&](int64_t sub) { return Ref{BufId::kX, r, SubBegin(R, C, sub) * K, R * K, K}; };
  // A shard's sub-chunk inside a gathered-layout buffer [P, N*R, K].
  auto g_ref = [&](BufId buf, int32_t owner, int32_t shard, int64_t sub) {
    return Ref{buf, owner, (shard * R + SubBegin(R, C, sub)) * K, N * R * K, K};
  };
  auto y_ref = [&](int32_t shard, int64_t sub) {
    return Ref{BufId::kY, r, (shard * R + SubBegin(R, C, sub)) * Nw, N * R * Nw, Nw};
  };
  auto flag = [&](int32_t shard, int64_t sub) { return static_cast<int32_t>(shard * C + sub); };
  auto tag = [&](int32_t dir, int32_t shard, int64_t sub) {
    return static_cast<int32_t>((dir * N + shard) * C + sub);
  };
  auto label = [](Op& op, int32_t shard, int64_t sub) {
    op.shard = shard;
    op.sub = static_cast<int32_t>(sub);
  };
  // fp8 x: each shard's scale travels with it. On nccl a rank holds shard j's
  // scale in ScratchScales slot j, its own in the XScale operand.
  const bool scaled = IsFp8(q.x_dtype);
  auto held_scale = [&](int32_t shard) {
    return shard == r ? Emitter::ScaleRef(BufId::kXScale, r, 0)
                      : Emitter::ScaleRef(BufId::kScratchScales, r, shard);
  };
  auto scale_tag = [&](int32_t dir, int32_t shard) {
    return static_cast<int32_t>(2 * N * C + dir * N + shard);
  };

  // Fused: the kernel reads every shard from the own workspace [P, N*R, K].
  const bool fused = q.fused && N > 1;
  // Local shard first: no transfer to wait for.
  if (!fused)
    for (int64_t s = 0; s < C; ++s) {
      label(e.Gemm(0, x_ref(s), y_ref(r, s), nullptr, P, rows(s)), r, s);
      if (q.return_gathered)
        label(e.Block(OpKind::kCopy, 0, x_ref(s), g_ref(BufId::kXGathered, r, r, s), P, rows(s), K),
              r, s);
    }
  if (N == 1) return OkStatus();

  p->num_flags = static_cast<int32_t>(N * C);
  std::vector<Arrival> arrivals;
  const int32_t steps = p->cw_steps > p->ccw_steps ? p->cw_steps : p->ccw_steps;
  for (int32_t t = 0; t < steps; ++t) {
    if (t < p->cw_steps) arrivals.push_back({Mod(r - 1 - t, N), 0});
    if (t < p->ccw_steps) arrivals.push_back({Mod(r + 1 + t, N), 1});
  }
  auto prev_of = [&](int32_t dir) { return Mod(dir == 0 ? r - 1 : r + 1, N); };
  auto next_of = [&](int32_t dir) { return Mod(dir == 0 ? r + 1 : r - 1, N); };
  auto dir_steps = [&](int32_t dir) { return dir == 0 ? p->cw_steps : p->ccw_steps; };

  // The fused GEMM over the own workspace: the local shard first (in place
  // before the kernel), then the shards in arrival order, each block waiting
  // for its flag from `writer(arrival)`; then the gathered x, if returned.
  auto fused_gemm = [&](auto writer) {
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
    e.FusedGemm(0, gathered, Ref{BufId::kY, r, 0, N * R * Nw, Nw}, P, std::move(f));
    if (q.return_gathered)
      e.Block(OpKind::kCopy, 0, gathered, Ref{BufId::kXGathered, r, 0, N * R * K, K}, P, N * R, K);
  };

  // Gemms on arrived shards, optionally copying them out to XGATHERED.
  auto consume = [&](BufId buf, const Arrival& a, int64_t s) {
    Ref src = g_ref(buf, r, a.shard, s);
    Op& gemm = e.Gemm(0, src, y_ref(a.shard, s), nullptr, P, rows(s));
    label(gemm, a.shard, s);
    if (scaled)
      gemm.a_scale = Emitter::ScaleRef(
          buf == BufId::kWorkspace ? BufId::kWorkspaceScales : BufId::kScratchScales, r, a.shard);
    if (q.return_gathered && buf != BufId::kXGathered)
      label(e.Block(OpKind::kCopy, 0, src, g_ref(BufId::kXGathered, r, a.shard, s), P, rows(s), K),
            a.shard, s);
  };

  switch (q.transport) {
    case Transport::kNccl: {
      // Receive straight into the gathered buffer (XGATHERED if returned,
      // else private scratch); forward from there on the next step.
      const BufId gbuf = q.return_gathered ? BufId::kXGathered : BufId::kScratch;
      if (!q.return_gathered) p->scratch_elems = P * N * R * K;
      if (scaled) p->scratch_scales = N;
      std::vector<int32_t> arrived(N * C, -1);  // event per (shard, sub)
      for (int32_t dir = 0; dir < 2; ++dir) {
        const int32_t stream = 1 + dir;
        for (int32_t t = 0; t < dir_steps(dir); ++t) {
          const int32_t send_shard = Mod(dir == 0 ? r - t : r + t, N);
          const int32_t recv_shard = Mod(dir == 0 ? r - 1 - t : r + 1 + t, N);
          for (int64_t s = 0; s < C; ++s) {
            const int32_t bundle = e.NewBundle();
            Ref src = t == 0 ? x_ref(s) : g_ref(gbuf, r, send_shard, s);
            Op& send = e.Block(OpKind::kSend, stream, src, Ref{}, P, rows(s), K);
            send.peer = next_of(dir);
            send.id = tag(dir, send_shard, s);
            send.bundle = bundle;
            label(send, send_shard, s);
            Op& recv =
                e.Block(OpKind::kRecv, stream, Ref{}, g_ref(gbuf, r, recv_shard, s), P, rows(s), K);
            recv.peer = prev_of(dir);
            recv.id = tag(dir, recv_shard, s);
            recv.bundle = bundle;
            label(recv, recv_shard, s);
            if (scaled && s == 0) {  // the shard's scale, in its first sub-chunk's group
              Op& send_scale =
                  e.Block(OpKind::kSend, stream, held_scale(send_shard), Ref{}, 1, 1, 1);
              send_scale.peer = next_of(dir);
              send_scale.id = scale_tag(dir, send_shard);
              send_scale.bundle = bundle;
              label(send_scale, send_shard, s);
              Op& recv_scale =
                  e.Block(OpKind::kRecv, stream, Ref{}, held_scale(recv_shard), 1, 1, 1);
              recv_scale.peer = prev_of(dir);
              recv_scale.id = scale_tag(dir, recv_shard);
              recv_scale.bundle = bundle;
              label(recv_scale, recv_shard, s);
            }
            arrived[recv_shard * C + s] = e.NewEvent();
            e.Record(stream, arrived[recv_shard * C + s]);
          }
        }
      }
      for (const Arrival& a : arrivals)
        for (int64_t s = 0; s < C; ++s) {
          e.StreamWait(0, arrived[a.shard * C + s]);
          consume(gbuf, a, s);
        }
      break;
    }
    case Transport::kP2p: {
      // Push each sub-chunk into the next rank's workspace, then raise its flag.
      p->workspace_elems = P * N * R * K;
      if (scaled) p->workspace_scales = N;
      // Fused: the local shard joins the others in the own workspace first (copy engine).
      if (fused)
        for (int64_t s = 0; s < C; ++s) {
          const Ref own = g_ref(BufId::kWorkspace, r, r, s);
          label(e.Block(OpKind::kCopy, 0, x_ref(s), own, P, rows(s), K), r, s);
        }
      for (int32_t dir = 0; dir < 2; ++dir) {
        const int32_t stream = 1 + dir;
        for (int32_t t = 0; t < dir_steps(dir); ++t) {
          const int32_t shard = Mod(dir == 0 ? r - t : r + t, N);
          for (int64_t s = 0; s < C; ++s) {
            Ref src = x_ref(s);
            if (t > 0) {
              e.Wait(stream, prev_of(dir), flag(shard, s));
              src = g_ref(BufId::kWorkspace, r, shard, s);
            }
            label(e.Block(OpKind::kCopy, stream, src,
                          g_ref(BufId::kWorkspace, next_of(dir), shard, s), P, rows(s), K),
                  shard, s);
            if (scaled && s == 0)  // the shard's scale, before its first flag
              label(
                  e.Block(OpKind::kCopy, stream,
                          t == 0 ? Emitter::ScaleRef(BufId::kXScale, r, 0)
                                 : Emitter::ScaleRef(BufId::kWorkspaceScales, r, shard),
                          Emitter::ScaleRef(BufId::kWorkspaceScales, next_of(dir), shard), 1, 1, 1),
                  shard, s);
            e.Signal(stream, next_of(dir), flag(shard, s));
          }
        }
      }
      if (fused) {
        fused_gemm([&](const Arrival& a) { return prev_of(a.dir); });
        break;
      }
      for (const Arrival& a : arrivals)
        for (int64_t s = 0; s < C; ++s) {
          e.Wait(0, prev_of(a.dir), flag(a.shard, s));
          consume(BufId::kWorkspace, a, s);
        }
      break;
    }
    case Transport::kMulticast: {
      // Store the own shard once through the multicast mapping; every rank
      // multiplies shards as their flags arrive.
      p->workspace_elems = P * N * R * K;
      if (scaled) p->workspace_scales = N;
      for (int64_t s = 0; s < C; ++s) {
        label(e.Block(OpKind::kMcStore, 1, x_ref(s), g_ref(BufId::kWorkspace, r, r, s), P, rows(s),
                      K),
              r, s);
        if (scaled && s == 0)  // the own scale, before the first flag
          label(e.Block(OpKind::kMcStore, 1, Emitter::ScaleRef(BufId::kXScale, r, 0),
                        Emitter::ScaleRef(BufId::kWorkspaceScales, r, r), 1, 1, 1),
                r, s);
        for (int32_t peer = 0; peer < N; ++peer)
          if (peer != r) e.Signal(1, peer, flag(r, s));
      }
      if (fused) {
        // The own multimem stores are kernels: they need SMs, which the fused GEMM holds
        // until it ends, so they finish before it starts (docs/gpu.md §10, rule 1).
        const int32_t stored = e.NewEvent();
        e.Record(1, stored);
        e.StreamWait(0, stored);
        // Arrival order: shards r-1, r-2, ... (multicast has cw_steps = N-1), each from its owner.
        fused_gemm([](const Arrival& a) { return a.shard; });
        break;
      }
      for (int32_t t = 1; t < N; ++t) {
        const Arrival a{Mod(r - t, N), 0};
        for (int64_t s = 0; s < C; ++s) {
          e.Wait(0, a.shard, flag(a.shard, s));
          consume(BufId::kWorkspace, a, s);
        }
      }
      break;
    }
  }
  return OkStatus();
}

}  // namespace jo::internal
