// Cliques: the ranks of one group of a mesh axis that run the calls of one
// call site together, and the registry that keeps them.
//
// A clique is keyed by (clique_key, group, site). clique_key is computed in
// Python from the mesh, the axis and the transport (identical in every
// process); group is the linear index of the other mesh axes (dp=2, tp=4
// along tp: groups 0 and 1); site is the call site's id (what the custom
// call is, the same in every process: core/call.h CallSite), so two call
// sites never share epochs, flags or workspace even when XLA runs them in a
// different order on different devices. Per rank a clique counts calls: the k-th execution of a
// call site has epoch k on every rank.
//
// The base owns what every executor's clique shares: the epochs, the
// agreement check (every rank makes the same call at the same epoch) and the
// broken state (the first failure wins; later calls fail fast). Executors
// derive from it to add their transport state and override the agreement
// and broken state only where they live elsewhere (shared memory across
// processes).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/status.h"

namespace jo {

struct CliqueKey {
  int64_t key = 0;
  int64_t group = 0;
  int64_t site = 0;  // call-site id (0: a mesh-axis group, not one call site)
  bool operator<(const CliqueKey& other) const {
    if (key != other.key) return key < other.key;
    if (site != other.site) return site < other.site;
    return group < other.group;
  }
};

// "clique 0x0123abcd.../site 0x4567.../group 1": how errors name a clique (a
// mesh-axis group, site 0, is "clique 0x0123abcd.../group 1").
std::string CliqueName(const CliqueKey& key);

class Clique {
 public:
  Clique(CliqueKey key, int32_t nranks);
  virtual ~Clique() = default;
  Clique(const Clique&) = delete;
  Clique& operator=(const Clique&) = delete;

  const CliqueKey& key() const { return key_; }
  int32_t nranks() const { return nranks_; }
  std::string name() const { return CliqueName(key_); }

  // Epoch of the next call of `rank` (1, 2, ...), taken in the order this
  // rank's device executes the call site.
  int64_t NextEpoch(int32_t rank);
  // The calls of `rank` so far (a clique that continues an earlier one's
  // epochs counts those too).
  virtual int64_t Epoch(int32_t rank) const;

  // The agreement check: `rank` makes the call `signature` at `epoch`. A
  // rank whose call differs from another's at the same epoch fails (naming
  // both calls) and breaks the clique, instead of exchanging wrong data.
  // `where` prefixes the error ("ag_matmul (clique ..., rank 2, epoch 5)").
  virtual Status Agree(const std::string& where, int32_t rank, int64_t epoch,
                       const std::string& signature);

  // Marks the clique broken (first error wins) and wakes its waiters.
  virtual void Break(const Status& status);
  virtual std::string BrokenReason() const;  // "" while not broken
  // kAborted naming the first failure, if broken.
  Status CheckNotBroken(const std::string& where) const;

 protected:
  // Derived cliques whose waiters must wake when the clique breaks.
  virtual void WakeAll() {}
  // Ranks of this clique that check in here (the others, in other processes,
  // agree through the transport's own matching).
  virtual int32_t LocalRanks() const { return nranks_; }

 private:
  const CliqueKey key_;
  const int32_t nranks_;
  mutable std::mutex mu_;
  std::vector<int64_t> epochs_;
  std::map<int64_t, std::pair<std::string, int32_t>> signatures_;  // epoch -> (call, seen)
  std::string broken_;
};

// Process-wide map CliqueKey -> clique of type C. All members are thread-safe.
template <typename C>
class CliqueRegistry {
 public:
  using Factory = std::function<std::unique_ptr<C>()>;

  // Returns the clique of `key`, creating it with `make` on first use; the
  // rank count must agree with the existing clique.
  Status GetOrCreate(const CliqueKey& key, int32_t nranks, const Factory& make,
                     std::shared_ptr<C>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = cliques_.find(key);
    if (it == cliques_.end()) {
      std::shared_ptr<C> clique(make());
      JO_ASSERT(clique != nullptr);
      it = cliques_.emplace(key, std::move(clique)).first;
    }
    JO_REQUIRE(it->second->nranks() == nranks,
               CliqueName(key) + " has " + std::to_string(it->second->nranks()) +
                   " ranks, but this call has axis_size " + std::to_string(nranks));
    *out = it->second;
    return OkStatus();
  }
  std::vector<std::shared_ptr<C>> List() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<C>> out;
    for (const auto& entry : cliques_) out.push_back(entry.second);
    return out;
  }
  void Clear() {  // calls in flight keep their shared_ptr
    std::lock_guard<std::mutex> lock(mu_);
    cliques_.clear();
  }

 private:
  mutable std::mutex mu_;
  std::map<CliqueKey, std::shared_ptr<C>> cliques_;
};

}  // namespace jo
