#include "cuda/executor.h"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "core/build.h"
#include "core/deadline.h"
#include "core/signature_cache.h"
#include "cuda/base/driver.h"
#include "cuda/fused/fused_gemm.h"
#include "cuda/gemm/gemm.h"
#include "cuda/kernels/allreduce_launch.h"
#include "cuda/kernels/flag_wait_table.h"
#include "cuda/kernels/kernels.h"
#include "cuda/transport/nccl_comms.h"

// NVTX ranges (NVTX3: header-only, in the CUDA toolkit). Without a tool
// attached (Nsight Systems sets NVTX_INJECTION64_PATH) every call is a
// cheap no-op.
#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define JO_HAVE_NVTX 1
#else
#define JO_HAVE_NVTX 0
#endif

namespace jo::cuda {
namespace {

// Whether a tool collects NVTX ranges: Nsight Systems and Nsight Compute
// attach through NVTX_INJECTION64_PATH. Without one, no range names are built.
bool NvtxOn() {
#if JO_HAVE_NVTX
  static const bool on = std::getenv("NVTX_INJECTION64_PATH") != nullptr;
  return on;
#else
  return false;
#endif
}

// One NVTX range on the enqueueing thread while it lives; `name()` is only
// called when a tool collects the ranges.
class NvtxRange {
 public:
  template <typename F>
  explicit NvtxRange(F&& name) : on_(NvtxOn()) {
#if JO_HAVE_NVTX
    if (on_) nvtxRangePushA(name().c_str());
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#if JO_HAVE_NVTX
    if (on_) nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  const bool on_;
};

// A dtype's NCCL type (core/kinds.h, the nccl column: Send/Recv only move bytes).
ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
#define JO_NCCL_TYPE(e, id, name, short_name, bytes, fp8, out, fused, elem, ffi, nccl, cublaslt) \
  case DType::e:                                                                                 \
    return nccl;
    JO_DTYPES(JO_NCCL_TYPE)
#undef JO_NCCL_TYPE
  }
  return ncclFloat32;
}

// One op, checked and resolved: what Execute hands to the API.
struct Step {
  cudaStream_t stream = nullptr;
  std::byte* src = nullptr;        // Copy, Send; Gemm: C when it must be copied into D first
  std::byte* dst = nullptr;        // Copy, Recv
  BlockArgs block;                 // Add, McStore, McReduce
  ReduceArgs reduce;               // Reduce
  GemmArgs gemm;                   // Gemm
  std::vector<GemmArgs> batches;   // Gemm, block-scaled over batches not back to back: one each
  void* workspace = nullptr;       // Gemm: its stream's cuBLASLt workspace (the rank's pool)
  bool copy_c = false;             // Gemm: bring C into D first (cuBLASLt's out-of-place rule)
  size_t fused = 0;                // FusedGemm: its arguments, the Enqueuer's fused_[fused]
  size_t allreduce = 0;            // AllReduce: its launch, the Enqueuer's allreduce_[allreduce]
  CUdeviceptr flag = 0;            // Signal, Wait
  const void* bounded = nullptr;   // Wait: the bounded flag-wait kernel (flag_wait_body.h)
  kernel::fw::Args wait;           // ... its arguments
  bool flush = false;              // ... then a cuStreamWaitValue32 of the flag, met: its FLUSH
  std::vector<CUdeviceptr> flags;  // ResetFlags
  cudaEvent_t event = nullptr;     // Record, StreamWait
  ncclComm_t comm = nullptr;       // Send, Recv (set by Execute, from the caller's lease)
};

}  // namespace

class Enqueuer {
 public:
  explicit Enqueuer(const RunArgs& a) : a_(a), p_(*a.program), ctx_(&a.ctx) {}

  Status Prepare() {
    JO_CHECK(LoadDriver(&drv_));
    JO_CHECK(WaitValueFlags(a_.device, &wait_flags_));
    JO_CUDA_CHECK(ctx_, cudaSetDevice(a_.device));
    JO_ASSERT(a_.order != nullptr && a_.resources != nullptr && a_.pool != nullptr &&
              a_.gen != nullptr);
    JO_ASSERT(static_cast<int32_t>(a_.resources->streams.size()) >= p_.num_streams - 1);
    JO_ASSERT(a_.resources->events.size() >= static_cast<size_t>(p_.num_events + p_.num_streams));
    // The issue order names every op exactly once.
    std::vector<int> issued(p_.ops.size(), 0);
    for (const IssueUnit& unit : *a_.order)
      for (int32_t i = unit.begin; i < unit.end; ++i) {
        JO_ASSERT(i >= 0 && static_cast<size_t>(i) < p_.ops.size());
        ++issued[static_cast<size_t>(i)];
      }
    for (size_t i = 0; i < issued.size(); ++i)
      if (issued[i] != 1)
        return Internal(a_.ctx.Describe() + ": the issue order lists op " + std::to_string(i) +
                        " " + std::to_string(issued[i]) +
                        " times: " + ToString(p_.ops[i], p_.problem.replayable));
    // A replayable program enqueues the same work every call: no epoch (half 0 of its own
    // buffers, values 1: CudaSite::EnqueueReplaying).
    if (RunsReplayableProgram(p_.problem) && (a_.epoch != 0 || a_.area != nullptr))
      return Internal(a_.ctx.Describe() + ": a replayable program runs at epoch 0");
    for (const Op& op : p_.ops) has_fused_ = has_fused_ || op.kind == OpKind::kFusedGemm;
    if (has_fused_) JO_CHECK(DeviceFusedKernel(&fused_kernel_));
    // The SMs a fused GEMM leaves to the reduction beside it: as many as cost its persistent
    // grid no wave (fused_tiles.h SpareSms) on the SMs it may use (KernelSms), at most
    // FusedBlocks::spare_sms and a quarter of those (only the fake's small devices have fewer
    // than 4 x 8), at least one; the kernels sized to them (Op::sms) take the same number. The
    // grid is of the CTA tiles of the kernel this device and these operands run (CtaTileOf:
    // FP8's are half as wide). jaxoverlap/sim/fused.py spare_sms mirrors it.
    for (const Op& op : p_.ops)
      if (op.kind == OpKind::kFusedGemm && op.fused.spare_sms > 0) {
        int32_t sms = 0;
        JO_CHECK(KernelSms(&sms));
        const fused::CtaTile tile =
            fused::CtaTileOf(MmaPairOf(fused_kernel_), IsFp8(p_.problem.x_dtype));
        const int64_t m_tiles = (op.m + tile.rows - 1) / tile.rows;
        const int64_t n_tiles = (op.n + tile.cols - 1) / tile.cols;
        spare_sms_ = std::max(1, fused::SpareSms(m_tiles, n_tiles, op.batch, sms,
                                                 std::min(op.fused.spare_sms, sms / 4)));
      }
    steps_.resize(p_.ops.size());
    for (size_t i = 0; i < p_.ops.size(); ++i) {
      Status status = PrepareOp(p_.ops[i], &steps_[i]);
      if (status.ok() && p_.ops[i].kind == OpKind::kWait && BoundedWait(i))
        status = PrepareBoundedWait(p_.ops[i], &steps_[i]);
      if (!status.ok())
        return Status(status.code(), status.message() + "; while preparing " +
                                         ToString(p_.ops[i], p_.problem.replayable) +
                                         " on stream " + std::to_string(p_.ops[i].stream));
    }
    return OkStatus();
  }

