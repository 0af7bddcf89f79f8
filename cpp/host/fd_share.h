// Sharing file descriptors between the processes of one job.
//
// For the host executor's shared memory (memfd segments, host/shm.h: the
// bootstrap's control segment, then every call site's segment, made at run
// time) and the GPU side's POSIX-fd handles (cuMemExportToShareableHandle of
// a workspace or multicast object gives an fd, meaningless elsewhere).
//
// Set-up time, driven from jaxoverlap/_executors/bootstrap.py (share_fds and the host
// clique bootstrap), which exchanges pids, fd numbers and socket names
// through the jax.distributed key-value store:
//
// * DupFromProcess: pidfd_open + pidfd_getfd (Linux >= 5.6). Needs ptrace
//   access to the owner (same user; Yama ptrace_scope=1 allows parents only).
// * FdServer / ReceiveFds: SCM_RIGHTS over a Unix socket in the abstract
//   namespace (no file anywhere). Both ends check the other's credentials
//   (SO_PEERCRED): the server serves only the pids it was told to expect, of
//   our uid; the client accepts fds only from the owner's pid, of our uid. An
//   abstract name is first come, first served: whoever bound it first (a
//   squatter) gets no fd from us and gives us none.
//
// A segment's descriptor waiting to be handed out is parked (ParkedFds): in
// flight in a socket's queue, in no fd table, so that no other process of the
// user can reopen it through /proc/<pid>/fd (which takes only read-level
// ptrace access, docs/multiprocess.md §3). It is in a process's table only
// while it is created, mapped, or sent, and then the process is not dumpable
// (HiddenFromPeers), which refuses that access too.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/status.h"

namespace jo::host {

// Owns one fd: closed by the destructor unless released.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// A duplicate of `fd` of process `pid` in this process.
Status DupFromProcess(int pid, int fd, UniqueFd* out);

// While one lives (in any thread), this process is not dumpable (prctl
// PR_SET_DUMPABLE 0; restored when the last one goes, if it was 1). Ptrace
// access checks then refuse every process without CAP_SYS_PTRACE, read-level
// ones included (ptrace(2), "Ptrace access mode checking": a target whose
// dumpable attribute is not 1), and /proc/<pid>/fd is governed by such a
// check (proc(5)): nobody of the same user can reopen this process's
// descriptors meanwhile. Held for as long as a segment's descriptor is in the
// fd table: created and mapped, received and mapped, taken out and sent.
class HiddenFromPeers {
 public:
  HiddenFromPeers();
  ~HiddenFromPeers();
  HiddenFromPeers(const HiddenFromPeers&) = delete;
  HiddenFromPeers& operator=(const HiddenFromPeers&) = delete;
};

// Descriptors held in flight: sent with SCM_RIGHTS into the receive queue of
// a socket whose sending end is closed, and closed here. They are in no fd
// table of this process (a socket cannot be reopened through its /proc link),
// until Take brings them back, to be handed out and parked again.
class ParkedFds {
 public:
  ParkedFds() = default;
  // Parks `fds` (1..64 of them; they are closed here).
  static Status Park(std::vector<UniqueFd> fds, ParkedFds* out);
  // Parks duplicates of `fds` (the caller keeps its own).
  static Status ParkCopies(const std::vector<int>& fds, ParkedFds* out);
  // The descriptors, back in this process's table; leaves this empty.
  Status Take(std::vector<UniqueFd>* out);
  size_t count() const { return count_; }

 private:
  UniqueFd queue_;  // the receiving end
  size_t count_ = 0;
};

class FdServer {
 public:
  // Listens on the abstract socket `name` and, on a background thread, sends
  // the `fds` to each of `allowed_pids` once, until all are served or
  // `timeout`; between hand-outs they are parked.
  static Status Start(const std::string& name, ParkedFds fds, const std::vector<int>& allowed_pids,
                      std::chrono::milliseconds timeout, std::unique_ptr<FdServer>* out);
  ~FdServer();  // stops and joins
  FdServer(const FdServer&) = delete;
  FdServer& operator=(const FdServer&) = delete;
  // Waits for the thread; its result (names the peers never served).
  Status Finish();

 private:
  FdServer() = default;
  void Serve();
  std::string name_;
  UniqueFd listener_;
  ParkedFds fds_;
  std::vector<int> pending_;  // pids still to serve
  std::chrono::steady_clock::time_point deadline_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  Status result_;
};

// Connects to the abstract socket `name` (retrying until it listens or the
// deadline), checks that process `owner_pid` of our uid serves it, and
// receives `count` fds.
Status ReceiveFds(const std::string& name, size_t count, int owner_pid,
                  std::chrono::milliseconds timeout, std::vector<UniqueFd>* out);

// Run time, without the store: each process has one SegmentServer, on an
// abstract socket with a random name that it writes into the shared memory of
// its domains (only the job's processes can read it). A process that creates
// a segment offers its fd under a token, for the pids of its peers and a
// number of uses; a peer asks the creator's server for the token. The server
// answers only a peer of our uid whose pid the offer names (SO_PEERCRED),
// and the client takes an fd only from the creator's pid, of our uid.
class SegmentServer {
 public:
  // This process's server, started at the first call (never destroyed: a
  // thread that serves until the process ends).
  static Status Instance(SegmentServer** out);

  const std::string& name() const { return name_; }
  // Serves `fd` to each of `pids` (at most `uses` times in all) under the
  // returned token, until then or Withdraw; parked in between.
  Status Offer(UniqueFd fd, std::vector<int> pids, int uses, uint64_t* token);
  void Withdraw(uint64_t token);
  size_t offers() const;  // for tests: fds still held (parked)

 private:
  struct Offered {
    ParkedFds fd;
    std::vector<int> pids;
    int uses = 0;
  };
  SegmentServer() = default;
  void Serve();
  void Answer(int conn, int pid);
  std::string name_;
  UniqueFd listener_;
  mutable std::mutex mu_;
  uint64_t next_token_ = 0;
  std::map<uint64_t, Offered> offered_;
  std::thread thread_;
};

// Asks the SegmentServer `name` of process `owner_pid` for the fd offered
// under `token`, until `deadline`.
Status FetchFd(const std::string& name, int owner_pid, uint64_t token,
               std::chrono::steady_clock::time_point deadline, UniqueFd* out);

}  // namespace jo::host
