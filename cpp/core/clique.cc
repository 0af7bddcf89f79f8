#include "core/clique.h"

#include <cinttypes>
#include <cstdio>
#include <iterator>

namespace jo {

std::string CliqueName(const CliqueKey& key) {
  char text[96];
  if (key.site == 0)  // a mesh-axis group, not one call site
    std::snprintf(text, sizeof(text), "clique 0x%016" PRIx64 "/group %" PRId64,
                  static_cast<uint64_t>(key.key), key.group);
  else
    std::snprintf(text, sizeof(text), "clique 0x%016" PRIx64 "/site %" PRId64 "/group %" PRId64,
                  static_cast<uint64_t>(key.key), key.site, key.group);
  return text;
}

Clique::Clique(CliqueKey key, int32_t nranks) : key_(key), nranks_(nranks), epochs_(nranks, 0) {}

int64_t Clique::NextEpoch(int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  return ++epochs_[rank];
}

int64_t Clique::Epoch(int32_t rank) const {
  std::lock_guard<std::mutex> lock(mu_);
  return epochs_[rank];
}

Status CliqueRegistry::GetOrCreate(const CliqueKey& key, int32_t nranks, const Factory& make,
                                   std::shared_ptr<Clique>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cliques_.find(key);
  if (it == cliques_.end()) {
    std::shared_ptr<Clique> clique(make());
    JO_ASSERT(clique != nullptr);
    it = cliques_.emplace(key, std::move(clique)).first;
  }
  JO_REQUIRE(it->second->nranks() == nranks,
             CliqueName(key) + " has " + std::to_string(it->second->nranks()) +
                 " ranks, but this call has axis_size " + std::to_string(nranks));
  *out = it->second;
  return OkStatus();
}

std::vector<std::shared_ptr<Clique>> CliqueRegistry::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<Clique>> out;
  for (const auto& entry : cliques_) out.push_back(entry.second);
  return out;
}

bool CliqueRegistry::Erase(const CliqueKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return cliques_.erase(key) != 0;
}

std::shared_ptr<Clique> CliqueRegistry::Find(const CliqueKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = cliques_.find(key);
  return it == cliques_.end() ? nullptr : it->second;
}

void CliqueRegistry::EraseSite(int64_t key, int64_t site) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = cliques_.begin(); it != cliques_.end();)
    it = it->first.key == key && it->first.site == site ? cliques_.erase(it) : std::next(it);
}

void CliqueRegistry::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  cliques_.clear();
}

}  // namespace jo