  bool WarmedUp() const { return warmed_; }

  void Abandon() {
    if (warmed_ && cudaSetDevice(a_.device) == cudaSuccess)
      (void)JoinWarmUps(a_.device, a_.stream, a_.ctx);
  }

  Status Execute(const std::vector<ncclComm_t>& comms, bool* enqueued) {
    // "jaxoverlap ag_matmul nccl rank 2 epoch 7": the call, around its enqueue.
    const NvtxRange call_range([&] {
      return "jaxoverlap " + Label() + " rank " + std::to_string(p_.problem.rank) + " epoch " +
             std::to_string(a_.epoch);
    });
    // `*enqueued` is only ever set here, never reset: the caller may have enqueued before (its
    // `started` event), and that work must be watched whatever happens below.
    for (size_t i = 0; i < steps_.size(); ++i) {
      const Op& op = p_.ops[i];
      if (!IsNccl(op.kind)) continue;
      const size_t s = static_cast<size_t>(op.stream);
      if (s >= comms.size() || comms[s] == nullptr)
        return Internal(a_.ctx.Describe() + ": no NCCL communicator for stream " +
                        std::to_string(op.stream));
      steps_[i].comm = comms[s];
    }
    JO_CUDA_CHECK(ctx_, cudaSetDevice(a_.device));
    *enqueued = true;  // from here on work may reach the GPU: the caller must watch it
    bool forked = false;
    Status status = warmed_ ? JoinWarmUps(a_.device, a_.stream, a_.ctx) : OkStatus();
    if (status.ok()) status = Fork(&forked);
    for (size_t u = 0; u < a_.order->size() && status.ok(); ++u) {
      const IssueUnit& unit = (*a_.order)[u];
      const Op& op = p_.ops[static_cast<size_t>(unit.begin)];
      const NvtxRange range([&] { return UnitName(op, static_cast<size_t>(unit.begin)); });
      if (a_.gate != nullptr) a_.gate->Before(u);
      status =
          IsNccl(op.kind) ? NcclGroup(unit) : Exec(op, steps_[static_cast<size_t>(unit.begin)]);
      if (a_.gate != nullptr) a_.gate->After(u);
      if (!status.ok())
        status = Status(status.code(), status.message() + "; while enqueueing " +
                                           ToString(op, p_.problem.replayable) + " on stream " +
                                           std::to_string(op.stream));
    }
    // Once forked, always joined: XLA's stream must not run ahead of work
    // that still reads x or writes y, even when enqueueing failed half-way.
    if (forked) {
      const Status joined = Join();
      if (status.ok()) status = joined;
    }
    return status;
  }

 private:
  // "ag_matmul nccl": the op and the transport, as the ranges name them.
  std::string Label() const {
    return std::string(CollectiveName(p_.problem.op)) + " " + TransportName(p_.problem.transport);
  }

  // "ag_matmul nccl Gemm shard 2 sub 0 stream 0 #5": one unit of the schedule
  // (#: its position in the program; an NCCL group is named by its first op).
  std::string UnitName(const Op& op, size_t index) const {
    std::string name = Label() + " " + OpKindName(op.kind);
    if (op.shard >= 0) name += " shard " + std::to_string(op.shard);
    if (op.sub >= 0) name += " sub " + std::to_string(op.sub);
    if (op.peer >= 0) name += " peer " + std::to_string(op.peer);
    return name + " stream " + std::to_string(op.stream) + " #" + std::to_string(index);
  }

  static bool IsNccl(OpKind kind) { return kind == OpKind::kSend || kind == OpKind::kRecv; }

  cudaStream_t Stream(int32_t s) const {
    return s == 0 ? a_.stream : a_.resources->streams[static_cast<size_t>(s - 1)];
  }
  cudaEvent_t ForkEvent() const { return a_.resources->events[static_cast<size_t>(p_.num_events)]; }
  cudaEvent_t JoinEvent(int32_t s) const {
    return a_.resources->events[static_cast<size_t>(p_.num_events + s)];
  }

