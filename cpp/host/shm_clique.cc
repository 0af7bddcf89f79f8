#include "host/shm_clique.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <new>

#include "core/log.h"

namespace jo::host {
namespace {

constexpr uint64_t kMagic = 0x746973736873656aULL;  // "jeshssit"
constexpr uint32_t kVersion = 2;
constexpr size_t kSignatureBytes = 192;
constexpr size_t kNameBytes = 160;
constexpr size_t kAlign = 64;
constexpr auto kPollSlice = std::chrono::milliseconds(100);
// Sanity bounds for sizes a peer publishes (a data segment is at most 1 TiB).
constexpr int64_t kMaxBytes = int64_t{1} << 40;
constexpr int32_t kMaxCount = 1 << 24;

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
  // The published data generation (0: none yet); its sizes and name are
  // written before it (release/acquire on `generation`).
  std::atomic<int64_t> generation;
  std::atomic<int64_t> workspace_bytes;
  std::atomic<int64_t> mail_bytes;
  std::atomic<int32_t> mail_messages;
  std::atomic<int32_t> num_flags;
  std::atomic<int32_t> data_attached;  // processes that mapped the current generation
  std::atomic<int32_t> grow_count;     // ranks in the current growth rendezvous
  char data_name[kNameBytes];
};

struct alignas(kAlign) ShmClique::RankState {
  std::atomic<int64_t> epoch;         // the call this rank is in (set in Agree)
  std::atomic<int64_t> owner_device;  // device inside a call as this rank, or -1
  std::atomic<int64_t> grow_epoch;    // epoch of its last growth-rendezvous arrival
  std::atomic<int64_t> signature_epoch[2];
  std::atomic<uint64_t> signature_hash[2];
  char signature[2][kSignatureBytes];
};

// Where each rank's state lives in a data segment. Per rank, per parity:
// flags | outbox header | entries | outbox data | workspace, each 64-aligned.
struct ShmClique::Layout {
  int64_t workspace_bytes = 0, mail_bytes = 0;
  int32_t mail_messages = 0, num_flags = 0;
  size_t flags_off = 0, outbox_off = 0, entries_off = 0, mail_off = 0, workspace_off = 0;
  size_t parity_bytes = 0, rank_bytes = 0, total = 0;

  Layout(int32_t nranks, int64_t ws, int64_t mail, int32_t messages, int32_t flags)
      : workspace_bytes(ws), mail_bytes(mail), mail_messages(messages), num_flags(flags) {
    flags_off = 0;
    outbox_off = RoundUp(static_cast<size_t>(flags) * sizeof(int64_t), kAlign);
    entries_off = outbox_off + RoundUp(sizeof(OutboxHeader), kAlign);
    mail_off = entries_off + static_cast<size_t>(messages) * sizeof(MailEntry);
    workspace_off = mail_off + RoundUp(static_cast<size_t>(mail), kAlign);
    parity_bytes = workspace_off + RoundUp(static_cast<size_t>(ws), kAlign);
    rank_bytes = 2 * parity_bytes;
    total = static_cast<size_t>(nranks) * rank_bytes;
  }
};

namespace {

size_t SiteBytes(int32_t nranks) {
  return RoundUp(sizeof(ShmClique::SiteHeader), kAlign) +
         static_cast<size_t>(nranks) * sizeof(ShmClique::RankState);
}

// Fills a new site segment (the first process to run the site does it).
void InitSite(std::byte* base, const ShmDomain& domain, int64_t site) {
  auto* h = new (base) ShmClique::SiteHeader();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = domain.nranks();
  h->key = domain.key();
  h->group = domain.group();
  h->site = site;
  for (int32_t r = 0; r < domain.nranks(); ++r) {
    auto* s = new (base + RoundUp(sizeof(ShmClique::SiteHeader), kAlign) +
                   r * sizeof(ShmClique::RankState)) ShmClique::RankState();
    s->owner_device.store(-1);
  }
}

}  // namespace

ShmClique::ShmClique(std::shared_ptr<ShmDomain> domain, int64_t site)
    : HostClique(CliqueKey{domain->key(), domain->group(), site}, domain->nranks()),
      domain_(std::move(domain)) {}

ShmClique::~ShmClique() {
  data_.reset();
  if (site_ != nullptr) domain_->ReleaseSite(key().site);
}

ShmClique::SiteHeader* ShmClique::header() const {
  return reinterpret_cast<SiteHeader*>(site_->data());
}

ShmClique::RankState* ShmClique::rank_state(int32_t rank) const {
  return reinterpret_cast<RankState*>(site_->data() + RoundUp(sizeof(SiteHeader), kAlign) +
                                      static_cast<size_t>(rank) * sizeof(RankState));
}

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
    where += (where.empty() ? "" : ", ") + domain_->RankName(r);
  }
  if (!late.empty())
    return "missing peer rank(s) " + late + " did not arrive (have not started epoch " +
           std::to_string(ctx.epoch) + "; " + where + ")";
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
Status ShmClique::WaitFor(const WaitContext& ctx, Pred pred) {
  const auto deadline = DeadlineAfter(ctx.timeout);
  std::atomic<uint32_t>* bell = domain_->Doorbell(ctx.rank);
  while (true) {
    const uint32_t seq = bell->load();
    if (pred()) return OkStatus();
    if (domain_->broken()) return BrokenStatus(ctx);
    JO_CHECK(domain_->CheckPeers(Where(ctx)));
    const auto now = Clock::now();
    if (now >= deadline) return Status(Code::kTimeout, "");
    FutexWait(bell, seq, std::min<Clock::duration>(deadline - now, kPollSlice));
  }
}

