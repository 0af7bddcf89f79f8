// Cliques: the ranks of one group of a mesh axis that run a collective
// together, and the registry that keeps them for the life of the process.
//
// A clique is keyed by (clique_key, group, site). clique_key is computed in
// Python from the mesh axis names/sizes, the axis name, the transport and the
// device ids when known, so it is identical in every process; group is the
// linear index of the other manual mesh axes (dp=2, tp=4 along tp: groups 0
// and 1); site names the call site (one custom-call instruction of one
// executable, see host_call.h NewCallSite), so two call sites never share
// epochs, flags or workspace even when XLA runs them in a different order on
// different devices. Per rank the clique counts calls: the k-th execution of
// a call site has epoch k on every rank.
//
// Nothing here assumes one address space; executors derive from Clique to
// attach their transport state (the host executor: in-process flags,
// mailbox and workspace; a multi-process executor: shm / IPC handles).
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
  int64_t site = 0;  // call-site ordinal (0 = not tied to a call site)
  bool operator<(const CliqueKey& other) const {
    if (key != other.key) return key < other.key;
    if (site != other.site) return site < other.site;
    return group < other.group;
  }
};

// "clique 0x0123abcd.../site 2/group 1": how errors name a clique (a
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

  // Epoch of the next call of `rank` (1, 2, ...).
  int64_t NextEpoch(int32_t rank);
  int64_t Epoch(int32_t rank) const;

 private:
  const CliqueKey key_;
  const int32_t nranks_;
  mutable std::mutex mu_;
  std::vector<int64_t> epochs_;
};

// Process-wide map CliqueKey -> Clique. All members are thread-safe.
class CliqueRegistry {
 public:
  using Factory = std::function<std::unique_ptr<Clique>()>;

  // Returns the clique of `key`, creating it with `make` on first use; the
  // rank count must agree with the existing clique.
  Status GetOrCreate(const CliqueKey& key, int32_t nranks, const Factory& make,
                     std::shared_ptr<Clique>* out);
  std::vector<std::shared_ptr<Clique>> List() const;
  bool Erase(const CliqueKey& key);  // a clique whose bootstrap failed
  std::shared_ptr<Clique> Find(const CliqueKey& key) const;  // null if absent
  void Clear();  // tests only: calls in flight keep their shared_ptr
  // Forgets the cliques of one call site (every group) when its executable
  // goes away; calls in flight keep their shared_ptr.
  void EraseSite(int64_t key, int64_t site);

 private:
  mutable std::mutex mu_;
  std::map<CliqueKey, std::shared_ptr<Clique>> cliques_;
};

}  // namespace jo