  Status Fork(bool* forked) {
    if (p_.num_streams <= 1) return OkStatus();
    JO_CUDA_CHECK(ctx_, cudaEventRecord(ForkEvent(), a_.stream));
    *forked = true;  // the comm streams may now hold our work: join whatever happens
    for (int32_t s = 1; s < p_.num_streams; ++s)
      JO_CUDA_CHECK(ctx_, cudaStreamWaitEvent(Stream(s), ForkEvent(), 0));
    return OkStatus();
  }

  // Best effort on every stream (a failed record must not skip the others).
  Status Join() {
    Status first = OkStatus();
    for (int32_t s = 1; s < p_.num_streams; ++s) {
      cudaError_t code = cudaEventRecord(JoinEvent(s), Stream(s));
      if (code == cudaSuccess) code = cudaStreamWaitEvent(a_.stream, JoinEvent(s), 0);
      if (code != cudaSuccess && first.ok())
        first = CudaFailure(code, "join of the comm streams into XLA's stream", ctx_);
    }
    return first;
  }

  // A replayable program's wait for a flag a PEER raises: the bounded flag-wait kernel
  // (docs/gpu-internals.md §8, "A dead peer"), so a peer that never comes is reported and
  // breaks the clique instead of hanging the stream. The kernel needs an SM: with a fused GEMM
  // that waits, such a wait ends its stream (check_program.cc, CheckReplayable rule 4: nothing
  // of the call but the join depends on it), so it may wait for the SMs the GEMM holds, never
  // the other way round; a releasing fused GEMM waits for nothing and always ends; cuBLAS
  // GEMMs and the block kernels end. A wait for the rank's OWN flag (the comm streams of the
  // fused GEMM + reduce-scatter waiting for its releases) stays cuStreamWaitValue32: the own
  // kernel raises it or ends on its own bound.
  bool BoundedWait(size_t i) const {
    return RunsReplayableProgram(p_.problem) && p_.ops[i].peer != p_.problem.rank;
  }

  Status PrepareBoundedWait(const Op& op, Step* step) {
    if (a_.wait_fault == nullptr)
      return Internal(a_.ctx.Describe() +
                      ": a replayable program's bounded wait has no fault record");
    const void* k = kernel::FlagWaitKernel();
    JO_ASSERT(k != nullptr);
    JO_CHECK(PrepareKernel(k, nullptr, a_.ctx, "the bounded flag wait"));
    step->bounded = k;  // looked up here: nothing but enqueueing on the enqueue path
    kernel::fw::Args& w = step->wait;
    w.flag = reinterpret_cast<const uint32_t*>(step->flag);
    w.value = FlagValue();
    w.flag_id = op.id;
    w.writer = op.peer;
    w.timeout_ns = TimeoutNs(a_.timeout);  // saturated (inf: 2^62 ms)
    w.fault = a_.wait_fault;
    // A data flag: its stream then reads what the peer pushed before raising it, which the
    // kernel's poll does not order by any documented rule ("the device is permitted to reorder
    // remote writes internally": CUDA driver API, CU_STREAM_WAIT_VALUE_FLUSH), so the kernel is
    // followed by the stream wait the plain program has, with FLUSH where the device has it —
    // met by then, it only flushes. An acknowledgement (the last nranks flags) orders no read.
    step->flush = op.id < AckFlags(p_);
    return OkStatus();
  }

  // The value a Signal writes and a wait waits for: the call's epoch, or 1 for a replayable
  // program (run at epoch 0: half 0's flags and workspace; docs/gpu-internals.md §8).
  cuuint32_t FlagValue() const {
    return p_.problem.replayable ? 1u : static_cast<cuuint32_t>(a_.epoch);
  }

  // Bytes of one element of `buf` (core/program.h, BufDType).
  int64_t Es(BufId buf) const { return ElemBytes(p_.problem, buf); }

  std::byte* Resolve(const Ref& ref) const {
    return jo::Resolve(
        p_, a_.io, static_cast<std::byte*>(a_.pool->scratch),
        [&](int32_t rank) { return a_.gen->Workspace(rank, a_.epoch, p_.problem.rank); }, ref);
  }

  // Where a multicast op's workspace block (or scale slot) is, through the multicast address.
  std::byte* Multicast(const Ref& ref) const {
    std::byte* mc = a_.gen->MulticastAddress(a_.epoch);
    if (mc == nullptr) return nullptr;
    if (ref.buf == BufId::kWorkspaceScales) mc += ScalesOffset(p_, ref.buf);
    return mc + ref.offset * Es(ref.buf);
  }

