// The program IR: the schedule of one rank of one collective-matmul call.
//
// A Program is plain data — an ordered list of Ops, each tagged with the
// stream it runs on (the per-stream order is the list order filtered by
// stream). It is the single source of truth of the schedule: the host
// executor, the CUDA executor and the simulator all consume the same
// Program, so no executor has a planning path of its own.
//
// Units: offsets, strides and leading dimensions are in ELEMENTS of the
// dtype of the buffer a Ref names (BufDType: x's for X, XGathered and an
// all-gather's Scratch/Workspace, w's for W, the output type for Y and the
// partial sums of a reduction, float32 for the scale buffers); byte counts
// are derived (Op bytes = batch*m*n*elem of its buffer).
// Every matrix operand is a batched-strided, row-major block (Ref): element
// (b, i, j) lives at offset + b*batch_stride + i*ld + j.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/fused_tiles.h"
#include "core/kinds.h"

namespace jo {

// The kinds (DType, Collective, Transport, ArAlgorithm) are tables of their
// own: core/kinds.h.

// Buffers a program names. X, W, Y and XGathered are the call's operands and
// results; Scratch is private per-rank memory the executor provides;
// Workspace is the symmetric per-clique buffer (the only memory peers touch),
// addressed with the owning rank in Ref::rank.
//
// The float32 dequantization scales of fp8 operands: XScale and WScale are the
// call's scale operands (one element each, this rank's own); an all-gather of
// an fp8 x moves each shard's scale with the shard, into ScratchScales (NCCL
// receives) or WorkspaceScales (symmetric, peers write it: p2p pushes,
// multicast stores), one slot per shard. The executors keep the scale slots
// in the same memory as Scratch / Workspace, after the data (ScalesOffset).
//
// Block scales (Problem::block_scaled, MXFP8): the scale buffers instead hold
// one e8m0 byte per kScaleBlock elements along k, laid out as their operand
// with k divided by kScaleBlock (XScale [batch, rows, k/32], WScale [k/32,
// cols]), and an all-gather moves each sub-chunk's scale rows with its data
// rows, into the gathered layout [batch, nranks*rows, k/32] of ScratchScales
// (NCCL) or WorkspaceScales (p2p, multicast). A GEMM's a_scale mirrors its a
// (BlockScalesOf). The scales are only moved and read by the GEMMs, never
// summed, so BufDType names them by a 1-byte kind that moves bytes
// (kF8E4M3: NCCL moves it as ncclUint8); no kinds row is e8m0.
enum class BufId : int32_t {
  kX = 0,
  kW,
  kY,
  kXGathered,
  kScratch,
  kWorkspace,
  kXScale,
  kWScale,
  kScratchScales,
  kWorkspaceScales,
};
const char* BufName(BufId buf);

struct Ref {
  BufId buf = BufId::kX;
  int32_t rank = -1;  // owner of the buffer (always the program's rank except Workspace)
  int64_t offset = 0;
  int64_t batch_stride = 0;
  int64_t ld = 0;
};

enum class OpKind : int32_t {
  kGemm = 0,    // d[b] = a[b] (m x k) @ b (k x n) (+ c[b] if accumulate); f32 accumulation
  kAdd,         // d += a, block (batch, m rows, n cols)
  kCopy,        // d <- a (p2p push when d.rank != rank)
  kSend,        // send block a to `peer` (matched by tag)
  kRecv,        // receive block from `peer` into d (matched by tag)
  kMcStore,     // multicast store: a -> Workspace of EVERY rank at d.offset
  kMcReduce,    // multicast load-reduce: d <- sum over every rank r of Workspace(r) at a.offset
  kSignal,      // set flag `id` of `peer` to the call's epoch (after all prior ops of the stream);
                // replayable: to 1
  kWait,        // wait until own flag `id` >= the call's epoch (replayable: >= 1); `peer` is the
                // expected writer
  kRecord,      // record event `id` on this stream
  kStreamWait,  // this stream waits for event `id`
  kFusedGemm,   // one persistent GEMM over every row block: d[b] = a[b] @ b, waiting or
                // releasing per row block (Op::fused; docs/gpu-internals.md §5)
  kReduce,      // d <- the sum of Op::sources in list order, accumulated in float32 and
                // rounded once to d's dtype: an N-way reduction in one pass
  kAllReduce,   // d <- the sum over every rank of its d, in place, in rank order (f32, rounded
                // once): matmul_ar's one-launch kernel algorithms (docs/gpu-internals.md §7)
  kResetFlags,  // own flags [id, id + n) <- 0, after all prior ops of the stream: a replayable
                // program's reader consuming what it waited for (Problem::replayable)
};
const char* OpKindName(OpKind kind);

// The most blocks one Reduce sums (the kernel takes their addresses as its
// parameters: cuda/kernels/kernel_body.h ReduceGeometry).
inline constexpr int32_t kMaxReduceSources = 64;
// The largest SM budget a program may name (Op::sms, FusedBlocks::spare_sms):
// a program holds it on every GPU it runs on, so it stays well below any
// fused-GEMM GPU's SM count (132 on an H100 SXM).
inline constexpr int32_t kMaxKernelSms = 32;

// The row blocks of a FusedGemm and what the kernel does at each. Its m rows
// are `rows.shards` shards of `rows.shard_rows`, each split into
// `rows.chunks` sub-chunks as the builders split them: block b = shard *
// chunks + sub (fused_tiles.h RowBlocks). A fused GEMM either waits or
// releases, never both: a kernel that only waits needs nothing after it on
// its own GPU, one that only releases needs nothing at all, so neither can
// deadlock (docs/gpu-internals.md §5).
struct FusedBlocks {
  fused::RowBlocks rows;
  fused::OrderKey key = fused::OrderKey::kLastArrival;
  std::vector<int32_t> sequence;  // every block once: the order the tiles take them in
  // Waits (all-gather + GEMM): block b's rows are in place once own flag
  // wait_flags + b reaches the call's epoch, raised by rank writers[b]; the
  // blocks of ready_shard are in place before the kernel (writers[b] = -1).
  int32_t wait_flags = -1;  // -1: no waits
  int32_t ready_shard = -1;
  std::vector<int32_t> writers;
  // Releases (GEMM + reduce-scatter): own flag release_flags + b is raised
  // once every tile touching block b is stored.
  int32_t release_flags = -1;  // -1: no releases
  // The most SMs the kernel leaves free for the kernels of the rank's other
  // streams (the reduction of released blocks, sized to them: Op::sms); how
  // many on a device is fused_tiles.h SpareSms (as many as cost it no wave).
  // Only a kernel that waits for nothing may leave SMs to others without a
  // deadlock risk, and it needs none for correctness: docs/gpu-internals.md §5.
  int32_t spare_sms = 0;
  // fp8: block b's rows take x's scale slot a_scale.offset + rows.Shard(b) * x_scale_stride:
  // 1 when each shard has its own scale (all-gather: the gathered shards), 0 when every row
  // has the rank's one scale (GEMM + reduce-scatter: x is the rank's own activation).
  int32_t x_scale_stride = 1;

