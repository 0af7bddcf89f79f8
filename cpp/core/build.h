// Program builders: Problem -> Program for every collective x transport.
//
// Algorithms (docs/native.md has the pictures):
//  * ring (transports nccl and p2p): shards travel cw_steps hops clockwise
//    (rank -> rank+1) and ccw_steps hops counter-clockwise. Unidirectional:
//    (N-1, 0). Bidirectional: (ceil((N-1)/2), floor((N-1)/2)) — every shard
//    travels whole, half-way round each direction, so each rank receives
//    every other shard exactly once, sends exactly N-1 shards (the ring lower
//    bound) and the transfer takes ceil((N-1)/2) steps.
//  * multicast: AG stores each shard once into every rank's workspace; RS
//    writes all partials into the own workspace and rank r load-reduces its
//    row block over all ranks.
//  * GEMM+AR: the RS ring followed by an all-gather ring of the reduced
//    blocks (each rank sends 2(N-1) blocks, the ring all-reduce bound); on
//    multicast, rank r load-reduces row block r and stores the result to
//    every rank (build_ar.cc).
// Each shard (AG) or row block (RS, AR) is split into `chunks` sub-chunks of
// rows that move and multiply separately, so the pipeline fills sooner.
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
