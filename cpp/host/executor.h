// The host executor: runs one rank's Program on the CPU.
//
// Each stream is a thread (stream 0 on the calling worker) executing its
// ops in FIFO order; Record/StreamWait are in-process events; Signal/Wait,
// Send/Recv and the workspace go through the HostClique, so a p2p program
// really waits on flags raised by the peer rank's thread. GEMMs and
// reductions run in f32 (bf16/f16 converted on the way in and out).
#pragma once

#include "core/call.h"
#include "core/program.h"
#include "core/status.h"
#include "host/host_clique.h"

namespace jo::host {

// Runs `program` as call ctx.epoch of `clique` (ctx names the op, the rank
// and the timeout). The caller has reserved the clique's buffers for it.
// First the program is checked against the buffers it gets
// (core/check_program.h). On failure the clique is broken (its peers stop
// waiting) and the error names the op.
Status RunProgram(const Program& program, HostClique& clique, const WaitContext& ctx,
                  const CallBuffers& io);

// The misuse tests only: runs a replayable program without its sequencing
// rules checked (core/check_program.h), to show what breaking them does.
Status RunProgramUnsequenced(const Program& program, HostClique& clique, const WaitContext& ctx,
                             const CallBuffers& io);

}  // namespace jo::host
