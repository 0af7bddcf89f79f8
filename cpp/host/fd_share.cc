#include "host/fd_share.h"

#include "core/deadline.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <system_error>

namespace jo::host {
namespace {

constexpr size_t kMaxFds = 64;

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

int Remaining(Clock::time_point deadline) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(ms.count(), 100)));
}

Status Address(const std::string& name, sockaddr_un* addr, socklen_t* len) {
  JO_REQUIRE(!name.empty() && name.size() + 1 < sizeof(addr->sun_path),
             "fd socket name must have 1.." + std::to_string(sizeof(addr->sun_path) - 2) +
                 " characters, got '" + name + "'");
  std::memset(addr, 0, sizeof(*addr));
  addr->sun_family = AF_UNIX;
  std::memcpy(addr->sun_path + 1, name.data(), name.size());  // abstract: leading NUL
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return OkStatus();
}

// A non-blocking listening socket on the abstract name @name.
Status Listen(const std::string& name, int backlog, UniqueFd* out) {
  sockaddr_un addr;
  socklen_t len = 0;
  JO_CHECK(Address(name, &addr, &len));
  UniqueFd listener(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (listener.get() < 0) return Status(Code::kResource, Errno("socket(AF_UNIX)"));
  if (bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0)
    return Status(Code::kResource, Errno("bind(@" + name + ")"));
  if (listen(listener.get(), backlog) != 0)
    return Status(Code::kResource, Errno("listen(@" + name + ")"));
  *out = std::move(listener);
  return OkStatus();
}

// The servers' trust check: waits up to `timeout_ms` for a connection on
// `listener` and accepts it only from a process of this user. False when none
// came, or it came from anyone else (then it is closed unanswered).
bool AcceptOwnUser(int listener, int timeout_ms, UniqueFd* conn, int* pid) {
  pollfd p{listener, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return false;
  UniqueFd accepted(accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
  if (accepted.get() < 0) return false;
  ucred cred;
  socklen_t cred_len = sizeof(cred);
  if (getsockopt(accepted.get(), SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0) return false;
  if (cred.uid != getuid()) return false;
  *conn = std::move(accepted);
  *pid = static_cast<int>(cred.pid);
  return true;
}

// Sends one byte, and the `count` fds at `fds` with it (none when count is 0).
bool SendWithFds(int conn, char byte, const int* fds, size_t count) {
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  std::memset(control, 0, sizeof(control));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (count > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * count);
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * count);
    std::memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * count);
  }
  return sendmsg(conn, &msg, MSG_NOSIGNAL) == 1;
}

// Sends one byte, and `fd` with it unless it is -1.
bool SendByte(int conn, char byte, int fd) { return SendWithFds(conn, byte, &fd, fd >= 0 ? 1 : 0); }

// Receives one byte and the fds sent with it (at most kMaxFds); `truncated`: some were dropped.
Status ReceiveWithFds(int conn, const std::string& name, char* byte, std::vector<UniqueFd>* got,
                      bool* truncated) {
  iovec iov{byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFds)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  if (recvmsg(conn, &msg, MSG_CMSG_CLOEXEC) != 1)
    return Status(Code::kResource, Errno("recvmsg(@" + name + ")"));
  got->clear();
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      got->emplace_back(fd);
    }
  }
  *truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  return OkStatus();
}

// Whoever listens on @name must be `owner` (`owner_pid`, of this user): anyone may bind an
// abstract name first.
Status CheckServedBy(int conn, const std::string& what, const std::string& name, int owner_pid,
                     const std::string& owner) {
  ucred cred;
  socklen_t cred_len = sizeof(cred);
  if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &cred_len) != 0)
    return Status(Code::kResource, Errno("getsockopt(SO_PEERCRED, @" + name + ")"));
  if (static_cast<int>(cred.pid) != owner_pid || cred.uid != getuid())
    return Status(Code::kInvalidArgument,
                  what + ": refusing @" + name + ": it is served by pid " +
                      std::to_string(cred.pid) + " (uid " + std::to_string(cred.uid) +
                      "), not by " + owner + ", pid " + std::to_string(owner_pid) + " (uid " +
                      std::to_string(getuid()) + "); another process holds the socket name");
  return OkStatus();
}

// Waits until `fd` is readable or `deadline`; false at the deadline.
bool Readable(int fd, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, Remaining(deadline)) > 0) return true;
    if (Clock::now() >= deadline) return false;
  }
}

}  // namespace

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) close(fd_);
}

namespace {
std::mutex hidden_mu;
int hidden_depth = 0;      // HiddenFromPeers alive now
bool hidden_made = false;  // the first one made this process non-dumpable
}  // namespace

