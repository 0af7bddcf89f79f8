// The loopback: N ranks' calls on ONE GPU, for a first contact with a
// single GPU (`python -m jaxoverlap selftest --loopback N`).
//
// Each rank is what it is across GPUs — its own x, w and y, its own streams
// (XLA's stands for one per rank), its own clique resources (workspace, flags,
// scratch, pool) — and reaches its peers' buffers as memory of the same
// device: the copy engine and the flag protocol as across GPUs, the GEMMs and
// the fused GEMM as they are. One thread per rank calls CudaSite::Enqueue, as
// XLA's thread per device does, naming its rank (several ranks share the
// device's ordinal: core/call.h, Place).
//
// The ranks share the device's hardware work queues, which the issue order
// (core/issue_order.h) does not expect: it makes each rank's order complete
// with one queue per device, given what the peers issued before. So the
// ranks' threads issue their units in one global order, the play's (the
// units of every rank round by round, rank by rank: IssueRounds), through an
// IssueGate (executor.h); in it every dependency points backwards, so it
// completes on any number of queues, one included, as the issue order does
// across GPUs. Set-up (reservation, pools, plans) is not gated.
//
// What a single GPU cannot show: anything between two GPUs (NVLink, peer
// access, the interconnect's ordering of remote writes), NCCL (one rank per
// device per communicator) and multicast (one memory per device): those
// transports are refused here. Peer copies are copies within one device: CUDA
// documents their overlap with kernels only on devices that run kernels
// concurrently (programming guide, "Overlap of Data Transfer and Kernel
// Execution"), so a fused row that stalls here may not stall across GPUs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/program.h"
#include "core/status.h"

namespace jo::cuda {

struct LoopbackCalls {
  Problem problem;  // without its rank
  // Per rank: x and w as the handler receives them (an fp8 w K-major: [cols, k] row-major), and
  // x's and w's float32 scales (empty: 1).
  std::vector<std::string> xs, ws;
  std::vector<float> x_scales, w_scales;
  int device = 0;
  int calls = 1;  // back-to-back calls per rank
  int64_t clique_key = 1;
  int64_t timeout_ms = 120000;
  // Tests: false lets each rank's thread issue its own order at will, as across GPUs, and at
  // the most uneven speeds: rank r's thread starts once rank r - 1's has returned. With shared
  // work queues a rank's waits then block the peers' work they wait for: what the global order
  // is for.
  bool ordered = true;
};

struct LoopbackOutcome {
  std::vector<std::string> ys;        // per rank: y, bytes
  std::vector<std::string> statuses;  // per rank: "" or the error text
  bool completed = false;             // every rank's work finished on the GPU in time
};

// What differs between a GPU and the host-side fake, which runs the same runner: the host
// thread of a rank (the fake counts them), a handler's bounds (the fake checks what runs
// between them), moving bytes between the host and device memory, and what follows the GPU's
// finishing the calls (`finished`, optional: the fake's watchdog clock stands still, so it lets
// one pass of it go by, which drops the finished calls and their buffer generations; a GPU's
// watchdog passes on its own).
struct LoopbackHooks {
  std::function<std::shared_ptr<void>()> rank_thread;  // held for the thread's life
  std::function<void(cudaStream_t)> begin_handler;
  std::function<void(cudaStream_t, const std::string& who)> end_handler;
  std::function<Status(void* device, const void* host, size_t bytes)> upload;
  std::function<Status(void* host, const void* device, size_t bytes)> download;
  std::function<void()> finished;
};

// Runs `calls.calls` calls on every rank, all on `calls.device`, and waits (polling, at most
// twice the timeout and then some, up to 10 s: the watchdog reports a call stuck for a peer
// after one and releases it, a fused GEMM's own bound ends its wait after two) for the GPU to
// finish them. Transports other than p2p are refused by the executor (the calls' statuses).
// InvalidArgument when the inputs do not fit the problem; the calls' own failures are in the
// outcome.
Status RunLoopback(const LoopbackCalls& calls, const LoopbackHooks& hooks, LoopbackOutcome* out);

}  // namespace jo::cuda
