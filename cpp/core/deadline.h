// Deadlines that cannot overflow.
//
// `now + timeout` on std::chrono::steady_clock wraps around for very long
// timeouts (JAXOVERLAP_TIMEOUT_S=1e10 is 1e19 ns, past the int64 range of
// the clock's nanoseconds), which would put the deadline in the past and
// fail every wait at once. Every wait takes its deadline from here.
#pragma once

#include <chrono>
#include <cstdint>

namespace jo {

using Clock = std::chrono::steady_clock;

// now + timeout, or the far future when that does not fit the clock. The
// comparison is made in floating-point seconds: converting a huge timeout to
// the clock's nanoseconds would overflow already.
template <typename Rep, typename Period>
Clock::time_point DeadlineAfter(std::chrono::duration<Rep, Period> timeout,
                                Clock::time_point now = Clock::now()) {
  // Leave room so that adding a poll slice to the result cannot overflow either.
  const Clock::time_point far = Clock::time_point::max() - std::chrono::hours(24 * 365);
  if (timeout <= timeout.zero()) return now;
  using Seconds = std::chrono::duration<double>;
  if (Seconds(timeout).count() >= Seconds(far - now).count()) return far;
  return now + std::chrono::duration_cast<Clock::duration>(timeout);
}

// The longest wait a GPU is given, in nanoseconds (2^60 ns: 36 years, forever in practice).
// Room is left so that twice it plus a grace second still fits int64.
inline constexpr int64_t kForeverNs = int64_t{1} << 60;

// `timeout` in nanoseconds for a wait on a GPU's clock (%globaltimer), saturated at
// kForeverNs: converting a huge timeout (JAXOVERLAP_TIMEOUT_S=inf is 2^62 ms) by
// duration_cast overflows int64 (to 0 for 2^62 ms: every wait would give up at once). The
// comparison is made in floating-point seconds, as DeadlineAfter's. 0 for a timeout <= 0
// (the callers refuse that: no wait may be unbounded, nor give up before it began).
template <typename Rep, typename Period>
int64_t TimeoutNs(std::chrono::duration<Rep, Period> timeout) {
  if (timeout <= timeout.zero()) return 0;
  using Seconds = std::chrono::duration<double>;
  if (Seconds(timeout).count() >= Seconds(std::chrono::nanoseconds(kForeverNs)).count())
    return kForeverNs;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
}

// `timeout` in milliseconds, from a count that may be anything a caller passed.
inline std::chrono::milliseconds Millis(int64_t count) {
  return std::chrono::milliseconds(count < 0 ? 0 : count);
}

}  // namespace jo
