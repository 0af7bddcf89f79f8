#include "host/host_clique.h"

#include <algorithm>

#include "core/deadline.h"
#include "core/log.h"

namespace jo::host {
namespace {

std::string Seconds(std::chrono::milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3f s", ms.count() / 1000.0);
  return text;
}

int32_t Parity(int64_t epoch) { return static_cast<int32_t>(epoch & 1); }

// Logs where a cross-rank failure starts (the text is kept for LastWarning()).
Status Warn(Status status) {
  JO_WARN(status.message());
  return status;
}

}  // namespace

LocalClique::LocalClique(CliqueKey key, int32_t nranks, std::shared_ptr<WorkspaceAllocator> allocator)
    : HostClique(key, nranks),
      allocator_(std::move(allocator)),
      workspace_(nranks),
      flags_(nranks),
      owner_device_(nranks, -1),
      grow_arrived_(nranks, false) {}

Status LocalClique::ClaimRank(const WaitContext& ctx, int64_t device) {
  std::unique_lock<std::mutex> lock(mu_);
  int64_t& owner = owner_device_[ctx.rank];
  if (owner == -1 || owner == device) {
    owner = device;
    return OkStatus();
  }
  Status status = InvalidArgument(
      Where(ctx) + ": devices " + std::to_string(owner) + " and " + std::to_string(device) +
      " call as rank " + std::to_string(ctx.rank) + " at the same time (a shard_map that leaves "
      "a mesh axis automatic gives devices that differ only in that axis the same rank and "
      "group; two meshes of the same shape running at once need jax.set_mesh so that their "
      "device ids enter the clique key)");
  broken_ = status.message();
  lock.unlock();
  cv_.notify_all();
  return status;
}

void LocalClique::ReleaseRank(int32_t rank) {
  std::lock_guard<std::mutex> lock(mu_);
  owner_device_[rank] = -1;
}

std::string LocalClique::Where(const WaitContext& ctx) const {
  return std::string(ctx.op) + " (" + name() + ", rank " + std::to_string(ctx.rank) + ", epoch " +
         std::to_string(ctx.epoch) + ")";
}

std::string LocalClique::Missing(const WaitContext& ctx, int32_t expected) const {
  // A rank whose call counter is behind ours has not entered this call: that
  // is the missing peer, even when the rank we wait on directly is another
  // (ring forwarding makes stalls travel).
  std::string late;
  for (int32_t r = 0; r < nranks(); ++r)
    if (Epoch(r) < ctx.epoch) late += (late.empty() ? "" : ", ") + std::to_string(r);
  if (!late.empty())
    return "missing peer rank(s) " + late + " did not arrive (have not started epoch " +
           std::to_string(ctx.epoch) + ")";
  return "every rank arrived; rank " + std::to_string(expected) + " did not deliver";
}

Status LocalClique::BrokenStatus(const WaitContext& ctx) const {
  return Status(Code::kAborted,
                Where(ctx) + ": clique aborted by an earlier failure: " + broken_);
}

void LocalClique::Break(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return;
    broken_ = status.message();
  }
  cv_.notify_all();
}

std::string LocalClique::BrokenReason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return broken_;
}

int64_t LocalClique::WorkspaceBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return workspace_bytes_;
}

Status LocalClique::Grow(int64_t workspace_bytes, int32_t num_flags) {
  // Round up so that a slowly growing sequence of shapes does not rendezvous
  // on every call.
  const int64_t bytes = std::max<int64_t>(workspace_bytes, workspace_bytes_ + workspace_bytes_ / 2);
  const int64_t rounded = (bytes + 4095) / 4096 * 4096;
  const int32_t flags = std::max(num_flags, num_flags_);
  for (int32_t r = 0; r < nranks(); ++r) {
    std::unique_ptr<WorkspaceRegion> region;
    if (rounded > 0) JO_CHECK(allocator_->Allocate(static_cast<size_t>(2 * rounded), &region));
    workspace_[r] = std::move(region);
    flags_[r].assign(2 * static_cast<size_t>(flags), 0);  // no call in flight: safe to reset
  }
  JO_INFO(name() + ": workspace grown to 2 x " + std::to_string(rounded) + " bytes per rank, " +
          std::to_string(flags) + " flags per parity");
  workspace_bytes_ = rounded;
  num_flags_ = flags;
  return OkStatus();
}

