// The host executor: runs one rank's Program on the CPU.
//
// Each stream is a thread (stream 0 on the calling worker) executing its
// ops in FIFO order; Record/StreamWait are in-process events; Signal/Wait,
// Send/Recv and the workspace go through the HostClique, so a p2p program
// really waits on flags raised by the peer rank's thread. GEMMs and
// reductions run in f32 (bf16/f16 converted on the way in and out).
#pragma once

#include <chrono>

#include "core/program.h"
#include "core/status.h"
#include "host/host_clique.h"

namespace jo::host {

struct HostBuffers {
  const void* x = nullptr;
  const void* w = nullptr;
  void* y = nullptr;
  void* x_gathered = nullptr;  // required iff the program writes XGATHERED
};

// Runs `program` as call `epoch` of `clique`. The caller has run
// clique.Prepare for this program's workspace and flags. On failure the
// clique is broken (its peers stop waiting) and the error names the op.
Status RunProgram(const Program& program, HostClique& clique, int64_t epoch,
                  const HostBuffers& io, std::chrono::milliseconds timeout, const char* op_name);

}  // namespace jo::host
