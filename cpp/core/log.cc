#include "core/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/status.h"

namespace jo {
namespace {

LogLevel ParseLevel(const char* text) {
  if (text == nullptr) return LogLevel::kWarn;
  if (std::strcmp(text, "debug") == 0 || std::strcmp(text, "DEBUG") == 0) return LogLevel::kDebug;
  if (std::strcmp(text, "info") == 0 || std::strcmp(text, "INFO") == 0) return LogLevel::kInfo;
  return LogLevel::kWarn;
}

std::mutex& LastMutex() {
  static std::mutex mu;
  return mu;
}
std::string& Last() {
  static std::string last;
  return last;
}

}  // namespace

LogLevel CurrentLogLevel() {
  static const LogLevel level = ParseLevel(std::getenv("JAXOVERLAP_LOG"));
  return level;
}

void LogMessage(LogLevel level, const char* file, int line, const std::string& text) {
  static const char* const kNames[] = {"WARN", "INFO", "DEBUG"};
  if (level == LogLevel::kWarn) {
    std::lock_guard<std::mutex> lock(LastMutex());
    Last() = text;
  }
  std::fprintf(stderr, "jaxoverlap %s %s:%d %s\n", kNames[static_cast<int>(level)], BaseName(file),
               line, text.c_str());
}

std::string LastWarning() {
  std::lock_guard<std::mutex> lock(LastMutex());
  return Last();
}

}  // namespace jo
