// The fake's misuse suites: the fake must fail loudly on what it does not
// model and on misuse, or the executor's tests on it prove nothing. Each
// check does one wrong thing (or its control, the right thing) through the
// real API names and reports what the fake recorded; tests/cuda/test_fake.py
// and test_fake_waits.py hold every check to the error it must give.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace jo::fake {

// Misuse of CUDA, cuBLASLt and NCCL (fake_misuse_checks.cc): check name -> the
// first error the fake recorded ("" = not caught, right for a control).
std::map<std::string, std::string> MisuseChecks();

// The rules about host calls that wait for the GPU (fake_wait_checks.cc),
// likewise.
std::map<std::string, std::string> WaitMisuseChecks();

// cuBLASLt's FP8 rules (fake_fp8_checks.cc), likewise; tests/cuda/test_fp8.py.
std::map<std::string, std::string> Fp8MisuseChecks();

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

}  // namespace jo::fake
