// replay_host: one program of a replayable problem (core/program.h
// Problem::replayable) run as several calls in a row by every rank of an
// in-process clique, each rank a thread with its own pace, as the host
// executor runs a clique's calls: a rank starts its next call once its own
// last one ended, whatever its peers do, so calls of neighbouring numbers are
// in flight at once. Every call runs the SAME program (the same Program
// object per rank): nothing in it depends on the call's number.
//
// The misuse tests take the acknowledgement out (drop_ack: the ack's Signal,
// Wait and ResetFlags) and run without the sequencing check, with one rank
// slow to read, to show what the acknowledgement prevents.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "core/build.h"
#include "core/call.h"
#include "host/executor.h"
#include "host/host_clique.h"
#include "python/kinds_bindings.h"

namespace nb = nanobind;

namespace {

// A clique whose rank `slow` sleeps before each flag wait: it reads what its
// writers pushed late, while they run ahead.
class SlowReader : public jo::host::LocalClique {
 public:
  SlowReader(jo::CliqueKey key, int32_t nranks, int32_t slow, int32_t slow_ms)
      : LocalClique(key, nranks), slow_(slow), slow_ms_(slow_ms) {}
  jo::Status WaitFlag(const jo::host::WaitContext& ctx, int32_t writer, int32_t flag) override {
    if (ctx.rank == slow_) std::this_thread::sleep_for(std::chrono::milliseconds(slow_ms_));
    return LocalClique::WaitFlag(ctx, writer, flag);
  }

