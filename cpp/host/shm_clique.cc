#include "host/shm_clique.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <new>
#include <set>

#include "core/log.h"

namespace jo::host {
namespace {

constexpr uint64_t kMagic = 0x716c636d6873656aULL;  // "jeshmclq"
constexpr uint32_t kVersion = 1;
constexpr size_t kReasonBytes = 2048;
constexpr size_t kSignatureBytes = 192;
constexpr size_t kAlign = 64;
constexpr auto kPollSlice = std::chrono::milliseconds(100);

size_t RoundUp(size_t bytes, size_t align) { return (bytes + align - 1) / align * align; }
int32_t Parity(int64_t epoch) { return static_cast<int32_t>(epoch & 1); }

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
  std::atomic<int64_t> cursor;   // next free byte of the outbox data
};

struct alignas(kAlign) MailEntry {
  std::atomic<int64_t> ready_epoch;  // the call that posted it (written last)
  int32_t dst;
  int32_t tag;
  int64_t offset;
  int64_t bytes;
};

}  // namespace

struct ShmClique::Header {
  uint64_t magic;
  uint32_t version;
  int32_t nranks;
  int32_t nprocs;
  int32_t pad;
  int64_t key;
  int64_t group;
  std::atomic<int32_t> attached;  // processes that mapped the control segment
  std::atomic<int32_t> broken;    // 0 ok; 1 being written; 2 `reason` is valid
  char reason[kReasonBytes];
  // The published data generation (0: none yet) and its sizes (written before it).
  std::atomic<int64_t> generation;
  std::atomic<int64_t> workspace_bytes;
  std::atomic<int64_t> mail_bytes;
  std::atomic<int32_t> mail_messages;
  std::atomic<int32_t> num_flags;
  std::atomic<int32_t> data_attached;  // processes that mapped the current generation
  std::atomic<int32_t> grow_count;     // ranks in the current growth rendezvous
};

struct alignas(kAlign) ShmClique::RankSlot {
  std::atomic<int64_t> epoch;         // the call this rank is in (set in Prepare)
  std::atomic<int64_t> owner_device;  // device inside a call as this rank, or -1
  std::atomic<int64_t> grow_epoch;    // epoch of its last growth-rendezvous arrival
  std::atomic<uint32_t> doorbell;     // bumped (and futex-woken) for every event it may await
  int32_t process;
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

size_t ControlBytes(int32_t nranks) {
  return RoundUp(sizeof(ShmClique::Header), kAlign) +
         static_cast<size_t>(nranks) * sizeof(ShmClique::RankSlot);
}

int32_t CountProcesses(const std::vector<int32_t>& rank_process) {
  return static_cast<int32_t>(std::set<int32_t>(rank_process.begin(), rank_process.end()).size());
}

std::string TableText(const std::vector<int32_t>& rank_process) {
  std::string out = "[";
  for (size_t r = 0; r < rank_process.size(); ++r)
    out += (r ? ", " : "") + std::to_string(rank_process[r]);
  return out + "]";
}

Status CheckTable(CliqueKey key, const std::vector<int32_t>& rank_process, int32_t process) {
  JO_REQUIRE(!rank_process.empty(), CliqueName(key) + ": empty rank table");
  JO_REQUIRE(std::find(rank_process.begin(), rank_process.end(), process) != rank_process.end(),
             CliqueName(key) + ": process " + std::to_string(process) +
                 " has no rank in the rank table " + TableText(rank_process));
  return OkStatus();
}

}  // namespace

ShmClique::ShmClique(CliqueKey key, int32_t nranks, std::vector<int32_t> rank_process,
                     int32_t process, std::unique_ptr<ShmSegment> control)
    : HostClique(key, nranks),
      rank_process_(std::move(rank_process)),
      process_(process),
      nprocs_(CountProcesses(rank_process_)),
      control_(std::move(control)) {}

ShmClique::~ShmClique() = default;