HiddenFromPeers::HiddenFromPeers() {
  std::lock_guard<std::mutex> lock(hidden_mu);
  if (hidden_depth++ > 0) return;
  // 0 or 2 (a set-user-ID program's): already refused to peers without CAP_SYS_PTRACE.
  hidden_made = prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 1 && prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0;
}

HiddenFromPeers::~HiddenFromPeers() {
  std::lock_guard<std::mutex> lock(hidden_mu);
  if (--hidden_depth > 0 || !hidden_made) return;
  (void)prctl(PR_SET_DUMPABLE, 1, 0, 0, 0);
  hidden_made = false;
}

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Status DupFromProcess(int pid, int fd, UniqueFd* out) {
#if defined(SYS_pidfd_open) && defined(SYS_pidfd_getfd)
  UniqueFd pidfd(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  if (pidfd.get() < 0)
    return Status(Code::kResource, Errno("pidfd_open(pid " + std::to_string(pid) + ")"));
  const int got = static_cast<int>(syscall(SYS_pidfd_getfd, pidfd.get(), fd, 0));
  if (got < 0) {
    const bool denied = errno == EPERM;
    return Status(
        Code::kResource,
        Errno("pidfd_getfd(pid " + std::to_string(pid) + ", fd " + std::to_string(fd) + ")") +
            (denied ? " (no ptrace access to that process: use the socket "
                      "method)"
                    : ""));
  }
  *out = UniqueFd(got);
  return OkStatus();
#else
  (void)pid;
  (void)fd;
  (void)out;
  return Status(Code::kResource, "pidfd_getfd is not available in this build (Linux >= 5.6)");
#endif
}

Status ParkedFds::Park(std::vector<UniqueFd> fds, ParkedFds* out) {
  JO_REQUIRE(!fds.empty() && fds.size() <= kMaxFds, "ParkedFds: expected 1.." +
                                                        std::to_string(kMaxFds) + " fds, got " +
                                                        std::to_string(fds.size()));
  int ends[2];
  if (socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0, ends) != 0)
    return Status(Code::kResource, Errno("socketpair (to park a descriptor)"));
  UniqueFd sender(ends[0]), queue(ends[1]);
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  if (!SendWithFds(sender.get(), 'p', raw.data(), raw.size()))
    return Status(Code::kResource, Errno("sendmsg (to park a descriptor)"));
  out->queue_ = std::move(queue);
  out->count_ = fds.size();
  return OkStatus();  // `fds` and `sender` close here: the queue holds the only references
}

Status ParkedFds::ParkCopies(const std::vector<int>& fds, ParkedFds* out) {
  HiddenFromPeers hidden;
  std::vector<UniqueFd> copies;
  for (int fd : fds) {
    copies.emplace_back(fcntl(fd, F_DUPFD_CLOEXEC, 0));
    if (copies.back().get() < 0)
      return Status(Code::kInvalidArgument, Errno("dup of fd " + std::to_string(fd)));
  }
  return Park(std::move(copies), out);
}

Status ParkedFds::Take(std::vector<UniqueFd>* out) {
  JO_REQUIRE(count_ > 0, "ParkedFds: nothing parked");
  char byte = 0;
  bool truncated = false;
  JO_CHECK(ReceiveWithFds(queue_.get(), "a parked descriptor", &byte, out, &truncated));
  JO_REQUIRE(out->size() == count_ && !truncated, "ParkedFds: " + std::to_string(out->size()) +
                                                      " descriptors came back, " +
                                                      std::to_string(count_) + " were parked");
  queue_ = UniqueFd();
  count_ = 0;
  return OkStatus();
}

namespace {

// Sends the parked fds with one byte and parks them again. False if the send
// failed (they stay parked) or they could not be parked again (then empty).
bool SendParked(int conn, char byte, ParkedFds* parked) {
  HiddenFromPeers hidden;
  std::vector<UniqueFd> fds;
  if (!parked->Take(&fds).ok()) return false;
  std::vector<int> raw;
  for (const UniqueFd& fd : fds) raw.push_back(fd.get());
  const bool sent = SendWithFds(conn, byte, raw.data(), raw.size());
  (void)ParkedFds::Park(std::move(fds), parked);
  return sent;
}

}  // namespace

