#include "host/shm_clique.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <new>

#include "core/log.h"

namespace jo::host {
namespace {

constexpr uint64_t kMagic = 0x746973736873656aULL;  // "jeshssit"
constexpr uint32_t kVersion = 3;
constexpr size_t kSignatureBytes = 192;
constexpr size_t kAlign = 64;
constexpr auto kPollSlice = std::chrono::milliseconds(100);
// The least time ranks must wait for each other unchanged before it counts as
// a deadlock (ranks that merely run late arrive, and change what they wait for).
constexpr auto kDeadlockSettle = std::chrono::milliseconds(1000);

size_t RoundUp(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }
int32_t ParityOf(int64_t epoch) { return static_cast<int32_t>(epoch & 1); }

std::string Seconds(std::chrono::milliseconds ms) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.3f s", ms.count() / 1000.0);
  return text;
}

uint64_t Fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ULL;
  return h;
}

struct OutboxHeader {
  std::atomic<int32_t> reserve;  // next entry index
  int32_t pad;
  std::atomic<int64_t> cursor;  // next free byte of the outbox data
};

struct alignas(kAlign) MailEntry {
  std::atomic<int64_t> ready_epoch;  // the call that posted it (written last)
  int32_t dst;
  int32_t tag;
  int64_t offset;
  int64_t bytes;
};

}  // namespace

struct ShmClique::SiteHeader {
  uint64_t magic;
  uint32_t version;
  int32_t nranks;
  int64_t key;
  int64_t group;
  int64_t site;
  // The call the site was made for: every process's must fit it.
  int64_t workspace_bytes;
  int64_t mail_bytes;
  int32_t mail_messages;
  int32_t num_flags;
  char signature[kSignatureBytes];
};

struct alignas(kAlign) ShmClique::RankState {
  std::atomic<int64_t> epoch;         // the call this rank is in (set in Agree)
  std::atomic<int64_t> done;          // the last call this rank finished
  std::atomic<int64_t> owner_device;  // device inside a call as this rank, or -1
  std::atomic<int64_t> signature_epoch[2];
  std::atomic<uint64_t> signature_hash[2];
  char signature[2][kSignatureBytes];
};

// Where everything lives in a site segment: the header, the rank states,
// then per rank, per parity: flags | outbox header | entries | outbox data |
// workspace, each 64-aligned.
struct ShmClique::Layout {
  int64_t workspace_bytes = 0, mail_bytes = 0;
  int32_t mail_messages = 0, num_flags = 0;
  size_t flags_off = 0, outbox_off = 0, entries_off = 0, mail_off = 0, workspace_off = 0;
  size_t ranks_off = 0, data_off = 0, parity_bytes = 0, rank_bytes = 0, total = 0;

  Layout(int32_t nranks, const CallNeeds& needs)
      : workspace_bytes(needs.workspace_bytes),
        mail_bytes(needs.mail_bytes),
        mail_messages(needs.mail_messages),
        num_flags(needs.num_flags) {
    flags_off = 0;
    outbox_off = RoundUp(static_cast<size_t>(num_flags) * sizeof(int64_t), kAlign);
    entries_off = outbox_off + RoundUp(sizeof(OutboxHeader), kAlign);
    mail_off = entries_off + static_cast<size_t>(mail_messages) * sizeof(MailEntry);
    workspace_off = mail_off + RoundUp(static_cast<size_t>(mail_bytes), kAlign);
    parity_bytes = workspace_off + RoundUp(static_cast<size_t>(workspace_bytes), kAlign);
    rank_bytes = 2 * parity_bytes;
    ranks_off = RoundUp(sizeof(SiteHeader), kAlign);
    data_off = ranks_off + static_cast<size_t>(nranks) * sizeof(RankState);
    total = data_off + static_cast<size_t>(nranks) * rank_bytes;
  }
};

