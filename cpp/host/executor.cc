#include "host/executor.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "core/check_program.h"
#include "core/convert.h"
#include "core/deadline.h"
#include "core/trace.h"
#include "host/blas.h"

namespace jo::host {
namespace {

// Joins its threads on every exit path.
class ThreadGroup {
 public:
  ~ThreadGroup() {
    for (std::thread& t : threads_)
      if (t.joinable()) t.join();
  }
  template <typename F>
  Status Spawn(F&& fn) {
    try {
      threads_.emplace_back(std::forward<F>(fn));
    } catch (const std::system_error& e) {
      return Status(Code::kResource, std::string("could not start a stream thread: ") + e.what());
    }
    return OkStatus();
  }

 private:
  std::vector<std::thread> threads_;
};

class Run {
 public:
  Run(const Program& p, HostClique& clique, const WaitContext& ctx, const CallBuffers& io,
      bool check_sequencing)
      : check_sequencing_(check_sequencing),
        p_(p),
        clique_(clique),
        epoch_(ctx.epoch),
        io_(io),
        ctx_(ctx),
        events_(p.num_events, 0) {
    ctx_.replayable = p.problem.replayable;  // its flags' values and slots (host_clique.h)
  }

  Status Execute() {
    // The program against the buffers this call really has (the clique's
    // workspace may be larger than the program needs, never smaller): its
    // elements, then (from ScalesOffset) its scale slots.
    const Problem& q = p_.problem;
    BufferSizes sizes = BufferSizes::Of(p_);
    const int64_t have = clique_.WorkspaceBytes();
    const int64_t scales_at =
        p_.workspace_scales > 0 ? ScalesOffset(p_, BufId::kWorkspaceScales) : have;
    sizes.workspace = std::min(have, scales_at) / ElemBytes(q, BufId::kWorkspace);
    sizes.workspace_scales =
        std::max<int64_t>(0, have - scales_at) / ElemBytes(q, BufId::kWorkspaceScales);
    if (io_.x_gathered == nullptr) sizes.x_gathered = 0;
    JO_CHECK(CheckProgram(p_, sizes, check_sequencing_));
    try {
      scratch_.assign(static_cast<size_t>(ScratchBytes(p_)), std::byte{0});
      if (q.w_dtype != DType::kF32) {  // W in f32 once per call (fp8: unscaled, exact)
        w32_.resize(static_cast<size_t>(q.k * q.cols));
        ToF32(q.w_dtype, io_.w, q.cols, q.k, q.cols, w32_.data());
        if (q.block_scaled)  // block scales: dequantized, each 32 rows of a column by its scale
          ApplyBlockScales(w32_.data(), q.k, q.cols, static_cast<const uint8_t*>(io_.w_scale),
                           q.cols, /*along_rows=*/true);
      }
    } catch (const std::bad_alloc&) {
      return Status(Code::kResource, std::string(ctx_.op) + ": host scratch allocation failed");
    }
    std::vector<Status> results(p_.num_streams);
    const bool recording = Recording();
    if (recording) {
      spans_.assign(static_cast<size_t>(p_.num_streams), {});
      for (auto& stream : spans_) stream.reserve(p_.ops.size());
      current_.assign(static_cast<size_t>(p_.num_streams), nullptr);
    }
    const int64_t start_ns = recording ? NowNs() : 0;
    {
      ThreadGroup threads;
      for (int32_t s = 1; s < p_.num_streams; ++s) {
        Status spawned = threads.Spawn([this, s, &results] { results[s] = RunStream(s); });
        if (!spawned.ok()) {
          results[s] = spawned;
          Fail(spawned);
        }
      }
      results[0] = RunStream(0);
    }
    if (recording) LogSpans(start_ns, results);
    // Report the root cause, not the aborts it caused in the other streams.
    for (const Status& status : results)
      if (!status.ok() && status.code() != Code::kAborted) return status;
    for (const Status& status : results)
      if (!status.ok()) return status;
    return OkStatus();
  }

