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

}  // namespace

Status SiteCliques::GetOrCreate(const CliqueKey& key, int64_t instance, int32_t nranks,
                                const Factory& make, std::shared_ptr<HostClique>* out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = cliques_.begin(); it != cliques_.end();)  // the cliques of sites now gone
    it = it->second.expired() ? cliques_.erase(it) : std::next(it);
  std::weak_ptr<HostClique>& slot = cliques_[{key, instance}];
  std::shared_ptr<HostClique> clique = slot.lock();
  if (clique == nullptr) {
    clique = make();
    JO_ASSERT(clique != nullptr);
    slot = clique;
  }
  JO_REQUIRE(clique->nranks() == nranks,
             CliqueName(key) + " has " + std::to_string(clique->nranks()) +
                 " ranks, but this call has axis_size " + std::to_string(nranks));
  *out = std::move(clique);
  return OkStatus();
}

std::vector<std::shared_ptr<HostClique>> SiteCliques::List() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<HostClique>> out;
  for (const auto& entry : cliques_)
    if (std::shared_ptr<HostClique> clique = entry.second.lock()) out.push_back(std::move(clique));
  return out;
}

Status RaisedFlag(const WaitContext& ctx, int32_t peer, int32_t flag) {
  return Internal(std::string(ctx.op) + " (rank " + std::to_string(ctx.rank) + ", call " +
                  std::to_string(ctx.epoch) + ", replayable): signals flag " +
                  std::to_string(flag) + " of rank " + std::to_string(peer) +
                  ", which is still raised: that rank has not consumed (and reset) the last "
                  "call's signal, so a writer ran a call ahead of its reader (a missing "
                  "acknowledgement; docs/gpu-internals.md §8)");
}

std::string HostClique::Where(const WaitContext& ctx) const {
  return std::string(ctx.op) + " (" + name() + ", rank " + std::to_string(ctx.rank) + ", epoch " +
         std::to_string(ctx.epoch) + ")";
}

LocalClique::LocalClique(CliqueKey key, int32_t nranks)
    : HostClique(key, nranks),
      workspace_(nranks),
      flags_(nranks),
      owner_device_(nranks, -1),
      done_(nranks, 0),
      grow_arrived_(nranks, false) {}

void LocalClique::WakeAll() {
  {
    std::lock_guard<std::mutex> lock(mu_);
  }  // a waiter is either before its check or waiting
  cv_.notify_all();
}

Status LocalClique::Fail(Status status) {
  JO_WARN(status.message());
  Break(status);
  return status;
}

Status LocalClique::ClaimRank(WaitContext* ctx, int64_t device) {
  int64_t owner = -1;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // One call at a time per rank, in epoch order (the parity rule).
    bool broken = false;
    const bool ready = cv_.wait_until(lock, DeadlineAfter(ctx->timeout), [&] {
      owner = owner_device_[ctx->rank];
      if (owner != -1 && owner != device) return true;
      broken = !BrokenReason().empty();
      return broken || (owner == -1 && done_[ctx->rank] >= ctx->epoch - 1);
    });
    if (broken) {
      lock.unlock();
      return CheckNotBroken(Where(*ctx));
    }
    if (ready && owner == -1) {
      owner_device_[ctx->rank] = device;
      return OkStatus();
    }
    if (!ready) {
      const int64_t done = done_[ctx->rank];
      lock.unlock();
      return Fail(Status(Code::kTimeout, Where(*ctx) + ": timeout after " + Seconds(ctx->timeout) +
                                             " waiting for this rank's "
                                             "call " +
                                             std::to_string(ctx->epoch - 1) +
                                             " to finish (it has finished call " +
                                             std::to_string(done) + ")"));
    }
  }
  return Fail(InvalidArgument(
      Where(*ctx) + ": devices " + std::to_string(owner) + " and " + std::to_string(device) +
      " call as rank " + std::to_string(ctx->rank) +
      " at the same time (a shard_map that leaves a mesh axis automatic gives devices that "
      "differ only in that axis the same rank and group)"));
}

void LocalClique::ReleaseRank(const WaitContext& ctx) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    owner_device_[ctx.rank] = -1;
    done_[ctx.rank] = std::max(done_[ctx.rank], ctx.epoch);
  }
  cv_.notify_all();
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

int64_t LocalClique::WorkspaceBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return workspace_bytes_;
}

void LocalClique::Grow(int64_t workspace_bytes, int32_t num_flags) {
  // Round up so that a slowly growing sequence of shapes does not rendezvous
  // on every call.
  const int64_t bytes = std::max<int64_t>(workspace_bytes, workspace_bytes_ + workspace_bytes_ / 2);
  const int64_t rounded = (bytes + 4095) / 4096 * 4096;
  const int32_t flags = std::max(num_flags, num_flags_);
  for (int32_t r = 0; r < nranks(); ++r) {
    workspace_[r].assign(static_cast<size_t>(2 * rounded), std::byte{0});
    flags_[r].assign(2 * static_cast<size_t>(flags), 0);  // no call in flight: safe to reset
  }
  JO_INFO(name() + ": workspace grown to 2 x " + std::to_string(rounded) + " bytes per rank, " +
          std::to_string(flags) + " flags per parity");
  workspace_bytes_ = rounded;
  num_flags_ = flags;
}