namespace {

struct SiteInitArgs {
  const CallNeeds* needs;
  const std::string* signature;
  const ShmClique::Layout* layout;
};

// Fills a new site segment (the first process to run the site does it).
void InitSite(std::byte* base, const ShmDomain& domain, int64_t site, const void* arg) {
  const auto* args = static_cast<const SiteInitArgs*>(arg);
  auto* h = new (base) ShmClique::SiteHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = domain.nranks();
  h->key = domain.key();
  h->group = domain.group();
  h->site = site;
  h->workspace_bytes = args->needs->workspace_bytes;
  h->mail_bytes = args->needs->mail_bytes;
  h->mail_messages = args->needs->mail_messages;
  h->num_flags = args->needs->num_flags;
  std::snprintf(h->signature, kSignatureBytes, "%s", args->signature->c_str());
  for (int32_t r = 0; r < domain.nranks(); ++r) {
    auto* s = new (base + args->layout->ranks_off + r * sizeof(ShmClique::RankState))
        ShmClique::RankState();
    s->owner_device.store(-1);
  }
}

}  // namespace

ShmClique::ShmClique(std::shared_ptr<ShmDomain> domain, int64_t site, const CallNeeds& needs,
                     std::string signature)
    : HostClique(CliqueKey{domain->key(), domain->group(), site}, domain->nranks()),
      domain_(std::move(domain)),
      signature_(std::move(signature)),
      layout_(std::make_unique<Layout>(domain_->nranks(), needs)),
      base_(new std::atomic<int64_t>[static_cast<size_t>(domain_->nranks())]()) {}

ShmClique::~ShmClique() {
  if (site_ != nullptr) domain_->ReleaseSite(key().site);
}

ShmClique::RankState* ShmClique::rank_state(int32_t rank) const {
  return reinterpret_cast<RankState*>(site_->data() + layout_->ranks_off +
                                      static_cast<size_t>(rank) * sizeof(RankState));
}

int64_t ShmClique::Epoch(int32_t rank) const { return Clique::Epoch(rank) + base_[rank].load(); }

std::string ShmClique::Kind() const {
  std::string local;
  for (int32_t r = 0; r < nranks(); ++r)
    if (domain_->Local(r)) local += (local.empty() ? "" : ",") + std::to_string(r);
  return "shared memory across " + std::to_string(domain_->nprocs()) + " processes (ranks " +
         local + " in this process " + std::to_string(domain_->process()) + ")";
}

std::string ShmClique::Where(const WaitContext& ctx) const {
  return std::string(ctx.op) + " (" + name() + ", rank " + std::to_string(ctx.rank) +
         " in process " + std::to_string(domain_->process()) + ", epoch " +
         std::to_string(ctx.epoch) + ")";
}

std::string ShmClique::Missing(const WaitContext& ctx, int32_t expected) const {
  std::string late, where;
  for (int32_t r = 0; r < nranks(); ++r) {
    if (rank_state(r)->epoch.load() >= ctx.epoch) continue;
    late += (late.empty() ? "" : ", ") + std::to_string(r);
    where += "; " + domain_->WhereIs(r);
  }
  if (!late.empty())
    return "missing peer rank(s) " + late + " did not arrive (have not started call " +
           std::to_string(ctx.epoch) + " of this " + SiteName(key().site) + ", '" + signature_ +
           "'" + where + ")";
  return "every rank arrived; " + domain_->RankName(expected) + " did not deliver";
}

Status ShmClique::BrokenStatus(const WaitContext& ctx) const {
  return Status(Code::kAborted,
                Where(ctx) + ": clique aborted by an earlier failure: " + BrokenReason());
}

Status ShmClique::Fail(Status status) {
  JO_WARN(status.message());
  Break(status);
  return status;
}

void ShmClique::Break(const Status& status) { domain_->Break(status); }

std::string ShmClique::BrokenReason() const { return domain_->BrokenReason(); }

