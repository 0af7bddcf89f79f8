// The fake's misuse suites: the fake must fail loudly on what it does not
// model and on misuse, or the executor's tests on it prove nothing. Each
// check does one wrong thing (or its control, the right thing) through the
// real API names and reports what the fake recorded; tests/cuda/test_fake.py
// and test_fake_waits.py hold every check to the error it must give.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace jo::fake {

// For the suites (fake_wait_checks.cc): a new non-blocking stream on `device`,
// which is left current.
cudaStream_t StreamOn(int device);
// NCCL connects to a peer at the first send/recv to it, allocating device
// memory, which waits for the device: one one-element send and receive each
// way between ranks 0 and 1 of `comms` (devices 0 and 1).
void ExchangeOnce(ncclComm_t comms[2]);
// The first algorithm cuBLASLt's heuristic offers for `d` on layouts a, b, c,
// d_layout, with every matrix promised `align` bytes of alignment (0: none).
cublasLtMatmulHeuristicResult_t FirstAlgo(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                          cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                          cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d_layout,
                                          uint32_t align = 0);

// Misuse of CUDA, cuBLASLt and NCCL (fake_misuse_checks.cc): check name -> the
// first error the fake recorded ("" = not caught, right for a control).
std::map<std::string, std::string> MisuseChecks();

// The rules about host calls that wait for the GPU (fake_wait_checks.cc),
// likewise.
std::map<std::string, std::string> WaitMisuseChecks();

// cuBLASLt's FP8 rules (fake_fp8_checks.cc), likewise; tests/cuda/test_fp8.py.
std::map<std::string, std::string> Fp8MisuseChecks();

// Stream capture of several streams and graph replay (fake_graph_checks.cc), likewise;
// tests/cuda/test_fake.py.
std::map<std::string, std::string> GraphChecks();

// The reduction beside a release-only fused GEMM (fake_reduce_checks.cc), likewise;
// tests/cuda/test_fused_fake.py.
std::map<std::string, std::string> ReduceMisuseChecks();

// The bounded flag-wait kernel's launches the fake refuses, and its wait given up and recorded
// (fake_flag_wait_checks.cc): check name -> the first error, or the fault record it wrote.
std::map<std::string, std::string> FlagWaitMisuseChecks();

// The watchdog's NcclComms::Abort racing an enqueue, as NcclComms orders
// them (fake_misuse_checks.cc): an "enqueue" thread takes rank 0's lease
// (hold_lease) or takes the communicators and drops the lease at once (the
// misuse a lease prevents); then a "watchdog" thread aborts the clique's
// communicators while the enqueue thread waits; then the enqueue thread
// issues NCCL calls on the communicators it got and drops the lease.
struct LeaseRaceOutcome {
  int64_t aborts_when_abort_returned = 0;  // ncclCommAbort calls done when Abort returned
  int64_t aborts_at_end = 0;
  std::string acquire_after_abort;  // a new Acquire's error ("" if it succeeded)
  std::vector<std::string> errors;  // what the fake recorded
};
Status LeaseRace(bool hold_lease, LeaseRaceOutcome* out);

// An abort that does not return, and the watchdog saying so (fake_misuse_checks.cc): rank 0 of a
// two-rank NcclComms has a send nobody receives in flight; when `stuck`, behind it on its device
// a wait for a flag raised only at the end, so that ncclCommAbort, which waits for the device's
// other work, cannot return. Abort, WatchAborts (200 ms), the watchdog's clock moved on by 300 ms.
struct StuckAbortOutcome {
  std::string warning;              // the watchdog's warning ("" if none)
  std::vector<std::string> errors;  // what the fake recorded
};
Status StuckAbort(bool stuck, StuckAbortOutcome* out);

// A call the watchdog found late finishing before it is fired (cuda/watchdog.cc): one rank's
// call on device 0 waits for a flag past the call's timeout (200 ms, the watchdog's virtual
// clock); when `finish`, the watchdog's fire hook (after it took the call's generation reference,
// before it looks again) raises the flag, lets the fake GPU finish the call and drops the test's
// own reference to the generation — the clique moving past it, so that the watchdog's is the
// last. Then the watchdog must not fire, and must not free the generation on its thread (it
// hands it back to the clique, which frees it at teardown here). Control (!finish): it fires.
struct LateCallOutcome {
  std::string warning;                    // the watchdog's warning ("" if none)
  std::string broken;                     // the clique's broken reason ("" if not broken)
  bool gen_alive_after_watchdog = false;  // the generation outlived the watchdog's pass
  bool gen_freed_with_clique = false;     // ... and was freed when the clique was dropped
  int pending_after = -1;                 // ranks still watched after the pass
  std::vector<std::string> errors;        // what the fake recorded
};
Status LateCall(bool finish, LateCallOutcome* out);

// The watchdog's lock against a CUDA query that blocks (cuda/watchdog.cc): a call stuck on device
// 0 is watched; the watchdog's pass (on another thread, its clock moved on) queries its events,
// and that query blocks (SetEventQueryHook) until released; meanwhile a handler's Watch of a new
// call must return: the pass must not hold the watchdog's lock across the query. After 2 s the
// check records that it did not, and releases the query.
struct WatchdogQueryRaceOutcome {
  bool query_blocked = false;  // the pass reached the query (and blocked in it)
  bool watch_waited = false;   // Watch did not return while the query blocked
  std::vector<std::string> errors;
};
Status WatchdogQueryRace(WatchdogQueryRaceOutcome* out);

// The GEMM cache's locks (cuda/gemm/gemm.cc) against a set-up that waits for the device: device 0
// waits for a flag; one rank's thread prepares a GEMM of a new shape there (its warm-up's lazy
// kernel load waits for the device, so for the flag) while another, between its
// handler's first enqueue and its return, enqueues a GEMM prepared before and joins the
// warm-ups, then (handler returned) raises the flag. The enqueue must not wait for the set-up:
// if it does, nothing raises the flag, and after 20 s of real time the check records
// it and raises the flag itself, so that it ends either way.
struct GemmSetUpRaceOutcome {
  bool enqueue_waited = false;      // the enqueue had not returned within the bound
  std::string set_up, enqueue;      // their statuses ("" = ok)
  std::vector<std::string> errors;  // what the fake recorded
};
Status GemmSetUpRace(GemmSetUpRaceOutcome* out);

}  // namespace jo::fake