 private:
  const int32_t slow_, slow_ms_;
};

// The program without its acknowledgement: the ops on the ack flags (the last nranks:
// build_internal.h Acknowledge).
void DropAck(jo::Program* p) {
  const int32_t acks = AckFlags(*p);
  std::vector<jo::Op> kept;
  for (const jo::Op& op : p->ops) {
    const bool flag_op = op.kind == jo::OpKind::kSignal || op.kind == jo::OpKind::kWait ||
                         op.kind == jo::OpKind::kResetFlags;
    if (!(flag_op && op.id >= acks)) kept.push_back(op);
  }
  p->ops = std::move(kept);
}

// xs[call][rank]: each call's x of each rank (bytes of x's dtype), w: the one w. Returns
// {"y": [call][rank] bytes (None where the call failed), "errors": [call][rank] str}.
nb::dict ReplayHost(const nb::dict& problem, const std::vector<std::vector<nb::bytes>>& xs,
                    const nb::bytes& w, int32_t slow_rank, int32_t slow_ms, bool drop_ack,
                    double timeout_s) {
  const jo::Problem base = jo::python::ProblemFromDict(problem);
  const int32_t n = base.nranks;
  const size_t calls = xs.size();
  std::vector<jo::Program> programs(static_cast<size_t>(n));
  for (int32_t r = 0; r < n; ++r) {
    jo::Problem q = base;
    q.rank = r;
    const jo::Status built = jo::BuildProgram(q, &programs[static_cast<size_t>(r)]);
    if (!built.ok()) throw std::invalid_argument(built.ToString());
    if (drop_ack) DropAck(&programs[static_cast<size_t>(r)]);
  }
  jo::CallNeeds needs;
  const jo::Status sized = jo::NeedsOf(base, &needs);
  if (!sized.ok()) throw std::invalid_argument(sized.ToString());
  const jo::OperandRows rows = jo::OperandRowsOf(base);
  const size_t y_bytes =
      static_cast<size_t>(base.batch * rows.y * base.cols * jo::DTypeSize(base.out_dtype));
  const size_t x_bytes =
      static_cast<size_t>(base.batch * rows.x * base.k * jo::DTypeSize(base.x_dtype));
  const size_t g_bytes =
      static_cast<size_t>(base.batch * rows.gathered * base.k * jo::DTypeSize(base.x_dtype));
  std::vector<std::vector<std::string>> x_in(calls);
  for (size_t c = 0; c < calls; ++c) {
    if (xs[c].size() != static_cast<size_t>(n)) throw std::invalid_argument("xs: one x per rank");
    for (const nb::bytes& x : xs[c]) {
      if (x.size() != x_bytes) throw std::invalid_argument("xs: x of the wrong size");
      x_in[c].emplace_back(x.c_str(), x.size());
    }
  }
  const std::string w_in(w.c_str(), w.size());
  std::vector<std::vector<std::vector<std::byte>>> ys(
      calls, std::vector<std::vector<std::byte>>(static_cast<size_t>(n)));
  std::vector<std::vector<std::vector<std::byte>>> gathered = ys;
  std::vector<std::vector<jo::Status>> results(calls,
                                               std::vector<jo::Status>(static_cast<size_t>(n)));
  {
    nb::gil_scoped_release release;
    SlowReader clique(jo::CliqueKey{0x4e9a, 0, 0x4e9a}, n, slow_rank, slow_ms);
    std::vector<std::thread> ranks;
    for (int32_t r = 0; r < n; ++r)
      ranks.emplace_back([&, r] {
        const jo::Program& program = programs[static_cast<size_t>(r)];
        for (size_t c = 0; c < calls; ++c) {
          // Each rank its own pace: a few milliseconds' jitter before its calls.
          std::this_thread::sleep_for(std::chrono::milliseconds((r * 7 + c * 3) % 5));
          jo::host::WaitContext ctx;
          ctx.op = "replay";
          ctx.rank = r;
          ctx.epoch = static_cast<int64_t>(c) + 1;
          ctx.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
          jo::Status& status = results[c][static_cast<size_t>(r)];
          status = clique.ClaimRank(&ctx, r);
          if (!status.ok()) continue;
          status = clique.Reserve(ctx, needs);
          std::vector<std::byte>& y = ys[c][static_cast<size_t>(r)];
          std::vector<std::byte>& g = gathered[c][static_cast<size_t>(r)];
          y.assign(y_bytes, std::byte{0});
          g.assign(g_bytes, std::byte{0});
          jo::CallBuffers io;
          io.x = x_in[c][static_cast<size_t>(r)].data();
          io.w = w_in.data();
          io.y = y.data();
          io.x_gathered = g_bytes > 0 ? g.data() : nullptr;
          if (status.ok())
            status = drop_ack ? jo::host::RunProgramUnsequenced(program, clique, ctx, io)
                              : jo::host::RunProgram(program, clique, ctx, io);
          clique.ReleaseRank(ctx);
        }
      });
    for (std::thread& t : ranks) t.join();
  }
  nb::list y_out, g_out, errors;
  for (size_t c = 0; c < calls; ++c) {
    nb::list y_call, g_call, e_call;
    for (int32_t r = 0; r < n; ++r) {
      const jo::Status& status = results[c][static_cast<size_t>(r)];
      const auto& y = ys[c][static_cast<size_t>(r)];
      const auto& g = gathered[c][static_cast<size_t>(r)];
      y_call.append(status.ok()
                        ? nb::object(nb::bytes(reinterpret_cast<const char*>(y.data()), y.size()))
                        : nb::none());
      g_call.append(status.ok()
                        ? nb::object(nb::bytes(reinterpret_cast<const char*>(g.data()), g.size()))
                        : nb::none());
      e_call.append(status.message());
    }
    y_out.append(y_call);
    g_out.append(g_call);
    errors.append(e_call);
  }
  nb::dict out;
  out["y"] = y_out;
  out["gathered"] = g_out;
  out["errors"] = errors;
  return out;
}

}  // namespace

void BindReplay(nb::module_& m) {
  m.def("replay_host", &ReplayHost, nb::arg("problem"), nb::arg("xs"), nb::arg("w"),
        nb::arg("slow_rank") = -1, nb::arg("slow_ms") = 0, nb::arg("drop_ack") = false,
        nb::arg("timeout_s") = 20.0,
        "Runs one replayable program per rank as len(xs) calls in a row on an in-process "
        "clique, every rank a thread at its own pace (slow_rank sleeps slow_ms before each "
        "flag wait); drop_ack takes the acknowledgement out and skips the sequencing check. "
        "{'y', 'gathered': [call][rank] bytes or None, 'errors': [call][rank] str}.");
}
