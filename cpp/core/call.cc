#include "core/call.h"

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <mutex>
#include <set>
#include <unordered_map>

#include "core/build.h"
#include "core/hash.h"
#include "core/log.h"
#include "core/signature_cache.h"

namespace jo {

bool Placement::spans_processes() const {
  return std::any_of(processes.begin(), processes.end(),
                     [&](int64_t p) { return p != processes.front(); });
}

Status Place(const RankTable& t, const Caller& caller, const char* op, Placement* out) {
  const std::string who = std::string(op) + ": ";
  const size_t n = t.processes.size();
  const int64_t size = t.axis_size;
  JO_REQUIRE(size >= 1 && t.device_ids.size() == n && t.ordinals.size() == n &&
                 n % static_cast<size_t>(size) == 0,
             who + "malformed rank table (" + std::to_string(n) + " processes, " +
                 std::to_string(t.device_ids.size()) + " device ids, " +
                 std::to_string(t.ordinals.size()) + " ordinals, axis_size " +
                 std::to_string(size) + ")");
  out->processes.clear();
  out->device_ids.clear();
  out->ordinals.clear();
  if (n == 0) {  // no table: the coords say where the caller is; every rank is local
    JO_REQUIRE(caller.rank >= 0 && caller.rank < size && caller.group >= 0,
               who + "no rank table and no coords: cannot tell which rank this device is");
    out->rank = caller.rank;
    out->group = caller.group;
    out->processes.assign(static_cast<size_t>(size), caller.process);
    out->device_ids.assign(static_cast<size_t>(size), -1);
    out->ordinals.assign(static_cast<size_t>(size), -1);
    return OkStatus();
  }
  const bool global = caller.naming == DeviceNaming::kGlobalId;
  const std::vector<int64_t>& ids = global ? t.device_ids : t.ordinals;
  int64_t found = -1;
  int64_t matches = 0;
  bool coords_match = false;  // the entry the caller's coords name is one of them
  const int64_t by_coords =
      caller.rank >= 0 && caller.group >= 0 ? caller.group * size + caller.rank : -1;
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] != caller.device || (!global && t.processes[i] != caller.process)) continue;
    if (found < 0) found = static_cast<int64_t>(i);
    ++matches;
    coords_match = coords_match || static_cast<int64_t>(i) == by_coords;
  }
  // A device listed more than once is found by the caller's coords (the loopback runner).
  JO_REQUIRE(matches <= 1 || coords_match, who + "the rank table lists device " +
                                               std::to_string(caller.device) + " of process " +
                                               std::to_string(caller.process) + " twice");
  if (matches > 1) found = by_coords;
  JO_REQUIRE(found >= 0, who + "this call runs on device " + std::to_string(caller.device) +
                             " of process " + std::to_string(caller.process) +
                             ", which the rank table (the mesh of the enclosing shard_map) does "
                             "not contain");
  out->group = found / size;
  out->rank = static_cast<int32_t>(found % size);
  JO_REQUIRE(caller.rank < 0 || (caller.rank == out->rank && caller.group == out->group),
             who + "device mismatch: the rank table puts device " + std::to_string(caller.device) +
                 " at (group " + std::to_string(out->group) + ", rank " +
                 std::to_string(out->rank) + "), but its coords say (group " +
                 std::to_string(caller.group) + ", rank " + std::to_string(caller.rank) + ")");
  for (int64_t r = 0; r < size; ++r) {
    const size_t i = static_cast<size_t>(out->group * size + r);
    out->processes.push_back(t.processes[i]);
    out->device_ids.push_back(t.device_ids[i]);
    out->ordinals.push_back(t.processes[i] == caller.process ? static_cast<int>(t.ordinals[i])
                                                             : -1);
  }
  return OkStatus();
}

