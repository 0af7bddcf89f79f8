// Program builders: Problem -> Program for every op x transport. BuildProgram
// checks the problem and calls the op's builder (core/kinds.h, JO_OPS; one
// file each, build_<op>.cc), which writes the programs of the transport's
// mechanism (docs/native.md §3 has the pictures):
//  * rings (messages and peer copies: nccl, p2p): blocks travel cw_steps hops
//    clockwise (rank -> rank+1) and ccw_steps hops counter-clockwise.
//    Unidirectional: (N-1, 0). Bidirectional: (ceil((N-1)/2), floor((N-1)/2))
//    — every block travels whole, half-way round each direction, so each rank
//    receives every other block exactly once, sends exactly N-1 (the ring
//    lower bound) and the transfer takes ceil((N-1)/2) steps.
//  * multicast: stores each block once into every rank's workspace through
//    the switch, or load-reduces a row block over all ranks' workspaces.
// Each shard or row block is split into `chunks` sub-chunks of rows that move
// and multiply separately, so the pipeline fills sooner.
#pragma once

#include "core/program.h"
#include "core/status.h"

namespace jo {

// Checks the problem and builds the program of `problem.rank`.
Status BuildProgram(const Problem& problem, Program* program);

// The dtypes a call may have (core/program.h, Problem): InvalidArgument naming
// them otherwise.
Status CheckDTypes(const Problem& problem);

// Ring step counts (clockwise, counter-clockwise) for N ranks.
void RingSteps(int32_t nranks, bool bidirectional, int32_t* cw, int32_t* ccw);

}  // namespace jo
