// Shared memory without a name, and futexes: the pieces a clique spanning
// processes is built from (cpp/host/shm_domain.h, cpp/host/shm_clique.h).
//
// A segment is a memfd (memfd_create): it has no name anywhere in the file
// system, so no other process can open it; it reaches the job's other
// processes only as a file descriptor, passed over a Unix socket whose peer
// is checked (host/fd_share.h). Segments are created mode 0600, their space
// is reserved (posix_fallocate: a machine without the memory fails here
// with an error naming the size, not with SIGBUS at the first write), and
// sealed against shrinking and growing, so a peer cannot truncate one under
// another's mapping. A received descriptor is used only if it is such a
// segment: a sealed memfd of this user, private, of exactly the expected
// size.
//
// ShmSegment owns one mapping; the destructor unmaps it. The memory goes
// when the last mapping and the last descriptor of it, in any process, are
// gone: a process that exits or is killed leaves nothing behind.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"
#include "host/fd_share.h"

namespace jo::host {

class ShmSegment {
 public:
  // A new segment of exactly `bytes` (zero-filled, reserved), mapped
  // read-write; `fd` receives its descriptor (to share it) if not null.
  // `what` says what it is for, in errors ("the call-site segment of ...").
  static Status Create(size_t bytes, const std::string& what, std::unique_ptr<ShmSegment>* out,
                       UniqueFd* fd = nullptr);
  // Maps the segment `fd` (received from another process) after checking it
  // is one of ours (Check) of exactly `bytes`; the caller keeps `fd`.
  static Status Map(int fd, size_t bytes, const std::string& what,
                    std::unique_ptr<ShmSegment>* out);
  // Whether `fd` is a segment of ours (a sealed memfd of this user, private);
  // its size in `bytes`.
  static Status Check(int fd, const std::string& what, size_t* bytes);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  ShmSegment(std::byte* data, size_t size) : data_(data), size_(size) {}
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Futex wait on a 32-bit word that may be shared between processes: returns
// when *word != expected, on a wake, or after `timeout` (spurious wake-ups
// are possible; callers re-check their condition).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

// This process's pid namespace (the inode of /proc/self/ns/pid), 0 if unknown:
// pids are comparable only between processes of one namespace.
uint64_t PidNamespace();

}  // namespace jo::host
