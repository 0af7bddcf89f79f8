// Leveled logging to stderr, selected by JAXOVERLAP_LOG (warn|info|debug;
// default warn). JO_WARN marks where an error starts (always printed, with
// file:line) and its text is kept for LastWarning(); JO_DEBUG is where the
// chosen plan of each call site is printed.
#pragma once

#include <string>

namespace jo {

enum class LogLevel : int { kWarn = 0, kInfo = 1, kDebug = 2 };

LogLevel CurrentLogLevel();  // read once from JAXOVERLAP_LOG
void LogMessage(LogLevel level, const char* file, int line, const std::string& text);
std::string LastWarning();

}  // namespace jo

#define JO_LOG_AT(level, text)                                                \
  do {                                                                        \
    if (static_cast<int>(::jo::CurrentLogLevel()) >= static_cast<int>(level)) \
      ::jo::LogMessage(level, __FILE__, __LINE__, (text));                    \
  } while (0)
#define JO_WARN(text) JO_LOG_AT(::jo::LogLevel::kWarn, text)
#define JO_INFO(text) JO_LOG_AT(::jo::LogLevel::kInfo, text)
#define JO_DEBUG(text) JO_LOG_AT(::jo::LogLevel::kDebug, text)