Status ShmClique::Open(const WaitContext& ctx) {
  std::lock_guard<std::mutex> lock(open_mu_);
  if (site_ != nullptr) return OkStatus();
  std::unique_ptr<ShmSegment> segment;
  JO_CHECK(domain_->OpenSite(key().site, SiteBytes(nranks()), DeadlineAfter(ctx.timeout),
                             Where(ctx), &InitSite, &segment));
  const auto* h = reinterpret_cast<const SiteHeader*>(segment->data());
  if (h->magic != kMagic || h->version != kVersion || h->nranks != nranks() ||
      h->key != key().key || h->group != key().group || h->site != key().site) {
    const std::string name = segment->name();
    segment.reset();
    domain_->ReleaseSite(key().site);
    return Fail(Internal(Where(ctx) + ": the segment " + name +
                         " in the call-site directory does not describe this call site"));
  }
  site_ = std::move(segment);
  return OkStatus();
}

Status ShmClique::ClaimRank(const WaitContext& ctx, int64_t device) {
  JO_CHECK(Open(ctx));
  int64_t owner = -1;
  if (rank_state(ctx.rank)->owner_device.compare_exchange_strong(owner, device) || owner == device)
    return OkStatus();
  return Fail(InvalidArgument(Where(ctx) + ": devices " + std::to_string(owner) + " and " +
                              std::to_string(device) + " call as rank " + std::to_string(ctx.rank) +
                              " at the same time"));
}

void ShmClique::ReleaseRank(int32_t rank) {
  if (site_ != nullptr) rank_state(rank)->owner_device.store(-1);
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
  SiteHeader* h = header();
  if (domain_->broken()) return BrokenStatus(ctx);
  const bool fits = h->generation.load(std::memory_order_acquire) > 0 &&
                    needs.workspace_bytes <= h->workspace_bytes.load() &&
                    needs.num_flags <= h->num_flags.load() &&
                    needs.mail_bytes <= h->mail_bytes.load() &&
                    needs.mail_messages <= h->mail_messages.load();
  if (fits) {
    JO_CHECK(MapCurrentData(ctx));
  } else {
    JO_CHECK(Grow(ctx, needs));
  }
  // A fresh outbox for this call's parity (nobody reads its call e-2 any more).
  std::lock_guard<std::mutex> lock(mu_);
  auto* outbox = reinterpret_cast<OutboxHeader*>(Parity(ctx.rank, ctx.epoch) + layout_->outbox_off);
  outbox->reserve.store(0);
  outbox->cursor.store(0);
  return OkStatus();
}

