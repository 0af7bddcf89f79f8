#include "core/trace.h"

#include <atomic>
#include <chrono>
#include <mutex>

namespace jo {
namespace {

std::atomic<bool> g_recording{false};

struct Log {
  std::mutex mu;
  std::vector<CallSpan> calls;
};

Log& TheLog() {
  static auto* log = new Log;  // never destroyed: workers may log at exit
  return *log;
}

}  // namespace

void SetRecording(bool on) { g_recording.store(on); }
bool Recording() { return g_recording.load(std::memory_order_relaxed); }

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void LogCall(CallSpan span) {
  Log& log = TheLog();
  std::lock_guard<std::mutex> lock(log.mu);
  log.calls.push_back(std::move(span));
}

std::vector<CallSpan> TakeCalls() {
  Log& log = TheLog();
  std::lock_guard<std::mutex> lock(log.mu);
  std::vector<CallSpan> out;
  out.swap(log.calls);
  return out;
}

}  // namespace jo