Status NeedsOf(const Problem& q, CallNeeds* out) {
  static auto* cache = new SignatureCache<CallNeeds>;  // never destroyed: workers may run at exit
  const std::string signature = CallSignature(q);
  if (auto hit = cache->Find(signature)) {
    *out = *hit;
    return OkStatus();
  }
  CallNeeds needs;
  int64_t scales_at = -1;  // where the workspace's scale slots begin, on every rank alike
  for (int32_t r = 0; r < q.nranks; ++r) {
    Problem other = q;
    other.rank = r;
    Program program;
    JO_CHECK(BuildProgram(other, &program));
    needs.workspace_bytes = std::max(needs.workspace_bytes, WorkspaceBytes(program));
    needs.num_flags = std::max(needs.num_flags, program.num_flags);
    if (program.workspace_scales > 0) {
      const int64_t at = ScalesOffset(program, BufId::kWorkspaceScales);
      JO_REQUIRE(scales_at < 0 || scales_at == at,
                 "the ranks' programs put the workspace's scale slots at different offsets");
      scales_at = at;
    }
    int64_t mail = 0;
    int32_t messages = 0;
    for (const Op& op : program.ops) {
      if (op.kind != OpKind::kSend) continue;
      mail += BlockBytes(program, op);
      ++messages;
    }
    needs.mail_bytes = std::max(needs.mail_bytes, mail);
    needs.mail_messages = std::max(needs.mail_messages, messages);
  }
  cache->Add(signature, needs);
  *out = needs;
  return OkStatus();
}

std::string DimsText(const std::vector<int64_t>& dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? "," : "") + std::to_string(dims[i]);
  return out + "]";
}

Status CanonicalProblem(const Problem& base, const std::vector<int64_t>& xd,
                        const std::vector<int64_t>& wd, int64_t axis, Problem* q,
                        ResultShapes* shapes) {
  const OpRow* row = RowOf(base.op);
  JO_REQUIRE(row != nullptr, "jaxoverlap: op " + std::to_string(static_cast<int32_t>(base.op)) +
                                 " is not one of " + kinds::Names(kOps));
  const std::string op = row->name;
  const auto bad = [&](const std::string& text) { return InvalidArgument(op + ": " + text); };
  const int64_t n = base.nranks;
  JO_REQUIRE(n >= 1, op + ": axis_size expected >= 1, got " + std::to_string(n));
  if (xd.size() < 2)
    return bad("operand x expected rank >= 2, got rank " + std::to_string(xd.size()) + " (shape " +
               DimsText(xd) + ")");
  if (wd.size() != 2)
    return bad("operand w expected rank 2, got rank " + std::to_string(wd.size()) + " (shape " +
               DimsText(wd) + ")");
  if (wd[0] != xd.back())
    return bad("operand w expected " + std::to_string(xd.back()) +
               " rows (x's last dim), got shape " + DimsText(wd));
  if (axis < 0 || axis > static_cast<int64_t>(xd.size()) - 2)
    return bad("attribute axis expected in [0, " + std::to_string(xd.size() - 2) + "], got " +
               std::to_string(axis));
  *q = base;
  q->k = xd.back();
  q->cols = wd[1];
  // x is [pre..., s, post..., k] with s on `axis`: batch = prod(pre), a shard's
  // rows = s * prod(post) (docs/native.md §1).
  q->batch = 1;
  for (int64_t i = 0; i < axis; ++i) q->batch *= xd[i];
  int64_t post = 1;
  for (size_t i = static_cast<size_t>(axis) + 1; i + 1 < xd.size(); ++i) post *= xd[i];
  const int64_t s = xd[axis];
  // y: x's dims with dim `axis` made `y_axis` and the last one cols.
  const auto result = [&](int64_t y_axis, int64_t last) {
    std::vector<int64_t> dims(xd);
    dims[axis] = y_axis;
    dims.back() = last;
    return dims;
  };
  shapes->x_gathered.clear();
  switch (row->rows) {
    case RowsRule::kGather:
      q->rows = s * post;
      shapes->y = result(s * n, q->cols);
      shapes->x_gathered = result(s * n, q->k);
      break;
    case RowsRule::kScatter:
      if (s % n != 0)
        return bad("operand x dim " + std::to_string(axis) + " (" + std::to_string(s) +
                   ") expected divisible by axis_size " + std::to_string(n));
      q->rows = s / n * post;
      shapes->y = result(s / n, q->cols);
      break;
    case RowsRule::kAll: {
      // Every dim but the last is a row: [1, N*rows, k] -> [1, N*rows, cols]
      // (one-shot: [1, rows, k] -> [1, rows, cols], any number of rows).
      if (axis != 0) return bad("attribute axis expected 0, got " + std::to_string(axis));
      int64_t total = 1;
      for (size_t i = 0; i + 1 < xd.size(); ++i) total *= xd[i];
      const bool one_shot = !SplitsRows(base.algorithm);  // one-shot and the kernels
      if (!one_shot && total % n != 0)
        return bad("operand x expected rows (the product of all dims but the last, " +
                   std::to_string(total) + ") divisible by axis_size " + std::to_string(n));
      q->batch = 1;
      q->rows = one_shot ? total : total / n;
      shapes->y = result(xd[0], q->cols);
      break;
    }
  }
  return OkStatus();
}

