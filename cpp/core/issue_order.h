// The order in which an executor hands one rank's program to the device.
//
// A Program gives each stream its ops in list order; an executor that runs
// streams as independent queues (the host executor: one thread per stream)
// needs nothing more. A GPU does not: CUDA multiplexes a device's streams
// onto CUDA_DEVICE_MAX_CONNECTIONS hardware work queues (default 8;
// Megatron-LM and TransformerEngine jobs set 1), each a FIFO, and an item
// that waits — cuStreamWaitValue32 on a flag, cudaStreamWaitEvent, a stream
// whose previous work is not done — blocks everything behind it in its queue
// (CUDA driver API reference, "Stream Memory Operations": "Improper use of
// these APIs may deadlock the application ... the scheduler [may] serialize
// them in an improper order"). So the order in which the host issues the
// ops of different streams matters: a wait issued before the copy that
// would satisfy a peer's wait, whose signal this wait needs, deadlocks once
// both share a queue.
//
// IssueOrder gives every rank an order that cannot: it plays the whole
// clique's programs forward with ONE FIFO per device, issuing on each rank
// only what can run at once given what the peers have issued before, so the
// order is itself a complete single-queue execution. With more queues each
// queue sees a subsequence of this order, and every dependency still points
// backwards, so it completes with any number of queues and any mapping of
// streams onto them.
//
// The play is in rounds. In each round every rank issues, in list order of
// preference, every unit whose dependencies are met by what the peers had
// issued before the round and what the rank itself has issued: a Wait needs
// its flag raised, a StreamWait its event recorded, a FusedGemm every flag
// its kernel waits for raised (so everything those flags depend on is
// enqueued before it, on every rank: the kernel holds every SM and never
// waits for work behind it; its releases count as raised one block per
// round after it is issued, in its order, so that what needs only its first
// blocks is issued before what waits for its last), an NCCL group is
// launched (and the rest of its stream waits until its peers have launched
// the matching group: NCCL send/recv are rendezvous), everything else only
// needs the ops before it on its stream. Peers' effects become visible at
// the end of the round, so every rank's order has the same shape. Preferring
// list order keeps the builders' intent (e.g. a GEMM before the copy of an
// earlier result) wherever dependencies leave a choice.
#pragma once

#include <cstdint>
#include <vector>

#include "core/program.h"
#include "core/status.h"

namespace jo {

// One unit of issue: one op, or the consecutive Send/Recv ops of one stream
// and bundle (issued together: one NCCL group). ops [begin, end).
struct IssueUnit {
  int32_t begin = 0;
  int32_t end = 0;
};

// The units of `program` in list order.
std::vector<IssueUnit> IssueUnits(const Program& program);

// The issue order of `problem.rank`'s program (its units, each once, the
// ops of each stream in list order). Builds every rank's program and plays
// them as described above; an error names the blocked ops if the programs
// cannot complete with one queue per device (a builder bug). Cached per call
// signature.
Status IssueOrder(const Problem& problem, std::vector<IssueUnit>* order);

// The round of the play in which each unit of `problem.rank`'s issue order was issued. The
// units of every rank of a clique, taken round by round, rank by rank, each rank's in its
// order, are one order in which every dependency points backwards: what host threads that
// share a device's work queues must enqueue (the CUDA loopback runner, several ranks on one
// GPU). Cached with the orders.
Status IssueRounds(const Problem& problem, std::vector<int32_t>* rounds);

}  // namespace jo