Status ShmClique::Grow(const WaitContext& ctx, const CallNeeds& needs) {
  SiteHeader* h = header();
  const int64_t generation = h->generation.load(std::memory_order_acquire);
  rank_state(ctx.rank)->grow_epoch.store(ctx.epoch);
  if (h->grow_count.fetch_add(1) + 1 == nranks()) {
    // Last to arrive: every rank of this site is parked here, none is in a call.
    auto grown = [](int64_t need, int64_t have) {
      if (need <= have) return have;
      const int64_t bytes = std::max<int64_t>(need, have + have / 2);
      return (bytes + 4095) / 4096 * 4096;
    };
    const int64_t ws = grown(needs.workspace_bytes, h->workspace_bytes.load());
    const int64_t mail = grown(needs.mail_bytes, h->mail_bytes.load());
    const int32_t messages = std::max(needs.mail_messages, h->mail_messages.load());
    const int32_t flags = std::max(needs.num_flags, h->num_flags.load());
    auto layout = std::make_unique<Layout>(nranks(), ws, mail, messages, flags);
    std::string data_name;
    std::unique_ptr<ShmSegment> segment;
    Status created = NewShmName(&data_name);
    if (created.ok())
      created = ShmSegment::Create(data_name, layout->total, "the buffers of " + name(), &segment);
    if (!created.ok())
      return Fail(Status(created.code(), Where(ctx) + ": workspace growth to " +
                                             std::to_string(layout->total) +
                                             " bytes: " + created.message()));
    std::snprintf(h->data_name, kNameBytes, "%s", data_name.c_str());
    h->workspace_bytes.store(ws);
    h->mail_bytes.store(mail);
    h->mail_messages.store(messages);
    h->num_flags.store(flags);
    h->data_attached.store(0);
    h->grow_count.store(0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      data_ = std::move(segment);
      layout_ = std::move(layout);
      data_generation_ = generation + 1;
    }
    h->generation.store(generation + 1, std::memory_order_release);
    domain_->RingAll();
    JO_INFO(name() + ": data segment generation " + std::to_string(generation + 1) + ": 2 x " +
            std::to_string(ws) + " workspace bytes, " + std::to_string(flags) + " flags, 2 x " +
            std::to_string(mail) + " mailbox bytes per rank");
    if (h->data_attached.fetch_add(1) + 1 == domain_->nprocs()) JO_CHECK(UnlinkShm(data_name));
    return OkStatus();
  }
  Status status =
      WaitFor(ctx, [&] { return h->generation.load(std::memory_order_acquire) != generation; });
  if (status.code() == Code::kTimeout) {
    std::string missing;
    for (int32_t r = 0; r < nranks(); ++r)
      if (rank_state(r)->grow_epoch.load() != ctx.epoch)
        missing += (missing.empty() ? "" : ", ") + domain_->RankName(r);
    return Fail(Status(Code::kTimeout,
                       Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                           " in the workspace-growth rendezvous; missing peer rank(s) did not "
                           "arrive: " +
                           missing + "; " + Missing(ctx, ctx.rank)));
  }
  JO_CHECK(status);
  return MapCurrentData(ctx);
}

