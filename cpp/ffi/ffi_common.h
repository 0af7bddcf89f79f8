// What the CPU and the CUDA FFI handlers share at the XLA boundary: turning
// our Status into an ffi::Error (once, here), dtypes, and error text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/program.h"
#include "core/status.h"
#include "xla/ffi/api/ffi.h"

namespace jo::ffi_common {

namespace ffi = xla::ffi;

inline std::string Dims(ffi::Span<const int64_t> dims) {
  std::string out = "[";
  for (size_t i = 0; i < dims.size(); ++i) out += (i ? "," : "") + std::to_string(dims[i]);
  return out + "]";
}

inline ffi::Error Invalid(const char* op, const std::string& text) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + text);
}

inline ffi::Error ToFfi(const Status& status) {
  switch (status.code()) {
    case Code::kOk: return ffi::Error::Success();
    case Code::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, status.message());
    case Code::kTimeout: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message());
    case Code::kAborted: return ffi::Error(ffi::ErrorCode::kAborted, status.message());
    case Code::kResource: return ffi::Error(ffi::ErrorCode::kResourceExhausted, status.message());
    case Code::kInternal: break;
  }
  return ffi::Error::Internal(status.message());
}

inline std::optional<DType> ToDType(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F32: return DType::kF32;
    case ffi::DataType::BF16: return DType::kBF16;
    case ffi::DataType::F16: return DType::kF16;
    default: return std::nullopt;
  }
}

// Checks a result against the shape it must have: x's dims with dim `axis`
// made `axis_dim` and the last dim `last`; and x's dtype.
inline ffi::Error CheckResult(const char* op, const char* name, const ffi::AnyBuffer& x,
                              ffi::Span<const int64_t> got, ffi::DataType got_type, int64_t axis,
                              int64_t axis_dim, int64_t last) {
  auto xd = x.dimensions();
  std::vector<int64_t> want(xd.begin(), xd.end());
  want[axis] = axis_dim;
  want.back() = last;
  bool same = got.size() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) same = got[i] == want[i];
  if (!same)
    return Invalid(op, std::string("result ") + name + " expected shape " +
                           Dims(ffi::Span<const int64_t>(want.data(), want.size())) + ", got " + Dims(got));
  if (got_type != x.element_type()) return Invalid(op, std::string("result ") + name + " expected the dtype of x");
  return ffi::Error::Success();
}

// The checks both executors' handlers make of x, w and the attributes they
// share (`A`: any struct with axis, axis_size, transport, chunks, timeout_ms).
template <typename A>
ffi::Error CheckOperands(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                         const A& a) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() < 2) return Invalid(op, "operand x expected rank >= 2, got rank " + std::to_string(xd.size()) + " (shape " + Dims(xd) + ")");
  if (wd.size() != 2) return Invalid(op, "operand w expected rank 2, got rank " + std::to_string(wd.size()) + " (shape " + Dims(wd) + ")");
  if (!ToDType(x.element_type())) return Invalid(op, "operand x expected dtype float32, bfloat16 or float16");
  if (w.element_type() != x.element_type()) return Invalid(op, "operand w expected the dtype of x");
  if (wd[0] != xd[xd.size() - 1])
    return Invalid(op, "operand w expected " + std::to_string(xd[xd.size() - 1]) + " rows (x's last dim), got shape " + Dims(wd));
  if (a.axis < 0 || a.axis > static_cast<int64_t>(xd.size()) - 2)
    return Invalid(op, "attribute axis expected in [0, " + std::to_string(xd.size() - 2) + "], got " + std::to_string(a.axis));
  if (a.axis_size < 1) return Invalid(op, "attribute axis_size expected >= 1, got " + std::to_string(a.axis_size));
  if (a.transport < 0 || a.transport > 2) return Invalid(op, "attribute transport expected 0 (nccl), 1 (p2p) or 2 (multicast), got " + std::to_string(a.transport));
  if (a.chunks < 1) return Invalid(op, "attribute chunks expected >= 1, got " + std::to_string(a.chunks));
  if (a.timeout_ms < 1) return Invalid(op, "attribute timeout_ms expected >= 1, got " + std::to_string(a.timeout_ms));
  return ffi::Error::Success();
}

// The canonical problem (docs/native.md §1) of checked operands: everything
// but the rank. `A` as for CheckOperands, plus bidirectional.
template <typename A>
ffi::Error FillProblem(Collective collective, const ffi::AnyBuffer& x, const ffi::AnyBuffer& w,
                       const A& a, Problem* q) {
  const char* op = CollectiveName(collective);
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  q->op = collective;
  q->transport = static_cast<Transport>(a.transport);
  q->nranks = static_cast<int32_t>(a.axis_size);
  q->dtype = *ToDType(x.element_type());
  q->chunks = a.chunks;
  q->bidirectional = a.bidirectional;
  q->k = xd[xd.size() - 1];
  q->n = wd[1];
  q->batch = 1;
  for (int64_t i = 0; i < a.axis; ++i) q->batch *= xd[i];
  int64_t post = 1;
  for (size_t i = static_cast<size_t>(a.axis) + 1; i + 1 < xd.size(); ++i) post *= xd[i];
  if (collective == Collective::kAgMatmul) {
    q->rows = xd[a.axis] * post;
  } else {
    if (xd[a.axis] % a.axis_size != 0)
      return Invalid(op, "operand x dim " + std::to_string(a.axis) + " (" + std::to_string(xd[a.axis]) + ") expected divisible by axis_size " + std::to_string(a.axis_size));
    q->rows = xd[a.axis] / a.axis_size * post;
  }
  return ffi::Error::Success();
}

}  // namespace jo::ffi_common
