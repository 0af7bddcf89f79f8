// One collective-matmul call on the host executor, with no XLA types: find
// the clique, take the epoch, build the program, prepare the workspace and
// run. The FFI handlers decode and check their operands, then call this.
#pragma once

#include <cstdint>
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
  int64_t timeout_ms = 120000;
  int64_t device = -1;       // the calling device (global id on CPU), -1 if unknown
  HostBuffers io;
};

Status HostCall(const CallArgs& args);

// Multi-process cliques (cpp/host/shm_clique.h), called by the Python
// bootstrap (jaxoverlap/_bootstrap.py) at trace time, before any call runs.
// rank_process[r] is the process index of rank r; `process` is ours.
// The leader (the process of rank 0) creates the control segment and returns
// its name for the key-value store; the others attach to it by name.
Status CreateShmClique(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, std::string* name);
Status AttachShmClique(int64_t clique_key, int64_t group, const std::vector<int32_t>& rank_process,
                       int32_t process, const std::string& name);
bool HasClique(int64_t clique_key, int64_t group);
bool ForgetClique(int64_t clique_key, int64_t group);  // after a failed bootstrap

// Test hook: the next `calls` calls of rank `rank` (any clique) return at
// once without taking part, so their peers must time out.
void SetTestSkip(int32_t rank, int64_t calls);
// Tests only: forgets every clique (a broken clique stays broken otherwise).
void ResetCliques();
// For info(): one line per clique.
std::string DescribeCliques();

}  // namespace jo::host
