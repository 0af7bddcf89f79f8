#include "core/clique.h"

#include <cinttypes>
#include <cstdio>

namespace jo {

std::string CliqueName(const CliqueKey& key) {
  char text[96];
  if (key.site == 0)  // a mesh-axis group, not one call site
    std::snprintf(text, sizeof(text), "clique 0x%016" PRIx64 "/group %" PRId64,
                  static_cast<uint64_t>(key.key), key.group);
  else
    std::snprintf(text, sizeof(text),
                  "clique 0x%016" PRIx64 "/site 0x%016" PRIx64 "/group %" PRId64,
                  static_cast<uint64_t>(key.key), static_cast<uint64_t>(key.site), key.group);
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

Status Clique::Agree(const std::string& where, int32_t rank, int64_t epoch,
                     const std::string& signature) {
  (void)rank;
  JO_CHECK(CheckNotBroken(where));  // a broken clique fails fast, whatever the call
  Status status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& seen = signatures_[epoch];
    if (seen.second == 0) seen.first = signature;
    if (seen.first == signature) {
      // Every rank of this process has checked in: nobody compares with it again.
      if (++seen.second == LocalRanks()) signatures_.erase(epoch);
      return OkStatus();
    }
    status = InvalidArgument(where + ": ranks disagree on call " + std::to_string(epoch) +
                             " of this clique: '" + signature + "' here, '" + seen.first +
                             "' on another rank (do all devices run the same program, with the "
                             "collective calls in the same order?)");
  }
  Break(status);
  return status;
}

void Clique::Break(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return;
    broken_ = status.message();
  }
  WakeAll();
}

std::string Clique::BrokenReason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

Status Clique::CheckNotBroken(const std::string& where) const {
  const std::string reason = BrokenReason();
  if (reason.empty()) return OkStatus();
  return Status(Code::kAborted, where + ": clique aborted by an earlier failure: " + reason);
}

}  // namespace jo