Status FdServer::Start(const std::string& name, ParkedFds fds, const std::vector<int>& allowed_pids,
                       std::chrono::milliseconds timeout, std::unique_ptr<FdServer>* out) {
  JO_REQUIRE(fds.count() > 0, "FdServer: nothing to serve");
  UniqueFd listener;
  JO_CHECK(Listen(name, static_cast<int>(allowed_pids.size()) + 4, &listener));
  std::unique_ptr<FdServer> server(new FdServer());
  server->name_ = name;
  server->listener_ = std::move(listener);
  server->fds_ = std::move(fds);
  server->pending_ = allowed_pids;
  server->deadline_ = DeadlineAfter(timeout);
  try {
    server->thread_ = std::thread([s = server.get()] { s->Serve(); });
  } catch (const std::system_error& e) {
    return Status(Code::kResource,
                  std::string("FdServer: could not start its thread: ") + e.what());
  }
  *out = std::move(server);
  return OkStatus();
}

void FdServer::Serve() {
  while (!pending_.empty()) {
    if (stop_.load()) {
      result_ = Status(Code::kAborted, "FdServer @" + name_ +
                                           ": stopped before every peer was "
                                           "served");
      return;
    }
    if (Clock::now() >= deadline_) {
      std::string who;
      for (int pid : pending_) who += (who.empty() ? "" : ", ") + std::to_string(pid);
      result_ = Status(Code::kTimeout, "FdServer @" + name_ + ": process(es) with pid " + who +
                                           " did not fetch their fds before the deadline");
      return;
    }
    UniqueFd conn;
    int pid = 0;
    if (!AcceptOwnUser(listener_.get(), Remaining(deadline_), &conn, &pid)) continue;
    auto it = std::find(pending_.begin(), pending_.end(), pid);
    if (it == pending_.end()) continue;  // not a peer we expect: drop
    if (SendParked(conn.get(), 'j', &fds_)) pending_.erase(it);
  }
  result_ = OkStatus();
}

Status FdServer::Finish() {
  if (thread_.joinable()) thread_.join();
  return result_;
}

FdServer::~FdServer() {
  stop_.store(true);  // the thread sees it within one poll slice
  if (thread_.joinable()) thread_.join();
}

Status ReceiveFds(const std::string& name, size_t count, int owner_pid,
                  std::chrono::milliseconds timeout, std::vector<UniqueFd>* out) {
  JO_REQUIRE(count >= 1 && count <= kMaxFds, "ReceiveFds: expected 1.." + std::to_string(kMaxFds) +
                                                 " fds, got " + std::to_string(count));
  sockaddr_un addr;
  socklen_t len = 0;
  JO_CHECK(Address(name, &addr, &len));
  const auto deadline = DeadlineAfter(timeout);
  UniqueFd conn;
  while (true) {  // the server may not listen yet
    conn = UniqueFd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (conn.get() < 0) return Status(Code::kResource, Errno("socket(AF_UNIX)"));
    if (connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), len) == 0) break;
    if (errno != ECONNREFUSED && errno != ENOENT && errno != EAGAIN)
      return Status(Code::kResource, Errno("connect(@" + name + ")"));
    if (Clock::now() >= deadline)
      return Status(Code::kTimeout,
                    "ReceiveFds: nobody listens on @" + name + " (did the owner start sharing?)");
    usleep(10000);
  }
  JO_CHECK(CheckServedBy(conn.get(), "ReceiveFds", name, owner_pid, "the owner"));
  if (!Readable(conn.get(), deadline))
    return Status(Code::kTimeout, "ReceiveFds: @" + name +
                                      " sent nothing before the deadline "
                                      "(is this process among the owner's expected peers?)");
  char byte = 0;
  std::vector<UniqueFd> got;
  bool truncated = false;
  JO_CHECK(ReceiveWithFds(conn.get(), name, &byte, &got, &truncated));
  JO_REQUIRE(got.size() == count && !truncated, "ReceiveFds: @" + name + " sent " +
                                                    std::to_string(got.size()) + " fds, expected " +
                                                    std::to_string(count));
  *out = std::move(got);
  return OkStatus();
}