Status LocalClique::Prepare(const WaitContext& ctx, const std::string& signature,
                            const CallNeeds& needs) {
  const int64_t workspace_bytes = needs.workspace_bytes;
  const int32_t num_flags = needs.num_flags;
  std::unique_lock<std::mutex> lock(mu_);
  if (!broken_.empty()) return BrokenStatus(ctx);
  auto& seen = signatures_[ctx.epoch];
  if (seen.second == 0) seen.first = signature;
  if (seen.first != signature) {
    Status status = InvalidArgument(
        Where(ctx) + ": ranks disagree on call " + std::to_string(ctx.epoch) + " of this clique: '" +
        signature + "' here, '" + seen.first + "' on another rank (do all devices run the same "
        "program, with the collective calls in the same order?)");
    broken_ = status.message();
    lock.unlock();
    cv_.notify_all();
    return status;
  }
  if (++seen.second == nranks()) signatures_.erase(ctx.epoch);
  if (workspace_bytes <= workspace_bytes_ && num_flags <= num_flags_) return OkStatus();
  // Rendezvous: every rank asks for the same size at the same epoch, since
  // all ranks run the same calls; the last one to arrive reallocates.
  const int64_t generation = grow_generation_;
  grow_arrived_[ctx.rank] = true;
  if (++grow_count_ == nranks()) {
    Status status = Grow(workspace_bytes, num_flags);
    grow_count_ = 0;
    std::fill(grow_arrived_.begin(), grow_arrived_.end(), false);
    ++grow_generation_;
    if (!status.ok()) broken_ = status.message();
    lock.unlock();
    cv_.notify_all();
    return status;
  }
  const bool done = cv_.wait_until(lock, DeadlineAfter(ctx.timeout), [&] {
    return grow_generation_ != generation || !broken_.empty();
  });
  if (grow_generation_ != generation) return OkStatus();
  if (!broken_.empty()) return BrokenStatus(ctx);
  (void)done;
  std::string missing;
  for (int32_t r = 0; r < nranks(); ++r)
    if (!grow_arrived_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  Status status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                    " in the workspace-growth rendezvous; missing peer rank(s) " +
                                    missing + " did not arrive");
  broken_ = status.message();
  lock.unlock();
  cv_.notify_all();
  JO_WARN(status.message());
  return status;
}

std::byte* LocalClique::Workspace(int32_t owner, int64_t epoch) {
  // Only written during a growth rendezvous, when no call is in flight.
  WorkspaceRegion* region = workspace_[owner].get();
  return region == nullptr ? nullptr : region->data() + Parity(epoch) * workspace_bytes_;
}

Status LocalClique::Signal(const WaitContext& ctx, int32_t peer, int32_t flag) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return BrokenStatus(ctx);
    JO_ASSERT(peer >= 0 && peer < nranks() && flag >= 0 && flag < num_flags_);
    int64_t& value = flags_[peer][Parity(ctx.epoch) * num_flags_ + flag];
    value = std::max(value, ctx.epoch);
  }
  cv_.notify_all();
  return OkStatus();
}

Status LocalClique::WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) {
  std::unique_lock<std::mutex> lock(mu_);
  JO_ASSERT(flag >= 0 && flag < num_flags_);
  const size_t index = static_cast<size_t>(Parity(ctx.epoch) * num_flags_ + flag);
  const bool arrived = cv_.wait_until(lock, DeadlineAfter(ctx.timeout), [&] {
    return flags_[ctx.rank][index] >= ctx.epoch || !broken_.empty();
  });
  if (flags_[ctx.rank][index] >= ctx.epoch) return OkStatus();
  if (arrived) return BrokenStatus(ctx);
  return Warn(Status(Code::kTimeout,
                Where(ctx) + ": timeout after " + Seconds(ctx.timeout) + " waiting for flag " +
                    std::to_string(flag) + " (has epoch " +
                    std::to_string(flags_[ctx.rank][index]) + ", needs " +
                    std::to_string(ctx.epoch) + ") from rank " + std::to_string(writer) + ": " +
                    Missing(ctx, writer)));
}

Status LocalClique::Send(const WaitContext& ctx, int32_t peer, int32_t tag,
                        std::vector<std::byte> data) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty()) return BrokenStatus(ctx);
    auto inserted = mailbox_.emplace(MailKey{ctx.epoch, ctx.rank, peer, tag}, std::move(data));
    JO_ASSERT(inserted.second);
  }
  cv_.notify_all();
  return OkStatus();
}

Status LocalClique::Recv(const WaitContext& ctx, int32_t peer, int32_t tag,
                        std::vector<std::byte>* data) {
  std::unique_lock<std::mutex> lock(mu_);
  const MailKey key{ctx.epoch, peer, ctx.rank, tag};
  const bool woke = cv_.wait_until(lock, DeadlineAfter(ctx.timeout), [&] {
    return mailbox_.count(key) != 0 || !broken_.empty();
  });
  auto it = mailbox_.find(key);
  if (it != mailbox_.end()) {
    *data = std::move(it->second);
    mailbox_.erase(it);
    return OkStatus();
  }
  if (woke) return BrokenStatus(ctx);
  return Warn(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                    " in Recv(tag " + std::to_string(tag) + ") from rank " +
                                    std::to_string(peer) + ": " + Missing(ctx, peer)));
}

}  // namespace jo::host
