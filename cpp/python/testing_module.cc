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

#include <atomic>
#include <chrono>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "core/call.h"
#include "core/exchange.h"
#include "host/host_clique.h"
#include "host/host_site.h"
#include "host/shm_clique.h"
#include "host/shm_domain.h"
#include "host/workers.h"
#include "python/ffi_capsule.h"
#include "python/kinds_bindings.h"
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
// (the sizing cache, the clique registry, the call-site identities) — as a call
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
      (void)jo::CallSite::Instantiate(i + 1);
    }
  });
  ThrowIfError(posted);
}

// The call-site directory of a domain with room for `capacity` sites, in this
// process (processes [0: here, 1: nobody]): site 1 stays open while `churn`
// other sites open and close one after another; then, with `fill`, sites
// open without closing until the directory refuses one (each holds its fd
// for the absent peer meanwhile). Returns what happened.
nb::dict SiteDirectory(int32_t capacity, int64_t churn, bool fill) {
  std::shared_ptr<jo::host::ShmDomain> domain;
  jo::host::UniqueFd fd;
  ThrowIfError(jo::host::ShmDomain::Create(0x5173, 0, {0, 1}, 0, 1, capacity, &domain, &fd));
  const auto init = [](std::byte* base, const jo::host::ShmDomain&, int64_t site, const void*) {
    std::memcpy(base, &site, sizeof(site));  // each segment says which site it is
  };
  const auto open = [&](int64_t site, std::shared_ptr<jo::host::ShmSegment>* out) {
    return domain->OpenSite(site, 4096, jo::DeadlineAfter(std::chrono::seconds(10)), "test", init,
                            nullptr, out);
  };
  nb::dict out;
  std::shared_ptr<jo::host::ShmSegment> kept;
  ThrowIfError(open(1, &kept));
  int64_t churned = 0;
  {
    nb::gil_scoped_release release;
    for (int64_t i = 0; i < churn; ++i) {
      std::shared_ptr<jo::host::ShmSegment> segment;
      ThrowIfError(open(1000 + i, &segment));
      int64_t written = 0;
      std::memcpy(&written, segment->data(), sizeof(written));
      if (written != 1000 + i) throw std::runtime_error("a site got another site's segment");
      segment.reset();
      domain->ReleaseSite(1000 + i);
      ++churned;
    }
  }
  int64_t site_of_kept = 0;
  std::memcpy(&site_of_kept, kept->data(), sizeof(site_of_kept));
  out["churned"] = churned;
  out["kept_site"] = site_of_kept;
  std::vector<int64_t> filled;
  jo::Status status;
  while (fill && status.ok() && static_cast<int64_t>(filled.size()) <= capacity) {
    std::shared_ptr<jo::host::ShmSegment> segment;
    status = open(1'000'000 + static_cast<int64_t>(filled.size()), &segment);
    if (status.ok()) filled.push_back(1'000'000 + static_cast<int64_t>(filled.size()));
  }
  out["filled"] = filled.size();
  out["full_error"] = status.message();
  out["description"] = domain->Describe();
  jo::host::SegmentServer* server = nullptr;
  ThrowIfError(jo::host::SegmentServer::Instance(&server));
  out["offers_open"] = server->offers();  // fds held for the absent peer
  kept.reset();
  for (int64_t site : filled) domain->ReleaseSite(site);
  domain->ReleaseSite(1);
  out["offers_closed"] = server->offers();  // every site closed: none left
  return out;
}