Status ShmClique::Create(CliqueKey key, const std::vector<int32_t>& rank_process,
                         int32_t process, std::unique_ptr<ShmClique>* out) {
  JO_CHECK(CheckTable(key, rank_process, process));
  const int32_t nranks = static_cast<int32_t>(rank_process.size());
  char suffix[64];
  std::snprintf(suffix, sizeof(suffix), "-%016" PRIx64 "-g%" PRId64,
                static_cast<uint64_t>(key.key), key.group);
  std::unique_ptr<ShmSegment> control;
  JO_CHECK(ShmSegment::Create(NewShmBaseName() + suffix, ControlBytes(nranks), &control));
  auto* h = new (control->data()) Header();
  h->magic = kMagic;
  h->version = kVersion;
  h->nranks = nranks;
  h->nprocs = CountProcesses(rank_process);
  h->key = key.key;
  h->group = key.group;
  for (int32_t r = 0; r < nranks; ++r) {
    auto* s = new (control->data() + RoundUp(sizeof(Header), kAlign) + r * sizeof(RankSlot))
        RankSlot();
    s->owner_device.store(-1);
    s->process = rank_process[r];
  }
  h->attached.store(1);
  out->reset(new ShmClique(key, nranks, rank_process, process, std::move(control)));
  JO_INFO((*out)->name() + ": created shared-memory control segment " +
          (*out)->control_name() + " for " + std::to_string(h->nprocs) + " processes");
  return OkStatus();
}

Status ShmClique::Attach(CliqueKey key, const std::vector<int32_t>& rank_process,
                         int32_t process, const std::string& name,
                         std::unique_ptr<ShmClique>* out) {
  JO_CHECK(CheckTable(key, rank_process, process));
  const int32_t nranks = static_cast<int32_t>(rank_process.size());
  std::unique_ptr<ShmSegment> control;
  JO_CHECK(ShmSegment::Open(name, ControlBytes(nranks), &control));
  const auto* h = reinterpret_cast<const Header*>(control->data());
  JO_REQUIRE(h->magic == kMagic && h->version == kVersion,
             name + " is not a jaxoverlap clique segment of version " + std::to_string(kVersion));
  JO_REQUIRE(h->key == key.key && h->group == key.group && h->nranks == nranks,
             name + " describes " + CliqueName(CliqueKey{h->key, h->group}) + " with " +
                 std::to_string(h->nranks) + " ranks, but this process bootstraps " +
                 CliqueName(key) + " with " + std::to_string(nranks));
  auto clique = std::unique_ptr<ShmClique>(
      new ShmClique(key, nranks, rank_process, process, std::move(control)));
  for (int32_t r = 0; r < nranks; ++r)
    JO_REQUIRE(clique->slot(r)->process == rank_process[r],
               clique->name() + ": the leader puts rank " + std::to_string(r) + " in process " +
                   std::to_string(clique->slot(r)->process) + ", this process's rank table " +
                   TableText(rank_process) + " puts it in process " +
                   std::to_string(rank_process[r]) + " (do all processes use the same mesh?)");
  if (clique->header()->attached.fetch_add(1) + 1 == clique->nprocs_)
    JO_CHECK(UnlinkShm(name));  // every process has it mapped: the name is no longer needed
  *out = std::move(clique);
  return OkStatus();
}

ShmClique::Header* ShmClique::header() const {
  return reinterpret_cast<Header*>(control_->data());
}

ShmClique::RankSlot* ShmClique::slot(int32_t rank) const {
  return reinterpret_cast<RankSlot*>(control_->data() + RoundUp(sizeof(Header), kAlign) +
                                     static_cast<size_t>(rank) * sizeof(RankSlot));
}

std::string ShmClique::Kind() const {
  std::string local;
  for (int32_t r = 0; r < nranks(); ++r)
    if (rank_process_[r] == process_) local += (local.empty() ? "" : ",") + std::to_string(r);
  return "shared memory across " + std::to_string(nprocs_) + " processes (ranks " + local +
         " in this process " + std::to_string(process_) + ")";
}

std::string ShmClique::RankName(int32_t rank) const {
  return "rank " + std::to_string(rank) + " (process " + std::to_string(rank_process_[rank]) + ")";
}

std::string ShmClique::Where(const WaitContext& ctx) const {
  return std::string(ctx.op) + " (" + name() + ", rank " + std::to_string(ctx.rank) +
         " in process " + std::to_string(process_) + ", epoch " + std::to_string(ctx.epoch) + ")";
}

