// POSIX shared memory and futexes: the pieces a clique spanning processes is
// built from (cpp/host/shm_domain.h, cpp/host/shm_clique.h).
//
// ShmSegment owns one mapping of one shm object; the destructor unmaps it.
// The file descriptor is closed as soon as the object is mapped (the mapping
// keeps the memory alive). Objects are created with O_CREAT | O_EXCL, mode
// 0600, and their space is reserved with posix_fallocate: on tmpfs, a size
// that does not fit fails here with an error naming the size, instead of
// killing the process with SIGBUS at the first write past the free space.
// Opening checks that the object is a regular file owned by this user,
// readable by nobody else, of exactly the expected size.
//
// Names are "/jaxoverlap-[<JAXOVERLAP_SHM_TAG>-]p<pid namespace>.<pid>-<128
// random bits>": unguessable (nobody can pre-create the next one), and they
// name the creating process, so that SweepStaleSegments can remove what a
// killed process left behind. Names are unlinked as soon as every process
// attached (the clique decides when); every name this process created or
// opened is also tracked, and whatever is still linked at normal process exit
// is unlinked then (UnlinkTrackedNames; Python calls it from atexit too).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "core/status.h"

namespace jo::host {

class ShmSegment {
 public:
  // A new object of exactly `bytes` (zero-filled, reserved), mapped read-write.
  // `what` says what it is for, in errors ("the data segment of clique ...").
  static Status Create(const std::string& name, size_t bytes, const std::string& what,
                       std::unique_ptr<ShmSegment>* out);
  // An existing object of exactly `bytes`, mapped read-write.
  static Status Open(const std::string& name, size_t bytes, std::unique_ptr<ShmSegment>* out);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  ShmSegment(std::string name, std::byte* data, size_t size);
  std::string name_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Removes `name` from the shm namespace (mappings stay valid). A name already
// gone is fine: every process of a clique may try.
Status UnlinkShm(const std::string& name);
// Unlinks every name this process created or opened and has not unlinked;
// returns how many were still there.
int UnlinkTrackedNames();

// A fresh name (see above). Fails only if the kernel has no randomness.
Status NewShmName(std::string* name);

// Unlinks the segments of this user whose creating process, in this pid
// namespace, no longer exists (a job killed between creating a segment and
// the last attach). Returns how many it removed.
int SweepStaleSegments();

// Futex wait on a 32-bit word that may be shared between processes: returns
// when *word != expected, on a wake, or after `timeout` (spurious wake-ups
// are possible; callers re-check their condition).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

// This process's pid namespace (the inode of /proc/self/ns/pid), 0 if unknown:
// pids are comparable only between processes of one namespace.
uint64_t PidNamespace();

}  // namespace jo::host
