#include "cuda/executor.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "cuda/driver.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"

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

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;
    case DType::kF16:
      return ncclFloat16;
  }
  return ncclFloat32;
}

class Enqueuer {
 public:
  explicit Enqueuer(const RunArgs& a)
      : a_(a),
        p_(*a.program),
        es_(DTypeSize(p_.problem.dtype)),
        ctx_(&a.ctx),
        recorded_(p_.num_events, false) {}

  Status Run() {
    // "jaxoverlap ag_matmul nccl rank 2 epoch 7": the call, around its enqueue.
    const NvtxRange call_range([&] {
      return "jaxoverlap " + Label() + " rank " + std::to_string(p_.problem.rank) + " epoch " +
             std::to_string(a_.epoch);
    });
    JO_CHECK(LoadDriver(&drv_));
    JO_CUDA_CHECK(ctx_, cudaSetDevice(a_.device));
    JO_CHECK(Fork());
    // Units: one op, or one NCCL group (consecutive Send/Recv of one stream and group).
    const std::vector<Op>& ops = p_.ops;
    std::vector<std::pair<size_t, size_t>> units;
    for (size_t i = 0; i < ops.size();) {
      size_t end = i + 1;
      if (ops[i].kind == OpKind::kSend || ops[i].kind == OpKind::kRecv)
        while (end < ops.size() &&
               (ops[end].kind == OpKind::kSend || ops[end].kind == OpKind::kRecv) &&
               ops[end].bundle == ops[i].bundle && ops[end].stream == ops[i].stream)
          ++end;
      units.emplace_back(i, end);
      i = end;
    }
    // Enqueue in list order, except that a StreamWait whose Record is listed
    // later (fine for the host executor's one-shot events) is deferred, with
    // the rest of its stream, until the Record is enqueued:
    // cudaStreamWaitEvent waits for the record enqueued BEFORE it.
    std::vector<std::vector<size_t>> deferred(static_cast<size_t>(p_.num_streams));
    auto blocked = [&](size_t u) {
      const Op& op = ops[units[u].first];
      return op.kind == OpKind::kStreamWait && op.id >= 0 && op.id < p_.num_events &&
             !recorded_[op.id];
    };
    auto flush = [&]() -> Status {
      for (bool progress = true; progress;) {
        progress = false;
        for (auto& queue : deferred)
          while (!queue.empty() && !blocked(queue.front())) {
            JO_CHECK(EnqueueUnit(units[queue.front()]));
            queue.erase(queue.begin());
            progress = true;
          }
      }
      return OkStatus();
    };
    for (size_t u = 0; u < units.size(); ++u) {
      auto& queue = deferred[static_cast<size_t>(ops[units[u].first].stream)];
      if (!queue.empty() || blocked(u)) {
        queue.push_back(u);
        continue;
      }
      JO_CHECK(EnqueueUnit(units[u]));
      if (ops[units[u].first].kind == OpKind::kRecord) JO_CHECK(flush());
    }
    JO_CHECK(flush());
    for (const auto& queue : deferred)
      if (!queue.empty())
        return Internal(a_.ctx.Describe() +
                        ": program has a StreamWait whose event is never "
                        "recorded before it on any stream: " +
                        ToString(ops[units[queue.front()].first]));
    JO_CHECK(Join());
    return OkStatus();
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

  Status EnqueueUnit(const std::pair<size_t, size_t>& unit) {
    const Op& op = p_.ops[unit.first];
    const NvtxRange range([&] { return UnitName(op, unit.first); });
    Status status = (op.kind == OpKind::kSend || op.kind == OpKind::kRecv)
                        ? NcclGroup(unit.first, unit.second)
                        : Exec(op);
    if (!status.ok())
      return Status(status.code(), status.message() + "; while enqueueing " + ToString(op) +
                                       " on stream " + std::to_string(op.stream));
    return OkStatus();
  }

  cudaStream_t Stream(int32_t s) const {
    return s == 0 ? a_.stream : a_.resources->streams[static_cast<size_t>(s - 1)];
  }
  cudaEvent_t ForkEvent() const { return a_.resources->events[static_cast<size_t>(p_.num_events)]; }
  cudaEvent_t JoinEvent(int32_t s) const {
    return a_.resources->events[static_cast<size_t>(p_.num_events + s)];
  }

  Status Fork() {
    if (p_.num_streams <= 1) return OkStatus();
    JO_CUDA_CHECK(ctx_, cudaEventRecord(ForkEvent(), a_.stream));
    for (int32_t s = 1; s < p_.num_streams; ++s)
      JO_CUDA_CHECK(ctx_, cudaStreamWaitEvent(Stream(s), ForkEvent(), 0));
    return OkStatus();
  }

  Status Join() {
    for (int32_t s = 1; s < p_.num_streams; ++s) {
      JO_CUDA_CHECK(ctx_, cudaEventRecord(JoinEvent(s), Stream(s)));
      JO_CUDA_CHECK(ctx_, cudaStreamWaitEvent(a_.stream, JoinEvent(s), 0));
    }
    return OkStatus();
  }

  std::byte* Resolve(const Ref& ref) const {
    std::byte* base = nullptr;
    switch (ref.buf) {
      case BufId::kX:
        base = static_cast<std::byte*>(const_cast<void*>(a_.io.x));
        break;
      case BufId::kW:
        base = static_cast<std::byte*>(const_cast<void*>(a_.io.w));
        break;
      case BufId::kY:
        base = static_cast<std::byte*>(a_.io.y);
        break;
      case BufId::kXGathered:
        base = static_cast<std::byte*>(a_.io.x_gathered);
        break;
      case BufId::kScratch:
        base =
            a_.resources->scratch ? static_cast<std::byte*>(a_.resources->scratch->ptr) : nullptr;
        break;
      case BufId::kWorkspace:
        base = a_.gen->Workspace(ref.rank, a_.epoch, p_.problem.rank);
        break;
    }
    return base == nullptr ? nullptr : base + ref.offset * es_;
  }

  Status Exec(const Op& op) {
    const cudaStream_t stream = Stream(op.stream);
    switch (op.kind) {
      case OpKind::kGemm:
        return Gemm(op, stream);
      case OpKind::kAdd: {
        BlockArgs b = Block(op, Resolve(op.a), op.a, Resolve(op.d), op.d);
        JO_ASSERT(b.src != nullptr && b.dst != nullptr);
        return LaunchAddBlock(b, stream, a_.ctx);
      }
      case OpKind::kCopy: {
        std::byte* src = Resolve(op.a);
        std::byte* dst = Resolve(op.d);
        JO_ASSERT(src != nullptr && dst != nullptr);
        return CopyBlock(op, src, op.a, dst, op.d, stream);
      }
      case OpKind::kMcStore: {
        std::byte* mc = a_.gen->MulticastAddress(a_.epoch);
        JO_ASSERT(mc != nullptr);
        BlockArgs b = Block(op, Resolve(op.a), op.a, mc + op.d.offset * es_, op.d);
        JO_ASSERT(b.src != nullptr);
        return LaunchMcStore(b, stream, a_.ctx);
      }
      case OpKind::kMcReduce: {
        std::byte* mc = a_.gen->MulticastAddress(a_.epoch);
        JO_ASSERT(mc != nullptr);
        BlockArgs b = Block(op, mc + op.a.offset * es_, op.a, Resolve(op.d), op.d);
        JO_ASSERT(b.dst != nullptr);
        return LaunchMcReduce(b, stream, a_.ctx);
      }
      case OpKind::kSignal: {
        JO_ASSERT(op.peer >= 0 && op.peer < p_.problem.nranks && op.id < a_.gen->num_flags);
        // Default flags: the write is fenced after every prior write of the stream.
        JO_CU_CHECK(ctx_, drv_->cuStreamWriteValue32(
                              reinterpret_cast<CUstream>(stream),
                              a_.gen->Flag(op.peer, a_.epoch, op.id, p_.problem.rank),
                              static_cast<cuuint32_t>(a_.epoch), CU_STREAM_WRITE_VALUE_DEFAULT));
        return OkStatus();
      }
      case OpKind::kWait: {
        JO_ASSERT(op.id >= 0 && op.id < a_.gen->num_flags);
        // GEQ is a cyclic comparison, (int32_t)(*addr - epoch) >= 0: epochs may wrap.
        JO_CU_CHECK(ctx_, drv_->cuStreamWaitValue32(
                              reinterpret_cast<CUstream>(stream),
                              a_.gen->Flag(p_.problem.rank, a_.epoch, op.id, p_.problem.rank),
                              static_cast<cuuint32_t>(a_.epoch), CU_STREAM_WAIT_VALUE_GEQ));
        return OkStatus();
      }
      case OpKind::kRecord:
        JO_ASSERT(op.id >= 0 && op.id < p_.num_events);
        JO_CUDA_CHECK(ctx_, cudaEventRecord(a_.resources->events[op.id], stream));
        recorded_[op.id] = true;
        return OkStatus();
      case OpKind::kStreamWait:
        JO_ASSERT(op.id >= 0 && op.id < p_.num_events);
        JO_ASSERT(recorded_[op.id]);  // Run() defers StreamWaits until their Record
        JO_CUDA_CHECK(ctx_, cudaStreamWaitEvent(stream, a_.resources->events[op.id], 0));
        return OkStatus();
      case OpKind::kSend:
      case OpKind::kRecv:
        break;  // handled as groups
    }
    return Internal("unknown op kind");
  }

  BlockArgs Block(const Op& op, const void* src, const Ref& s, void* dst, const Ref& d) const {
    BlockArgs b;
    b.dtype = p_.problem.dtype;
    b.src = src;
    b.dst = dst;
    b.batch = op.batch;
    b.m = op.m;
    b.n = op.n;
    b.src_batch_stride = s.batch_stride;
    b.src_ld = s.ld;
    b.dst_batch_stride = d.batch_stride;
    b.dst_ld = d.ld;
    return b;
  }

  // Batched strided copy: one call when both sides are dense, else one 2-D copy per batch.
  Status CopyBlock(const Op& op, const std::byte* src, const Ref& s, std::byte* dst, const Ref& d,
                   cudaStream_t stream) {
    const size_t row = static_cast<size_t>(op.n * es_);
    const bool dense =
        s.ld == op.n && d.ld == op.n &&
        (op.batch == 1 || (s.batch_stride == op.m * op.n && d.batch_stride == op.m * op.n));
    if (dense) {
      JO_CUDA_CHECK(ctx_,
                    cudaMemcpyAsync(dst, src, row * op.m * op.batch, cudaMemcpyDefault, stream));
      return OkStatus();
    }
    for (int64_t b = 0; b < op.batch; ++b)
      JO_CUDA_CHECK(ctx_, cudaMemcpy2DAsync(dst + b * d.batch_stride * es_, d.ld * es_,
                                            src + b * s.batch_stride * es_, s.ld * es_, row,
                                            static_cast<size_t>(op.m), cudaMemcpyDefault, stream));
    return OkStatus();
  }

  Status Gemm(const Op& op, cudaStream_t stream) {
    GemmArgs g;
    g.dtype = p_.problem.dtype;
    g.batch = op.batch;
    g.m = op.m;
    g.n = op.n;
    g.k = op.k;
    g.a = Resolve(op.a);
    g.a_bs = op.a.batch_stride;
    g.a_ld = op.a.ld;
    g.w = Resolve(op.b);  // W: one matrix for every batch (batch stride 0 in cuBLASLt)
    g.w_ld = op.b.ld;
    g.d = Resolve(op.d);
    g.d_bs = op.d.batch_stride;
    g.d_ld = op.d.ld;
    JO_ASSERT(g.a != nullptr && g.w != nullptr && g.d != nullptr);
    if (op.accumulate) {
      std::byte* c = Resolve(op.c);
      JO_ASSERT(c != nullptr);
      if (c != g.d && (op.c.ld != op.d.ld || op.c.batch_stride != op.d.batch_stride)) {
        // cuBLASLt's out-of-place form needs equal layouts: bring C into D first.
        Op copy = op;
        copy.k = 0;
        JO_CHECK(CopyBlock(copy, c, op.c, static_cast<std::byte*>(g.d), op.d, stream));
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
    return LtMatmul(a_.device, g, stream, a_.ctx);
  }

  Status NcclGroup(size_t begin, size_t end) {
    JO_ASSERT(a_.comm != nullptr);
    const ncclDataType_t type = NcclType(p_.problem.dtype);
    JO_NCCL_CHECK(ctx_, ncclGroupStart());
    Status status;
    for (size_t i = begin; i < end && status.ok(); ++i) status = NcclOp(p_.ops[i], type);
    // Always close the group, even after a failure inside it.
    const ncclResult_t closed = ncclGroupEnd();
    JO_CHECK(status);
    JO_NCCL_CHECK_ASYNC(ctx_, closed);
    // Non-blocking communicator: the first send/recv to a peer connects to it
    // on the host, which needs the peer; bounded by the call's timeout.
    if (closed == ncclInProgress)
      JO_CHECK(AwaitNccl(a_.comm, std::chrono::steady_clock::now() + a_.timeout,
                         "ncclGroupEnd (send/recv)", ctx_));
    return OkStatus();
  }

  // A block is sent per batch (each batch's m x n rows must be dense): both
  // sides of a pair issue the same number of calls of the same sizes in the
  // same order, which is how NCCL matches sends with receives.
  Status NcclOp(const Op& op, ncclDataType_t type) {
    const cudaStream_t stream = Stream(op.stream);
    const bool send = op.kind == OpKind::kSend;
    const Ref& ref = send ? op.a : op.d;
    std::byte* base = Resolve(ref);
    JO_ASSERT(base != nullptr && op.peer >= 0 && op.peer < p_.problem.nranks);
    if (ref.ld != op.n)
      return Internal(a_.ctx.Describe() + ": NCCL block rows must be dense (ld " +
                      std::to_string(ref.ld) + " != n " + std::to_string(op.n) + ")");
    // Always one call per batch (never merged when one side happens to be
    // dense): the peer's side of the pair may be strided.
    const size_t count = static_cast<size_t>(op.m * op.n);
    for (int64_t b = 0; b < op.batch; ++b) {
      std::byte* ptr = base + b * ref.batch_stride * es_;
      if (send) {
        JO_NCCL_CHECK_ASYNC(ctx_, ncclSend(ptr, count, type, op.peer, a_.comm, stream));
      } else {
        JO_NCCL_CHECK_ASYNC(ctx_, ncclRecv(ptr, count, type, op.peer, a_.comm, stream));
      }
    }
    return OkStatus();
  }

  const RunArgs& a_;
  const Program& p_;
  const int64_t es_;
  const ErrorContext* ctx_;
  const DriverApi* drv_ = nullptr;
  std::vector<bool> recorded_;
};

}  // namespace

Status EnqueueProgram(const RunArgs& args) {
  Enqueuer enqueuer(args);
  return enqueuer.Run();
}

}  // namespace jo::cuda
