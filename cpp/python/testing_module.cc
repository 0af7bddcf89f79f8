// jaxoverlap_testing: helpers for the tests only. Built beside the package's
// modules but never installed; tests load it from the build tree
// (tests/testing_ext.py).
//
// * exchange_selftest: drives a jo::Exchange (cpp/core/exchange.h) from C++
//   over a Python object, as the CUDA executor's set-up does;
// * exchange_probe_target / set_probe_exchange: a CPU FFI handler that
//   exchanges through the jax.distributed store from inside an XLA execution
//   (the CUDA handlers' first execution does that);
// * busy_worker: a host worker that keeps using the process-wide state a
//   native call uses, for a test that exits while it runs.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/call.h"
#include "core/exchange.h"
#include "host/host_site.h"
#include "host/workers.h"
#include "python/ffi_capsule.h"
#include "python/py_exchange.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

void ThrowIfError(const jo::Status& status) {
  if (!status.ok()) throw std::runtime_error(status.ToString());
}

std::mutex g_probe_mu;
std::shared_ptr<jo::Exchange> g_probe_exchange;

// y = x + the sum, over the exchange's processes, of (process + 1).
ffi::Error ExchangeProbeImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  std::shared_ptr<jo::Exchange> exchange;
  {
    std::lock_guard<std::mutex> lock(g_probe_mu);
    exchange = g_probe_exchange;
  }
  if (!exchange) return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "no probe exchange set");
  std::map<int32_t, std::string> all;
  const jo::Status status =
      exchange->AllGather("probe", std::to_string(exchange->process() + 1), &all);
  if (!status.ok()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.ToString());
  float total = 0;
  for (const auto& [process, text] : all) total += std::stof(text);
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = x.typed_data()[i] + total;
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER(kExchangeProbe, ExchangeProbeImpl,
                       ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());

void SetProbeExchange(nb::object impl) {
  std::shared_ptr<jo::Exchange> exchange;
  if (!impl.is_none()) exchange = std::make_shared<jo::python::PyExchange>(std::move(impl));
  std::lock_guard<std::mutex> lock(g_probe_mu);
  g_probe_exchange = std::move(exchange);
}

nb::dict ExchangeSelftest(nb::object impl, bool share_fds, int owner_fd) {
  jo::python::PyExchange exchange(std::move(impl));
  const std::vector<int32_t> procs = exchange.processes();
  const int32_t me = exchange.process();
  if (procs.empty()) throw nb::value_error("exchange: no processes");
  std::string uid;
  if (me == procs.front()) {
    uid.assign(128, '\0');  // an ncclUniqueId's size, NULs included
    for (size_t i = 0; i < uid.size(); ++i) uid[i] = static_cast<char>(i * 7 + 3);
  }
  nb::dict out;
  {
    nb::gil_scoped_release release;  // as set-up code on another thread might run
    ThrowIfError(exchange.Broadcast("selftest/uid", procs.front(), &uid));
  }
  std::string mine = "handles of process " + std::to_string(me);
  mine.push_back('\0');
  std::map<int32_t, std::string> all;
  ThrowIfError(exchange.AllGather("selftest/handles", mine, &all));
  out["uid"] = nb::bytes(uid.data(), uid.size());
  nb::dict gathered;
  for (const auto& [p, bytes] : all) gathered[nb::int_(p)] = nb::bytes(bytes.data(), bytes.size());
  out["handles"] = gathered;
  // The multicast shape of ShareFds: only the first process offers an fd.
  if (share_fds) {
    std::vector<int> offer;
    if (me == procs.front()) offer.push_back(owner_fd);
    std::map<int32_t, std::vector<int>> got;
    {
      nb::gil_scoped_release release;
      ThrowIfError(exchange.ShareFds("selftest/fd", offer, &got));
    }
    nb::dict fds;
    for (const auto& [p, list] : got) {
      nb::list l;
      for (int fd : list) l.append(nb::int_(fd));
      fds[nb::int_(p)] = l;
    }
    out["fds"] = fds;
  }
  return out;
}

// A worker that, for `seconds`, keeps touching what a call's worker touches
// (the sizing cache, the clique registry, the call-site counter) — as a call
// still waiting for a peer does while its process exits. This module links
// its own copy of that state; the test shows exit is clean all the same.
void BusyWorker(double seconds) {
  jo::Status posted = jo::host::PostToWorker([seconds] {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    jo::Problem q;
    q.nranks = 4;
    q.rows = 8;
    q.k = 8;
    q.cols = 8;
    int64_t i = 0;
    while (std::chrono::steady_clock::now() < end) {
      q.batch = 1 + (i++ % 64);
      jo::CallNeeds needs;
      (void)jo::NeedsOf(q, &needs);
      (void)jo::host::DescribeCliques();
      (void)jo::NewCallSiteId(i);
    }
  });
  ThrowIfError(posted);
}

}  // namespace

void BindFusedTiles(nb::module_& m);  // testing_fused_tiles.cc

NB_MODULE(jaxoverlap_testing, m) {
  m.doc() = "jaxoverlap test helpers (not installed).";
  m.def("exchange_selftest", &ExchangeSelftest, nb::arg("exchange"), nb::arg("share_fds") = false,
        nb::arg("owner_fd") = -1,
        "A broadcast and an allgather through jo::Exchange over a Python object; with "
        "share_fds, ShareFds where the first process offers owner_fd and the others nothing "
        "(the caller owns the duplicates returned under 'fds').");
  m.def(
      "exchange_probe_target", [] { return jo::python::Encapsulate(kExchangeProbe); },
      "A CPU FFI handler that allgathers through the probe exchange.");
  m.def("set_probe_exchange", &SetProbeExchange, nb::arg("exchange").none(),
        "The exchange the probe handler uses (None: forget it).");
  m.def("busy_worker", &BusyWorker, nb::arg("seconds"),
        "A host worker that keeps using process-wide state for `seconds`.");
  BindFusedTiles(m);
}
