#include "core/call.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include "core/build.h"
#include "core/log.h"

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
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] != caller.device || (!global && t.processes[i] != caller.process)) continue;
    JO_REQUIRE(found < 0, who + "the rank table lists device " + std::to_string(caller.device) +
                              " of process " + std::to_string(caller.process) + " twice");
    found = static_cast<int64_t>(i);
  }
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
  static auto* mu = new std::mutex;  // never destroyed: workers may run at exit
  static auto* cache = new std::map<std::string, CallNeeds>;
  const std::string signature = CallSignature(q);
  {
    std::lock_guard<std::mutex> lock(*mu);
    auto it = cache->find(signature);
    if (it != cache->end()) {
      *out = it->second;
      return OkStatus();
    }
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
  std::lock_guard<std::mutex> lock(*mu);
  cache->emplace(signature, needs);
  *out = needs;
  return OkStatus();
}

Status PlaceCall(const CallDesc& desc, const Problem& problem, int64_t site, const Caller& caller,
                 PlacedCall* out) {
  const char* op = CollectiveName(desc.op);
  JO_CHECK(Place(desc.table, caller, op, &out->place));
  Problem q = problem;
  q.rank = out->place.rank;
  JO_REQUIRE(q.nranks == desc.table.axis_size,
             std::string(op) + ": the problem has " + std::to_string(q.nranks) +
                 " ranks, the rank table " + std::to_string(desc.table.axis_size));
  JO_CHECK(BuildProgram(q, &out->program));
  JO_CHECK(NeedsOf(q, &out->needs));
  out->signature = CallSignature(q);
  out->clique = CliqueKey{desc.clique_key, out->place.group, site};
  LogPlanOnce(out->program, out->clique, "native");
  return OkStatus();
}

namespace {
std::atomic<int64_t> g_process_index{0};
}  // namespace

void SetProcessIndex(int64_t index) { g_process_index = index; }
int64_t ProcessIndex() { return g_process_index; }

int64_t NewCallSiteId(int64_t clique_key) {
  static auto* mu = new std::mutex;
  static auto* count = new std::map<int64_t, int64_t>;
  std::lock_guard<std::mutex> lock(*mu);
  return ++(*count)[clique_key];
}

std::string CallSignature(const Problem& q) {
  return std::string(CollectiveName(q.op)) +
         (q.op == Collective::kMatmulAr ? std::string("/") + ArAlgorithmName(q.algorithm) : "") +
         "/" + TransportName(q.transport) + " n=" + std::to_string(q.nranks) + " [" +
         std::to_string(q.batch) + "," + std::to_string(q.rows) + "," + std::to_string(q.k) + "]x" +
         std::to_string(q.cols) + " " + DTypesName(q) + " chunks=" + std::to_string(q.chunks) +
         (q.bidirectional ? " bidirectional" : "") + (q.return_gathered ? " gathered" : "") +
         (q.fused ? " fused" : "");
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