  Status PrepareOp(const Op& op, Step* step) {
    JO_ASSERT(op.stream >= 0 && op.stream < p_.num_streams);
    step->stream = Stream(op.stream);
    switch (op.kind) {
      case OpKind::kGemm:
        return PrepareGemm(op, step);
      case OpKind::kAdd:
        step->block = Block(op, Resolve(op.a), op.a, Resolve(op.d), op.d);
        JO_ASSERT(step->block.src != nullptr && step->block.dst != nullptr);
        return PrepareBlockKernel(BlockKernel::kAdd, step->block, a_.ctx);
      case OpKind::kCopy: {
        step->src = Resolve(op.a);
        step->dst = Resolve(op.d);
        JO_ASSERT(step->src != nullptr && step->dst != nullptr);
        // A peer copy beside a fused GEMM must be 1-D (CopyBlock): its rows contiguous.
        const auto peer = [&](const Ref& r) {
          return r.buf == BufId::kWorkspace && r.rank != p_.problem.rank;
        };
        if (has_fused_ && (peer(op.a) || peer(op.d)) && (op.a.ld != op.n || op.d.ld != op.n))
          return Internal(a_.ctx.Describe() +
                          ": a peer copy with strided rows (a 2-D copy) in a program with a "
                          "fused GEMM, which holds every SM: CUDA documents no copy engine for "
                          "2-D copies");
        return OkStatus();
      }
      case OpKind::kMcStore: {
        std::byte* mc = Multicast(op.d);
        JO_ASSERT(mc != nullptr);
        step->block = Block(op, Resolve(op.a), op.a, mc, op.d);
        JO_ASSERT(step->block.src != nullptr);
        return PrepareBlockKernel(BlockKernel::kMcStore, step->block, a_.ctx);
      }
      case OpKind::kMcReduce: {
        std::byte* mc = Multicast(op.a);
        JO_ASSERT(mc != nullptr);
        step->block = Block(op, mc, op.a, Resolve(op.d), op.d);
        JO_ASSERT(step->block.dst != nullptr);
        return PrepareBlockKernel(BlockKernel::kMcReduce, step->block, a_.ctx);
      }
      case OpKind::kSignal:
        JO_ASSERT(op.peer >= 0 && op.peer < p_.problem.nranks && op.id >= 0 &&
                  op.id < a_.gen->num_flags);
        step->flag = a_.gen->Flag(op.peer, a_.epoch, op.id, p_.problem.rank);
        return OkStatus();
      case OpKind::kWait:
        JO_ASSERT(op.id >= 0 && op.id < a_.gen->num_flags);
        step->flag = a_.gen->Flag(p_.problem.rank, a_.epoch, op.id, p_.problem.rank);
        return OkStatus();
      case OpKind::kRecord:
      case OpKind::kStreamWait:
        JO_ASSERT(op.id >= 0 && op.id < p_.num_events);
        step->event = a_.resources->events[static_cast<size_t>(op.id)];
        return OkStatus();
      case OpKind::kFusedGemm:
        return PrepareFused(op, step);
      case OpKind::kReduce: {
        ReduceArgs& r = step->reduce;
        r.dtype = BufDType(p_.problem, op.d.buf);  // every source's too (CheckProgram)
        r.dst = Resolve(op.d);
        JO_ASSERT(r.dst != nullptr);
        r.batch = op.batch;
        r.m = op.m;
        r.n = op.n;
        r.dst_batch_stride = op.d.batch_stride;
        r.dst_ld = op.d.ld;
        for (const Ref& src : op.sources) {
          r.sources.push_back({Resolve(src), src.batch_stride, src.ld});
          JO_ASSERT(r.sources.back().ptr != nullptr);
        }
        r.sms = Budget(op);
        return PrepareReduce(r, a_.ctx);
      }
      case OpKind::kAllReduce:
        return PrepareAllReduceOp(op, step);
      case OpKind::kResetFlags:
        // Only a replayable program resets flags (CheckProgram); its flags are half 0's.
        JO_ASSERT(p_.problem.replayable && a_.epoch == 0 && op.id >= 0 &&
                  op.id + op.n <= a_.gen->num_flags);
        for (int32_t f = op.id; f < op.id + op.n; ++f)
          step->flags.push_back(a_.gen->Flag(p_.problem.rank, 0, f, p_.problem.rank));
        return OkStatus();
      case OpKind::kSend:
      case OpKind::kRecv: {
        const bool send = op.kind == OpKind::kSend;
        const Ref& ref = send ? op.a : op.d;
        (send ? step->src : step->dst) = Resolve(ref);
        JO_ASSERT((send ? step->src : step->dst) != nullptr && op.peer >= 0 &&
                  op.peer < p_.problem.nranks);
        if (ref.ld != op.n)
          return Internal(a_.ctx.Describe() + ": NCCL block rows must be dense (ld " +
                          std::to_string(ref.ld) + " != n " + std::to_string(op.n) + ")");
        if (op.stream < 1 || op.stream > NcclComms::kChannels)
          return Internal(a_.ctx.Describe() + ": NCCL ops on stream " + std::to_string(op.stream) +
                          ", which has no communicator");
        return OkStatus();  // its communicator: at Execute, under the caller's lease
      }
    }
    return Internal("unknown op kind");
  }

