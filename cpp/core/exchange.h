// Exchange: opaque bytes among the processes of one clique, keyed by tag.
//
// The transport is the jax.distributed key-value store, reachable from Python
// only, so the implementation lives there (jaxoverlap/_executors/bootstrap.py,
// StoreExchange) and reaches C++ through cpp/python/py_exchange.h. C++ set-up
// code that needs it — the CUDA executor's clique creation (NCCL unique id,
// CUDA IPC / multicast handles), called from Python at trace time — takes an
// Exchange& and stays free of Python and of the store. Every call has the
// deadline the object was made with; a timeout names the silent process.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/status.h"

namespace jo {

class Exchange {
 public:
  virtual ~Exchange() = default;
  // This process's index and the processes taking part (sorted).
  virtual int32_t process() const = 0;
  virtual std::vector<int32_t> processes() const = 0;
  // The machine this process runs on, as its peers should compare it (what
  // can move between processes depends on it: fds and CUDA IPC only within
  // one machine). Default: the host name.
  virtual std::string host() const {
    char name[256] = {};
    if (::gethostname(name, sizeof(name) - 1) != 0) return "unknown-host";
    return name;
  }
  // `root` passes *data in; every other process gets root's bytes in *data.
  virtual Status Broadcast(const std::string& tag, int32_t root, std::string* data) = 0;
  // Every process contributes `mine`; *all maps each process to its bytes.
  virtual Status AllGather(const std::string& tag, const std::string& mine,
                           std::map<int32_t, std::string>* all) = 0;
  // POSIX fds (same machine): every process offers its `fds` (possibly none);
  // *got maps each other process that offered any to duplicates, in this
  // process, of its fds, in order. The caller owns (and closes) them. Owners
  // may close theirs once this returns. Default: not available.
  virtual Status ShareFds(const std::string& tag, const std::vector<int>& fds,
                          std::map<int32_t, std::vector<int>>* got) {
    (void)fds;
    got->clear();
    return Status(Code::kInvalidArgument,
                  "exchange share_fds '" + tag + "': this exchange cannot move file descriptors");
  }
};

}  // namespace jo
