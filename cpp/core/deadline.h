// Deadlines that cannot overflow.
//
// `now + timeout` on std::chrono::steady_clock wraps around for very long
// timeouts (JAXOVERLAP_TIMEOUT_S=1e10 is 1e19 ns, past the int64 range of
// the clock's nanoseconds), which would put the deadline in the past and
// fail every wait at once. Every wait takes its deadline from here.
#pragma once

#include <chrono>

namespace jo {

using Clock = std::chrono::steady_clock;

// now + timeout, or the far future when that does not fit the clock.
inline Clock::time_point DeadlineAfter(std::chrono::nanoseconds timeout,
                                       Clock::time_point now = Clock::now()) {
  // Leave room so that adding a poll slice to the result cannot overflow either.
  const Clock::time_point far = Clock::time_point::max() - std::chrono::hours(24 * 365);
  if (timeout <= Clock::duration::zero()) return now;
  if (timeout >= far - now) return far;
  return now + std::chrono::duration_cast<Clock::duration>(timeout);
}

// `timeout` in milliseconds, from a count that may be anything a caller passed.
inline std::chrono::milliseconds Millis(int64_t count) {
  return std::chrono::milliseconds(count < 0 ? 0 : count);
}

}  // namespace jo