  Status PrepareGemm(const Op& op, Step* step) {
    const Problem& q = p_.problem;
    GemmArgs& g = step->gemm;
    g.a_type = q.x_dtype;
    g.w_type = q.w_dtype;
    g.out_type = q.out_dtype;
    g.tf32 = q.tf32;
    g.batch = op.batch;
    g.m = op.m;
    g.n = op.n;
    g.k = op.k;
    g.a = Resolve(op.a);
    g.a_bs = op.a.batch_stride;
    g.a_ld = op.a.ld;
    g.w = Resolve(op.b);  // W: one matrix for every batch (batch stride 0 in cuBLASLt)
    g.w_ld = op.b.ld;
    if (IsFp8(q.w_dtype)) {
      // An fp8 w arrives K-major, [cols, k] row-major (gemm.h: cuBLASLt's FP8 "TN" rule).
      JO_ASSERT(op.b.buf == BufId::kW && op.b.offset == 0 && op.b.ld == q.cols);
      g.w_ld = q.k;
    }
    if (op.a_scaled) g.a_scale = Resolve(op.a_scale);
    if (op.b_scaled) g.w_scale = Resolve(op.b_scale);
    JO_ASSERT((g.a_scale != nullptr) == op.a_scaled && (g.w_scale != nullptr) == op.b_scaled);
    // Block scales (MXFP8): e8m0 bytes in cuBLAS's tiled layout (gemm.h), the rows' own.
    g.block_scaled = q.block_scaled;
    g.d = Resolve(op.d);
    g.d_bs = op.d.batch_stride;
    g.d_ld = op.d.ld;
    JO_ASSERT(g.a != nullptr && g.w != nullptr && g.d != nullptr);
    if (op.accumulate) {
      std::byte* c = Resolve(op.c);
      JO_ASSERT(c != nullptr);
      if (c != g.d && (op.c.ld != op.d.ld || op.c.batch_stride != op.d.batch_stride)) {
        // cuBLASLt's out-of-place form needs equal layouts: bring C into D first.
        step->copy_c = true;
        step->src = c;
        c = static_cast<std::byte*>(g.d);
      }
      g.c = c;
      g.c_bs = c == g.d ? op.d.batch_stride : op.c.batch_stride;
      g.c_ld = c == g.d ? op.d.ld : op.c.ld;
    }
    // Batches laid out back to back (every row the same ld apart) are one
    // taller GEMM: fewer, larger cuBLASLt calls, and no stride-0 W.
    if (g.batch > 1 && g.a_bs == g.m * g.a_ld && g.d_bs == g.m * g.d_ld &&
        (g.c == nullptr || g.c_bs == g.m * g.c_ld)) {
      g.m *= g.batch;
      g.batch = 1;
      g.a_bs = g.d_bs = g.c_bs = 0;
    }
    JO_ASSERT(static_cast<size_t>(op.stream) < a_.pool->workspaces.size());
    GemmBuffers buffers;
    buffers.workspace = a_.pool->workspaces[static_cast<size_t>(op.stream)];
    buffers.warm_workspace = a_.pool->warm_workspace;
    buffers.warm = a_.pool->warm;
    buffers.warm_bytes = a_.pool->warm_bytes;
    step->workspace = buffers.workspace;
    if (g.block_scaled && g.batch > 1) {
      // cuBLASLt's block scales have no batch stride (gemm.h): one call per batch, each with
      // its batch's rows and the scale rows beside them.
      const int64_t es = DTypeSize(g.a_type), os = DTypeSize(g.out_type);
      for (int64_t b = 0; b < g.batch; ++b) {
        GemmArgs one = g;
        one.batch = 1;
        one.a = static_cast<const std::byte*>(g.a) + b * g.a_bs * es;
        one.a_scale = static_cast<const std::byte*>(g.a_scale) + b * op.a_scale.batch_stride;
        one.d = static_cast<std::byte*>(g.d) + b * g.d_bs * os;
        if (g.c != nullptr) one.c = static_cast<const std::byte*>(g.c) + b * g.c_bs * os;
        one.a_bs = one.d_bs = one.c_bs = 0;
        JO_CHECK(PrepareLtMatmul(a_.device, one, buffers, a_.ctx, &warmed_));
        step->batches.push_back(one);
      }
      return OkStatus();
    }
    return PrepareLtMatmul(a_.device, g, buffers, a_.ctx, &warmed_);
  }

  // The fused GEMM (fused_gemm.h): checked, its tile order made and its
  // kernel loaded here, so a GPU that cannot run it (FusedKernelFor: sm_90a
  // code for compute capability 9.0, 16-bit or per-tensor FP8; sm_100a for
  // 10.0, 16-bit only; anything else none) refuses the call before anything
  // is enqueued. Its waits
  // give up only well after the watchdog reported the call (twice the call's
  // timeout), so that a missing peer is reported by the watchdog, which names
  // it, and the kernel still always ends.
  Status PrepareFused(const Op& op, Step* step) {
    step->fused = fused_.size();
    FusedGemmArgs& f = fused_.emplace_back();
    const FusedBlocks& blocks = op.fused;
    const Problem& q = p_.problem;
    f.types = {q.x_dtype, q.w_dtype, q.out_dtype};  // one BuildProgram's FusedServes accepts
    f.batch = op.batch;
    f.m = op.m;
    f.n = op.n;
    f.k = op.k;
    f.a = Resolve(op.a);
    f.lda = op.a.ld;
    f.a_batch_stride = op.a.batch_stride;
    f.b = Resolve(op.b);
    f.ldb = op.b.ld;
    if (IsFp8(q.w_dtype)) {
      // An fp8 w arrives K-major, [cols, k] row-major: B^T, as the FP8 kernel takes it.
      JO_ASSERT(op.b.buf == BufId::kW && op.b.offset == 0 && op.b.ld == q.cols);
      f.ldb = q.k;
    }
    if (op.a_scaled) {  // the shards' scale slots (shard s's at slot s), or one for all rows
      f.scales.x = reinterpret_cast<const float*>(Resolve(op.a_scale));
      f.scales.x_stride = blocks.x_scale_stride;
    }
    if (op.b_scaled) f.scales.w = reinterpret_cast<const float*>(Resolve(op.b_scale));
    JO_ASSERT(op.a_scaled == op.b_scaled && op.a_scaled == IsFp8(q.x_dtype));
    f.d = Resolve(op.d);
    f.ldd = op.d.ld;
    f.d_batch_stride = op.d.batch_stride;
    f.blocks = blocks.rows;
    f.sequence = blocks.sequence.data();
    f.key = blocks.key;
    f.epoch = FlagValue();
    const int32_t rank = p_.problem.rank;
    JO_ASSERT(a_.pool->fused_state != nullptr &&
              a_.pool->fused_bytes >= FusedStateBytes(blocks.rows.count()));
    auto* state = static_cast<std::byte*>(a_.pool->fused_state);
    if (blocks.wait_flags >= 0) {
      JO_ASSERT(blocks.wait_flags + blocks.rows.count() <= a_.gen->num_flags);
      f.wait_flags =
          reinterpret_cast<const uint32_t*>(a_.gen->Flag(rank, a_.epoch, blocks.wait_flags, rank));
      f.ready_shard = blocks.ready_shard;
      f.timeout_ns = 2 * TimeoutNs(a_.timeout) + 1000000000;  // saturated: cannot overflow
      f.fault = reinterpret_cast<FusedGemmFault*>(state);
      // A replayable call's: a give-up traps (no host gate stops its replays' later work) and
      // is recorded where the trap leaves it readable, watched standing (docs/gpu-internals.md
      // §8, "A dead peer").
      if (RunsReplayableProgram(p_.problem)) {
        if (a_.fused_fault == nullptr)
          return Internal(a_.ctx.Describe() +
                          ": a replayable program's fused GEMM has no fault record");
        f.fault = a_.fused_fault;
        f.trap = true;
      }
    }
    if (blocks.release_flags >= 0) {
      JO_ASSERT(blocks.release_flags + blocks.rows.count() <= a_.gen->num_flags);
      f.release_flags =
          reinterpret_cast<uint32_t*>(a_.gen->Flag(rank, a_.epoch, blocks.release_flags, rank));
      f.counters = reinterpret_cast<uint32_t*>(state + sizeof(FusedGemmFault));
    }
    // A release-only kernel leaves the reduction beside it the SMs the program reserved for
    // it (FusedBlocks::spare_sms, as Prepare bounded them; its kernels are sized to them).
    JO_CHECK(KernelSms(&f.sm_count));
    if (blocks.spare_sms > 0) f.sm_count -= spare_sms_;
    f.kernel = fused_kernel_;      // the kernel (and its tile order's unit)
    JO_CHECK(CheckFusedGemm(&f));  // and its tile order made, once
    return PrepareFusedGemm(f.types, f.kernel, a_.ctx);
  }

