// What the CPU and the CUDA FFI handlers share at the XLA boundary: turning
// our Status into an ffi::Error (once, here), dtypes, and error text.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

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

}  // namespace jo::ffi_common
