#include "core/status.h"

#include <cstring>

namespace jo {

const char* CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid argument";
    case Code::kTimeout:
      return "timeout";
    case Code::kAborted:
      return "aborted";
    case Code::kInternal:
      return "internal error";
    case Code::kResource:
      return "out of resources";
  }
  return "unknown";
}

const char* BaseName(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

Status& Status::Trail(const char* file, int line) {
  message_ += " [";
  message_ += BaseName(file);
  message_ += ":" + std::to_string(line) + "]";
  return *this;
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return std::string(CodeName(code_)) + ": " + message_;
}

Status InvalidArgument(std::string message) {
  return Status(Code::kInvalidArgument, std::move(message));
}
Status Internal(std::string message) { return Status(Code::kInternal, std::move(message)); }

}  // namespace jo
