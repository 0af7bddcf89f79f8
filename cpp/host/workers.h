// Worker threads for asynchronous calls.
//
// The CPU FFI handlers do not block XLA's device thread on peers: they hand
// the call to a worker and return an ffi::Future. The worker completes the
// future when the call is done, and XLA may run the device's continuation
// (the next thunks, which can block in an XLA collective for a long time)
// inline on that worker. So the pool never makes a task wait for a busy
// worker: a task gets an idle worker or a new thread. Idle workers exit
// after a while; the pool itself lives until the process exits.
#pragma once

#include <functional>

#include "core/status.h"

namespace jo::host {

// Runs `task` on a worker thread: an idle one, else a new one. Fails only if
// no thread can be started (then `task` is not run).
Status PostToWorker(std::function<void()> task);

}  // namespace jo::host
