// The NCCL communicators of a clique's ranks in this process (transport nccl).
//
// One communicator per comm stream of each rank — program stream 1 (the
// clockwise ring) and stream 2 (counter-clockwise): NCCL serialises the
// operations of one communicator in the order they are issued, whatever
// stream they are issued on, so two ring directions sharing one
// communicator would complete only in the order the host happened to issue
// them. The second is split from the first (ncclCommSplit, every rank the
// same colour): no second unique id has to cross processes.
//
// Communicators are non-blocking (config.blocking = 0): creation, split,
// finalize and a send/recv group that connects to a new peer may answer
// ncclInProgress, and are then polled (ncclCommGetAsyncError) until a
// deadline, never waited on without one.
//
// Lifetime: an enqueue holds a Lease on its rank's communicators while it
// issues NCCL calls — from just before its first enqueue, never across a
// wait for the device (CudaClique::AcquireComms). Abort (the watchdog releasing kernels that wait
// for a peer, or a failed creation) aborts at once what no lease holds and the rest when their
// lease is dropped: ncclCommAbort frees a communicator, so one must never be aborted under a thread
// still issuing calls on it. After Abort, Acquire fails. Teardown finalizes (ncclCommFinalize,
// polled) and destroys; a communicator that does not finalize in time is aborted.
//
// Every ncclCommAbort runs on a thread of its own, all of a device's at
// once, with no lock held: it frees device memory, which waits for every
// kernel of the device (NCCL issue #549, pull request #564: aborting a
// device's communicators one after the other hangs while another one's
// kernel still runs; marking them all aborted first lets every kernel exit).
// Nobody waits for an abort: Abort returns at once; an abort still running
// after the timeout is reported by the watchdog while it happens (WatchAborts,
// watchdog.h), named by StuckAborts (the clique's description) and left behind
// at teardown, reported, rather than waited for.
//
// NCCL's thread-safety rule (NCCL user guide, "Thread Safety": issuing
// operations in parallel to independent communicators located on the same
// device from several threads is not safe) is kept with one process-wide
// lock per device (DeviceNcclLock), taken by every NCCL call sequence here
// and by the executor's groups — never across ncclCommAbort or
// ncclCommDestroy: both free device memory, which may wait for the device,
// and a handler takes the lock between its first enqueue and its return.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"
#include "cuda/base/check.h"

namespace jo::cuda {

// Process-wide: serialises NCCL host calls on communicators of one device.
std::mutex& DeviceNcclLock(int device);

class NcclComms {
 public:
  static constexpr int32_t kChannels = 2;  // program streams 1 and 2

  explicit NcclComms(std::chrono::milliseconds timeout = std::chrono::milliseconds(120000))
      : timeout_(timeout) {}
  // Aborts whatever Finalize did not take down; waits for the aborts until the
  // timeout, then leaves the stuck ones behind (reported).
  ~NcclComms();
  NcclComms(const NcclComms&) = delete;
  NcclComms& operator=(const NcclComms&) = delete;

  // Creates every local rank's communicators: one ncclCommInitRankConfig
  // per local rank (devices[r] >= 0) in one group, awaited, then one split
  // per local rank in one group, awaited; `deadline` bounds both. On
  // failure everything made is aborted.
  Status Create(const std::vector<int>& devices, const ncclUniqueId& id,
                std::chrono::steady_clock::time_point deadline, const char* joining,
                const ErrorContext& ctx);

  class Lease {
   public:
    Lease() = default;
    ~Lease() { Drop(); }
    Lease(Lease&& other) noexcept { *this = std::move(other); }
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    // The communicator of each program stream (index = stream; stream 0 and
    // streams beyond the channels get null).
    std::vector<ncclComm_t> ForStreams(int32_t num_streams) const;
    void Drop();

   private:
    friend class NcclComms;
    NcclComms* owner_ = nullptr;
    int32_t rank_ = -1;
  };
  // Leases `rank`'s communicators; kAborted once Abort was called.
  Status Acquire(int32_t rank, const ErrorContext& ctx, Lease* out);

