// Multi-process GPU cliques: what a process learns about a clique at trace
// time, before the first execution needs it.
//
// A clique whose ranks live in different processes (one process per GPU,
// SLURM style) cannot make its NCCL communicators in one process: every
// process calls ncclCommInitRankConfig for its own ranks with one ncclUniqueId,
// made by the process of rank 0. That id travels through the jax.distributed
// key-value store at trace time (jaxoverlap/_executors/bootstrap.py
// broadcast_bytes), and lands here, keyed by (clique key, group, process),
// until CudaCall creates the clique at its first execution. The process is
// part of the key only so that the host-side fake test can play several
// processes in one; in a real process it is always jax.process_index().
//
// What works across processes: transport nccl; p2p and multicast through
// RegisterExchange's jo::Exchange (buffer handles per generation, CUDA IPC
// or fabric, and the multicast object's handle; cuda_clique.h).
#pragma once

#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "core/exchange.h"
#include "core/status.h"

namespace jo::cuda {

// ncclGetUniqueId, as bytes (NCCL_UNIQUE_ID_BYTES).
Status NewNcclUniqueId(std::string* out);

// Remembers the id of clique (clique_key, group) for `process`; a second id
// for the same clique replaces the first only if no clique was created from it.
Status RegisterNcclId(int64_t clique_key, int64_t group, int64_t process, const std::string& id);

// The registered id, or an error saying that this process never traced the call.
Status FindNcclId(int64_t clique_key, int64_t group, int64_t process, const std::string& who,
                  ncclUniqueId* out);

// The clique's exchange among its processes (jo::Exchange over the
// jax.distributed store, registered at trace time), for what can only be
// exchanged once buffers exist: which kind of handle (fabric or CUDA IPC),
// the handles of each new buffer generation of a p2p or multicast clique
// spanning processes, and the multicast object (CudaClique::NewGeneration,
// at the first execution and when a call needs bigger buffers — never under
// graph capture). Kept for the life of the process (the registry holds a
// reference, so no clique ever drops the last one from a GPU thread).
Status RegisterExchange(int64_t clique_key, int64_t group, int64_t process,
                        std::shared_ptr<Exchange> exchange);
std::shared_ptr<Exchange> FindExchange(int64_t clique_key, int64_t group, int64_t process);

// Tests only: forgets every id and exchange.
void ForgetNcclIds();

}  // namespace jo::cuda
