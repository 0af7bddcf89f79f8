#include "host/shm.h"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
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

// Maps `fd` read-write and shared, then closes it (the mapping keeps the object).
Status MapAndClose(const std::string& name, int fd, size_t bytes, std::byte** data) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);
  if (p == MAP_FAILED) return Status(Code::kResource, Errno("mmap", name, err));
  *data = static_cast<std::byte*>(p);
  return OkStatus();
}

std::string MiB(double bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f MiB", bytes / (1024.0 * 1024.0));
  return text;
}

// Why a reservation of `bytes` failed, and what to do about it.
std::string NoSpace(const std::string& name, size_t bytes, const std::string& what, int err) {
  std::string out = "could not reserve " + std::to_string(bytes) + " bytes (" + MiB(bytes) +
                    ") of shared memory for " + what + " (" + name + "): " + std::strerror(err);
  struct statvfs fs;
  if (statvfs("/dev/shm", &fs) == 0) {
    const double total = static_cast<double>(fs.f_blocks) * fs.f_frsize;
    const double free = static_cast<double>(fs.f_bavail) * fs.f_frsize;
    out += "; /dev/shm has " + MiB(free) + " free of " + MiB(total);
  }
  // Suggest a size with room for the other segments of the job.
  const size_t suggest_mib = std::max<size_t>(256, (4 * bytes) / (1024 * 1024) + 64);
  out +=
      ". The processes of a job share their cliques' buffers through /dev/shm: make it "
      "larger (Docker: --shm-size=" +
      std::to_string(suggest_mib) +
      "m or --ipc=host; "
      "Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm), or use smaller "
      "shapes per call";
  return out;
}

bool AllHex(const std::string& text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return std::isxdigit(c) != 0; });
}

bool AllDigits(const std::string& text) {
  return !text.empty() &&
         std::all_of(text.begin(), text.end(), [](char c) { return std::isdigit(c) != 0; });
}

// "p<pidns>.<pid>" in a name made by NewShmName, else false.
bool CreatorOf(const std::string& name, uint64_t* pidns, long* pid) {
  size_t at = 0;
  while ((at = name.find("-p", at)) != std::string::npos) {
    at += 2;
    const size_t dot = name.find('.', at), dash = name.find('-', at);
    if (dot == std::string::npos || dash == std::string::npos || dot > dash) continue;
    const std::string ns = name.substr(at, dot - at), id = name.substr(dot + 1, dash - dot - 1);
    const std::string rest = name.substr(dash + 1, 32);
    if (!AllDigits(ns) || !AllDigits(id) || rest.size() != 32 || !AllHex(rest)) continue;
    *pidns = std::strtoull(ns.c_str(), nullptr, 10);
    *pid = std::strtol(id.c_str(), nullptr, 10);
    return true;
  }
  return false;
}

}  // namespace

ShmSegment::ShmSegment(std::string name, std::byte* data, size_t size)
    : name_(std::move(name)), data_(data), size_(size) {}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, size_);
}

Status ShmSegment::Create(const std::string& name, size_t bytes, const std::string& what,
                          std::unique_ptr<ShmSegment>* out) {
  JO_REQUIRE(bytes > 0, "shared-memory segment " + name + ": size must be > 0");
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return Status(Code::kResource, Errno("shm_open(O_CREAT|O_EXCL)", name, errno));
  Tracked().Add(name);
  // ftruncate alone succeeds on a full tmpfs, and the first write past its
  // free space then kills the process with SIGBUS: reserve the pages now.
  int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == EOPNOTSUPP || err == EINVAL) {  // a file system without fallocate: size it only
    err = ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  }
  if (err != 0) {
    close(fd);
    (void)UnlinkShm(name);
    return Status(Code::kResource, err == ENOSPC || err == ENOMEM || err == EFBIG
                                       ? NoSpace(name, bytes, what, err)
                                       : Errno("posix_fallocate", name, err));
  }
  std::byte* data = nullptr;
  Status mapped = MapAndClose(name, fd, bytes, &data);
  if (!mapped.ok()) {
    (void)UnlinkShm(name);
    return mapped;
  }
  out->reset(new ShmSegment(name, data, bytes));
  return OkStatus();
}

Status ShmSegment::Open(const std::string& name, size_t bytes, std::unique_ptr<ShmSegment>* out) {
  JO_REQUIRE(bytes > 0, "shared-memory segment " + name + ": size must be > 0");
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) {
    const int err = errno;
    return Status(
        err == ENOENT ? Code::kInvalidArgument : Code::kResource,
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
  // Only a segment of ours that nobody else may read or write is trusted.
  std::string problem;
  if (!S_ISREG(st.st_mode))
    problem = "is not a regular shared-memory object";
  else if (st.st_uid != geteuid())
    problem = "belongs to uid " + std::to_string(st.st_uid) + ", not to this user (uid " +
              std::to_string(geteuid()) + ")";
  else if ((st.st_mode & 0077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    problem = std::string("has mode ") + mode + " (other users may access it; ours are 0600)";
  } else if (static_cast<size_t>(st.st_size) != bytes)
    problem = "has " + std::to_string(st.st_size) + " bytes, expected " + std::to_string(bytes);
  if (!problem.empty()) {
    close(fd);
    return Status(Code::kInvalidArgument,
                  "refusing shared-memory segment " + name + ": it " + problem);
  }
  std::byte* data = nullptr;
  JO_CHECK(MapAndClose(name, fd, bytes, &data));
  out->reset(new ShmSegment(name, data, bytes));
  return OkStatus();
}

Status UnlinkShm(const std::string& name) {
  Tracked().Remove(name);
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT)
    return Status(Code::kResource, Errno("shm_unlink", name, errno));
  return OkStatus();
}

int UnlinkTrackedNames() { return Tracked().UnlinkAll(); }

uint64_t PidNamespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_ino);
}

Status NewShmName(std::string* out) {
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      return Status(Code::kResource, std::string("getrandom failed: ") + std::strerror(errno));
    got += static_cast<size_t>(n);
  }
  std::string name = "/jaxoverlap-";
  if (const char* tag = std::getenv("JAXOVERLAP_SHM_TAG"); tag != nullptr && *tag != '\0') {
    for (const char* c = tag; *c != '\0' && name.size() < 64; ++c)
      name += (std::isalnum(static_cast<unsigned char>(*c)) || *c == '_') ? *c : '_';
    name += "-";
  }
  name += "p" + std::to_string(PidNamespace()) + "." + std::to_string(getpid()) + "-";
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", b);
    name += hex;
  }
  *out = name;
  return OkStatus();
}

int SweepStaleSegments() {
  const uint64_t mine = PidNamespace();
  if (mine == 0) return 0;  // cannot tell whose pids the names carry
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return 0;
  int removed = 0;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name.rfind("jaxoverlap-", 0) != 0) continue;
    uint64_t pidns = 0;
    long pid = 0;
    if (!CreatorOf(name, &pidns, &pid) || pidns != mine || pid <= 0) continue;
    if (kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive (or unknown)
    struct stat st;
    if (fstatat(dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 || st.st_uid != geteuid())
      continue;
    if (shm_unlink(("/" + name).c_str()) == 0) {
      ++removed;
      JO_INFO("removed /dev/shm/" + name + ", left behind by process " + std::to_string(pid) +
              ", which no longer exists");
    }
  }
  closedir(dir);
  return removed;
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