 private:
  Status RunStream(int32_t stream) {
    const bool recording = !spans_.empty();
    for (size_t i = 0; i < p_.ops.size(); ++i) {
      const Op& op = p_.ops[i];
      if (op.stream != stream) continue;
      OpSpan* span = nullptr;
      if (recording) {
        auto& mine = spans_[static_cast<size_t>(stream)];
        // A p2p push names its peer by the workspace it writes.
        const int32_t peer = op.kind == OpKind::kCopy && op.d.buf == BufId::kWorkspace &&
                                     op.d.rank != p_.problem.rank
                                 ? op.d.rank
                                 : op.peer;
        mine.push_back(OpSpan{static_cast<int32_t>(i), stream, op.kind, op.shard, op.sub, peer,
                              BlockBytes(p_, op), NowNs(), 0, 0});
        span = &mine.back();
        span->ready_ns = span->start_ns;
        current_[static_cast<size_t>(stream)] = span;
      }
      Status status = Exec(op);
      if (span != nullptr) {
        span->end_ns = NowNs();
        // A wait's whole time is waiting.
        if (op.kind == OpKind::kWait || op.kind == OpKind::kStreamWait)
          span->ready_ns = span->end_ns;
        current_[static_cast<size_t>(stream)] = nullptr;
      }
      if (!status.ok()) {
        status = Status(status.code(), status.message() + "; during " +
                                           ToString(op, p_.problem.replayable) + " on stream " +
                                           std::to_string(stream));
        Fail(status);
        return status;
      }
    }
    return OkStatus();
  }

  // While recording: what the op on `stream` waited for is there.
  void MarkReady(int32_t stream) {
    if (!current_.empty() && current_[static_cast<size_t>(stream)] != nullptr)
      current_[static_cast<size_t>(stream)]->ready_ns = NowNs();
  }

  void LogSpans(int64_t start_ns, const std::vector<Status>& results) {
    CallSpan call;
    call.executor = "host";
    call.clique = clique_.name();
    call.epoch = epoch_;
    call.problem = p_.problem;
    call.start_ns = start_ns;
    call.end_ns = NowNs();
    call.ok = std::all_of(results.begin(), results.end(), [](const Status& s) { return s.ok(); });
    for (auto& stream : spans_) call.ops.insert(call.ops.end(), stream.begin(), stream.end());
    std::stable_sort(call.ops.begin(), call.ops.end(),
                     [](const OpSpan& a, const OpSpan& b) { return a.start_ns < b.start_ns; });
    LogCall(std::move(call));
  }

  void Fail(const Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failed_) first_error_ = status.message();
      failed_ = true;
    }
    cv_.notify_all();
    clique_.Break(status);
  }

  std::byte* Resolve(const Ref& ref) {
    return jo::Resolve(
        p_, io_, scratch_.data(),
        [&](int32_t rank) { return clique_.Workspace(rank, SlotEpoch(ctx_)); }, ref);
  }

