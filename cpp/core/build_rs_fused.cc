// The fused GEMM + reduce-scatter (docs/native.md §3, docs/gpu-internals.md §5): one
// persistent GEMM computes every destination's partial and releases each
// sub-chunk as it is stored; the reduction of the rank's own block runs on a
// stream of its own, sub-chunk by sub-chunk, while the kernel computes later
// ones, so what is left after the kernel's last tile is one sub-chunk's sum.
//
// The kernel waits for nothing: whatever it needs is in place when it
// starts, so no rank's kernel can wait for another's, and it may leave SMs to
// the reduction's kernels (FusedBlocks::spare_sms) without any deadlock risk:
// if the GPU runs them beside it they overlap it, if not they run after it,
// with the same result (CUDA does not promise that kernels of two streams run
// concurrently; docs/gpu-internals.md §5, rule 1).
//
// The kernel's order: C rounds; round s takes sub-chunk s of every
// destination's block, so every owner can reduce its sub-chunk s during round
// s + 1. Within a round:
//  * p2p: destinations r-1, r-2, ..., the own block last (at each step every
//    rank sends to a different owner; the own partial never leaves). Streams 1
//    and 2, in turn, copy each released partial into slot r of its owner's
//    workspace (the copy engine) and raise the owner's flag; stream 3 waits for
//    the own release and the N-1 flags of a sub-chunk, then sums the N partials
//    in one pass (Reduce: rank order, float32, one rounding);
//  * multicast: destinations 0, 1, ..., N-1 on every rank (synchronised: all
//    ranks release sub-chunk (j, s) at about the same time, so its owner can
//    load-reduce it through the switch while the kernels go on). Stream 1
//    passes each release on to the block's owner; stream 2 load-reduces the
//    own block's sub-chunk once every rank released it (McReduce).
// Each reduction that can run beside the kernel is sized to the SMs the
// kernel leaves (Op::sms); the one whose input the kernel releases last runs
// after it, on the whole device.
#include <vector>

#include "core/build_internal.h"