Status ShmClique::MapCurrentData(const WaitContext& ctx) {
  SiteHeader* h = header();
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t generation = h->generation.load(std::memory_order_acquire);
  if (generation == data_generation_) return OkStatus();
  // Sizes and the name come from another process: check them before use.
  const int64_t ws = h->workspace_bytes.load(), mail = h->mail_bytes.load();
  const int32_t messages = h->mail_messages.load(), flags = h->num_flags.load();
  const std::string data_name(h->data_name, strnlen(h->data_name, kNameBytes));
  if (ws < 0 || ws > kMaxBytes || mail < 0 || mail > kMaxBytes || messages < 0 ||
      messages > kMaxCount || flags < 0 || flags > kMaxCount ||
      data_name.rfind("/jaxoverlap-", 0) != 0)
    return Fail(Internal(Where(ctx) + ": the published data generation " +
                         std::to_string(generation) + " is invalid (workspace " +
                         std::to_string(ws) + " bytes, mailbox " + std::to_string(mail) +
                         " bytes, " + std::to_string(messages) + " messages, " +
                         std::to_string(flags) + " flags, name '" + data_name + "')"));
  auto layout = std::make_unique<Layout>(nranks(), ws, mail, messages, flags);
  std::unique_ptr<ShmSegment> segment;
  Status opened = ShmSegment::Open(data_name, layout->total, &segment);
  if (!opened.ok()) return Fail(Status(opened.code(), Where(ctx) + ": " + opened.message()));
  data_ = std::move(segment);  // the previous generation: no call of this site is using it
  layout_ = std::move(layout);
  data_generation_ = generation;
  if (h->data_attached.fetch_add(1) + 1 == domain_->nprocs()) JO_CHECK(UnlinkShm(data_name));
  return OkStatus();
}

std::byte* ShmClique::Parity(int32_t owner, int64_t epoch) const {
  return data_->data() + static_cast<size_t>(owner) * layout_->rank_bytes +
         ParityOf(epoch) * layout_->parity_bytes;
}

std::byte* ShmClique::Workspace(int32_t owner, int64_t epoch) {
  if (data_ == nullptr || owner < 0 || owner >= nranks()) return nullptr;
  return Parity(owner, epoch) + layout_->workspace_off;
}

int64_t ShmClique::WorkspaceBytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return layout_ == nullptr ? 0 : layout_->workspace_bytes;
}

std::atomic<int64_t>* ShmClique::Flag(int32_t owner, int64_t epoch, int32_t flag) const {
  return reinterpret_cast<std::atomic<int64_t>*>(Parity(owner, epoch) + layout_->flags_off) + flag;
}

Status ShmClique::Signal(const WaitContext& ctx, int32_t peer, int32_t flag) {
  if (domain_->broken()) return BrokenStatus(ctx);
  JO_ASSERT(data_ != nullptr && peer >= 0 && peer < nranks() && flag >= 0 &&
            flag < layout_->num_flags);
  std::atomic<int64_t>* value = Flag(peer, ctx.epoch, flag);
  int64_t seen = value->load();
  while (seen < ctx.epoch && !value->compare_exchange_weak(seen, ctx.epoch)) {
  }
  domain_->Ring(peer);
  return OkStatus();
}

Status ShmClique::WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) {
  JO_ASSERT(data_ != nullptr && flag >= 0 && flag < layout_->num_flags);
  std::atomic<int64_t>* value = Flag(ctx.rank, ctx.epoch, flag);
  Status status = WaitFor(ctx, [&] { return value->load(std::memory_order_acquire) >= ctx.epoch; });
  if (status.code() != Code::kTimeout) return status;
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " waiting for flag " + std::to_string(flag) +
                                         " (has epoch " + std::to_string(value->load()) +
                                         ", needs " + std::to_string(ctx.epoch) + ") from " +
                                         domain_->RankName(writer) + ": " + Missing(ctx, writer)));
}

Status ShmClique::Send(const WaitContext& ctx, int32_t peer, int32_t tag,
                       std::vector<std::byte> data) {
  if (domain_->broken()) return BrokenStatus(ctx);
  JO_ASSERT(data_ != nullptr && peer >= 0 && peer < nranks());
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
  JO_ASSERT(data_ != nullptr && peer >= 0 && peer < nranks());
  std::byte* base = Parity(peer, ctx.epoch);
  auto* entries = reinterpret_cast<MailEntry*>(base + layout_->entries_off);
  const MailEntry* found = nullptr;
  Status status = WaitFor(ctx, [&] {
    for (int32_t i = 0; i < layout_->mail_messages; ++i) {
      const MailEntry& e = entries[i];
      if (e.ready_epoch.load(std::memory_order_acquire) == ctx.epoch && e.dst == ctx.rank &&
          e.tag == tag) {
        found = &e;
        return true;
      }
    }
    return false;
  });
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
