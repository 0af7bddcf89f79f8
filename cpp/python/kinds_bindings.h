// The Python side of core/kinds.h and of a Problem, for every extension that
// takes or gives one (_host, _cuda_fake): a kind parsed from its name (a
// ValueError naming the argument and what it expects), the kinds' tables as
// Python sees them (_host.kinds(), held to jaxoverlap/_kinds.py by
// tests/test_kinds.py), and a problem as a dict.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <optional>
#include <string>

#include "core/kinds.h"
#include "core/program.h"

namespace jo::python {

namespace nb = nanobind;

template <typename Kind>
Kind Require(const char* what, const std::string& name, std::optional<Kind> parsed,
             const std::string& expected) {
  if (!parsed)
    throw nb::value_error(
        (std::string(what) + ": expected " + expected + ", got '" + name + "'").c_str());
  return *parsed;
}

inline Collective ParseOpArg(const char* what, const std::string& name) {
  return Require(what, name, ParseCollective(name), kinds::Names(kOps));
}
inline Transport ParseTransportArg(const char* what, const std::string& name) {
  return Require(what, name, ParseTransport(name), kinds::Names(kTransports));
}
inline ArAlgorithm ParseAlgorithmArg(const char* what, const std::string& name) {
  return Require(what, name, ParseArAlgorithm(name), kinds::Names(kArAlgorithms));
}
// A dtype by JAX's name or the programs' short one.
inline DType ParseDTypeArg(const char* what, const std::string& name) {
  return Require(what, name, ParseDType(name), kinds::Names(kDTypes));
}

// The tables, one dict per row, the columns Python knows (_kinds.py) by the
// same names; the enums' values as their names. Of any tables of these rows
// (the testing module exports a deliberately unbalanced one).
template <size_t NOps, size_t NTransports, size_t NDTypes, size_t NAlgorithms>
nb::dict KindsDict(const OpRow (&op_rows)[NOps], const TransportRow (&transport_rows)[NTransports],
                   const DTypeRow (&dtype_rows)[NDTypes],
                   const ArAlgorithmRow (&algorithm_rows)[NAlgorithms]) {
  nb::list ops, transports, dtypes, algorithms;
  for (const OpRow& r : op_rows) {
    nb::dict d;
    d["id"] = static_cast<int>(r.op);
    d["name"] = r.name;
    d["collective"] = r.collective;
    d["communicates"] = ColumnName(r.communicates);
    d["rows"] = ColumnName(r.rows);
    d["fused"] = r.fused;
    d["gathered"] = r.gathered;
    d["one_shot"] = r.one_shot;
    ops.append(d);
  }
  for (const TransportRow& r : transport_rows) {
    nb::dict d;
    d["id"] = static_cast<int>(r.transport);
    d["name"] = r.name;
    d["auto_rank"] = r.auto_rank;
    d["fused"] = r.fused;
    d["mechanism"] = ColumnName(r.mechanism);
    transports.append(d);
  }
  for (const DTypeRow& r : dtype_rows) {
    nb::dict d;
    d["id"] = static_cast<int>(r.dtype);
    d["name"] = r.name;
    d["short"] = r.short_name;
    d["bytes"] = r.bytes;
    d["fp8"] = r.fp8;
    d["out"] = r.out;
    d["fused"] = r.fused;
    dtypes.append(d);
  }
  for (const ArAlgorithmRow& r : algorithm_rows) {
    nb::dict d;
    d["id"] = static_cast<int>(r.algorithm);
    d["name"] = r.name;
    d["splits_rows"] = r.splits_rows;
    d["kernel"] = r.kernel;
    algorithms.append(d);
  }
  nb::list fused_fp8;  // this build's (JO_FUSED_FP8), by JAX's dtype names
#define JO_FUSED_FP8_DICT(a, b, y) \
  {                                \
    nb::dict d;                    \
    d["x"] = Row(DType::a).name;   \
    d["w"] = Row(DType::b).name;   \
    d["y"] = Row(DType::y).name;   \
    fused_fp8.append(d);           \
  }
  JO_FUSED_FP8(JO_FUSED_FP8_DICT)
#undef JO_FUSED_FP8_DICT
  nb::dict out;
  out["fused_fp8"] = fused_fp8;
  out["ops"] = ops;
  out["transports"] = transports;
  out["dtypes"] = dtypes;
  out["algorithms"] = algorithms;
  return out;
}

// This build's tables (_host.kinds()).
inline nb::dict KindsDict() { return KindsDict(kOps, kTransports, kDTypes, kArAlgorithms); }

// A problem from a dict with the keys of ProblemDict (n: the output columns;
// dtype: x's, w_dtype and out_dtype default to it; rank, chunks,
// bidirectional, return_gathered, algorithm, tf32, fused and block_scaled may be left out).
inline Problem ProblemFromDict(const nb::dict& d) {
  const auto get = [&](const char* key, auto fallback) {
    using T = decltype(fallback);
    return d.contains(key) ? nb::cast<T>(d[key]) : fallback;
  };
  for (const char* key : {"op", "transport", "nranks", "batch", "rows", "k", "n", "dtype"})
    if (!d.contains(key)) throw nb::key_error((std::string("problem: no '") + key + "'").c_str());
  Problem q;
  q.op = ParseOpArg("op", nb::cast<std::string>(d["op"]));
  q.transport = ParseTransportArg("transport", nb::cast<std::string>(d["transport"]));
  q.nranks = nb::cast<int32_t>(d["nranks"]);
  q.rank = get("rank", int32_t{0});
  q.batch = nb::cast<int64_t>(d["batch"]);
  q.rows = nb::cast<int64_t>(d["rows"]);
  q.k = nb::cast<int64_t>(d["k"]);
  q.cols = nb::cast<int64_t>(d["n"]);
  q.x_dtype = ParseDTypeArg("dtype", nb::cast<std::string>(d["dtype"]));
  const std::string w_dtype = get("w_dtype", std::string());
  const std::string out_dtype = get("out_dtype", std::string());
  q.w_dtype = w_dtype.empty() ? q.x_dtype : ParseDTypeArg("w_dtype", w_dtype);
  q.out_dtype = out_dtype.empty() ? q.x_dtype : ParseDTypeArg("out_dtype", out_dtype);
  q.chunks = get("chunks", int64_t{1});
  q.bidirectional = get("bidirectional", false);
  q.return_gathered = get("return_gathered", false);
  q.algorithm = ParseAlgorithmArg("algorithm", get("algorithm", std::string("two_shot")));
  q.tf32 = get("tf32", false);
  q.fused = get("fused", false);
  q.block_scaled = get("block_scaled", false);
  q.replayable = get("replayable", false);
  return q;
}

// A problem as a dict (dtypes by the programs' short names).
inline nb::dict ProblemDict(const Problem& q) {
  nb::dict d;
  d["op"] = CollectiveName(q.op);
  d["transport"] = TransportName(q.transport);
  d["nranks"] = q.nranks;
  d["rank"] = q.rank;
  d["batch"] = q.batch;
  d["rows"] = q.rows;
  d["k"] = q.k;
  d["n"] = q.cols;  // Python's name of the output columns
  d["dtype"] = DTypeName(q.x_dtype);
  d["w_dtype"] = DTypeName(q.w_dtype);
  d["out_dtype"] = DTypeName(q.out_dtype);
  d["chunks"] = q.chunks;
  d["bidirectional"] = q.bidirectional;
  d["return_gathered"] = q.return_gathered;
  d["algorithm"] = ArAlgorithmName(q.algorithm);
  d["tf32"] = q.tf32;
  d["fused"] = q.fused;
  d["block_scaled"] = q.block_scaled;
  d["replayable"] = q.replayable;
  return d;
}

}  // namespace jo::python
