// Bounds, dtypes and ids of a program, checked before anything runs it.
//
// A builder bug that put an offset one block too far would otherwise make an
// executor write silently into a neighbour's memory (another rank's workspace
// half, another call's buffer). Every Ref an op touches must lie inside its
// buffer; peers, flags, events, streams and workspace owners must be in range;
// a block op moves between buffers of one dtype, a Gemm reads x's and w's
// dtypes and writes the output type, its scales are float32 scale slots.
// BuildProgram checks what it builds against the sizes the program declares;
// an executor checks again against the buffers it actually has.
#pragma once

#include <cstdint>

#include "core/program.h"
#include "core/status.h"

namespace jo {

// Elements of each buffer a program may touch (per rank, per parity for the
// workspace and its scale slots). Of() gives the call's own sizes from its
// program.
struct BufferSizes {
  int64_t x = 0, w = 0, y = 0, x_gathered = 0, scratch = 0, workspace = 0;
  int64_t x_scale = 0, w_scale = 0, scratch_scales = 0, workspace_scales = 0;
  static BufferSizes Of(const Program& program);  // workspace = program.workspace_elems
};

// A replayable program (Problem::replayable) must also keep the sequencing
// rules that make replaying it safe (check_program.cc CheckReplayable; `sequencing`
// false skips them: only the misuse tests, which show what they prevent).
Status CheckProgram(const Program& program, const BufferSizes& sizes, bool sequencing = true);

}  // namespace jo
