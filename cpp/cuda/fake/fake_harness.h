// What the tests drive (jaxoverlap._cuda_fake, which only binds this): the
// CUDA executor and the fake reset together, and calls played on every rank
// of a clique as XLA makes them. The misuse suites are in fake_checks.h.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/program.h"
#include "core/status.h"
#include "cuda/fake/fake_runtime.h"

namespace jo::fake {

// Forgets every clique, cache and verdict of the CUDA executor and the
// played XLA streams (PlayCalls), then resets the fake to `config`; unless
// the config says otherwise, time that passes while the fake's GPU is stuck
// moves the watchdog's virtual clock (cuda/watchdog.h).
void ResetExecutorAndFake(Config config);

// Calls of one call site (one custom call of one executable) on every rank
// of a clique, one host thread per rank as XLA has one per device, through
// CudaSite::Enqueue — what the CUDA FFI handlers call — on a stream standing
// for XLA's; then the fake's GPU runs the queued work (Drain).
struct PlayedCalls {
  // The canonical problem (core/program.h) without its rank; the call site's
  // attributes follow from it (axis 0, the rank table below).
  Problem problem;
  // Per rank: x and w, bytes in the layout the handler receives (an fp8 w
  // K-major: [cols, k] row-major, cuda/gemm/gemm.h), and x's and w's scales
  // (float32 device scalars; empty: 1).
  std::vector<std::string> xs, ws;
  std::vector<float> x_scales, w_scales;
  // Per rank, a block-scaled problem's (Problem::block_scaled): x's and w's e8m0 block scale
  // bytes as the CUDA executor takes them (cuBLAS's 128x4-tiled layout, cuda/gemm/gemm.h).
  std::vector<std::string> x_block_scales, w_block_scales;
  std::vector<int64_t> devices;  // per rank: its device (ordinal in its played process)
  // Per rank: the played process it belongs to (none: all in process 0). A
  // clique spanning played processes is one clique object per process, as in
  // distinct processes, and gets a played exchange per process (unless a test
  // registered its own).
  std::optional<std::vector<int64_t>> processes;
  std::map<int32_t, std::string> hosts;  // the machine a played process pretends to run on
  int64_t clique_key = 1;
  // Per rank: the site key of a call site of its own, instantiated on the
  // rank's thread as each process compiles its own program (equal keys: the
  // same site). None: one call site of key clique_key shared by every rank.
  std::optional<std::vector<int64_t>> site_keys;
  int calls = 1;  // back-to-back calls per rank
  // Per call, its chunks (empty: the problem's, `calls` times): calls of several call sites
  // (one per number of chunks) whose needs differ, as the rows of the selftest on one clique
  // (new cuBLASLt plans, workspace).
  std::vector<int64_t> chunks_per_call;
  int skew_rank = -1;  // this rank disagrees on the call (one more chunk)
  int skip_rank = -1;  // this rank never makes the call
  // This rank is late from call `late_from` on: it starts each such call only once every other
  // rank has returned from it (bounded: 20 s of real time), so that its peers' calls are
  // enqueued — and wait for it on the GPU — while it sets its own up.
  int late_rank = -1;
  int late_from = 0;
  int64_t timeout_ms = 120000;
  // XLA records the call into a command buffer (a CUDA graph) and replays it: after the `calls`
  // ordinary executions, each rank's thread captures one more call of the site on its stream
  // (the handler runs under capture), and the graphs are then launched `replays` times, the
  // x of replay i being replay_xs[i] (per rank; none: x unchanged) — XLA replays with the same
  // buffers, new contents. replay_late_rank >= 0: each replay launches every other rank's graph
  // and lets the fake GPU run as far as it can before launching that rank's. capture_any: the
  // handler records even a program that does not replay (it refuses otherwise): the misuse
  // check of a host-side epoch baked into a graph.
  bool capture = false;
  int replays = 0;
  std::vector<std::vector<std::string>> replay_xs;
  int replay_late_rank = -1;
  // This rank does not launch its graph in the last replay (a peer that never comes).
  int replay_skip_rank = -1;
  // Tests: rank r's y starts y_offsets[r] bytes into its allocation ([]: 0 for all), as an
  // output buffer less aligned than XLA's.
  std::vector<int64_t> y_offsets;
  bool capture_any = false;
  // XLA's stream of every rank first waits for a flag the host raises only
  // after the watchdog's clock moved on by hold_ms (earlier work the GPU is
  // still busy with).
  int64_t hold_ms = 0;
  // A rank whose set-up is slow (a loaded host): the first cudaEventQuery of any rank's thread
  // (a set-up's poll of its zero-fill or connection) pauses this long, in real time.
  int64_t setup_pause_ms = 0;
};

struct PlayedOutcome {
  std::vector<std::string> ys;                      // per rank: y, bytes
  std::vector<std::string> x_gathered;              // per rank (ag_matmul with return_gathered)
  std::vector<std::string> statuses;                // per rank: "" or the error text
  bool drained = false;                             // false: the fake's GPU deadlocked
  std::vector<std::vector<std::string>> replay_ys;  // per replay, per rank: y
  std::vector<bool> replay_drained;                 // per replay
};

// InvalidArgument when the inputs do not fit the problem; the calls' own
// failures are in the outcome's statuses.
Status PlayCalls(const PlayedCalls& calls, PlayedOutcome* out);

}  // namespace jo::fake