std::string ShmClique::Missing(const WaitContext& ctx, int32_t expected) const {
  std::string late, where;
  for (int32_t r = 0; r < nranks(); ++r) {
    if (slot(r)->epoch.load() >= ctx.epoch) continue;
    late += (late.empty() ? "" : ", ") + std::to_string(r);
    where += (where.empty() ? "" : ", ") + RankName(r);
  }
  if (!late.empty())
    return "missing peer rank(s) " + late + " did not arrive (have not started epoch " +
           std::to_string(ctx.epoch) + "; " + where + ")";
  return "every rank arrived; " + RankName(expected) + " did not deliver";
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

void ShmClique::Ring(int32_t rank) {
  std::atomic<uint32_t>* bell = &slot(rank)->doorbell;
  bell->fetch_add(1);
  FutexWakeAll(bell);
}

void ShmClique::RingAll() {
  for (int32_t r = 0; r < nranks(); ++r) Ring(r);
}

void ShmClique::Break(const Status& status) {
  Header* h = header();
  int32_t expected = 0;
  if (!h->broken.compare_exchange_strong(expected, 1)) return;  // first error wins
  std::snprintf(h->reason, kReasonBytes, "%s", status.message().c_str());
  h->broken.store(2, std::memory_order_release);
  RingAll();
}

std::string ShmClique::BrokenReason() const {
  const Header* h = header();
  if (h->broken.load(std::memory_order_acquire) != 2) return "";
  return std::string(h->reason, strnlen(h->reason, kReasonBytes));
}

template <typename Pred>
Status ShmClique::WaitFor(const WaitContext& ctx, Pred pred) {
  const auto deadline = Clock::now() + ctx.timeout;
  std::atomic<uint32_t>* bell = &slot(ctx.rank)->doorbell;
  while (true) {
    const uint32_t seq = bell->load();
    if (pred()) return OkStatus();
    if (header()->broken.load(std::memory_order_acquire) == 2) return BrokenStatus(ctx);
    const auto now = Clock::now();
    if (now >= deadline) return Status(Code::kTimeout, "");
    FutexWait(bell, seq,
              std::min<std::chrono::nanoseconds>(deadline - now, kPollSlice));
  }
}

Status ShmClique::ClaimRank(const WaitContext& ctx, int64_t device) {
  int64_t owner = -1;
  if (slot(ctx.rank)->owner_device.compare_exchange_strong(owner, device) || owner == device)
    return OkStatus();
  return Fail(InvalidArgument(Where(ctx) + ": devices " + std::to_string(owner) + " and " +
                              std::to_string(device) + " call as rank " +
                              std::to_string(ctx.rank) + " at the same time"));
}

void ShmClique::ReleaseRank(int32_t rank) { slot(rank)->owner_device.store(-1); }

Status ShmClique::CheckSignature(const WaitContext& ctx, const std::string& signature) {
  const int32_t p = Parity(ctx.epoch);
  const uint64_t hash = Fnv1a(signature);
  RankSlot* mine = slot(ctx.rank);
  mine->signature_hash[p].store(hash);
  std::snprintf(mine->signature[p], kSignatureBytes, "%s", signature.c_str());
  mine->signature_epoch[p].store(ctx.epoch);
  // Whichever of two disagreeing ranks publishes second sees the other.
  for (int32_t r = 0; r < nranks(); ++r) {
    RankSlot* other = slot(r);
    if (r == ctx.rank || other->signature_epoch[p].load() != ctx.epoch) continue;
    if (other->signature_hash[p].load() == hash) continue;
    return Fail(InvalidArgument(
        Where(ctx) + ": ranks disagree on call " + std::to_string(ctx.epoch) +
        " of this clique: '" + signature + "' here, '" +
        std::string(other->signature[p], strnlen(other->signature[p], kSignatureBytes)) +
        "' on " + RankName(r) + " (do all processes run the same program, with the collective "
        "calls in the same order?)"));
  }
  return OkStatus();
}

Status ShmClique::Prepare(const WaitContext& ctx, const std::string& signature,
                          const CallNeeds& needs) {
  Header* h = header();
  slot(ctx.rank)->epoch.store(ctx.epoch);
  if (h->broken.load(std::memory_order_acquire) == 2) return BrokenStatus(ctx);
  JO_CHECK(CheckSignature(ctx, signature));
  const bool fits = h->generation.load(std::memory_order_acquire) > 0 &&
                    needs.workspace_bytes <= h->workspace_bytes.load() &&
                    needs.num_flags <= h->num_flags.load() &&
                    needs.mail_bytes <= h->mail_bytes.load() &&
                    needs.mail_messages <= h->mail_messages.load();
  if (fits) {
    JO_CHECK(MapCurrentData());
  } else {
    JO_CHECK(Grow(ctx, needs));
  }
  // A fresh outbox for this call's parity (nobody reads its call e-2 any more).
  std::lock_guard<std::mutex> lock(mu_);
  std::byte* base = data_->data() + static_cast<size_t>(ctx.rank) * layout_->rank_bytes +
                    Parity(ctx.epoch) * layout_->parity_bytes;
  auto* outbox = reinterpret_cast<OutboxHeader*>(base + layout_->outbox_off);
  outbox->reserve.store(0);
  outbox->cursor.store(0);
  return OkStatus();
}

Status ShmClique::Grow(const WaitContext& ctx, const CallNeeds& needs) {
  Header* h = header();
  const int64_t generation = h->generation.load(std::memory_order_acquire);
  slot(ctx.rank)->grow_epoch.store(ctx.epoch);
  if (h->grow_count.fetch_add(1) + 1 == nranks()) {
    // Last to arrive: every rank is parked here, no call is in flight.
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
    const std::string data_name = control_name() + "-d" + std::to_string(generation + 1);
    std::unique_ptr<ShmSegment> segment;
    Status created = ShmSegment::Create(data_name, layout->total, &segment);
    if (!created.ok())
      return Fail(Status(created.code(), Where(ctx) + ": workspace growth to " +
                                             std::to_string(layout->total) + " bytes: " +
                                             created.message()));
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
    RingAll();
    JO_INFO(name() + ": data segment generation " + std::to_string(generation + 1) + ": 2 x " +
            std::to_string(ws) + " workspace bytes, " + std::to_string(flags) + " flags, 2 x " +
            std::to_string(mail) + " mailbox bytes per rank");
    if (h->data_attached.fetch_add(1) + 1 == nprocs_) JO_CHECK(UnlinkShm(data_name));
    return OkStatus();
  }
  Status status = WaitFor(ctx, [&] {
    return h->generation.load(std::memory_order_acquire) != generation;
  });
  if (status.code() == Code::kTimeout) {
    std::string missing;
    for (int32_t r = 0; r < nranks(); ++r)
      if (slot(r)->grow_epoch.load() != ctx.epoch)
        missing += (missing.empty() ? "" : ", ") + RankName(r);
    return Fail(Status(Code::kTimeout,
                       Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                           " in the workspace-growth rendezvous; missing peer rank(s) did not "
                           "arrive: " + missing + "; " + Missing(ctx, ctx.rank)));
  }
  JO_CHECK(status);
  return MapCurrentData();
}

Status ShmClique::MapCurrentData() {
  Header* h = header();
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t generation = h->generation.load(std::memory_order_acquire);
  if (generation == data_generation_) return OkStatus();
  auto layout = std::make_unique<Layout>(nranks(), h->workspace_bytes.load(), h->mail_bytes.load(),
                                         h->mail_messages.load(), h->num_flags.load());
  const std::string data_name = control_name() + "-d" + std::to_string(generation);
  std::unique_ptr<ShmSegment> segment;
  Status opened = ShmSegment::Open(data_name, layout->total, &segment);
  if (!opened.ok()) {
    Break(opened);
    return opened;
  }
  data_ = std::move(segment);  // the previous generation: no call is using it
  layout_ = std::move(layout);
  data_generation_ = generation;
  if (h->data_attached.fetch_add(1) + 1 == nprocs_) JO_CHECK(UnlinkShm(data_name));
  return OkStatus();
}

std::byte* ShmClique::Workspace(int32_t owner, int64_t epoch) {
  if (data_ == nullptr) return nullptr;
  return data_->data() + static_cast<size_t>(owner) * layout_->rank_bytes +
         Parity(epoch) * layout_->parity_bytes + layout_->workspace_off;
}

int64_t ShmClique::WorkspaceBytes() const { return header()->workspace_bytes.load(); }

std::atomic<int64_t>* ShmClique::Flag(int32_t owner, int64_t epoch, int32_t flag) const {
  std::byte* base = data_->data() + static_cast<size_t>(owner) * layout_->rank_bytes +
                    Parity(epoch) * layout_->parity_bytes + layout_->flags_off;
  return reinterpret_cast<std::atomic<int64_t>*>(base) + flag;
}

Status ShmClique::Signal(const WaitContext& ctx, int32_t peer, int32_t flag) {
  if (header()->broken.load(std::memory_order_acquire) == 2) return BrokenStatus(ctx);
  JO_ASSERT(data_ != nullptr && peer >= 0 && peer < nranks() && flag >= 0 &&
            flag < layout_->num_flags);
  std::atomic<int64_t>* value = Flag(peer, ctx.epoch, flag);
  int64_t seen = value->load();
  while (seen < ctx.epoch && !value->compare_exchange_weak(seen, ctx.epoch)) {
  }
  Ring(peer);
  return OkStatus();
}

Status ShmClique::WaitFlag(const WaitContext& ctx, int32_t writer, int32_t flag) {
  JO_ASSERT(data_ != nullptr && flag >= 0 && flag < layout_->num_flags);
  std::atomic<int64_t>* value = Flag(ctx.rank, ctx.epoch, flag);
  Status status = WaitFor(ctx, [&] { return value->load(std::memory_order_acquire) >= ctx.epoch; });
  if (status.code() != Code::kTimeout) return status;
  return Fail(Status(Code::kTimeout,
                     Where(ctx) + ": timeout after " + Seconds(ctx.timeout) + " waiting for flag " +
                         std::to_string(flag) + " (has epoch " + std::to_string(value->load()) +
                         ", needs " + std::to_string(ctx.epoch) + ") from " + RankName(writer) +
                         ": " + Missing(ctx, writer)));
}

Status ShmClique::Send(const WaitContext& ctx, int32_t peer, int32_t tag,
                       std::vector<std::byte> data) {
  if (header()->broken.load(std::memory_order_acquire) == 2) return BrokenStatus(ctx);
  JO_ASSERT(data_ != nullptr && peer >= 0 && peer < nranks());
  std::byte* base = data_->data() + static_cast<size_t>(ctx.rank) * layout_->rank_bytes +
                    Parity(ctx.epoch) * layout_->parity_bytes;
  auto* outbox = reinterpret_cast<OutboxHeader*>(base + layout_->outbox_off);
  auto* entries = reinterpret_cast<MailEntry*>(base + layout_->entries_off);
  const int32_t index = outbox->reserve.fetch_add(1);
  const int64_t bytes = static_cast<int64_t>(data.size());
  const int64_t offset = outbox->cursor.fetch_add(bytes);
  if (index >= layout_->mail_messages || offset + bytes > layout_->mail_bytes)
    return Internal(Where(ctx) + ": outbox overflow (message " + std::to_string(index) + " of " +
                    std::to_string(bytes) + " bytes at " + std::to_string(offset) + "; room for " +
                    std::to_string(layout_->mail_messages) + " messages, " +
                    std::to_string(layout_->mail_bytes) + " bytes)");
  if (bytes > 0) std::memcpy(base + layout_->mail_off + offset, data.data(), data.size());
  MailEntry& entry = entries[index];
  entry.dst = peer;
  entry.tag = tag;
  entry.offset = offset;
  entry.bytes = bytes;
  entry.ready_epoch.store(ctx.epoch, std::memory_order_release);
  Ring(peer);
  return OkStatus();
}

Status ShmClique::Recv(const WaitContext& ctx, int32_t peer, int32_t tag,
                       std::vector<std::byte>* data) {
  JO_ASSERT(data_ != nullptr && peer >= 0 && peer < nranks());
  std::byte* base = data_->data() + static_cast<size_t>(peer) * layout_->rank_bytes +
                    Parity(ctx.epoch) * layout_->parity_bytes;
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
    const std::byte* src = base + layout_->mail_off + found->offset;
    data->assign(src, src + found->bytes);
    return OkStatus();
  }
  if (status.code() != Code::kTimeout) return status;
  return Fail(Status(Code::kTimeout, Where(ctx) + ": timeout after " + Seconds(ctx.timeout) +
                                         " in Recv(tag " + std::to_string(tag) + ") from " +
                                         RankName(peer) + ": " + Missing(ctx, peer)));
}

}  // namespace jo::host
