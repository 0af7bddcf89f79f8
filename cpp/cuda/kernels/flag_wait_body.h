// A bounded wait for one flag, as a kernel of one thread: what a replayable program's
// acknowledgement wait (docs/gpu-internals.md §8) runs instead of cuStreamWaitValue32, which has
// no bound. ONE source, compiled by nvcc for the GPU (flag_wait.cu) and by the host compiler
// for the fake (fake/fake_flag_wait.cc), which runs the same polls.
//
// The thread polls the flag with ld.acquire.sys until it is at or past the value (the cyclic
// comparison of stream memops' GEQ), sleeping between polls; a flag not reached `timeout_ns`
// (the GPU's %globaltimer) after the first poll is recorded in the rank's fault record
// (page-locked host memory the watchdog reads) and the kernel ends, so the wait always ends.
// A wait that finds the record already written (an earlier wait of this rank gave up) ends at
// once: the clique is broken, its results are garbage, and a replayed graph must not take the
// timeout again at every wait.
//
// Ordering, from the PTX ISA's memory consistency model
// (https://docs.nvidia.com/cuda/parallel-thread-execution/#memory-consistency-model):
//  * the acquire: the flag's writer raised it with cuStreamWriteValue32 (default flags: a
//    fence before the write, "similar semantics to __threadfence_system()", CUDA driver API,
//    CUstreamWriteValue_flags), a release pattern at system scope; the ld.acquire.sys that
//    reads its value synchronizes with it (§8.9.4, item 4: release and acquire patterns), so
//    what the writer did before the flag happens before everything after the acquire;
//  * the stream's later work: the completion of a kernel synchronizes with the start of the next
//    operation in its stream (§8.9.4, "API synchronization": the completion of a task in a
//    stream and the start of the next); causality order is transitive (§8.9.5), so the
//    stream's later copies and memops (its ResetFlags) come after the acquire as they did
//    after cuStreamWaitValue32.
//  * the fault record: its fields are stored before its code, with a fence.acq_rel.sys between
//    (a release pattern: whoever reads the code sees the fields); one claim word, atomicCAS,
//    makes one wait of the rank the writer (the kernels of one GPU: device scope; CUDA
//    programming guide, "Mapped Memory": atomics on mapped page-locked memory are not atomic
//    for the host, which only reads it).
//
// What only a GPU has is a call on `ops`: LoadAcquireSys32 (ld.acquire.sys.b32),
// LoadRelaxedSys32 (ld.relaxed.sys.b32), StoreRelaxedSys, FenceReleaseSys, Claim and GlobalNs
// (%globaltimer), as allreduce_body.h names them.
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
  int64_t waiting_since = -1;  // %globaltimer at the first poll that did not find the value
};

// One poll: true when the wait is over (the flag reached, or the wait gave up).
template <class Ops>
JO_KERNEL_FN bool Poll(Ops& ops, const Args& a, State& s) {
  const uint32_t seen = ops.LoadAcquireSys32(a.flag);
  if (static_cast<int32_t>(seen - a.value) >= 0) return true;
  if (ops.LoadRelaxedSys32(&a.fault->code) != 0) return true;  // this rank gave up before
  const int64_t now = ops.GlobalNs();
  if (s.waiting_since < 0) {
    s.waiting_since = now;
    return false;
  }
  if (now - s.waiting_since <= a.timeout_ns) return false;
  if (ops.Claim(&a.fault->claim)) {
    ops.StoreRelaxedSys(&a.fault->flag, static_cast<uint32_t>(a.flag_id));
    ops.StoreRelaxedSys(&a.fault->writer, static_cast<uint32_t>(a.writer));
    ops.StoreRelaxedSys(&a.fault->seen, seen);
    ops.StoreRelaxedSys(&a.fault->value, a.value);
    ops.FenceReleaseSys();  // the fields before the code
    ops.StoreRelaxedSys(&a.fault->code, static_cast<uint32_t>(FaultCode::kTimedOut));
  }
  return true;
}

}  // namespace jo::cuda::kernel::fw
