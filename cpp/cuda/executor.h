// The CUDA executor: enqueues one rank's Program on the GPU.
//
// A thin mapping, one op to one (or one per batch) API call (docs/gpu-internals.md §1):
//   Gemm        cuBLASLt matmul on the op's stream (gemm.h has the layout mapping)
//   Add         AddBlock kernel
//   Copy        cudaMemcpyAsync / cudaMemcpy2DAsync (to the peer's mapping: copy engine)
//   Send/Recv   ncclSend / ncclRecv, ops of one `bundle` inside ncclGroupStart/End, on the
//               communicator of their stream (one per comm stream: NCCL serialises the
//               launches of one communicator across streams)
//   McStore     multimem.st kernel through the multicast address
//   McReduce    multimem.ld_reduce kernel through the multicast address
//   Signal      cuStreamWriteValue32(peer's flag, epoch)   (default: with a memory fence)
//   Wait        cuStreamWaitValue32(own flag, epoch, GEQ)  (cyclic 32-bit comparison)
//   Record      cudaEventRecord          StreamWait   cudaStreamWaitEvent
//   FusedGemm   the persistent CUTLASS GEMM (fused_gemm.h; compute capability 9.0 only:
//               refused at prepare elsewhere), its tiles waiting for or releasing flags
//   AllReduce   the one-launch all-reduce kernel (kernels/allreduce_launch.h) on the clique's
//               fixed kernel area: no epoch in what it enqueues
// Program stream 0 is XLA's stream; streams 1.. are the rank's own
// (high-priority, non-blocking). They are forked from XLA's stream with an
// event at the start and joined back into it at the end, so XLA sees one
// ordinary op on its stream. Nothing here blocks the host.
//
// Two phases, so that a call is never left half-enqueued:
//  * Prepare checks every op and makes everything it needs (pointers,
//    cuBLASLt plans and workspaces) without enqueueing anything: a failure
//    there leaves the GPU untouched.
//  * Execute only enqueues: the fork, the units in the plan's issue order
//    (core/issue_order.h: it completes even when every stream of the device
//    shares one hardware queue, CUDA_DEVICE_MAX_CONNECTIONS=1), the join.
//    Once the fork is enqueued the join always is too, even after a failure
//    in between, so XLA's stream never runs ahead of work that reads x and
//    writes y.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include "core/call.h"
#include "core/issue_order.h"
#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/clique/clique_state.h"
#include "cuda/fused/fused_gemm_launch.h"
#include "cuda/kernels/flag_wait_body.h"

namespace jo::cuda {

// Orders the issue of one call's units among host threads that share a device's work queues
// (cuda/loopback.h: several ranks on one GPU, whose issue orders must interleave as the issue
// order's play did: core/issue_order.h, IssueRounds). Null everywhere else.
class IssueGate {
 public:
  virtual ~IssueGate() = default;
  // Returns once the `unit`-th unit of the rank's issue order may be issued (bounded).
  virtual void Before(size_t unit) = 0;
  // The unit was issued (or its issue failed).
  virtual void After(size_t unit) = 0;
  // The rank issues nothing more of this call (also after a failure; idempotent).
  virtual void Leave() = 0;
};

struct RunArgs {
  const Program* program = nullptr;
  const std::vector<IssueUnit>* order = nullptr;  // the plan's issue order
  int device = -1;
  cudaStream_t stream = nullptr;  // XLA's stream (program stream 0)
  int64_t epoch = 0;
  const Generation* gen = nullptr;
  RankResources* resources = nullptr;  // streams and events
  const RankPool* pool = nullptr;      // scratch, fused state, cuBLASLt buffers
  CallBuffers io;
  ErrorContext ctx;
  std::chrono::milliseconds timeout{0};  // for host-side NCCL progress (AwaitNccl)
  IssueGate* gate = nullptr;             // the loopback runner's; null: issue at will
  // Ranks of the clique on this GPU (more than one only in the loopback): a fused GEMM takes
  // its share of the SMs, so that every rank's can run at once, as each would on a GPU of its
  // own (one that held every SM would wait for flags that the others, unable to start, raise).
  int32_t device_share = 1;
  // AllReduce: the clique's kernel area and the call's signature (what every rank's call must
  // agree on, checked on the device).
  const KernelArea* area = nullptr;
  uint32_t signature = 0;
  // A replayable program: the rank's fault records (its ReplayArea's, page-locked host memory)
  // of its bounded flag waits and of its fused GEMM's waits, which then trap when they give up.
  kernel::fw::Fault* wait_fault = nullptr;
  FusedGemmFault* fused_fault = nullptr;
};

class Enqueuer;

// One call ready to enqueue: every op checked, every pointer resolved,
// every cuBLASLt plan made.
class PreparedCall {
 public:
  ~PreparedCall();
  PreparedCall(const PreparedCall&) = delete;
  PreparedCall& operator=(const PreparedCall&) = delete;

  // Enqueues the call. `comms`: NCCL's communicator of each program stream
  // (index = stream; null where the stream issues no Send/Recv), held by the
  // caller's lease, which is taken only now: preparing may wait for the
  // device. `*enqueued` says whether work may have reached the GPU (the
  // caller must then watch the call, whatever the status): set to true once
  // Execute enqueues, never reset (the caller's own earlier enqueue, its
  // `started` event, keeps it true); if the comm streams were forked, they
  // were joined back too.
  Status Execute(const std::vector<ncclComm_t>& comms, bool* enqueued);

  // Instead of Execute, when the call fails after preparing: the set-up work prepare started
  // (new cuBLASLt plans' warm-ups, on a private stream) is still ordered before XLA's next op,
  // as all work a handler starts is (best effort).
  void Abandon();

  // Whether preparing started a new cuBLASLt plan's warm-up, which Execute joins into XLA's
  // stream first.
  bool WarmedUp() const;

 private:
  friend Status PrepareProgram(const RunArgs& args, std::unique_ptr<PreparedCall>* out);
  explicit PreparedCall(std::unique_ptr<Enqueuer> enqueuer);
  std::unique_ptr<Enqueuer> enqueuer_;
};

// Checks and prepares `args` (nothing is enqueued). `args` must outlive the result.
Status PrepareProgram(const RunArgs& args, std::unique_ptr<PreparedCall>* out);

// What calls of `problem` need of each local rank's pool (clique_state.h): the largest need of
// every rank's program (their scratch, fused GEMM state, GEMM streams and warm-ups). Cached per
// call signature.
Status PoolNeedsOf(const Problem& problem, PoolNeeds* out);

}  // namespace jo::cuda
