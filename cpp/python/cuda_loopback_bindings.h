// `loopback_run`: the loopback runner (cpp/cuda/loopback.h), bound in _cuda (a GPU's hooks) and
// in the test-only _cuda_fake (the fake's), so that `selftest --fake --loopback N` runs the very
// code `selftest --loopback N` runs on one GPU.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/program.h"
#include "cuda/loopback.h"
#include "python/kinds_bindings.h"

namespace jo::python {

inline void BindLoopback(nanobind::module_& m, std::function<cuda::LoopbackHooks()> hooks) {
  namespace nb = nanobind;
  m.def(
      "loopback_run",
      [hooks](const nb::dict& problem, const std::vector<nb::bytes>& xs,
              const std::vector<nb::bytes>& ws, std::vector<float> x_scales,
              std::vector<float> w_scales, int device, int calls, int64_t clique_key,
              int64_t timeout_ms, bool ordered) {
        cuda::LoopbackCalls in;
        in.problem = ProblemFromDict(problem);
        for (const nb::bytes& x : xs) in.xs.emplace_back(x.c_str(), x.size());
        for (const nb::bytes& w : ws) in.ws.emplace_back(w.c_str(), w.size());
        in.x_scales = std::move(x_scales);
        in.w_scales = std::move(w_scales);
        in.device = device;
        in.calls = calls;
        in.clique_key = clique_key;
        in.timeout_ms = timeout_ms;
        in.ordered = ordered;
        cuda::LoopbackOutcome outcome;
        Status status;
        {
          nb::gil_scoped_release release;
          status = cuda::RunLoopback(in, hooks(), &outcome);
        }
        if (status.code() == Code::kInvalidArgument)
          throw nb::value_error(status.message().c_str());
        if (!status.ok()) throw std::runtime_error(status.message());
        nb::list ys, statuses;
        for (size_t r = 0; r < outcome.ys.size(); ++r) {
          ys.append(nb::bytes(outcome.ys[r].data(), outcome.ys[r].size()));
          statuses.append(outcome.statuses[r].empty()
                              ? nb::none()
                              : nb::object(nb::str(outcome.statuses[r].c_str())));
        }
        nb::dict out;
        out["ys"] = ys;
        out["statuses"] = statuses;
        out["completed"] = outcome.completed;
        return out;
      },
      nb::arg("problem"), nb::arg("xs"), nb::arg("ws"), nb::arg("x_scales") = std::vector<float>(),
      nb::arg("w_scales") = std::vector<float>(), nb::arg("device") = 0, nb::arg("calls") = 1,
      nb::arg("clique_key") = 1, nb::arg("timeout_ms") = 120000, nb::arg("ordered") = true,
      "Runs the problem's N ranks on ONE GPU (`device`), `calls` calls each (cpp/cuda/loopback.h): "
      "problem is a dict with the keys of _host.build_program's (kinds_bindings.h, "
      "ProblemFromDict; its rank is ignored); xs and ws per rank as the handler "
      "receives them (an fp8 w K-major). Returns ys (bytes per rank), statuses (None or the "
      "error) and completed (the GPU finished in time). ordered=False (tests): the ranks' threads "
      "issue their units at will, not in the play's global order.");
}

}  // namespace jo::python