OperandRows OperandRowsOf(const Problem& q) {
  const int64_t all = q.rows * q.nranks;
  OperandRows out;
  switch (Row(q.op).rows) {
    case RowsRule::kGather:  // x: the local shard; y: every shard
      out = {q.rows, all, q.return_gathered ? all : 0};
      break;
    case RowsRule::kScatter:  // x: every block; y: the own one
      out = {all, q.rows, 0};
      break;
    case RowsRule::kAll: {  // every row on both sides (one-shot: rows are all of them)
      const int64_t rows = SplitsRows(q.algorithm) ? all : q.rows;
      out = {rows, rows, 0};
      break;
    }
  }
  return out;
}

Status PlaceCall(const CallDesc& desc, const Problem& problem, int64_t site, const Caller& caller,
                 PlacedCall* out) {
  const char* op = CollectiveName(desc.problem.op);
  JO_CHECK(Place(desc.table, caller, op, &out->place));
  Problem q = problem;
  q.rank = out->place.rank;
  JO_REQUIRE(q.nranks == desc.table.axis_size,
             std::string(op) + ": the problem has " + std::to_string(q.nranks) +
                 " ranks, the rank table " + std::to_string(desc.table.axis_size));
  JO_CHECK(BuildProgram(q, &out->program));
  JO_CHECK(NeedsOf(q, &out->needs));
  out->signature = CallSignature(q) + " at " + SiteName(site);
  out->clique = CliqueKey{desc.clique_key, out->place.group, site};
  LogPlanOnce(out->program, out->clique, "native");
  return OkStatus();
}

namespace {
std::atomic<int64_t> g_process_index{0};
}  // namespace

void SetProcessIndex(int64_t index) { g_process_index = index; }
int64_t ProcessIndex() { return g_process_index; }

struct CallSite::Token {
  int64_t id = 0;
  int64_t serial = 0;
};

namespace {

std::atomic<int64_t> g_serial{0};

// Per site_key, the serial of its latest lowering (process-wide: XLA
// instantiates on a compile thread of its own, not where JAX lowered).
constexpr size_t kLoweredKeys = size_t{1} << 16;
uint64_t g_lowering = 0;  // under LoweredMu()
std::mutex& LoweredMu() {
  static auto* mu = new std::mutex;
  return *mu;
}
std::unordered_map<int64_t, uint64_t>& Lowered() {
  static auto* lowered = new std::unordered_map<int64_t, uint64_t>;
  return *lowered;
}
uint64_t LastLowering(int64_t site_key) {
  std::lock_guard<std::mutex> lock(LoweredMu());
  auto it = Lowered().find(site_key);
  return it == Lowered().end() ? 0 : it->second;
}

// Per instantiating thread (XLA makes one executable's sites on one thread,
// one after another), per site_key: the last instance made here, its
// sibling index, and the lowering it followed.
struct Burst {
  std::weak_ptr<const CallSite::Token> last;
  int64_t index = 0;
  uint64_t lowering = 0;
};
thread_local std::unordered_map<int64_t, Burst>* t_bursts = nullptr;

}  // namespace