  // The one-launch all-reduce: every address from the clique's fixed kernel area, half 0 (the
  // kernel picks the half of its sequence number), so what is enqueued is the same every call.
  Status PrepareAllReduceOp(const Op& op, Step* step) {
    const Problem& q = p_.problem;
    const KernelArea* area = a_.area;
    JO_ASSERT(area != nullptr && area->gen != nullptr &&
              area->faults.size() == static_cast<size_t>(q.nranks) &&
              area->faults[static_cast<size_t>(q.rank)] != nullptr);
    AllReduceCall call;
    call.dtype = BufDType(q, op.d.buf);
    call.multicast = Row(q.transport).mechanism == Mechanism::kMulticast;
    call.two_shot = q.algorithm == ArAlgorithm::kTwoShotKernel;
    call.nranks = q.nranks;
    call.rank = q.rank;
    call.y = Resolve(op.d);
    call.bytes = BlockBytes(p_, op);
    for (int32_t j = 0; j < q.nranks; ++j) {
      call.area.push_back(call.multicast && j != q.rank ? nullptr
                                                        : area->gen->Workspace(j, 0, q.rank));
      call.state.push_back(reinterpret_cast<uint32_t*>(area->gen->Flag(j, 0, 0, q.rank)));
    }
    call.mc = area->gen->MulticastAddress(0);
    call.fault = static_cast<kernel::ar::Fault*>(area->faults[static_cast<size_t>(q.rank)]->ptr);
    call.signature = a_.signature;
    call.timeout_ns = TimeoutNs(a_.timeout);  // saturated (inf: 2^62 ms)
    step->allreduce = allreduce_.size();
    return PrepareAllReduce(call, a_.device, a_.ctx, &allreduce_.emplace_back());
  }

  Status Exec(const Op& op, const Step& step) {
    switch (op.kind) {
      case OpKind::kGemm:
        if (step.copy_c) {
          Op copy = op;
          copy.k = 0;
          JO_CHECK(CopyBlock(copy, step.src, op.c, static_cast<std::byte*>(step.gemm.d), op.d,
                             step.stream));
        }
        for (const GemmArgs& one : step.batches)
          JO_CHECK(LtMatmul(a_.device, one, step.stream, step.workspace, a_.ctx));
        if (!step.batches.empty()) return OkStatus();
        return LtMatmul(a_.device, step.gemm, step.stream, step.workspace, a_.ctx);
      case OpKind::kAdd:
        return LaunchAddBlock(step.block, step.stream, a_.ctx);
      case OpKind::kCopy:
        return CopyBlock(op, step.src, op.a, step.dst, op.d, step.stream);
      case OpKind::kMcStore:
        return LaunchMcStore(step.block, step.stream, a_.ctx);
      case OpKind::kMcReduce:
        return LaunchMcReduce(step.block, step.stream, a_.ctx);
      case OpKind::kReduce:
        return LaunchReduce(step.reduce, step.stream, a_.ctx);
      case OpKind::kSignal:
        // Default flags: the write is fenced after every prior write of the stream.
        JO_CU_CHECK(ctx_,
                    drv_->cuStreamWriteValue32(reinterpret_cast<CUstream>(step.stream), step.flag,
                                               FlagValue(), CU_STREAM_WRITE_VALUE_DEFAULT));
        return OkStatus();
      case OpKind::kWait:
        if (step.bounded != nullptr) {  // flag_wait_body.h: one thread, ld.acquire.sys, bounded
          kernel::fw::Args args = step.wait;
          void* params[] = {&args};
          JO_CUDA_CHECK(ctx_,
                        cudaLaunchKernel(step.bounded, dim3(1), dim3(1), params, 0, step.stream));
          if (step.flush)
            JO_CU_CHECK(ctx_, drv_->cuStreamWaitValue32(reinterpret_cast<CUstream>(step.stream),
                                                        step.flag, FlagValue(), wait_flags_));
          return OkStatus();
        }
        // GEQ is a cyclic comparison, (int32_t)(*addr - epoch) >= 0: epochs may wrap.
        // FLUSH where the device has it: the data before the flag are remote writes too.
        JO_CU_CHECK(ctx_, drv_->cuStreamWaitValue32(reinterpret_cast<CUstream>(step.stream),
                                                    step.flag, FlagValue(), wait_flags_));
        return OkStatus();
      case OpKind::kRecord:
        JO_CUDA_CHECK(ctx_, cudaEventRecord(step.event, step.stream));
        return OkStatus();
      case OpKind::kStreamWait:
        // The issue order puts every StreamWait after its Record (cudaStreamWaitEvent
        // waits for the record enqueued BEFORE it).
        JO_CUDA_CHECK(ctx_, cudaStreamWaitEvent(step.stream, step.event, 0));
        return OkStatus();
      case OpKind::kFusedGemm: {
        // The issue order puts it after everything its flags depend on, on every rank.
        const FusedGemmArgs& fused = fused_[step.fused];
        // A fresh fault record for this call; a trapping launch's stays (its first give-up ends
        // the context's work).
        if (fused.fault != nullptr && !fused.trap)
          JO_CUDA_CHECK(ctx_, cudaMemsetAsync(fused.fault, 0, sizeof(FusedGemmFault), step.stream));
        return LaunchFusedGemm(fused, step.stream, a_.ctx);
      }
      case OpKind::kAllReduce:
        return LaunchAllReduce(allreduce_[step.allreduce], step.stream, a_.ctx);
      case OpKind::kResetFlags:
        // The reader lowers what it waited on, after its waits (stream order and the program's
        // StreamWaits, docs/gpu-internals.md §8); the next write of the stream (its
        // acknowledgement) is fenced after these by cuStreamWriteValue32's default barrier.
        for (const CUdeviceptr flag : step.flags)
          JO_CU_CHECK(ctx_, drv_->cuStreamWriteValue32(reinterpret_cast<CUstream>(step.stream),
                                                       flag, 0, CU_STREAM_WRITE_VALUE_DEFAULT));
        return OkStatus();
      case OpKind::kSend:
      case OpKind::kRecv:
        break;  // issued as groups
    }
    return Internal("unknown op kind");
  }

