// One collective-matmul call on the host executor, with no XLA types: find
// the clique, take the epoch, build the program, prepare the workspace and
// run. The FFI handlers decode and check their operands, then call this.
//
// Calls are asynchronous (StartHostCall): XLA:CPU may run an independent XLA
// collective on some devices while others run our call, so blocking the
// device thread on peers can deadlock (docs/native.md §4).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/program.h"
#include "core/status.h"
#include "host/executor.h"

namespace jo::host {

struct CallArgs {
  Problem problem;           // op, transport, nranks, rank, shape, dtype, chunks, ...
  int64_t clique_key = 0;
  int64_t group = 0;
  int64_t site = 0;          // call site (NewCallSite), 0 if none
  int64_t timeout_ms = 120000;
  int64_t device = -1;       // the calling device (global id on CPU), -1 if unknown
  HostBuffers io;
};

// Starts a call. The part that fixes the call's place in this rank's order
// (program, clique, epoch) runs on the calling thread; claiming the rank,
// the workspace and the program run on a worker thread, which finally calls
// `done` with the result (also for failures of the synchronous part, which
// are reported inline on the calling thread). `done` runs after every
// resource of the call is released and may run for a long time (it
// completes XLA's future; XLA may continue the device's program inline).
void StartHostCall(const CallArgs& args, std::function<void(const Status&)> done);

// Call sites. A call site is one custom-call instruction of one executable;
// the FFI instantiate stage runs once per call site (for all local devices)
// and takes a site id here: the ordinal of this call site among those with
// the same clique_key created in this process (1, 2, ...). Every process
// compiles the same programs in the same order and XLA instantiates an
// executable's thunks in program order, so every process derives the same
// ids. ForgetCallSite drops the site's cliques when the executable goes.
int64_t NewCallSite(int64_t clique_key);
void ForgetCallSite(int64_t clique_key, int64_t site);

// Multi-process cliques: the domain of one group of a mesh axis
// (cpp/host/shm_domain.h), made by the Python bootstrap
// (jaxoverlap/_bootstrap.py) at trace time, before any call runs; every call
// site of the group then gets its own clique in it (cpp/host/shm_clique.h).
// rank_process[r] is the process index of rank r; `process` is ours;
// `attempt` names the bootstrap attempt (agreed through the store). The
// leader (the process of rank 0) creates the control segment and returns its
// name for the key-value store; the others attach to it by name. A broken
// domain is replaced by the next bootstrap (its call sites keep the old one).
Status CreateShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, std::string* name);
Status AttachShmDomain(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, int64_t attempt, const std::string& name);
// "absent", "ok" or "broken".
std::string DomainState(int64_t clique_key, int64_t group);
// Marks the domain broken (a failed bootstrap): its processes' calls fail fast.
void BreakDomain(int64_t clique_key, int64_t group, const std::string& reason);
bool ForgetDomain(int64_t clique_key, int64_t group);

// Test hook: the next `calls` calls of rank `rank` (any clique) return at
// once without taking part, so their peers must time out.
void SetTestSkip(int32_t rank, int64_t calls);
// Tests only: forgets every clique (a broken clique stays broken otherwise).
void ResetCliques();
// For info(): one line per clique.
std::string DescribeCliques();

}  // namespace jo::host