// ClaimRank's rule on a clique of `kind` ("local", or "shm": a domain whose
// two ranks are both in this process): a device's call 2 of rank 0, started
// first, waits until its call 1 has been claimed and released; a second
// device calling as a rank that is inside a call fails at once.
nb::dict ClaimOrder(const std::string& kind) {
  const jo::CliqueKey key{0x0c1a, 0, 0x51e};
  std::shared_ptr<jo::host::HostClique> clique;
  if (kind == "local") {
    clique = std::make_shared<jo::host::LocalClique>(key, 2);
  } else {
    std::shared_ptr<jo::host::ShmDomain> domain;
    jo::host::UniqueFd fd;
    ThrowIfError(jo::host::ShmDomain::Create(key.key, 0, {0, 0}, 0, 1, 8, &domain, &fd));
    jo::CallNeeds needs;
    needs.workspace_bytes = 256;
    needs.num_flags = 2;
    clique = std::make_shared<jo::host::ShmClique>(domain, key.site, needs, "a call");
  }
  const auto context = [](int32_t rank, int64_t epoch) {
    jo::host::WaitContext ctx;
    ctx.op = "test";
    ctx.rank = rank;
    ctx.epoch = epoch;
    ctx.timeout = std::chrono::milliseconds(10000);
    return ctx;
  };
  nb::dict out;
  nb::gil_scoped_release release;
  std::atomic<bool> second_claimed{false}, first_released{false};
  std::atomic<bool> claimed_before_release{false};
  jo::Status second;
  std::thread later([&] {
    jo::host::WaitContext ctx = context(0, 2);
    second = clique->ClaimRank(&ctx, 7);
    claimed_before_release = !first_released.load();
    second_claimed = true;
    if (second.ok()) clique->ReleaseRank(ctx);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const bool waited = !second_claimed.load();
  jo::host::WaitContext first = context(0, 1);
  jo::Status status = clique->ClaimRank(&first, 7);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const bool still_waited = !second_claimed.load();
  first_released = true;
  if (status.ok()) clique->ReleaseRank(first);
  later.join();
  jo::host::WaitContext other = context(1, 1);
  jo::Status one = clique->ClaimRank(&other, 3);
  jo::host::WaitContext twin = context(1, 2);
  const auto start = std::chrono::steady_clock::now();
  jo::Status two = clique->ClaimRank(&twin, 4);
  const double two_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  nb::gil_scoped_acquire acquire;
  out["waited"] = waited && still_waited;
  out["first"] = status.message();
  out["second"] = second.message();
  out["claimed_before_release"] = claimed_before_release.load();
  out["two_devices"] = two.message();
  out["two_devices_s"] = two_s;
  out["one"] = one.message();
  return out;
}

// This build's dtype table with one more row that jaxoverlap/_kinds.py does not
// have: what tests/test_kinds.py must refuse (a row added on one side only).
nb::dict UnbalancedKinds() {
#define JO_TEST_DTYPE_ROW(e, id, name, short_name, bytes, fp8, out, fused, ...) \
  {jo::DType::e, name, short_name, bytes, fp8, out, fused},
  static constexpr jo::DTypeRow kDTypesAndOneMore[] = {JO_DTYPES(JO_TEST_DTYPE_ROW){
      static_cast<jo::DType>(std::size(jo::kDTypes)), "float64", "f64", 8, false, true, false}};
#undef JO_TEST_DTYPE_ROW
  return jo::python::KindsDict(jo::kOps, jo::kTransports, kDTypesAndOneMore, jo::kArAlgorithms);
}

}  // namespace

void BindFusedTiles(nb::module_& m);  // testing_fused_tiles.cc
void BindReplay(nb::module_& m);      // testing_replay.cc

NB_MODULE(jaxoverlap_testing, m) {
  m.doc() = "jaxoverlap test helpers (not installed).";
  m.def("unbalanced_kinds", &UnbalancedKinds,
        "_host.kinds() of this build's tables with a float64 dtype row added on the C++ side "
        "only (tests/test_kinds.py must tell).");
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
  m.def("claim_order", &ClaimOrder, nb::arg("kind"),
        "ClaimRank's order and exclusion on a 'local' or 'shm' clique (see its comment).");
  m.def("site_directory", &SiteDirectory, nb::arg("capacity"), nb::arg("churn"),
        nb::arg("fill") = false,
        "Churns the call-site directory of a domain in this process (see its comment).");
  m.def("busy_worker", &BusyWorker, nb::arg("seconds"),
        "A host worker that keeps using process-wide state for `seconds`.");
  BindFusedTiles(m);
  BindReplay(m);
}