CallSite CallSite::Instantiate(int64_t site_key) {
  if (t_bursts == nullptr) t_bursts = new std::unordered_map<int64_t, Burst>();  // per thread
  Burst& burst = (*t_bursts)[site_key];
  const uint64_t lowering = LastLowering(site_key);
  const bool sibling = !burst.last.expired() && burst.lowering == lowering;
  const int64_t index = sibling ? burst.index + 1 : 1;  // among identical siblings
  auto token = std::make_shared<Token>();
  token->id = index == 1 ? site_key
                         : static_cast<int64_t>(Mix64(static_cast<uint64_t>(site_key) ^
                                                      Mix64(static_cast<uint64_t>(index))));
  if (token->id == 0) token->id = 1;  // 0 names no site
  token->serial = ++g_serial;
  burst.last = token;
  burst.index = index;
  burst.lowering = lowering;
  if (t_bursts->size() > 4096)  // forget the keys whose instances are all gone
    for (auto it = t_bursts->begin(); it != t_bursts->end();)
      it = it->second.last.expired() ? t_bursts->erase(it) : std::next(it);
  CallSite site;
  site.token_ = std::move(token);
  return site;
}

int64_t CallSite::id() const { return token_ ? token_->id : 0; }
int64_t CallSite::serial() const { return token_ ? token_->serial : 0; }

void NoteLowering(int64_t site_key) {
  std::lock_guard<std::mutex> lock(LoweredMu());
  auto& lowered = Lowered();
  lowered[site_key] = ++g_lowering;
  if (lowered.size() <= kLoweredKeys) return;
  // Forget the older half (a key lowered that long ago has been instantiated since).
  const uint64_t cut = g_lowering - kLoweredKeys / 2;
  for (auto it = lowered.begin(); it != lowered.end();)
    it = it->second < cut ? lowered.erase(it) : std::next(it);
}

std::string SiteName(int64_t site) {
  char text[40];
  std::snprintf(text, sizeof(text), "site 0x%016" PRIx64, static_cast<uint64_t>(site));
  return text;
}

std::string CallSignature(const Problem& q) {
  return std::string(CollectiveName(q.op)) +
         (Row(q.op).one_shot ? std::string("/") + ArAlgorithmName(q.algorithm) : "") + "/" +
         TransportName(q.transport) + " n=" + std::to_string(q.nranks) + " [" +
         std::to_string(q.batch) + "," + std::to_string(q.rows) + "," + std::to_string(q.k) + "]x" +
         std::to_string(q.cols) + " " + DTypesName(q) + " chunks=" + std::to_string(q.chunks) +
         (q.bidirectional ? " bidirectional" : "") + (q.return_gathered ? " gathered" : "") +
         (q.fused ? " fused" : "") + (q.block_scaled ? " block-scaled" : "") +
         (q.replayable ? " replayable" : "");
}

void LogPlanOnce(const Program& program, const CliqueKey& key, const char* executor) {
  if (CurrentLogLevel() < LogLevel::kDebug || program.problem.rank != 0) return;
  static auto* mu = new std::mutex;
  static auto* seen = new std::set<std::string>;
  const std::string name = CliqueName(key);
  const std::string summary = std::string(executor) + " " + name + " " + Summary(program);
  std::lock_guard<std::mutex> lock(*mu);
  if (!seen->insert(summary).second) return;
  JO_DEBUG("plan: " + name + " (" + executor + " executor)\n" + ToString(program));
}

}  // namespace jo