  Status Exec(const Op& op) {
    switch (op.kind) {
      case OpKind::kGemm:
        return Gemm(op);
      case OpKind::kAdd:
        return Elementwise(op, /*reduce_all=*/false);
      case OpKind::kMcReduce:
        return Elementwise(op, /*reduce_all=*/true);
      case OpKind::kCopy: {
        std::byte* src = Resolve(op.a);
        std::byte* dst = Resolve(op.d);
        JO_ASSERT(src != nullptr && dst != nullptr);
        CopyBlock(op, src, op.a, dst, op.d);
        return OkStatus();
      }
      case OpKind::kMcStore: {
        std::byte* src = Resolve(op.a);
        JO_ASSERT(src != nullptr);
        for (int32_t owner = 0; owner < p_.problem.nranks; ++owner) {
          Ref dst_ref = op.d;
          dst_ref.rank = owner;
          std::byte* dst = Resolve(dst_ref);
          JO_ASSERT(dst != nullptr);
          CopyBlock(op, src, op.a, dst, dst_ref);
        }
        return OkStatus();
      }
      case OpKind::kSend: {
        std::byte* src = Resolve(op.a);
        JO_ASSERT(src != nullptr);
        std::vector<std::byte> packed(static_cast<size_t>(BlockBytes(p_, op)));
        const Ref dense{op.a.buf, 0, 0, op.m * op.n, op.n};
        CopyBlock(op, src, op.a, packed.data(), dense);
        return clique_.Send(ctx_, op.peer, op.id, std::move(packed));
      }
      case OpKind::kRecv: {
        std::byte* dst = Resolve(op.d);
        JO_ASSERT(dst != nullptr);
        std::vector<std::byte> packed;
        JO_CHECK(clique_.Recv(ctx_, op.peer, op.id, &packed));
        MarkReady(op.stream);  // the rest is the copy out of the message
        JO_ASSERT(packed.size() == static_cast<size_t>(BlockBytes(p_, op)));
        const Ref dense{op.d.buf, 0, 0, op.m * op.n, op.n};
        CopyBlock(op, packed.data(), dense, dst, op.d);
        return OkStatus();
      }
      case OpKind::kFusedGemm:
        return FusedGemm(op);
      case OpKind::kReduce:
        return Reduce(op);
      case OpKind::kAllReduce:
        return AllReduce(op);
      case OpKind::kSignal:
        return clique_.Signal(ctx_, op.peer, op.id);
      case OpKind::kWait:
        return clique_.WaitFlag(ctx_, op.peer, op.id);
      case OpKind::kResetFlags:
        return clique_.ResetFlags(ctx_, op.id, static_cast<int32_t>(op.n));
      case OpKind::kRecord: {
        {
          std::lock_guard<std::mutex> lock(mu_);
          events_[op.id] = 1;
        }
        cv_.notify_all();
        return OkStatus();
      }
      case OpKind::kStreamWait: {
        // The producing stream's own cross-rank waits time out after
        // ctx_.timeout and then fail the run, which wakes us with the root
        // cause; this wait's longer deadline only guards against our own bugs.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_until(lock,
                       DeadlineAfter(2.0 * std::chrono::duration<double>(ctx_.timeout) +
                                     std::chrono::seconds(1)),
                       [&] { return events_[op.id] != 0 || failed_; });
        if (events_[op.id] != 0) return OkStatus();
        if (failed_)
          return Status(
              Code::kAborted,
              std::string(ctx_.op) + ": another stream of this rank failed: " + first_error_);
        return Status(Code::kTimeout, std::string(ctx_.op) + ": timeout waiting for event " +
                                          std::to_string(op.id) + " of this rank's own streams");
      }
    }
    return Internal("unknown op kind");
  }

  // Batched strided block copy; offsets already applied to the pointers. Both
  // sides hold elements of one dtype (CheckProgram), the size of the source's.
  void CopyBlock(const Op& op, const std::byte* src, const Ref& s, std::byte* dst, const Ref& d) {
    const int64_t es = ElemBytes(p_.problem, s.buf);
    const size_t row_bytes = static_cast<size_t>(op.n * es);
    for (int64_t b = 0; b < op.batch; ++b)
      for (int64_t i = 0; i < op.m; ++i)
        std::memcpy(dst + (b * d.batch_stride + i * d.ld) * es,
                    src + (b * s.batch_stride + i * s.ld) * es, row_bytes);
  }

  // Add: d += a.  McReduce: d = sum over all ranks' workspace at a.offset. In
  // f32, rounded to d's dtype (the output type: never fp8, CheckProgram).
  Status Elementwise(const Op& op, bool reduce_all) {
    const DType dt = BufDType(p_.problem, op.d.buf);
    std::byte* dst = Resolve(op.d);
    JO_ASSERT(dst != nullptr);
    std::vector<const std::byte*> srcs;
    if (reduce_all) {
      for (int32_t owner = 0; owner < p_.problem.nranks; ++owner) {
        Ref ref = op.a;
        ref.rank = owner;
        srcs.push_back(Resolve(ref));
      }
    } else {
      srcs.push_back(Resolve(op.a));
    }
    for (const std::byte* src : srcs) JO_ASSERT(src != nullptr);
    for (int64_t b = 0; b < op.batch; ++b)
      for (int64_t i = 0; i < op.m; ++i)
        for (int64_t j = 0; j < op.n; ++j) {
          const int64_t di = b * op.d.batch_stride + i * op.d.ld + j;
          const int64_t si = b * op.a.batch_stride + i * op.a.ld + j;
          float sum = reduce_all ? 0.0f : LoadElement(dt, dst, di);
          for (const std::byte* src : srcs) sum += LoadElement(dt, src, si);
          StoreElement(dt, dst, di, sum);
        }
    return OkStatus();
  }

  // Reduce: d = the sum of the sources in their order, accumulated in f32 and
  // rounded once to d's dtype (the output type, CheckProgram), as the kernel
  // sums them (cuda/kernels/kernel_body.h ReduceBody).
  Status Reduce(const Op& op) {
    const DType dt = BufDType(p_.problem, op.d.buf);
    std::byte* dst = Resolve(op.d);
    JO_ASSERT(dst != nullptr);
    std::vector<const std::byte*> srcs;
    for (const Ref& ref : op.sources) {
      srcs.push_back(Resolve(ref));
      JO_ASSERT(srcs.back() != nullptr);
    }
    for (int64_t b = 0; b < op.batch; ++b)
      for (int64_t i = 0; i < op.m; ++i)
        for (int64_t j = 0; j < op.n; ++j) {
          float sum = 0.0f;
          for (size_t k = 0; k < srcs.size(); ++k) {
            const Ref& ref = op.sources[k];
            sum += LoadElement(dt, srcs[k], b * ref.batch_stride + i * ref.ld + j);
          }
          StoreElement(dt, dst, b * op.d.batch_stride + i * op.d.ld + j, sum);
        }
    return OkStatus();
  }

  // d = alpha * a @ W (+ c), alpha the product of the fp8 operands' scales: an
  // fp8 value times an fp8 or 16-bit one is exact in f32, so this is the GEMM of
  // the dequantized operands up to where two f32 roundings fall. Accumulated in
  // f32 (OpenBLAS sgemm), rounded once to the output type. Block scales (MXFP8):
  // a's rows and W (once per call) dequantized block by block, exactly (an fp8
  // value times a power of two), then multiplied: the dequantize-then-multiply
  // reference.
  Status Gemm(const Op& op) {
    const Problem& q = p_.problem;
    std::byte* a = Resolve(op.a);
    std::byte* d = Resolve(op.d);
    std::byte* c = op.accumulate ? Resolve(op.c) : nullptr;
    const std::byte* w = Resolve(op.b);
    JO_ASSERT(a != nullptr && d != nullptr && w != nullptr && (c != nullptr || !op.accumulate));
    float alpha = 1.0f;
    const std::byte* a_blocks = q.block_scaled ? Resolve(op.a_scale) : nullptr;
    JO_ASSERT(!q.block_scaled || a_blocks != nullptr);
    for (const auto& [scaled, ref] :
         {std::pair{op.a_scaled, op.a_scale}, {op.b_scaled, op.b_scale}}) {
      if (!scaled || q.block_scaled) continue;
      const std::byte* scale = Resolve(ref);
      JO_ASSERT(scale != nullptr);
      alpha *= LoadElement(DType::kF32, scale, 0);
    }
    const float beta = op.accumulate ? 1.0f : 0.0f;
    const int64_t xs = ElemBytes(q, op.a.buf), ys = ElemBytes(q, op.d.buf);
    const bool f32 =
        q.x_dtype == DType::kF32 && q.w_dtype == DType::kF32 && q.out_dtype == DType::kF32;
    std::vector<float> a32, d32;
    if (!f32) {
      a32.resize(static_cast<size_t>(op.m * op.k));
      d32.resize(static_cast<size_t>(op.m * op.n));
    }
    const float* w32 = q.w_dtype == DType::kF32 ? reinterpret_cast<const float*>(w) : w32_.data();
    const int64_t ldw = q.w_dtype == DType::kF32 ? op.b.ld : op.n;
    for (int64_t b = 0; b < op.batch; ++b) {
      std::byte* ab = a + b * op.a.batch_stride * xs;
      std::byte* db = d + b * op.d.batch_stride * ys;
      std::byte* cb = c == nullptr ? nullptr : c + b * op.c.batch_stride * ys;
      if (f32) {
        if (cb != nullptr && cb != db)
          for (int64_t i = 0; i < op.m; ++i)
            std::memcpy(db + i * op.d.ld * ys, cb + i * op.c.ld * ys, op.n * ys);
        Sgemm(op.m, op.n, op.k, alpha, reinterpret_cast<const float*>(ab), op.a.ld, w32, ldw, beta,
              reinterpret_cast<float*>(db), op.d.ld);
      } else {
        ToF32(q.x_dtype, ab, op.a.ld, op.m, op.k, a32.data());
        if (a_blocks != nullptr)
          ApplyBlockScales(a32.data(), op.m, op.k,
                           reinterpret_cast<const uint8_t*>(a_blocks) + b * op.a_scale.batch_stride,
                           op.a_scale.ld, /*along_rows=*/false);
        if (cb != nullptr) ToF32(q.out_dtype, cb, op.c.ld, op.m, op.n, d32.data());
        Sgemm(op.m, op.n, op.k, alpha, a32.data(), op.k, w32, ldw, beta, d32.data(), op.n);
        FromF32(q.out_dtype, d32.data(), op.m, op.n, db, op.d.ld);
      }
    }
    return OkStatus();
  }

  // The fused GEMM's semantics, block by block in its order: wait for the
  // block's flag, multiply its rows (fp8: scaled by their shard's scale),
  // release it (the kernel does the same tile by tile: docs/gpu-internals.md §5).
  Status FusedGemm(const Op& op) {
    const FusedBlocks& f = op.fused;
    Op rows = op;  // the plain GEMM of one block's rows (without the fused plan)
    rows.kind = OpKind::kGemm;
    rows.fused = {};
    for (int32_t b : f.sequence) {
      if (f.Waits(b)) JO_CHECK(clique_.WaitFlag(ctx_, f.writers[b], f.wait_flags + b));
      rows.m = f.rows.End(b) - f.rows.Begin(b);
      rows.a.offset = op.a.offset + f.rows.Begin(b) * op.a.ld;
      rows.d.offset = op.d.offset + f.rows.Begin(b) * op.d.ld;
      // fp8: the block's rows take their shard's scale slot, or all the one (check_program.cc).
      if (op.a_scaled) rows.a_scale.offset = op.a_scale.offset + f.rows.Shard(b) * f.x_scale_stride;
      JO_CHECK(Gemm(rows));
      if (f.release_flags >= 0)
        JO_CHECK(clique_.Signal(ctx_, p_.problem.rank, f.release_flags + b));
    }
    return OkStatus();
  }

  // The one-launch all-reduce's semantics (docs/gpu-internals.md §7): y to every peer's workspace
  // slot of this rank, a flag to each, every peer's flag, then y = the N ranks' partials summed in
  // rank order in f32, rounded once (the p2p kernel's order; multicast's load-reduce sums in
  // f32 too, in the switch's order).
  Status AllReduce(const Op& op) {
    const Problem& q = p_.problem;
    const int32_t r = q.rank, n = q.nranks;
    const DType dt = BufDType(q, op.d.buf);
    const int64_t elems = op.batch * op.m * op.n;
    const size_t bytes = static_cast<size_t>(elems * ElemBytes(q, op.d.buf));
    std::byte* y = Resolve(op.d);
    JO_ASSERT(y != nullptr);
    const auto slot = [&](int32_t owner, int32_t writer) {
      return clique_.Workspace(owner, epoch_) + writer * bytes;
    };
    for (int32_t k = 1; k < n; ++k) {
      const int32_t peer = (r + k) % n;
      std::memcpy(slot(peer, r), y, bytes);
      JO_CHECK(clique_.Signal(ctx_, peer, r));
    }
    for (int32_t k = 1; k < n; ++k) JO_CHECK(clique_.WaitFlag(ctx_, (r + k) % n, (r + k) % n));
    MarkReady(op.stream);
    std::vector<float> sum(static_cast<size_t>(elems), 0.0f);
    for (int32_t j = 0; j < n; ++j) {
      const std::byte* part = j == r ? y : slot(r, j);
      for (int64_t i = 0; i < elems; ++i) sum[static_cast<size_t>(i)] += LoadElement(dt, part, i);
    }
    for (int64_t i = 0; i < elems; ++i) StoreElement(dt, y, i, sum[static_cast<size_t>(i)]);
    return OkStatus();
  }

  const bool check_sequencing_;
  const Program& p_;
  HostClique& clique_;
  const int64_t epoch_;
  const CallBuffers io_;
  WaitContext ctx_;
  std::vector<std::byte> scratch_;
  std::vector<float> w32_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<char> events_;
  std::vector<std::vector<OpSpan>> spans_;  // per stream, while recording
  std::vector<OpSpan*> current_;            // per stream: the op running, while recording
  bool failed_ = false;
  std::string first_error_;
};

}  // namespace

Status RunProgram(const Program& program, HostClique& clique, const WaitContext& ctx,
                  const CallBuffers& io) {
  Run run(program, clique, ctx, io, /*check_sequencing=*/true);
  return run.Execute();
}

Status RunProgramUnsequenced(const Program& program, HostClique& clique, const WaitContext& ctx,
                             const CallBuffers& io) {
  Run run(program, clique, ctx, io, /*check_sequencing=*/false);
  return run.Execute();
}

}  // namespace jo::host
