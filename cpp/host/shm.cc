#include "host/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>

namespace jo::host {
namespace {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are 32-bit");

// Newer than some kernel headers we build against.
#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

// What every segment of ours is sealed with once sized.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

std::string Errno(const std::string& what, int err) {
  return what + " failed: " + std::strerror(err);
}

std::string MiB(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", bytes / (1024.0 * 1024.0));
  return text;
}

// Why a reservation of `bytes` failed, and what to do about it.
std::string NoRoom(size_t bytes, const std::string& what, int err) {
  return "could not reserve " + std::to_string(bytes) + " bytes (" + MiB(bytes) +
         ") of shared memory for " + what + ": " + std::strerror(err) +
         ". The processes of a job share their call sites' buffers in memory (memfd, counted "
         "against the machine's or the container's memory limit, not /dev/shm); every live call "
         "site keeps its own. Give the job more memory, drop executables it no longer needs, or "
         "use smaller shapes per call";
}

// Maps `fd` read-write and shared.
Status MapFd(int fd, size_t bytes, const std::string& what, std::byte** data) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return Status(Code::kResource, Errno("mmap of " + what, errno));
  *data = static_cast<std::byte*>(p);
  return OkStatus();
}

int MemfdCreate(const char* name) {
  // Not executable, where the kernel knows the flag (vm.memfd_noexec may demand it).
  int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
  if (fd < 0 && errno == EINVAL) fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  return fd;
}

}  // namespace

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
}

Status ShmSegment::Create(size_t bytes, const std::string& what, std::unique_ptr<ShmSegment>* out,
                          UniqueFd* fd_out) {
  JO_REQUIRE(bytes > 0, "shared-memory segment for " + what + ": size must be > 0");
  UniqueFd fd(MemfdCreate("jaxoverlap"));
  if (fd.get() < 0) return Status(Code::kResource, Errno("memfd_create for " + what, errno));
  if (fchmod(fd.get(), 0600) != 0) return Status(Code::kResource, Errno("fchmod", errno));
  // ftruncate alone would leave the pages to the first write, which gets
  // SIGBUS if the memory is not there then: reserve them now.
  int err = posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes));
  if (err == EOPNOTSUPP || err == EINVAL)  // no fallocate here: size it only
    err = ftruncate(fd.get(), static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (err != 0)
    return Status(Code::kResource, err == ENOSPC || err == ENOMEM || err == EFBIG
                                       ? NoRoom(bytes, what, err)
                                       : Errno("posix_fallocate for " + what, err));
  if (fcntl(fd.get(), F_ADD_SEALS, kSeals) != 0)
    return Status(Code::kResource, Errno("sealing the segment for " + what, errno));
  std::byte* data = nullptr;
  JO_CHECK(MapFd(fd.get(), bytes, what, &data));
  out->reset(new ShmSegment(data, bytes));
  if (fd_out != nullptr) *fd_out = std::move(fd);
  return OkStatus();
}

Status ShmSegment::Check(int fd, const std::string& what, size_t* bytes) {
  struct stat st;
  if (fstat(fd, &st) != 0) return Status(Code::kResource, Errno("fstat of " + what, errno));
  // Only a segment of ours that nobody else may open and that cannot change
  // size under our mapping is trusted.
  std::string problem;
  const int seals = fcntl(fd, F_GET_SEALS);
  if (!S_ISREG(st.st_mode))
    problem = "is not a shared-memory file";
  else if (st.st_uid != geteuid())
    problem = "belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
              std::to_string(geteuid()) + ")";
  else if ((st.st_mode & 0077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    problem = std::string("has mode ") + mode + " (other users may open it; ours are 0600)";
  } else if (seals < 0 || (seals & kSeals) != kSeals || (seals & F_SEAL_WRITE) != 0)
    problem = "is not a sealed memfd (seals " + std::to_string(seals) +
              "; a named or unsealed file could be opened or resized by others)";
  if (!problem.empty())
    return Status(Code::kInvalidArgument,
                  "refusing the shared-memory segment for " + what + ": it " + problem);
  *bytes = static_cast<size_t>(st.st_size);
  return OkStatus();
}

Status ShmSegment::Map(int fd, size_t bytes, const std::string& what,
                       std::unique_ptr<ShmSegment>* out) {
  JO_REQUIRE(bytes > 0, "shared-memory segment for " + what + ": size must be > 0");
  size_t has = 0;
  JO_CHECK(Check(fd, what, &has));
  if (has != bytes)
    return Status(Code::kInvalidArgument, "refusing the shared-memory segment for " + what +
                                              ": it has " + std::to_string(has) +
                                              " bytes, expected " + std::to_string(bytes));
  std::byte* data = nullptr;
  JO_CHECK(MapFd(fd, bytes, what, &data));
  out->reset(new ShmSegment(data, bytes));
  return OkStatus();
}

uint64_t PidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  if (timeout.count() <= 0) return;
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  // Not FUTEX_PRIVATE_FLAG: the word may live in a mapping shared with other processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace jo::host
