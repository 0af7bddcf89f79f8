// POSIX shared memory and futexes: the pieces a clique spanning processes is
// built from (cpp/host/shm_clique.h).
//
// ShmSegment owns one mapping of one shm object: the destructor unmaps it and
// closes the fd (RAII). Names are created with O_CREAT | O_EXCL and mode 0600
// and unlinked as soon as every process attached (the clique decides when).
// Every name this process created or opened is also tracked, and whatever is
// still linked at normal process exit is unlinked then (UnlinkTrackedNames;
// Python calls it from atexit too), so a peer that died before attaching
// does not leave a segment behind in /dev/shm.
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
  // A new object of exactly `bytes` (zero-filled), mapped read-write. Fails
  // if the name exists.
  static Status Create(const std::string& name, size_t bytes, std::unique_ptr<ShmSegment>* out);
  // An existing object, mapped read-write; fails if it is smaller than `min_bytes`.
  static Status Open(const std::string& name, size_t min_bytes, std::unique_ptr<ShmSegment>* out);

  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& name() const { return name_; }

 private:
  ShmSegment(std::string name, int fd, std::byte* data, size_t size);
  std::string name_;
  int fd_ = -1;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Removes `name` from the shm namespace (mappings stay valid). A name already
// gone is fine: every process of a clique may try.
Status UnlinkShm(const std::string& name);
// Unlinks every name this process created or opened and has not unlinked;
// returns how many were still there.
int UnlinkTrackedNames();

// "/jaxoverlap-[<JAXOVERLAP_SHM_TAG>-]<16 random hex digits>": a fresh base
// name for one clique (the tag lets a test harness find what its run made).
std::string NewShmBaseName();

// Futex wait on a 32-bit word that may be shared between processes: returns
// when *word != expected, on a wake, or after `timeout` (spurious wake-ups
// are possible; callers re-check their condition).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout);
void FutexWakeAll(std::atomic<uint32_t>* word);

}  // namespace jo::host