  bool Waits(int32_t block) const { return wait_flags >= 0 && rows.Shard(block) != ready_shard; }
};

struct Op {
  OpKind kind = OpKind::kGemm;
  int32_t stream = 0;
  Ref a, b, c, d;
  bool accumulate = false;                 // Gemm: add c
  int64_t batch = 0, m = 0, n = 0, k = 0;  // Gemm dims; block ops copy batch x m x n
  int32_t peer = -1;                       // Send/Recv/Signal/Wait
  int32_t id = -1;      // flag id (Signal/Wait), event id (Record/StreamWait), tag (Send/Recv)
  int32_t bundle = -1;  // Send/Recv issued together (one ncclGroupStart/End on the GPU)
  int32_t shard = -1;   // which shard (AG) / row block (RS, AR) this op works on (for tests)
  int32_t sub = -1;     // which sub-chunk of that shard
  // Gemm of fp8 operands: d = (a * a_scale) @ (W * b_scale), the scales float32
  // single elements (a's: its shard's, for an all-gather); an operand that is
  // not fp8 has no scale (a_scaled / b_scaled false: 1). FusedGemm of fp8
  // operands: a_scale is slot 0 of one scale slot per shard of its rows (shard
  // s's rows take slot a_scale.offset + s), or, with FusedBlocks::x_scale_stride
  // 0, the one scale of all its rows.
  Ref a_scale, b_scale;
  bool a_scaled = false, b_scaled = false;
  FusedBlocks fused;  // FusedGemm only
  // Reduce: the blocks summed (batch x m x n each, of d's dtype), in the order
  // the sum takes them: the same order gives every executor the same bits.
  std::vector<Ref> sources;
  // A kernel's SM budget (Add, McReduce, Reduce): its grid is sized to the SMs
  // the program's fused GEMM leaves free (FusedBlocks::spare_sms), at most
  // this many; 0: as many as its block needs (the whole device).
  int32_t sms = 0;
};

// The problem one call solves, in canonical form (docs/native.md §1), with w
// [k, cols], by the op's rows rule (core/kinds.h, JO_ROWS_RULES):
//   gather:  x [batch, rows, k] local shard -> y [batch, nranks*rows, cols]
//   scatter: x [batch, nranks*rows, k]      -> y [batch, rows, cols]
//   all:     x [batch, nranks*rows, k]      -> y [batch, nranks*rows, cols]
//            one-shot: x [batch, rows, k]   -> y [batch, rows, cols] (rows: all)
struct Problem {
  Collective op = Collective::kAgMatmul;
  Transport transport = Transport::kNccl;
  int32_t nranks = 1;
  int32_t rank = 0;
  int64_t batch = 1;
  int64_t rows = 1;
  int64_t k = 1;
  int64_t cols = 1;
  // x's, w's and y's dtypes. x and w are both f32, bf16 or f16 (the same), or
  // either is fp8 (then with its scale); y is f32, bf16 or f16: every GEMM
  // accumulates in f32 and rounds once to it, and reductions run in it.
  DType x_dtype = DType::kF32;
  DType w_dtype = DType::kF32;
  DType out_dtype = DType::kF32;
  int64_t chunks = 1;
  bool bidirectional = false;
  bool return_gathered = false;                   // AG only: also write XGathered
  ArAlgorithm algorithm = ArAlgorithm::kTwoShot;  // AR only
  // float32 GEMMs may round their inputs to TF32 (the op's precision is not
  // HIGHEST); the CUDA executor's cuBLASLt compute type, ignored on the host.
  bool tf32 = false;
  // AG and RS over p2p or multicast: the compute stream runs ONE persistent
  // GEMM (FusedGemm) instead of a GEMM per row block (docs/gpu-internals.md §5).
  bool fused = false;
  // x and w are fp8 with e8m0 block scales, one per kScaleBlock elements of k
  // (MXFP8, OCP MX v1.0), instead of one float32 scale each (see BufId).
  bool block_scaled = false;
  // Every call of the program enqueues the same work, so a captured call can be
  // replayed (docs/gpu-internals.md §8): a Signal writes 1 and a Wait waits for
  // >= 1, whatever the call's number; one workspace region (no parity halves);
  // each reader resets the flags it waited on (ResetFlags) and then raises an
  // acknowledgement flag on each of its writers, which each writer waits for
  // (and resets) at the end of a stream that wrote into that reader
  // (build_internal.h Acknowledge). Every program over p2p and multicast but the
  // kernel algorithms (BuildProgram refuses the rest).
  bool replayable = false;
};

// MXFP8's block: one e8m0 scale per 32 consecutive elements along k.
inline constexpr int64_t kScaleBlock = 32;
// Block scales per row of x (and rows of w's scales): k / kScaleBlock.
inline int64_t KBlocks(const Problem& q) { return q.k / kScaleBlock; }

// Whether a call of `q` runs a program built replayable (docs/gpu-internals.md §8). Not a single
// rank's: its program is its own GEMM (build_rs.cc BuildSingleRank, build_ag.cc BuildAgMatmul),
// no flag and no peer, so it has none of the sequencing `replayable` asks for. Whether the call
// replays at all (a one-launch kernel algorithm's too) is the handlers' ffi_call::Replays.
inline bool RunsReplayableProgram(const Problem& q) { return q.replayable && q.nranks > 1; }

struct Program {
  Problem problem;
  int64_t chunks = 1;       // effective sub-chunk count (clamped to [1, rows])
  int32_t cw_steps = 0;     // ring transfer steps clockwise (to rank+1)
  int32_t ccw_steps = 0;    // ring transfer steps counter-clockwise (to rank-1)
  int32_t num_streams = 1;  // stream 0 is compute (XLA's stream on GPU)
  int32_t num_events = 0;
  int32_t num_flags = 0;         // flags per parity per rank (replayable: parity 0's only)
  int64_t workspace_elems = 0;   // symmetric workspace per parity per rank (replayable: 0's)
  int64_t scratch_elems = 0;     // private scratch per rank
  int64_t workspace_scales = 0;  // WorkspaceScales slots per parity per rank
  int64_t scratch_scales = 0;    // ScratchScales slots per rank
  std::vector<Op> ops;
};

// The dtype of the elements of `buf` in a call of `q`: x's for X and
// XGathered, w's for W, the output type for Y, float32 for the scales (block
// scales: a 1-byte kind, see BufId); Scratch
// and Workspace hold what the program moves: x's shards (all-gather) or
// partial sums in the output type (reduce-scatter, all-reduce).
DType BufDType(const Problem& q, BufId buf);
// "bf16" when x, w and y share it, else "x f8e4m3fn w f8e4m3fn y bf16".
std::string DTypesName(const Problem& q);
int64_t ElemBytes(const Problem& q, BufId buf);

// Scratch and Workspace each hold their elements, then (from this byte
// offset: the elements' bytes rounded up to 256) their scale slots. The same
// on every rank of a call: it depends on the problem's sizes only.
int64_t ScalesOffset(const Program& program, BufId scales);
// Bytes of the symmetric workspace per parity per rank, and of the scratch:
// elements, then scale slots.
int64_t WorkspaceBytes(const Program& program);
int64_t ScratchBytes(const Program& program);

// Block scales: where the scales of the rows a Ref `a` of x's data names lie,
// the same rows in the scale buffer of a's buffer (X: XScale; Scratch and
// XGathered: ScratchScales; Workspace: WorkspaceScales), k/32 per row. `a`
// starts at a row (offset, ld and batch stride multiples of k).
Ref BlockScalesOf(const Problem& q, const Ref& a);

// A replayable program's first acknowledgement flag: its last nranks flags are the
// acknowledgements, flag AckFlags(p) + r raised by reader r (build.cc Acknowledge).
inline int32_t AckFlags(const Program& p) { return p.num_flags - p.problem.nranks; }

std::string ToString(const Ref& ref);
// `replayable`: the op of a replayable program, whose Signals write 1 and Waits wait for >= 1
// (no epoch: docs/gpu-internals.md §8).
std::string ToString(const Op& op, bool replayable = false);
std::string ToString(const Program& program);  // one op per line, grouped by stream
std::string Summary(const Program& program);   // one line: op, transport, shape, chunks

// Bytes of the block an op moves, adds or (Gemm) writes: batch x m x n of its
// buffer's dtype.
int64_t BlockBytes(const Program& program, const Op& op);
// Bytes one op moves to another rank (Copy to a peer, Send, McStore); 0 otherwise.
int64_t RemoteBytes(const Program& program, const Op& op);

}  // namespace jo