  // The peers a call of `rank` sends to and receives from on each channel (program stream 1 +
  // channel), and the connecting one-element buffers: `send` (1 float) and `recv` (one float
  // per rank) on the rank's device.
  struct Peers {
    std::set<int32_t> sends[kChannels];
    std::set<int32_t> recvs[kChannels];
  };
  // Connects `rank`'s communicators to the peers of `peers` not connected yet: per channel, one
  // group of a one-element ncclSend / ncclRecv to each, on `stream`; then polls, until
  // `deadline`, both NCCL's connection (ncclCommGetAsyncError) and the group's completion on the
  // GPU (`done`, recorded after it), giving up as soon as `check` fails (the clique broke).
  // NCCL connects to a peer at the first send/recv to it (NCCL source, src/group.cc:
  // ncclPreconnectFunc -> ncclTransportP2pSetup; NCCL_RUNTIME_CONNECT concerns collectives),
  // allocating the connection's device memory, which waits for the device (NCCL user guide,
  // "Using multiple NCCL communicators concurrently"): so here, at set-up, before the call's
  // first enqueue, never on the enqueue path. The group's completion is awaited too, so that no
  // later wait for the device (the call's own set-up) waits for a group whose peer never comes.
  // Every rank connects the same pairs at the same epoch (a send of one is a receive of the
  // other in the same call), so the one-element operations match. kAborted once Abort was
  // called (`check`'s failure if it has one); kTimeout at the deadline. `*in_flight`: a group may
  // have been left on the GPU (`done` recorded after it, best effort), to be released by aborting
  // the communicators.
  Status Connect(int32_t rank, const Peers& peers, cudaStream_t stream, cudaEvent_t done,
                 float* send, float* recv, std::chrono::steady_clock::time_point deadline,
                 const std::function<Status()>& check, const ErrorContext& ctx, bool* in_flight);

  // Aborts every communicator: now where no lease holds it, else when the
  // last lease of its rank is dropped.
  void Abort();

  // Teardown: ncclCommFinalize + poll until `deadline`, ncclCommDestroy;
  // aborts what does not finalize in time. Requires no lease.
  void Finalize(std::chrono::steady_clock::time_point deadline);

  bool created() const;

  // The aborts running for longer than the timeout ("" if none).
  std::string StuckAborts() const;
  // The aborts still running, however long ("rank r on GPU d, ..."; "" if none).
  std::string RunningAborts() const;

  // Whether every abort started so far has returned, polling until `deadline`
  // (the fake's virtual-clock watchdog and tests; nothing else waits for them).
  bool AwaitAborts(std::chrono::steady_clock::time_point deadline) const;

 private:
  // One ncclCommAbort on its own thread; shared with that thread.
  struct AbortTask {
    ncclComm_t comm = nullptr;
    int32_t rank = -1;
    int device = -1;
    std::chrono::steady_clock::time_point started;
    std::atomic<bool> done{false};
    std::thread thread;
  };
  // The aborts still running that started more than `age` ago ("rank r on GPU d, ...").
  std::string AbortsOlderThan(std::chrono::steady_clock::duration age) const;
  // Starts the aborts of `rank`'s communicators (requires mu_).
  void AbortRankLocked(size_t rank);
  // Starts ncclCommAbort of `comm` on a thread of its own (requires mu_).
  void StartAbortLocked(ncclComm_t comm, int32_t rank, int device);
  void Release(int32_t rank);

  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<AbortTask>> aborts_;
  std::vector<int> devices_;
  std::vector<std::vector<ncclComm_t>> comms_;  // [rank][channel]; null: another process's
  std::vector<Peers> connected_;                // [rank]: peers connected so far (Connect)
  std::vector<int> leases_;
  bool aborting_ = false;
};

}  // namespace jo::cuda
