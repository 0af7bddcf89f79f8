// The host executor's side of one call site (cpu): its placed calls, its
// cliques, and its calls, which run asynchronously.
//
// A HostSite is the FFI instantiate-stage state of one custom call of one
// executable (ffi/ffi_call.h), shared by every local device. The first
// execution on a device places the call there (core/call.h) and binds it to
// its clique; later executions fetch it. Each execution takes its epoch on the calling (XLA
// device) thread, so that it follows this device's order of executions of
// the site, and hands the rest — claim the rank, agree, reserve, run — to a
// worker thread, which completes XLA's future: XLA:CPU may run an
// independent XLA collective on some devices while others run our call, so
// blocking the device thread on peers could deadlock (docs/native.md §4).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "core/call.h"
#include "core/status.h"
#include "host/host_clique.h"

namespace jo::host {

class HostSite {
 public:
  HostSite(CallDesc desc, CallSite site);

  // Starts one call of `caller` (XLA:CPU names devices by their global id).
  // `done` receives the result, on a worker thread after every resource of
  // the call is released, or inline when the call cannot start; it may run
  // for a long time (XLA may continue the device's program inline).
  void Start(const Caller& caller, const Problem& problem, const CallBuffers& io,
             std::function<void(const Status&)> done);

  const CallDesc& desc() const { return desc_; }

 private:
  // The site's call on one device: placed, and bound to the clique it runs on.
  struct BoundCall {
    PlacedCall call;
    std::shared_ptr<HostClique> clique;
  };
  Status BindCall(const Caller& caller, const Problem& problem, BoundCall* out);

  const CallDesc desc_;
  const CallSite site_;
  PerDevice<BoundCall> bound_;
};

// For info(): one line per live clique (and per domain spanning processes).
std::string DescribeCliques();

}  // namespace jo::host