template <typename Pred>
Status ShmClique::WaitFor(const WaitContext& ctx, Pred pred, bool for_peers) {
  const auto start = Clock::now();
  const auto deadline = DeadlineAfter(ctx.timeout);
  // Ranks that wait for each other in calls none of them can reach stay so:
  // once the same ranks wait the same way for this long (an eighth of the
  // timeout, at least a second, at most a quarter), it is a deadlock. Long
  // enough that two independent calls XLA runs at once, started in mirror
  // order by two ranks each still busy before its other call, are not taken
  // for one (docs/native.md §5).
  const auto settle = std::min<Clock::duration>(
      std::max<Clock::duration>(kDeadlockSettle, ctx.timeout / 8), ctx.timeout / 4);
  std::atomic<uint32_t>* bell = domain_->Doorbell(ctx.rank);
  constexpr int32_t kNotBegun = -2;
  int32_t record = kNotBegun;
  std::vector<uint32_t> stamp;
  auto stuck_since = start;
  struct EndWait {
    ShmDomain* domain;
    int32_t rank;
    const int32_t* record;
    ~EndWait() {
      if (*record != kNotBegun) domain->EndWait(rank, *record);
    }
  } end_wait{domain_.get(), ctx.rank, &record};
  while (true) {
    const uint32_t seq = bell->load();
    if (pred()) return OkStatus();
    if (domain_->broken()) return BrokenStatus(ctx);
    JO_CHECK(domain_->CheckPeers(Where(ctx)));
    const auto now = Clock::now();
    if (now >= deadline) return Status(Code::kTimeout, "");
    if (for_peers && nranks() <= 64) {
      if (record == kNotBegun)
        record = domain_->BeginWait(ctx.rank, key().site, ctx.epoch, signature_);
      uint64_t missing = 0;
      for (int32_t r = 0; r < nranks(); ++r)
        if (rank_state(r)->epoch.load() < ctx.epoch) missing |= uint64_t{1} << r;
      domain_->UpdateWait(ctx.rank, record, missing);
      std::vector<uint32_t> seen;
      std::string waits;
      const std::vector<int32_t> ranks =
          missing != 0 ? domain_->Stuck(ctx.rank, &seen, &waits) : std::vector<int32_t>();
      if (ranks.empty() || seen != stamp) {
        stamp = ranks.empty() ? std::vector<uint32_t>() : seen;
        stuck_since = now;
      } else if (now - stuck_since >= settle) {
        return Fail(Deadlock(ctx, waits));
      }
    }
    FutexWait(bell, seq, std::min<Clock::duration>(deadline - now, kPollSlice));
  }
}

Status ShmClique::Deadlock(const WaitContext& ctx, const std::string& waits) const {
  return InvalidArgument(
      Where(ctx) +
      ": ranks wait for each other in calls that none of them can reach, which can never end "
      "(" +
      waits +
      "): the processes run different calls, or the same calls in different orders. Every "
      "process must run the same calls in the same order: a call named by something a process "
      "has of its own (its index, a shape of its own) is another call, and a process traces "
      "its calls in the order its Python code meets them, so a loop over a set (or anything "
      "ordered by hash) meets them in another order in every process (each has its own hash "
      "seed): iterate a list or sorted(...), never a set "
      "(docs/native.md section 7)");
}

