#include "host/shm.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "core/log.h"

namespace jo::host {
namespace {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "futex words are 32-bit");

std::string Errno(const char* what, const std::string& name, int err) {
  return std::string(what) + "(" + name + ") failed: " + std::strerror(err);
}

// Names to unlink at exit. A function-local static with a destructor: it runs
// at normal exit (after Python's atexit handlers, which call it first).
class TrackedNames {
 public:
  void Add(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.insert(name);
  }
  void Remove(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    names_.erase(name);
  }
  int UnlinkAll() {
    std::lock_guard<std::mutex> lock(mu_);
    int count = 0;
    for (const std::string& name : names_)
      if (shm_unlink(name.c_str()) == 0) ++count;
    names_.clear();
    return count;
  }

 private:
  std::mutex mu_;
  std::set<std::string> names_;
};

TrackedNames& Tracked() {
  static TrackedNames* names = new TrackedNames();  // leaked on purpose: usable during exit
  static struct Finalizer {
    ~Finalizer() { names->UnlinkAll(); }
  } finalizer;
  return *names;
}

// Maps `fd` (already sized) read-write and shared; closes it on failure.
Status MapFd(const std::string& name, int fd, size_t bytes, std::byte** data) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    close(fd);
    return Status(Code::kResource, Errno("mmap", name, err));
  }
  *data = static_cast<std::byte*>(p);
  return OkStatus();
}

}  // namespace

ShmSegment::ShmSegment(std::string name, int fd, std::byte* data, size_t size)
    : name_(std::move(name)), fd_(fd), data_(data), size_(size) {}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

Status ShmSegment::Create(const std::string& name, size_t bytes, std::unique_ptr<ShmSegment>* out) {
  JO_REQUIRE(bytes > 0, "shared-memory segment " + name + ": size must be > 0");
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Status(Code::kResource, Errno("shm_open(O_CREAT|O_EXCL)", name, errno));
  Tracked().Add(name);
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const int err = errno;
    close(fd);
    (void)UnlinkShm(name);
    return Status(Code::kResource, Errno("ftruncate", name, err) + " (is /dev/shm large enough for " +
                                       std::to_string(bytes) + " bytes?)");
  }
  std::byte* data = nullptr;
  Status mapped = MapFd(name, fd, bytes, &data);
  if (!mapped.ok()) {
    (void)UnlinkShm(name);
    return mapped;
  }
  out->reset(new ShmSegment(name, fd, data, bytes));
  return OkStatus();
}

Status ShmSegment::Open(const std::string& name, size_t min_bytes, std::unique_ptr<ShmSegment>* out) {
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    return Status(err == ENOENT ? Code::kInvalidArgument : Code::kResource,
                  Errno("shm_open", name, err) +
                      (err == ENOENT ? " (already unlinked: did every process attach in time?)" : ""));
  }
  Tracked().Add(name);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return Status(Code::kResource, Errno("fstat", name, err));
  }
  const size_t bytes = static_cast<size_t>(st.st_size);
  if (bytes < min_bytes || bytes == 0) {
    close(fd);
    return Internal("shared-memory segment " + name + " has " + std::to_string(bytes) +
                    " bytes, expected at least " + std::to_string(min_bytes));
  }
  std::byte* data = nullptr;
  JO_CHECK(MapFd(name, fd, bytes, &data));
  out->reset(new ShmSegment(name, fd, data, bytes));
  return OkStatus();
}

Status UnlinkShm(const std::string& name) {
  Tracked().Remove(name);
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT)
    return Status(Code::kResource, Errno("shm_unlink", name, errno));
  return OkStatus();
}

int UnlinkTrackedNames() { return Tracked().UnlinkAll(); }

std::string NewShmBaseName() {
  std::random_device device;
  std::mt19937_64 gen((static_cast<uint64_t>(device()) << 32) ^ device() ^
                      static_cast<uint64_t>(getpid()));
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(gen()));
  std::string name = "/jaxoverlap-";
  if (const char* tag = std::getenv("JAXOVERLAP_SHM_TAG"); tag != nullptr && *tag != '\0') {
    for (const char* c = tag; *c != '\0' && name.size() < 64; ++c)
      name += (std::isalnum(static_cast<unsigned char>(*c)) || *c == '_') ? *c : '_';
    name += "-";
  }
  return name + hex;
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
