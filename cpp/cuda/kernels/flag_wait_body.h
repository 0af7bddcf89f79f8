// A bounded wait for one flag, as a kernel of one thread: what a replayable program's waits for
// a peer's flag (docs/gpu-internals.md §8) run instead of cuStreamWaitValue32, which has no
// bound. ONE source, compiled by nvcc for the GPU (flag_wait.cu) and by the host compiler for
// the fake (fake/fake_flag_wait.cc), which runs the same polls.
//
// The thread polls the flag with ld.acquire.sys until it is at or past the value (the cyclic
// comparison of stream memops' GEQ), sleeping between polls. A flag not reached `timeout_ns`
// (the GPU's %globaltimer) after the first poll that missed it is recorded in the rank's fault
// record (page-locked host memory the watchdog reads), and then the kernel executes `trap`
// (PTX ISA, "trap": "Abort execution and generate an interrupt to the host CPU"): the error is
// sticky, so no later copy, memop or kernel of the rank runs — a replay runs no host code, so
// nothing but the device can stop the rank's next pushes into a peer that may still be reading
// — and XLA sees the failure at its next synchronisation. PyTorch's symmetric-memory signal
// waits end their timeouts the same way (torch/csrc/distributed/c10d/symm_mem,
// CUDASymmetricMemory-inl.h: a message, then __trap()). Two waits of one rank that give up
// together: the one that claims the record writes it and traps; the other keeps polling until
// that trap ends it, so the record is whole before the context dies.
//
// Ordering (PTX ISA, "Memory Consistency Model",
// https://docs.nvidia.com/cuda/parallel-thread-execution/#memory-consistency-model):
//  * what the wait orders: the stream's later work starts after the kernel ends ("API
//    synchronization": the completion of a task in a stream synchronizes with the start of the
//    next), and the kernel ends only after a poll saw the value, so the rank's later writes (its
//    ResetFlags, its next call's pushes) come after the peer raised the flag, and what the peer
//    did before raising it (its completed reads, its completed copies: stream order on the
//    peer) came before.
//  * what is assumed, not documented: the peer raises the flag with cuStreamWriteValue32, a
//    stream memory operation, which is not an operation of the PTX model (it has no scope), so
//    "the acquire synchronizes with it" is not a documented relation; the driver API's
//    CU_STREAM_WAIT_VALUE_FLUSH says "the device is permitted to reorder remote writes
//    internally", which a kernel's poll has no flag for. So a wait whose stream then READS what
//    the peer pushed is followed by a cuStreamWaitValue32 with FLUSH on the same flag (already
//    reached: it returns at once, and flushes); the acknowledgement waits read nothing. That the
//    reset of an acknowledgement (a stream memop on the writer) is ordered after the reader's
//    acknowledgement (a remote stream memop) is assumed as it was with cuStreamWaitValue32.
//  * the fault record: its fields are stored before its code, with a fence.acq_rel.sys between
//    (a release pattern, §"Release and Acquire Patterns": whoever reads the code sees the
//    fields), and a fence.sc.sys (__threadfence_system()) before the trap. That the record then
//    reaches host memory before the trap tears the context down is assumed, not documented:
//    the ISA defines a fence by its order with later memory operations, and none follows;
//    if it did not land, XLA still gets the sticky error, without the flag and the peer. One
//    claim word, atomicCAS, makes
//    one wait of the rank the writer (the kernels of one GPU: PTX ISA, "Atomicity": overlapping
//    atomics of a scope that includes each other are performed one after the other; the CUDA
//    programming guide, "Mapped Memory": atomics on mapped page-locked memory are not atomic
//    for the host or other devices — one record per rank, one GPU per rank).
//  * the clock: %globaltimer is "a predefined, 64-bit global nanosecond timer", documented among
//    the registers meant for NVIDIA's tools, whose value is unspecified "when JIT-compiled to
//    other targets": the kernel is refused on a GPU it would run JIT-compiled (PrepareKernel's
//    `clocked` check, kernels.h). A flag read before the clock ends the wait, so a flag that
//    arrived while the kernel was preempted never makes it give up.
//
// What only a GPU has is a call on `ops`: LoadAcquireSys32 (ld.acquire.sys.b32),
// StoreRelaxedSys, FenceReleaseSys (fence.acq_rel.sys), FenceSys (fence.sc.sys), Claim,
// GlobalNs (%globaltimer) and Trap, as
// allreduce_body.h names them.
#pragma once

#include <cstdint>

#include "cuda/kernels/kernel_body.h"

namespace jo::cuda::kernel::fw {

// Why a wait gave up (page-locked host memory, per local rank; `code` is written last).
enum class FaultCode : uint32_t { kNone = 0, kTimedOut = 1 };
struct Fault {
  uint32_t code;
  uint32_t claim;   // 1 once a wait of this rank claimed the record
  uint32_t flag;    // the flag (id in the program) it waited for
  uint32_t writer;  // the rank that raises it
  uint32_t seen;    // its value when the wait gave up
  uint32_t value;   // the value waited for
};

struct Args {
  const uint32_t* flag = nullptr;  // the rank's own flag word
  uint32_t value = 0;
  int32_t flag_id = 0, writer = 0;  // for the record
  int64_t timeout_ns = 0;
  Fault* fault = nullptr;
};

struct State {
  bool armed = false;  // a poll missed the value, at %globaltimer `since`
  int64_t since = 0;
  bool gave_up = false;  // the timeout passed: this wait traps once the record is written
};

// One poll: true when the wait is over (the flag reached). A wait that gave up never ends: it
// traps (Trap does not return on a GPU; the fake's stops the rank's work).
template <class Ops>
JO_KERNEL_FN bool Poll(Ops& ops, const Args& a, State& s) {
  const uint32_t seen = ops.LoadAcquireSys32(a.flag);
  if (!s.gave_up) {
    if (static_cast<int32_t>(seen - a.value) >= 0) return true;
    const int64_t now = ops.GlobalNs();
    if (!s.armed) {
      s.armed = true;
      s.since = now;
      return false;
    }
    if (now - s.since <= a.timeout_ns) return false;
    s.gave_up = true;
    if (!ops.Claim(&a.fault->claim)) return false;  // another wait writes the record and traps
    ops.StoreRelaxedSys(&a.fault->flag, static_cast<uint32_t>(a.flag_id));
    ops.StoreRelaxedSys(&a.fault->writer, static_cast<uint32_t>(a.writer));
    ops.StoreRelaxedSys(&a.fault->seen, seen);
    ops.StoreRelaxedSys(&a.fault->value, a.value);
    ops.FenceReleaseSys();  // the fields before the code
    ops.StoreRelaxedSys(&a.fault->code, static_cast<uint32_t>(FaultCode::kTimedOut));
    ops.FenceSys();  // the record before the trap (assumed to land: below)
    ops.Trap();
    return true;
  }
  return false;  // gave up without the claim: the claiming wait's trap ends this one
}

}  // namespace jo::cuda::kernel::fw
