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

namespace jo::python {

namespace loopback_detail {

inline DType DTypeNamed(const std::string& name) {
  static const std::pair<const char*, DType> kNames[] = {{"float32", DType::kF32},
                                                         {"bfloat16", DType::kBF16},
                                                         {"float16", DType::kF16},
                                                         {"float8_e4m3fn", DType::kF8E4M3},
                                                         {"float8_e5m2", DType::kF8E5M2}};
  for (const auto& [text, dtype] : kNames)
    if (name == text) return dtype;
  throw nanobind::value_error(("loopback_run: dtype " + name +
                               ": expected float32, bfloat16, float16, float8_e4m3fn or "
                               "float8_e5m2")
                                  .c_str());
}

inline Collective OpNamed(const std::string& name) {
  for (Collective op : {Collective::kAgMatmul, Collective::kMatmulRs, Collective::kMatmulAr})
    if (name == CollectiveName(op)) return op;
  throw nanobind::value_error(
      ("loopback_run: op " + name + ": expected ag_matmul, matmul_rs or matmul_ar").c_str());
}

// The problem from its Python description (selftest's keys), without a rank.
inline Problem ProblemOf(const nanobind::dict& d) {
  namespace nb = nanobind;
  const auto get = [&](const char* key) {
    if (!d.contains(key))
      throw nb::value_error((std::string("loopback_run: problem needs '") + key + "'").c_str());
    return d[key];
  };
  Problem q;
  q.op = OpNamed(nb::cast<std::string>(get("op")));
  const std::string transport = nb::cast<std::string>(get("transport"));
  bool known = false;
  for (Transport t : {Transport::kNccl, Transport::kP2p, Transport::kMulticast})
    if (transport == TransportName(t)) {
      q.transport = t;
      known = true;
    }
  if (!known)
    throw nb::value_error(
        ("loopback_run: transport " + transport + ": expected nccl, p2p or multicast").c_str());
  q.nranks = nb::cast<int32_t>(get("nranks"));
  q.batch = nb::cast<int64_t>(get("batch"));
  q.rows = nb::cast<int64_t>(get("rows"));
  q.k = nb::cast<int64_t>(get("k"));
  q.cols = nb::cast<int64_t>(get("cols"));
  q.x_dtype = DTypeNamed(nb::cast<std::string>(get("x_dtype")));
  q.w_dtype = DTypeNamed(nb::cast<std::string>(get("w_dtype")));
  q.out_dtype = DTypeNamed(nb::cast<std::string>(get("out_dtype")));
  q.chunks = nb::cast<int64_t>(get("chunks"));
  q.bidirectional = nb::cast<bool>(get("bidirectional"));
  const std::string algorithm = nb::cast<std::string>(get("algorithm"));
  if (algorithm != "two_shot" && algorithm != "one_shot")
    throw nb::value_error("loopback_run: algorithm: expected two_shot or one_shot");
  q.algorithm = algorithm == "one_shot" ? ArAlgorithm::kOneShot : ArAlgorithm::kTwoShot;
  q.fused = nb::cast<bool>(get("fused"));
  return q;
}

}  // namespace loopback_detail

inline void BindLoopback(nanobind::module_& m, std::function<cuda::LoopbackHooks()> hooks) {
  namespace nb = nanobind;
  m.def(
      "loopback_run",
      [hooks](const nb::dict& problem, const std::vector<nb::bytes>& xs,
              const std::vector<nb::bytes>& ws, std::vector<float> x_scales,
              std::vector<float> w_scales, int device, int calls, int64_t clique_key,
              int64_t timeout_ms, bool ordered) {
        cuda::LoopbackCalls in;
        in.problem = loopback_detail::ProblemOf(problem);
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
      "problem is a dict (op, transport, nranks, batch, rows, k, cols, x_dtype, w_dtype, "
      "out_dtype, chunks, bidirectional, algorithm, fused); xs and ws per rank as the handler "
      "receives them (an fp8 w K-major). Returns ys (bytes per rank), statuses (None or the "
      "error) and completed (the GPU finished in time). ordered=False (tests): the ranks' threads "
      "issue their units at will, not in the play's global order.");
}

}  // namespace jo::python