  // The SMs a kernel's grid is sized to: those the program's fused GEMM leaves it (0: the
  // whole device).
  // The SMs a fused GEMM of this rank may use: the device's, or in the loopback (ranks
  // sharing one GPU) an even share of them (clusters of two CTAs).
  Status KernelSms(int32_t* sms) {
    int device_sms = 0;
    JO_CUDA_CHECK(ctx_,
                  cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, a_.device));
    *sms = device_sms;
    if (a_.device_share > 1) *sms = std::max(2, device_sms / a_.device_share / 2 * 2);
    return OkStatus();
  }

  // The fused GEMM kernel of the device: its compute capability's (FusedKernelFor).
  Status DeviceFusedKernel(FusedKernel* kernel) {
    int major = 0, minor = 0;
    JO_CUDA_CHECK(ctx_,
                  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, a_.device));
    JO_CUDA_CHECK(ctx_,
                  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, a_.device));
    *kernel = FusedKernelFor(major, minor);
    return OkStatus();
  }

  int32_t Budget(const Op& op) const { return op.sms > 0 ? std::min(op.sms, spare_sms_) : 0; }

  BlockArgs Block(const Op& op, const void* src, const Ref& s, void* dst, const Ref& d) const {
    BlockArgs b;
    b.dtype = BufDType(p_.problem, s.buf);  // d's too (CheckProgram)
    b.src = src;
    b.dst = dst;
    b.batch = op.batch;
    b.m = op.m;
    b.n = op.n;
    b.src_batch_stride = s.batch_stride;
    b.src_ld = s.ld;
    b.dst_batch_stride = d.batch_stride;
    b.dst_ld = d.ld;
    b.sms = Budget(op);
    return b;
  }

  // Batched strided copy: one 1-D copy when both sides are dense, one per batch when each
  // batch's rows are (contiguous rows), else one 2-D copy per batch. 1-D wherever it can be:
  // while a fused GEMM holds every SM, a peer copy must run on a copy engine, and CUDA documents
  // no engine for a 2-D copy (docs/gpu-internals.md §5, rule 1); the fake refuses one behind a
  // fused GEMM.
  Status CopyBlock(const Op& op, const std::byte* src, const Ref& s, std::byte* dst, const Ref& d,
                   cudaStream_t stream) {
    const int64_t es = Es(s.buf);  // d's too (CheckProgram)
    const size_t row = static_cast<size_t>(op.n * es);
    const bool rows_contiguous = s.ld == op.n && d.ld == op.n;
    const bool dense =
        rows_contiguous &&
        (op.batch == 1 || (s.batch_stride == op.m * op.n && d.batch_stride == op.m * op.n));
    if (dense) {
      JO_CUDA_CHECK(ctx_,
                    cudaMemcpyAsync(dst, src, row * op.m * op.batch, cudaMemcpyDefault, stream));
      return OkStatus();
    }
    if (rows_contiguous) {
      for (int64_t b = 0; b < op.batch; ++b)
        JO_CUDA_CHECK(ctx_,
                      cudaMemcpyAsync(dst + b * d.batch_stride * es, src + b * s.batch_stride * es,
                                      row * op.m, cudaMemcpyDefault, stream));
      return OkStatus();
    }
    for (int64_t b = 0; b < op.batch; ++b)
      JO_CUDA_CHECK(ctx_, cudaMemcpy2DAsync(dst + b * d.batch_stride * es, d.ld * es,
                                            src + b * s.batch_stride * es, s.ld * es, row,
                                            static_cast<size_t>(op.m), cudaMemcpyDefault, stream));
    return OkStatus();
  }

  // The Send/Recv of one bundle: one NCCL group on their stream's communicator.
  Status NcclGroup(const IssueUnit& unit) {
    const ncclComm_t comm = steps_[static_cast<size_t>(unit.begin)].comm;
    Status status;
    ncclResult_t closed = ncclSuccess;
    {
      // NCCL's thread-safety rule (nccl_comms.h): no other thread issues calls on a
      // communicator of this device meanwhile. Never held across a wait: aborts take no lock.
      std::lock_guard<std::mutex> device(DeviceNcclLock(a_.device));
      JO_NCCL_CHECK(ctx_, ncclGroupStart());
      for (int32_t i = unit.begin; i < unit.end && status.ok(); ++i)
        status = NcclOp(p_.ops[static_cast<size_t>(i)], steps_[static_cast<size_t>(i)]);
      // Always close the group, even after a failure inside it.
      closed = ncclGroupEnd();
    }
    JO_CHECK(status);
    JO_NCCL_CHECK_ASYNC(ctx_, closed);
    // Non-blocking communicator: the first send/recv to a peer connects to it
    // on the host, which needs the peer; bounded by the call's timeout.
    if (closed == ncclInProgress)
      JO_CHECK(AwaitNccl(comm, std::chrono::steady_clock::now() + a_.timeout,
                         "ncclGroupEnd (send/recv)", ctx_));
    return OkStatus();
  }

  // A block is sent per batch (each batch's m x n rows must be dense): both
  // sides of a pair issue the same number of calls of the same sizes in the
  // same order, which is how NCCL matches sends with receives. Never merged
  // when one side happens to be dense: the peer's side may be strided.
  Status NcclOp(const Op& op, const Step& step) {
    const bool send = op.kind == OpKind::kSend;
    const Ref& ref = send ? op.a : op.d;
    const ncclDataType_t type = NcclType(BufDType(p_.problem, ref.buf));
    std::byte* base = send ? step.src : step.dst;
    const size_t count = static_cast<size_t>(op.m * op.n);
    for (int64_t b = 0; b < op.batch; ++b) {
      std::byte* ptr = base + b * ref.batch_stride * Es(ref.buf);
      if (send) {
        JO_NCCL_CHECK_ASYNC(ctx_, ncclSend(ptr, count, type, op.peer, step.comm, step.stream));
      } else {
        JO_NCCL_CHECK_ASYNC(ctx_, ncclRecv(ptr, count, type, op.peer, step.comm, step.stream));
      }
    }
    return OkStatus();
  }

  const RunArgs& a_;
  const Program& p_;
  const ErrorContext* ctx_;
  const DriverApi* drv_ = nullptr;
  unsigned wait_flags_ = CU_STREAM_WAIT_VALUE_GEQ;  // WaitValueFlags of the device
  std::vector<Step> steps_;
  std::vector<FusedGemmArgs> fused_;  // the FusedGemm steps' (not in Step: 520-byte tile orders)
  std::vector<PreparedAllReduce> allreduce_;  // the AllReduce steps
  bool warmed_ = false;     // a new cuBLASLt plan ran its warm-up in Prepare: join it first
  bool has_fused_ = false;  // the program has a FusedGemm
  int32_t spare_sms_ = 0;   // the SMs the fused GEMM leaves to the kernels beside it
  FusedKernel fused_kernel_ = FusedKernel::kNone;  // the device's (with has_fused_)
};

