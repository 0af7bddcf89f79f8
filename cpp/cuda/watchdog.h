// The GPU-side timeout: a host thread watching every rank's queued calls.
//
// On the GPU a Wait (cuStreamWaitValue32) or an NCCL receive waits forever
// if the peer never arrives. After each enqueue, CudaSite records a `done`
// event on XLA's stream and hands it to the watchdog; a `started` event,
// recorded on XLA's stream before the call's first work, says when the GPU
// got to it. Each call has events of its own (never re-recorded while it is
// watched, however many calls the host queues behind it). A polling thread
// (it runs only while calls are pending) queries each rank's oldest pending
// call; the clock of a call starts when its `started` event is seen complete
// (the host may run far ahead of the GPU: time the call spends queued behind
// XLA's work or earlier calls does not count; those are watched themselves,
// and the calls queued behind a stuck one wait for it: it is the one that
// fires). When it is older than the call's timeout
// (JAXOVERLAP_TIMEOUT_S, the timeout_ms attribute), it
//   1. reads the rank's flags and reports, with JO_WARN, which flag from
//      which peer never arrived (or that it is stuck inside NCCL);
//   2. breaks the clique: every later call fails with that message;
//   3. releases the GPU: writes the newest epoch into the rank's flags on
//      its own stream (cuStreamWriteValue32) and aborts the clique's NCCL
//      communicators, so the streams drain instead of hanging the process.
// A call with a fused GEMM that waits (fused_gemm.h) has a fault record the
// kernel writes when its own bound (twice the timeout) ends a wait: read at the
// firing, and again once the call is done, and reported (JO_WARN) when the
// kernel gave up — its results are then garbage.
// The watchdog never waits without a bound and takes no lock of a clique
// (the communicators guard themselves: nccl_comms.h) but the one that only
// takes back its generation references (CudaClique::DeferRelease): it never
// drops the last reference to a generation or a clique where that would
// free device memory on its thread or under its lock; nor does it hold its own
// lock, which every handler's Watch takes, across a CUDA call (any of them "may
// block", CUDA driver API, "API synchronization behavior"). A call found late is
// looked at again before it is fired (it may have just finished). Its flag read and its
// release go through a stream of its own, which the driver may map onto
// the hardware queue the stuck wait blocks (CUDA_DEVICE_MAX_CONNECTIONS; the
// only queue when it is 1): then the flags are reported unreadable and the
// release of stream-memory-op waits cannot reach the GPU — the clique is
// still broken and reported, and an NCCL wait is still released (the abort
// needs no queue). docs/gpu-internals.md §1 says what that means for a process.
// The call that timed out has already returned to XLA, so its results are
// garbage; the error surfaces at the next call of the clique.
//
// Time is a test seam: the fake of CUDA (tests) puts the watchdog on a
// virtual clock, so that whether a call times out depends on the fake GPU's
// state only, never on how fast a loaded machine runs the test.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/program.h"
#include "cuda/clique/cuda_clique.h"
#include "cuda/fused/fused_gemm_launch.h"

namespace jo::cuda {

struct WatchedCall {
  std::weak_ptr<CudaClique> clique;
  int32_t rank = 0;
  int device = 0;
  // The call's own events on XLA's stream (clique_state.h): `started` before its first work,
  // `done` after it; never re-recorded while held here.
  std::shared_ptr<const CallEvents> events;
  int64_t epoch = 0;
  std::weak_ptr<const Generation> gen;             // the clique frees it once every rank is past it
  std::vector<std::pair<int32_t, int32_t>> waits;  // (flag id, writer) of the program's Waits
  bool nccl = false;
  // A fused GEMM that waits: its fault record (device memory, the rank's pool), the page-locked
  // buffer it is read into, and the flag id of its first row block (block b waits for flag
  // fused_wait_flags + b). Null: none.
  const FusedGemmFault* fault = nullptr;
  std::shared_ptr<PinnedHost> fault_read;
  int32_t fused_wait_flags = -1;
  std::string op;
  std::chrono::milliseconds timeout{0};
};

// Registers the newest call of (clique, rank), after the rank's earlier ones.
void Watch(WatchedCall call);

// Reports, once, with JO_WARN, aborts of `comms` (a clique's, named `clique`) still running
// `timeout` after this call, the watchdog's clock: ncclCommAbort frees device memory, which waits
// for the device's other work, so an abort can hang (NCCL issue #549); nobody waits for one, so
// this is where it is said while it happens (the clique's description names it too).
void WatchAborts(std::weak_ptr<const NcclComms> comms, std::string clique,
                 std::chrono::milliseconds timeout);

// The one-launch all-reduce (docs/gpu-internals.md §7) has no call of its own to watch (a replayed
// call runs no host code): its kernel bounds its waits itself and records why it gave up in the
// clique's kernel area (a fault record per local rank, page-locked host memory). The watchdog
// reads those records on every pass while the clique lives (plain host reads: nothing
// enqueued); the first fault found is reported with JO_WARN and breaks the clique. Registering
// an area again is a no-op. A replayable program's buffers (CudaClique::ReplayArea,
// KernelArea::replay) are watched the same way: their records are its bounded flag waits'
// (kernels/flag_wait_body.h) and its fused GEMM's (fused_gemm_launch.h), reported naming the
// collective (KernelArea::op), the rank, the flag and the peer that raises it.
void WatchKernelArea(std::weak_ptr<CudaClique> clique, std::weak_ptr<const KernelArea> area,
                     std::chrono::milliseconds timeout);

// For info() and tests: number of ranks with pending calls.
int PendingWatches();

// Tests only (the fake of CUDA), before the first Watch: no thread is started
// and the watchdog's clock stands still but for AdvanceWatchdogClock, which
// moves it on by `by` and runs, on the calling thread, the checks the thread
// would have run meanwhile (every 20 ms; the flag read's wait moves it too).
void UseVirtualWatchdogClock();
void AdvanceWatchdogClock(std::chrono::milliseconds by);

// Tests only: `hook` runs when the watchdog is about to fire a call a pass found late — after it
// took the call's generation reference, before it looks at the call again — the moment in
// which the call can still finish and the clique move past its generation. Empty: none.
void SetWatchdogFireHook(std::function<void()> hook);

}  // namespace jo::cuda