Status SegmentServer::Instance(SegmentServer** out) {
  static std::mutex mu;
  static SegmentServer* instance = nullptr;  // never destroyed: its thread serves until exit
  std::lock_guard<std::mutex> lock(mu);
  if (instance != nullptr) {
    *out = instance;
    return OkStatus();
  }
  unsigned char bytes[16];
  size_t got = 0;
  while (got < sizeof(bytes)) {
    const ssize_t n = getrandom(bytes + got, sizeof(bytes) - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Status(Code::kResource, Errno("getrandom"));
    got += static_cast<size_t>(n);
  }
  std::string name = "jaxoverlap-" + std::to_string(getpid()) + "-";
  char hex[3];
  for (unsigned char b : bytes) {
    std::snprintf(hex, sizeof(hex), "%02x", b);
    name += hex;
  }
  UniqueFd listener;
  JO_CHECK(Listen(name, 64, &listener));
  std::unique_ptr<SegmentServer> server(new SegmentServer());
  server->name_ = name;
  server->listener_ = std::move(listener);
  server->next_token_ =
      (uint64_t{bytes[0]} << 32) | 1;  // tokens need not be secret: pids are checked
  try {
    server->thread_ = std::thread([s = server.get()] { s->Serve(); });
    server->thread_.detach();
  } catch (const std::system_error& e) {
    return Status(Code::kResource,
                  std::string("SegmentServer: could not start its thread: ") + e.what());
  }
  instance = server.release();
  *out = instance;
  return OkStatus();
}

Status SegmentServer::Offer(UniqueFd fd, std::vector<int> pids, int uses, uint64_t* token) {
  Offered offer{ParkedFds(), std::move(pids), uses};
  if (uses > 0) {
    std::vector<UniqueFd> one;
    one.push_back(std::move(fd));
    JO_CHECK(ParkedFds::Park(std::move(one), &offer.fd));
  }
  std::lock_guard<std::mutex> lock(mu_);
  *token = next_token_++;
  if (uses > 0) offered_[*token] = std::move(offer);
  return OkStatus();
}

void SegmentServer::Withdraw(uint64_t token) {
  std::lock_guard<std::mutex> lock(mu_);
  offered_.erase(token);
}

size_t SegmentServer::offers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return offered_.size();
}

void SegmentServer::Serve() {
  while (true) {
    UniqueFd conn;
    int pid = 0;
    if (!AcceptOwnUser(listener_.get(), 1000, &conn, &pid)) continue;
    Answer(conn.get(), pid);
  }
}

void SegmentServer::Answer(int conn, int pid) {
  {
    // Only a pid some offer names may take the server's time.
    std::lock_guard<std::mutex> lock(mu_);
    bool known = false;
    for (const auto& [token, offer] : offered_)
      known = known || std::find(offer.pids.begin(), offer.pids.end(), pid) != offer.pids.end();
    if (!known) return;
  }
  uint64_t token = 0;
  size_t got = 0;
  const auto deadline = DeadlineAfter(std::chrono::seconds(1));
  while (got < sizeof(token)) {
    if (!Readable(conn, deadline)) return;
    const ssize_t n = recv(conn, reinterpret_cast<char*>(&token) + got, sizeof(token) - got, 0);
    if (n <= 0) return;
    got += static_cast<size_t>(n);
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = offered_.find(token);
  const bool allowed =
      it != offered_.end() &&
      std::find(it->second.pids.begin(), it->second.pids.end(), pid) != it->second.pids.end();
  if (!allowed) {
    (void)SendByte(conn, 'n', -1);
    return;
  }
  if (!SendParked(conn, 'y', &it->second.fd)) return;
  // Each peer takes its copy once.
  it->second.pids.erase(std::find(it->second.pids.begin(), it->second.pids.end(), pid));
  if (--it->second.uses <= 0 || it->second.pids.empty()) offered_.erase(it);
}

Status FetchFd(const std::string& name, int owner_pid, uint64_t token, Clock::time_point deadline,
               UniqueFd* out) {
  sockaddr_un addr;
  socklen_t len = 0;
  JO_CHECK(Address(name, &addr, &len));
  UniqueFd conn(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (conn.get() < 0) return Status(Code::kResource, Errno("socket(AF_UNIX)"));
  // The server listens before its name is published: no answer means its process is gone.
  if (connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), len) != 0)
    return Status(Code::kAborted, Errno("connect(@" + name + ") to the segment server of pid " +
                                        std::to_string(owner_pid)) +
                                      " (has that process exited?)");
  JO_CHECK(CheckServedBy(conn.get(), "FetchFd", name, owner_pid, "the segment's creator"));
  if (send(conn.get(), &token, sizeof(token), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(token)))
    return Status(Code::kResource, Errno("send(@" + name + ")"));
  if (!Readable(conn.get(), deadline))
    return Status(Code::kTimeout, "FetchFd: the segment server of pid " +
                                      std::to_string(owner_pid) + " did not answer in time");
  char byte = 0;
  std::vector<UniqueFd> got;
  bool truncated = false;
  JO_CHECK(ReceiveWithFds(conn.get(), name, &byte, &got, &truncated));
  if (byte != 'y' || got.size() != 1 || truncated)
    return Status(Code::kInvalidArgument,
                  "FetchFd: the segment server of pid " + std::to_string(owner_pid) +
                      " has no segment for this process under token " + std::to_string(token));
  *out = std::move(got.front());
  return OkStatus();
}

}  // namespace jo::host
