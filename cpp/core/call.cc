#include "core/call.h"

#include <mutex>
#include <set>

#include "core/log.h"

namespace jo {

std::string CallSignature(const Problem& q) {
  return std::string(CollectiveName(q.op)) + "/" + TransportName(q.transport) + " n=" +
         std::to_string(q.nranks) + " [" + std::to_string(q.batch) + "," +
         std::to_string(q.rows) + "," + std::to_string(q.k) + "]x" + std::to_string(q.n) + " " +
         DTypeName(q.dtype) + " chunks=" + std::to_string(q.chunks) +
         (q.bidirectional ? " bidirectional" : "") + (q.return_gathered ? " gathered" : "");
}

void LogPlanOnce(const Program& program, const CliqueKey& key, const char* executor) {
  if (CurrentLogLevel() < LogLevel::kDebug || program.problem.rank != 0) return;
  static std::mutex mu;
  static std::set<std::string> seen;
  const std::string name = CliqueName(key);
  const std::string summary = std::string(executor) + " " + name + " " + Summary(program);
  std::lock_guard<std::mutex> lock(mu);
  if (!seen.insert(summary).second) return;
  JO_DEBUG("plan: " + name + " (" + executor + " executor)\n" + ToString(program));
}

}  // namespace jo
