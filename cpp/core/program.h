// The program IR: the schedule of one rank of one collective-matmul call.
//
// A Program is plain data — an ordered list of Ops, each tagged with the
// stream it runs on (the per-stream order is the list order filtered by
// stream). It is the single source of truth of the schedule: the host
// executor, the CUDA executor and the simulator all consume the same
// Program, so no executor has a planning path of its own.
//
// Units: offsets, strides and leading dimensions are in ELEMENTS of the
// program's dtype; byte counts are derived (Op bytes = batch*m*n*elem).
// Every matrix operand is a batched-strided, row-major block (Ref): element
// (b, i, j) lives at offset + b*batch_stride + i*ld + j.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jo {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };
int64_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);

enum class Collective : int32_t { kAgMatmul = 0, kMatmulRs = 1, kMatmulAr = 2 };
const char* CollectiveName(Collective op);

// Python reads the names in this order from the extension (_host.TRANSPORTS,
// jaxoverlap/_native/capabilities.py transports()): the transport attribute.
enum class Transport : int32_t { kNccl = 0, kP2p = 1, kMulticast = 2 };
const char* TransportName(Transport transport);

// How GEMM+AR reduces (docs/native.md §3). Two-shot: a reduce-scatter of N
// row blocks, then an all-gather of the reduced blocks (a ring on nccl and
// p2p; a load-reduce and a store through the switch on multicast): each rank
// moves 2(N-1)/N of y, the bandwidth bound. One-shot: every rank's whole
// partial goes to every rank (or, on multicast, is load-reduced by every
// rank), which sums all of them itself: (N-1) partials per rank, but one
// round of transfers, whatever N — the latency bound, for small calls. Rows
// need not split into N blocks.
enum class ArAlgorithm : int32_t { kTwoShot = 0, kOneShot = 1 };
const char* ArAlgorithmName(ArAlgorithm algorithm);

// Buffers a program names. X, W, Y and XGathered are the call's operands and
// results; Scratch is private per-rank memory the executor provides;
// Workspace is the symmetric per-clique buffer (the only memory peers touch),
// addressed with the owning rank in Ref::rank.
enum class BufId : int32_t { kX = 0, kW, kY, kXGathered, kScratch, kWorkspace };
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
  kSignal,      // set flag `id` of `peer` to the call's epoch (after all prior ops of the stream)
  kWait,        // wait until own flag `id` >= the call's epoch; `peer` is the expected writer
  kRecord,      // record event `id` on this stream
  kStreamWait,  // this stream waits for event `id`
};
const char* OpKindName(OpKind kind);

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
};

// The problem one call solves, in canonical form (docs/native.md), with w
// [k, cols]:
//   AG: x [batch, rows, k] local shard -> y [batch, nranks*rows, cols]
//   RS: x [batch, nranks*rows, k]      -> y [batch, rows, cols]
//   AR: x [batch, nranks*rows, k]      -> y [batch, nranks*rows, cols]
//   AR one-shot: x [batch, rows, k]    -> y [batch, rows, cols] (rows: all of them)
struct Problem {
  Collective op = Collective::kAgMatmul;
  Transport transport = Transport::kNccl;
  int32_t nranks = 1;
  int32_t rank = 0;
  int64_t batch = 1;
  int64_t rows = 1;
  int64_t k = 1;
  int64_t cols = 1;
  DType dtype = DType::kF32;
  int64_t chunks = 1;
  bool bidirectional = false;
  bool return_gathered = false;                   // AG only: also write XGathered
  ArAlgorithm algorithm = ArAlgorithm::kTwoShot;  // AR only
  // float32 GEMMs may round their inputs to TF32 (the op's precision is not
  // HIGHEST); the CUDA executor's cuBLASLt compute type, ignored on the host.
  bool tf32 = false;
};

struct Program {
  Problem problem;
  int64_t chunks = 1;       // effective sub-chunk count (clamped to [1, rows])
  int32_t cw_steps = 0;     // ring transfer steps clockwise (to rank+1)
  int32_t ccw_steps = 0;    // ring transfer steps counter-clockwise (to rank-1)
  int32_t num_streams = 1;  // stream 0 is compute (XLA's stream on GPU)
  int32_t num_events = 0;
  int32_t num_flags = 0;        // flags per parity per rank
  int64_t workspace_elems = 0;  // symmetric workspace per parity per rank
  int64_t scratch_elems = 0;    // private scratch per rank
  std::vector<Op> ops;
};

std::string ToString(const Ref& ref);
std::string ToString(const Op& op);
std::string ToString(const Program& program);  // one op per line, grouped by stream
std::string Summary(const Program& program);   // one line: op, transport, shape, chunks

// Bytes one op moves to another rank (Copy to a peer, Send, McStore); 0 otherwise.
int64_t RemoteBytes(const Program& program, const Op& op);

}  // namespace jo
