// A process-wide cache keyed by CallSignature, bounded: a long job that keeps
// meeting new shapes keeps the most recent kSignatureCacheEntries entries
// (each one costs a program build per rank to recompute).
#pragma once

#include <cstddef>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

namespace jo {

constexpr size_t kSignatureCacheEntries = 1024;

// When full, the least recently used entry goes. Thread-safe.
template <typename V>
class SignatureCache {
 public:
  // The entry of `signature`, null if none; a hit makes it the most recent.
  std::shared_ptr<const V> Find(const std::string& signature) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(signature);
    if (it == entries_.end()) return nullptr;
    order_.splice(order_.begin(), order_, it->second.second);  // most recent first
    return it->second.first;
  }
  // Keeps the first value added for a signature.
  void Add(const std::string& signature, V value) {
    std::lock_guard<std::mutex> lock(mu_);
    if (entries_.count(signature) != 0) return;
    order_.push_front(signature);
    entries_.emplace(signature, Entry{std::make_shared<const V>(std::move(value)), order_.begin()});
    while (entries_.size() > kSignatureCacheEntries) {
      entries_.erase(order_.back());
      order_.pop_back();
    }
  }

 private:
  using Entry = std::pair<std::shared_ptr<const V>, std::list<std::string>::iterator>;
  std::mutex mu_;
  std::list<std::string> order_;
  std::unordered_map<std::string, Entry> entries_;
};

}  // namespace jo