Status LocalClique::Reserve(const WaitContext& ctx, const CallNeeds& needs) {
  std::unique_lock<std::mutex> lock(mu_);
  if (needs.workspace_bytes <= workspace_bytes_ && needs.num_flags <= num_flags_) return OkStatus();
  // Rendezvous: every rank asks for the same size at the same epoch, since
  // all ranks run the same calls; the last one to arrive reallocates.
  const int64_t generation = grow_generation_;
  grow_arrived_[ctx.rank] = true;
  if (++grow_count_ == nranks()) {
    try {
      Grow(needs.workspace_bytes, needs.num_flags);
    } catch (const std::bad_alloc&) {
      lock.unlock();
      return Fail(Status(Code::kResource, Where(ctx) + ": workspace growth to 2 x " +
                                              std::to_string(needs.workspace_bytes) +
                                              " bytes per rank: out of memory"));
    }
    grow_count_ = 0;
    std::fill(grow_arrived_.begin(), grow_arrived_.end(), false);
    ++grow_generation_;
    lock.unlock();
    cv_.notify_all();
    return OkStatus();
  }
  cv_.wait_until(lock, DeadlineAfter(ctx.timeout),
                 [&] { return grow_generation_ != generation || !BrokenReason().empty(); });
  if (grow_generation_ != generation) return OkStatus();
  lock.unlock();
  JO_CHECK(CheckNotBroken(Where(ctx)));
  std::string missing;
  {
    std::lock_guard<std::mutex> relock(mu_);
    for (int32_t r = 0; r < nranks(); ++r)
      if (!grow_arrived_[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " in the workspace-growth rendezvous; missing peer "
                                         "rank(s) " +
                                         missing + " did not arrive"));
}

std::byte* LocalClique::Workspace(int32_t owner, int64_t epoch) {
  // Only written during a growth rendezvous, when no call is in flight.
  std::vector<std::byte>& region = workspace_[owner];
  return region.empty() ? nullptr : region.data() + Parity(epoch) * workspace_bytes_;
}

Status LocalClique::Signal(const WaitContext& ctx, int32_t peer, int32_t flag) {
  JO_CHECK(CheckNotBroken(Where(ctx)));
  {
    std::unique_lock<std::mutex> lock(mu_);
    JO_ASSERT(peer >= 0 && peer < nranks() && flag >= 0 && flag < num_flags_);
    int64_t& value = flags_[peer][Parity(SlotEpoch(ctx)) * num_flags_ + flag];
    if (ctx.replayable && value != 0) {
      lock.unlock();
      return Fail(RaisedFlag(ctx, peer, flag));
    }
    value = std::max(value, FlagValue(ctx));
  }
  cv_.notify_all();
  return OkStatus();
}

Status LocalClique::WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) {
  std::unique_lock<std::mutex> lock(mu_);
  JO_ASSERT(flag >= 0 && flag < num_flags_);
  const size_t index = static_cast<size_t>(Parity(SlotEpoch(ctx)) * num_flags_ + flag);
  const int64_t want = FlagValue(ctx);
  cv_.wait_until(lock, DeadlineAfter(ctx.timeout),
                 [&] { return flags_[ctx.rank][index] >= want || !BrokenReason().empty(); });
  if (flags_[ctx.rank][index] >= want) return OkStatus();
  const int64_t has = flags_[ctx.rank][index];
  lock.unlock();
  JO_CHECK(CheckNotBroken(Where(ctx)));
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " waiting for flag " + std::to_string(flag) + " (has " +
                                         std::to_string(has) + ", needs " + std::to_string(want) +
                                         ") from rank " + std::to_string(writer) + ": " +
                                         Missing(ctx, writer)));
}

Status LocalClique::ResetFlags(const WaitContext& ctx, int32_t first, int32_t count) {
  JO_CHECK(CheckNotBroken(Where(ctx)));
  std::lock_guard<std::mutex> lock(mu_);
  JO_ASSERT(ctx.replayable && first >= 0 && count >= 0 && first + count <= num_flags_);
  std::fill_n(flags_[ctx.rank].begin() + first, count, 0);  // parity 0's
  return OkStatus();
}

Status LocalClique::Send(const WaitContext& ctx, int32_t peer, int32_t tag,
                         std::vector<std::byte> data) {
  JO_CHECK(CheckNotBroken(Where(ctx)));
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  cv_.wait_until(lock, DeadlineAfter(ctx.timeout),
                 [&] { return mailbox_.count(key) != 0 || !BrokenReason().empty(); });
  auto it = mailbox_.find(key);
  if (it != mailbox_.end()) {
    *data = std::move(it->second);
    mailbox_.erase(it);
    return OkStatus();
  }
  lock.unlock();
  JO_CHECK(CheckNotBroken(Where(ctx)));
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " in Recv(tag " + std::to_string(tag) + ") from rank " +
                                         std::to_string(peer) + ": " + Missing(ctx, peer)));
}

}  // namespace jo::host