PreparedCall::PreparedCall(std::unique_ptr<Enqueuer> enqueuer) : enqueuer_(std::move(enqueuer)) {}
PreparedCall::~PreparedCall() = default;

Status PreparedCall::Execute(const std::vector<ncclComm_t>& comms, bool* enqueued) {
  return enqueuer_->Execute(comms, enqueued);
}

void PreparedCall::Abandon() { enqueuer_->Abandon(); }

bool PreparedCall::WarmedUp() const { return enqueuer_->WarmedUp(); }

Status PrepareProgram(const RunArgs& args, std::unique_ptr<PreparedCall>* out) {
  auto enqueuer = std::make_unique<Enqueuer>(args);
  JO_CHECK(enqueuer->Prepare());
  out->reset(new PreparedCall(std::move(enqueuer)));
  return OkStatus();
}

Status PoolNeedsOf(const Problem& q, PoolNeeds* out) {
  static auto* cache = new SignatureCache<PoolNeeds>;  // never destroyed: workers may run late
  const std::string signature = CallSignature(q);
  if (auto hit = cache->Find(signature)) {
    *out = *hit;
    return OkStatus();
  }
  PoolNeeds needs;
  if (Row(q.transport).messages() && q.nranks > 1) needs.connect_ranks = q.nranks;
  for (int32_t r = 0; r < q.nranks; ++r) {
    Problem other = q;
    other.rank = r;
    Program p;
    JO_CHECK(BuildProgram(other, &p));
    needs.scratch = std::max(needs.scratch, static_cast<size_t>(ScratchBytes(p)));
    for (const Op& op : p.ops) {
      if (op.kind == OpKind::kFusedGemm)
        needs.fused_state = std::max(needs.fused_state, FusedStateBytes(op.fused.rows.count()));
      if (op.kind != OpKind::kGemm) continue;
      needs.workspaces = std::max(needs.workspaces, op.stream + 1);
      // The warm-up's operands: its shapes and layouts (pointers are not read; a set c says the
      // call may be out of place).
      GemmArgs g;
      g.a_type = q.x_dtype;
      g.w_type = q.w_dtype;
      g.out_type = q.out_dtype;
      g.block_scaled = q.block_scaled;
      g.batch = op.batch;
      g.m = op.m;
      g.n = op.n;
      g.k = op.k;
      g.a_bs = op.a.batch_stride;
      g.a_ld = op.a.ld;
      g.w_ld = IsFp8(q.w_dtype) ? q.k : op.b.ld;
      g.d_bs = op.d.batch_stride;
      g.d_ld = op.d.ld;
      if (op.accumulate) {
        static const std::byte kSomewhere{};
        g.c = &kSomewhere;
        g.c_bs = op.c.batch_stride;
        g.c_ld = op.c.ld;
      }
      needs.warm = std::max(needs.warm, WarmUpBytes(g));
    }
  }
  cache->Add(signature, needs);
  *out = needs;
  return OkStatus();
}

}  // namespace jo::cuda