namespace jo::internal {
namespace {

// The most SMs the fused GEMM leaves to the reduction beside it (FusedBlocks::spare_sms; how
// many it leaves on a device is fused_tiles.h SpareSms: as many as cost no wave). The p2p
// reduction of one round moves (N + 1) x its sub-chunk through HBM while the
// kernel computes the next round: (N + 1) partials' bytes over the kernel's time, about
// 200 GB/s at TP8 M 8192 N 8192 on an H100 (docs/performance.md §2.6); the multicast
// one receives one reduced partial per round. Triton-distributed reduces on 15-16 SMs
// ("16 are enough for H800 ... The reduction kernel bandwidth is not a bottleneck if it
// exceeds 450GB": python/triton_dist/kernels/nvidia/reduce_scatter.py), TransformerEngine's
// userbuffers on 16 (set_sm_margin, num_sm=16), Flux's Ampere RS kernel on 6 blocks.
constexpr int32_t kReductionSms = 16;

struct Part {
  int32_t block;  // destination: the row block of x, the rank that owns the result
  int64_t sub;
};

}  // namespace

Status BuildRsFused(Program* p, Emitter& e) {
  const Problem& q = p->problem;
  const int32_t N = q.nranks, r = q.rank;
  const int64_t P = q.batch, R = q.rows, K = q.k, Nw = q.cols;
  const bool mc = Row(q.transport).mechanism == Mechanism::kMulticast;
  // The kernel's tile order lists runs of consecutive tiles, at most fused::TileOrder::kMaxRuns
  // of them, and every (destination, sub-chunk) of a round may start one: fewer chunks.
  const int64_t C =
      std::max<int64_t>(1, std::min<int64_t>(p->chunks, fused::TileOrder::kMaxRuns / N));
  p->chunks = C;
  auto rows = [&](int64_t s) { return SubRows(R, C, s); };
  auto begin = [&](int64_t s) { return SubBegin(R, C, s); };
  const int32_t release = static_cast<int32_t>(N * C);  // own flags release + j*C + s
  p->num_flags = 2 * release;                           // and i*C + s: from rank i
  auto flag = [&](int32_t from, int64_t s) { return static_cast<int32_t>(from * C + s); };

  // The kernel's partials, [P, N*R, Nw]: block j's rows at j*R (multicast: in the own
  // workspace, which every rank's load-reduce reads; p2p: in scratch, copied from there).
  const BufId parts = mc ? BufId::kWorkspace : BufId::kScratch;
  auto partial = [&](int32_t j, int64_t s) {
    return Ref{parts, r, (j * R + begin(s)) * Nw, N * R * Nw, Nw};
  };
  // p2p: what rank i sent of this rank's block: slot i of [N slots of P, R, Nw].
  auto slot = [&](int32_t owner, int32_t i, int64_t s) {
    return Ref{BufId::kWorkspace, owner, i * P * R * Nw + begin(s) * Nw, R * Nw, Nw};
  };
  auto y = [&](int64_t s) { return Ref{BufId::kY, r, begin(s) * Nw, R * Nw, Nw}; };
  if (mc) {
    p->workspace_elems = P * N * R * Nw;
  } else {
    p->workspace_elems = N * P * R * Nw;
    p->scratch_elems = P * N * R * Nw;
  }

  std::vector<Part> order;
  for (int64_t s = 0; s < C; ++s)
    for (int32_t t = 0; t < N; ++t) order.push_back({mc ? t : Mod(r - 1 - t, N), s});
  const Part last = order.back();
  const bool overlaps = mc || C > 1;  // some reduction can run beside the kernel

  FusedBlocks f;
  f.rows = fused::RowBlocks{N, static_cast<int32_t>(C), R};
  f.key = fused::OrderKey::kFirstDeparture;
  for (const Part& part : order)
    f.sequence.push_back(static_cast<int32_t>(part.block * C + part.sub));
  f.release_flags = release;
  f.spare_sms = overlaps ? kReductionSms : 0;
  f.x_scale_stride = 0;  // fp8: x is this rank's own, one scale for every row (Emitter::Gemm's)
  e.FusedGemm(0, Ref{BufId::kX, r, 0, N * R * K, K}, partial(0, 0), P, std::move(f));

  // Streams 1 (and 2): each released partial of another owner goes on to it. p2p copies
  // alternate between two streams, so that one copy's start overlaps another's bytes (each
  // copy pays a fixed start: docs/performance.md §2.2); the reduction is the last stream.
  const int32_t copiers = mc ? 1 : 2, reducer = 1 + copiers;
  int32_t sent = 0;
  for (const Part& part : order) {
    if (part.block == r) continue;
    const int32_t stream = 1 + sent++ % copiers;
    e.Wait(stream, r, release + flag(part.block, part.sub));
    if (!mc) {
      Op& copy = e.Block(OpKind::kCopy, stream, partial(part.block, part.sub),
                         slot(part.block, r, part.sub), P, rows(part.sub), Nw);
      copy.shard = part.block;
      copy.sub = static_cast<int32_t>(part.sub);
    }
    e.Signal(stream, part.block, flag(r, part.sub));
  }

  // The last stream: the own block, sub-chunk by sub-chunk, once every rank's partial of it is
  // in.
  for (int64_t s = 0; s < C; ++s) {
    e.Wait(reducer, r, release + flag(r, s));
    for (int32_t t = 1; t < N; ++t) {
      const int32_t from = Mod(r + t, N);  // the order their partials of this block come in
      e.Wait(reducer, from, flag(from, s));
    }
    const bool after_kernel = last.block == r && last.sub == s;
    Op* sum = nullptr;
    if (mc) {
      sum = &e.Block(OpKind::kMcReduce, reducer, partial(r, s), y(s), P, rows(s), Nw);
    } else {
      sum = &e.Add(OpKind::kReduce, reducer);
      sum->d = y(s);
      sum->batch = P;
      sum->m = rows(s);
      sum->n = Nw;
      for (int32_t i = 0; i < N; ++i)
        sum->sources.push_back(i == r ? partial(r, s) : slot(r, i, s));
    }
    sum->sms = overlaps && !after_kernel ? kReductionSms : 0;
    sum->shard = r;
    sum->sub = static_cast<int32_t>(s);
  }
  return OkStatus();
}

}  // namespace jo::internal