Status ShmClique::Open(const WaitContext& ctx) {
  std::lock_guard<std::mutex> lock(open_mu_);
  if (site_ != nullptr) return OkStatus();
  // A site that could not open fails every local rank at once, with the first
  // one's error: they share one deadline, not one each.
  if (!open_status_.ok()) return open_status_;
  CallNeeds needs;
  needs.workspace_bytes = layout_->workspace_bytes;
  needs.mail_bytes = layout_->mail_bytes;
  needs.mail_messages = layout_->mail_messages;
  needs.num_flags = layout_->num_flags;
  const SiteInitArgs init{&needs, &signature_, layout_.get()};
  std::shared_ptr<ShmSegment> segment;
  Status status = domain_->OpenSite(key().site, layout_->total, DeadlineAfter(ctx.timeout),
                                    Where(ctx), &InitSite, &init, &segment);
  if (status.ok()) {
    const auto* h = reinterpret_cast<const SiteHeader*>(segment->data());
    if (h->magic != kMagic || h->version != kVersion || h->nranks != nranks() ||
        h->key != key().key || h->group != key().group || h->site != key().site)
      status = Internal(Where(ctx) +
                        ": the segment of this call site in the directory "
                        "describes another site");
    else if (h->workspace_bytes != needs.workspace_bytes || h->mail_bytes != needs.mail_bytes ||
             h->mail_messages != needs.mail_messages || h->num_flags != needs.num_flags)
      status = InvalidArgument(Where(ctx) + ": ranks disagree on the calls of this " +
                               SiteName(key().site) + ": '" + signature_ + "' here, '" +
                               std::string(h->signature, strnlen(h->signature, kSignatureBytes)) +
                               "' where it was made (do all processes run the same program?)");
  }
  if (!status.ok()) {
    if (segment != nullptr) domain_->ReleaseSite(key().site);
    open_status_ = status.code() == Code::kAborted ? status : Fail(status);
    return open_status_;
  }
  site_ = std::move(segment);
  // A process that opens a site its peers already ran continues where its
  // ranks left off (its earlier clique of the site is gone: its calls are done).
  for (int32_t r = 0; r < nranks(); ++r)
    if (domain_->Local(r)) base_[r].store(rank_state(r)->done.load());
  JO_INFO(name() + ": mapped its segment, " + std::to_string(layout_->total) + " bytes for '" +
          signature_ + "'");
  return OkStatus();
}

Status ShmClique::ClaimRank(WaitContext* ctx, int64_t device) {
  JO_CHECK(Open(*ctx));
  ctx->epoch += base_[ctx->rank].load();
  RankState* state = rank_state(ctx->rank);
  // One call of the site at a time per rank, in epoch order (the parity rule).
  int64_t other = -1;
  Status status = WaitFor(*ctx, [&] {
    other = state->owner_device.load();
    if (other != -1 && other != device) return true;
    if (state->done.load() < ctx->epoch - 1) return false;
    other = -1;
    return state->owner_device.compare_exchange_strong(other, device);
  });
  if (status.code() == Code::kTimeout)
    return Fail(Status(Code::kTimeout, Where(*ctx) + ": timeout after " + Seconds(ctx->timeout) +
                                           " waiting for this rank's call " +
                                           std::to_string(ctx->epoch - 1) +
                                           " of the site to finish (it has finished call " +
                                           std::to_string(state->done.load()) + ")"));
  JO_CHECK(status);
  if (other != -1 && other != device)
    return Fail(InvalidArgument(Where(*ctx) + ": devices " + std::to_string(other) + " and " +
                                std::to_string(device) + " call as rank " +
                                std::to_string(ctx->rank) + " at the same time"));
  domain_->NoteCall(ctx->rank, key().site, ctx->epoch, true, signature_);
  return OkStatus();
}

void ShmClique::ReleaseRank(const WaitContext& ctx) {
  if (site_ == nullptr) return;
  RankState* state = rank_state(ctx.rank);
  state->done.store(ctx.epoch);
  state->owner_device.store(-1);
  domain_->NoteCall(ctx.rank, key().site, ctx.epoch, false, signature_);
  domain_->Ring(ctx.rank);  // the rank's next call of this site may be waiting for it
}

