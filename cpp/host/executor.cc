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
  Run(const Program& p, HostClique& clique, const WaitContext& ctx, const CallBuffers& io)
      : p_(p),
        clique_(clique),
        epoch_(ctx.epoch),
        io_(io),
        es_(DTypeSize(p.problem.dtype)),
        ctx_(ctx),
        events_(p.num_events, 0) {}

  Status Execute() {
    // The program against the buffers this call really has (the clique's
    // workspace may be larger than the program needs, never smaller).
    BufferSizes sizes = BufferSizes::Of(p_);
    sizes.workspace = clique_.WorkspaceBytes() / es_;
    if (io_.x_gathered == nullptr) sizes.x_gathered = 0;
    JO_CHECK(CheckProgram(p_, sizes));
    try {
      scratch_.assign(static_cast<size_t>(p_.scratch_elems * es_), std::byte{0});
      if (p_.problem.dtype != DType::kF32) {
        w32_.resize(static_cast<size_t>(p_.problem.k * p_.problem.cols));
        ToF32(p_.problem.dtype, io_.w, p_.problem.cols, p_.problem.k, p_.problem.cols, w32_.data());
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
                              op.batch * op.m * op.n * es_, NowNs(), 0, 0});
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
        status = Status(status.code(), status.message() + "; during " + ToString(op) +
                                           " on stream " + std::to_string(stream));
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
    std::byte* base = nullptr;
    switch (ref.buf) {
      case BufId::kX:
        base = static_cast<std::byte*>(const_cast<void*>(io_.x));
        break;
      case BufId::kW:
        base = static_cast<std::byte*>(const_cast<void*>(io_.w));
        break;
      case BufId::kY:
        base = static_cast<std::byte*>(io_.y);
        break;
      case BufId::kXGathered:
        base = static_cast<std::byte*>(io_.x_gathered);
        break;
      case BufId::kScratch:
        base = scratch_.data();
        break;
      case BufId::kWorkspace:
        base = clique_.Workspace(ref.rank, epoch_);
        break;
    }
    return base == nullptr ? nullptr : base + ref.offset * es_;
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
        std::vector<std::byte> packed(static_cast<size_t>(op.batch * op.m * op.n * es_));
        const Ref dense{BufId::kScratch, 0, 0, op.m * op.n, op.n};
        CopyBlock(op, src, op.a, packed.data(), dense);
        return clique_.Send(ctx_, op.peer, op.id, std::move(packed));
      }
      case OpKind::kRecv: {
        std::byte* dst = Resolve(op.d);
        JO_ASSERT(dst != nullptr);
        std::vector<std::byte> packed;
        JO_CHECK(clique_.Recv(ctx_, op.peer, op.id, &packed));
        MarkReady(op.stream);  // the rest is the copy out of the message
        JO_ASSERT(packed.size() == static_cast<size_t>(op.batch * op.m * op.n * es_));
        const Ref dense{BufId::kScratch, 0, 0, op.m * op.n, op.n};
        CopyBlock(op, packed.data(), dense, dst, op.d);
        return OkStatus();
      }
      case OpKind::kSignal:
        return clique_.Signal(ctx_, op.peer, op.id);
      case OpKind::kWait:
        return clique_.WaitFlag(ctx_, op.peer, op.id);
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

  // Batched strided block copy; offsets already applied to the pointers.
  void CopyBlock(const Op& op, const std::byte* src, const Ref& s, std::byte* dst, const Ref& d) {
    const size_t row_bytes = static_cast<size_t>(op.n * es_);
    for (int64_t b = 0; b < op.batch; ++b)
      for (int64_t i = 0; i < op.m; ++i)
        std::memcpy(dst + (b * d.batch_stride + i * d.ld) * es_,
                    src + (b * s.batch_stride + i * s.ld) * es_, row_bytes);
  }

  // Add: d += a.  McReduce: d = sum over all ranks' workspace at a.offset.
  Status Elementwise(const Op& op, bool reduce_all) {
    const DType dt = p_.problem.dtype;
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

  Status Gemm(const Op& op) {
    const DType dt = p_.problem.dtype;
    std::byte* a = Resolve(op.a);
    std::byte* d = Resolve(op.d);
    std::byte* c = op.accumulate ? Resolve(op.c) : nullptr;
    const std::byte* w = Resolve(op.b);
    JO_ASSERT(a != nullptr && d != nullptr && w != nullptr && (c != nullptr || !op.accumulate));
    const float beta = op.accumulate ? 1.0f : 0.0f;
    std::vector<float> a32, d32;
    if (dt != DType::kF32) {
      a32.resize(static_cast<size_t>(op.m * op.k));
      d32.resize(static_cast<size_t>(op.m * op.n));
    }
    for (int64_t b = 0; b < op.batch; ++b) {
      std::byte* ab = a + b * op.a.batch_stride * es_;
      std::byte* db = d + b * op.d.batch_stride * es_;
      std::byte* cb = c == nullptr ? nullptr : c + b * op.c.batch_stride * es_;
      if (dt == DType::kF32) {
        if (cb != nullptr && cb != db)
          for (int64_t i = 0; i < op.m; ++i)
            std::memcpy(db + i * op.d.ld * es_, cb + i * op.c.ld * es_, op.n * es_);
        Sgemm(op.m, op.n, op.k, reinterpret_cast<const float*>(ab), op.a.ld,
              reinterpret_cast<const float*>(w), op.b.ld, beta, reinterpret_cast<float*>(db),
              op.d.ld);
      } else {
        ToF32(dt, ab, op.a.ld, op.m, op.k, a32.data());
        if (cb != nullptr) ToF32(dt, cb, op.c.ld, op.m, op.n, d32.data());
        Sgemm(op.m, op.n, op.k, a32.data(), op.k, w32_.data(), op.n, beta, d32.data(), op.n);
        FromF32(dt, d32.data(), op.m, op.n, db, op.d.ld);
      }
    }
    return OkStatus();
  }

  const Program& p_;
  HostClique& clique_;
  const int64_t epoch_;
  const CallBuffers io_;
  const int64_t es_;
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
  Run run(program, clique, ctx, io);
  return run.Execute();
}

}  // namespace jo::host
