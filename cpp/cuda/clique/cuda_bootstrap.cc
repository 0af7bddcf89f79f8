#include "cuda/clique/cuda_bootstrap.h"

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/base/check.h"

namespace jo::cuda {
namespace {

using Key = std::tuple<int64_t, int64_t, int64_t>;  // clique key, group, process

struct Ids {
  std::mutex mu;
  std::map<Key, std::string> ids;
  std::map<Key, std::shared_ptr<Exchange>> exchanges;
};

Ids& Registry() {
  static auto* ids = new Ids();  // outlives static destructors: handlers may run late
  return *ids;
}

}  // namespace

Status NewNcclUniqueId(std::string* out) {
  ncclUniqueId id{};
  const ncclResult_t code = ncclGetUniqueId(&id);
  if (code != ncclSuccess)
    return Status(Code::kInternal, std::string("ncclGetUniqueId failed: ") +
                                       ncclGetErrorString(code) +
                                       " (NCCL_SOCKET_IFNAME / NCCL_DEBUG=INFO help find why)");
  out->assign(id.internal, sizeof(id.internal));
  return OkStatus();
}

Status RegisterNcclId(int64_t clique_key, int64_t group, int64_t process, const std::string& id) {
  if (id.size() != sizeof(ncclUniqueId::internal))
    return InvalidArgument("NCCL unique id: expected " +
                           std::to_string(sizeof(ncclUniqueId::internal)) + " bytes, got " +
                           std::to_string(id.size()));
  Ids& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.ids[{clique_key, group, process}] = id;
  return OkStatus();
}

Status FindNcclId(int64_t clique_key, int64_t group, int64_t process, const std::string& who,
                  ncclUniqueId* out) {
  Ids& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.ids.find({clique_key, group, process});
  if (it == r.ids.end())
    return Status(Code::kInvalidArgument,
                  who + ": this clique spans processes but process " + std::to_string(process) +
                      " has no NCCL unique id for it. The id is exchanged through "
                      "jax.distributed when jaxoverlap traces the call (jax.distributed."
                      "initialize() first, and trace the op in this process rather than loading "
                      "a compiled executable made elsewhere)");
  std::memcpy(out->internal, it->second.data(), sizeof(out->internal));
  return OkStatus();
}

Status RegisterExchange(int64_t clique_key, int64_t group, int64_t process,
                        std::shared_ptr<Exchange> exchange) {
  if (!exchange) return InvalidArgument("RegisterExchange: no exchange");
  Ids& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.exchanges[{clique_key, group, process}] = std::move(exchange);
  return OkStatus();
}

std::shared_ptr<Exchange> FindExchange(int64_t clique_key, int64_t group, int64_t process) {
  Ids& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.exchanges.find({clique_key, group, process});
  return it == r.exchanges.end() ? nullptr : it->second;
}

void ForgetNcclIds() {
  Ids& r = Registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.ids.clear();
  r.exchanges.clear();
}

}  // namespace jo::cuda