Status ShmClique::Agree(const std::string& where, int32_t rank, int64_t epoch,
                        const std::string& signature) {
  JO_ASSERT(site_ != nullptr);  // ClaimRank opened it
  rank_state(rank)->epoch.store(epoch);
  JO_CHECK(domain_->broken() ? Status(Code::kAborted, where +
                                                          ": clique aborted by an earlier "
                                                          "failure: " +
                                                          BrokenReason())
                             : OkStatus());
  const int32_t p = ParityOf(epoch);
  const uint64_t hash = Fnv1a(signature);
  RankState* mine = rank_state(rank);
  mine->signature_hash[p].store(hash);
  std::snprintf(mine->signature[p], kSignatureBytes, "%s", signature.c_str());
  mine->signature_epoch[p].store(epoch);
  // Whichever of two disagreeing ranks publishes second sees the other.
  for (int32_t r = 0; r < nranks(); ++r) {
    RankState* other = rank_state(r);
    if (r == rank || other->signature_epoch[p].load() != epoch) continue;
    if (other->signature_hash[p].load() == hash) continue;
    return Fail(InvalidArgument(
        where + ": ranks disagree on call " + std::to_string(epoch) + " of this clique: '" +
        signature + "' here, '" +
        std::string(other->signature[p], strnlen(other->signature[p], kSignatureBytes)) + "' on " +
        domain_->RankName(r) +
        " (do all processes run the same program, with the "
        "collective calls in the same order?)"));
  }
  return OkStatus();
}

Status ShmClique::Reserve(const WaitContext& ctx, const CallNeeds& needs) {
  JO_CHECK(Open(ctx));
  if (domain_->broken()) return BrokenStatus(ctx);
  if (needs.workspace_bytes > layout_->workspace_bytes || needs.num_flags > layout_->num_flags ||
      needs.mail_bytes > layout_->mail_bytes || needs.mail_messages > layout_->mail_messages)
    return Fail(Internal(Where(ctx) + ": this call needs more than its call site was made for"));
  // A fresh outbox for this call's parity (nobody reads its call e-2 any more).
  auto* outbox = reinterpret_cast<OutboxHeader*>(Parity(ctx.rank, ctx.epoch) + layout_->outbox_off);
  outbox->reserve.store(0);
  outbox->cursor.store(0);
  return OkStatus();
}

std::byte* ShmClique::Parity(int32_t owner, int64_t epoch) const {
  return site_->data() + layout_->data_off + static_cast<size_t>(owner) * layout_->rank_bytes +
         ParityOf(epoch) * layout_->parity_bytes;
}

std::byte* ShmClique::Workspace(int32_t owner, int64_t epoch) {
  if (site_ == nullptr || owner < 0 || owner >= nranks()) return nullptr;
  return Parity(owner, epoch) + layout_->workspace_off;
}

int64_t ShmClique::WorkspaceBytes() const { return layout_->workspace_bytes; }

std::atomic<int64_t>* ShmClique::Flag(int32_t owner, int64_t epoch, int32_t flag) const {
  return reinterpret_cast<std::atomic<int64_t>*>(Parity(owner, epoch) + layout_->flags_off) + flag;
}

Status ShmClique::Signal(const WaitContext& ctx, int32_t peer, int32_t flag) {
  if (domain_->broken()) return BrokenStatus(ctx);
  JO_ASSERT(site_ != nullptr && peer >= 0 && peer < nranks() && flag >= 0 &&
            flag < layout_->num_flags);
  std::atomic<int64_t>* value = Flag(peer, SlotEpoch(ctx), flag);
  const int64_t signal = FlagValue(ctx);
  int64_t seen = value->load();
  if (ctx.replayable && seen != 0) return Fail(RaisedFlag(ctx, peer, flag));
  while (seen < signal && !value->compare_exchange_weak(seen, signal)) {
  }
  domain_->Ring(peer);
  return OkStatus();
}

Status ShmClique::WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) {
  JO_ASSERT(site_ != nullptr && flag >= 0 && flag < layout_->num_flags);
  std::atomic<int64_t>* value = Flag(ctx.rank, SlotEpoch(ctx), flag);
  const int64_t want = FlagValue(ctx);
  Status status =
      WaitFor(ctx, [&] { return value->load(std::memory_order_acquire) >= want; }, true);
  if (status.code() != Code::kTimeout) return status;
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " waiting for flag " + std::to_string(flag) + " (has " +
                                         std::to_string(value->load()) + ", needs " +
                                         std::to_string(want) + ") from " +
                                         domain_->RankName(writer) + ": " + Missing(ctx, writer)));
}

Status ShmClique::ResetFlags(const WaitContext& ctx, int32_t first, int32_t count) {
  if (domain_->broken()) return BrokenStatus(ctx);
  JO_ASSERT(site_ != nullptr && ctx.replayable && first >= 0 && count >= 0 &&
            first + count <= layout_->num_flags);
  for (int32_t f = first; f < first + count; ++f) Flag(ctx.rank, 0, f)->store(0);
  return OkStatus();
}

Status ShmClique::Send(const WaitContext& ctx, int32_t peer, int32_t tag,
                       std::vector<std::byte> data) {
  if (domain_->broken()) return BrokenStatus(ctx);
  JO_ASSERT(site_ != nullptr && peer >= 0 && peer < nranks());
  std::byte* base = Parity(ctx.rank, ctx.epoch);
  auto* outbox = reinterpret_cast<OutboxHeader*>(base + layout_->outbox_off);
  auto* entries = reinterpret_cast<MailEntry*>(base + layout_->entries_off);
  const int32_t index = outbox->reserve.fetch_add(1);
  const int64_t bytes = static_cast<int64_t>(data.size());
  const int64_t offset = outbox->cursor.fetch_add(bytes);
  if (index < 0 || index >= layout_->mail_messages || offset < 0 ||
      offset + bytes > layout_->mail_bytes)
    return Fail(Internal(Where(ctx) + ": outbox overflow (message " + std::to_string(index) +
                         " of " + std::to_string(bytes) + " bytes at " + std::to_string(offset) +
                         "; room for " + std::to_string(layout_->mail_messages) + " messages, " +
                         std::to_string(layout_->mail_bytes) + " bytes)"));
  if (bytes > 0) std::memcpy(base + layout_->mail_off + offset, data.data(), data.size());
  MailEntry& entry = entries[index];
  entry.dst = peer;
  entry.tag = tag;
  entry.offset = offset;
  entry.bytes = bytes;
  entry.ready_epoch.store(ctx.epoch, std::memory_order_release);
  domain_->Ring(peer);
  return OkStatus();
}

Status ShmClique::Recv(const WaitContext& ctx, int32_t peer, int32_t tag,
                       std::vector<std::byte>* data) {
  JO_ASSERT(site_ != nullptr && peer >= 0 && peer < nranks());
  std::byte* base = Parity(peer, ctx.epoch);
  auto* entries = reinterpret_cast<MailEntry*>(base + layout_->entries_off);
  const MailEntry* found = nullptr;
  Status status = WaitFor(
      ctx,
      [&] {
        for (int32_t i = 0; i < layout_->mail_messages; ++i) {
          const MailEntry& e = entries[i];
          if (e.ready_epoch.load(std::memory_order_acquire) == ctx.epoch && e.dst == ctx.rank &&
              e.tag == tag) {
            found = &e;
            return true;
          }
        }
        return false;
      },
      true);
  if (status.ok()) {
    // The entry was written by the peer: it must lie inside the peer's outbox.
    const int64_t offset = found->offset, bytes = found->bytes;
    if (offset < 0 || bytes < 0 || bytes > layout_->mail_bytes ||
        offset > layout_->mail_bytes - bytes)
      return Fail(Internal(Where(ctx) + ": the message (tag " + std::to_string(tag) + ") from " +
                           domain_->RankName(peer) + " points outside its outbox (" +
                           std::to_string(bytes) + " bytes at " + std::to_string(offset) + " of " +
                           std::to_string(layout_->mail_bytes) + ")"));
    const std::byte* src = base + layout_->mail_off + offset;
    data->assign(src, src + bytes);
    return OkStatus();
  }
  if (status.code() != Code::kTimeout) return status;
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " in Recv(tag " + std::to_string(tag) + ") from " +
                                         domain_->RankName(peer) + ": " + Missing(ctx, peer)));
}

}  // namespace jo::host
