// Status: the one result type of the native core.
//
// Nothing in cpp/core or cpp/host throws across a boundary or aborts; every
// fallible function returns a Status, and the FFI handlers convert it to an
// ffi::Error exactly once. JO_CHECK propagates a failure and appends a
// "file:line" breadcrumb, so an error read in Python shows the path it took
// through the C++ (as NCCL's NCCLCHECK does: src/include/checks.h).
#pragma once

#include <string>
#include <utility>

namespace jo {

enum class Code : int {
  kOk = 0,
  kInvalidArgument,  // the caller passed something the program cannot run
  kTimeout,          // a wait ran past its deadline (a peer did not arrive)
  kAborted,          // the clique was broken by an earlier failure
  kInternal,         // a broken invariant of our own
  kResource,         // allocation failed
};

const char* CodeName(Code code);

class Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

  // Adds a breadcrumb (called by JO_CHECK on the way up).
  Status& Trail(const char* file, int line);
  std::string ToString() const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

inline Status OkStatus() { return Status(); }
Status InvalidArgument(std::string message);
Status Internal(std::string message);

// Strips directories: breadcrumbs stay short.
const char* BaseName(const char* path);

}  // namespace jo

// Returns the failure of `expr` to the caller with a file:line breadcrumb.
#define JO_CHECK(expr)                      \
  do {                                      \
    ::jo::Status jo_status_ = (expr);       \
    if (!jo_status_.ok()) {                 \
      jo_status_.Trail(__FILE__, __LINE__); \
      return jo_status_;                    \
    }                                       \
  } while (0)

// Returns an InvalidArgument / Internal status if `cond` does not hold.
#define JO_REQUIRE(cond, message)                                                 \
  do {                                                                            \
    if (!(cond)) return ::jo::InvalidArgument(message).Trail(__FILE__, __LINE__); \
  } while (0)

#define JO_ASSERT(cond)                                                                       \
  do {                                                                                        \
    if (!(cond)) return ::jo::Internal("invariant failed: " #cond).Trail(__FILE__, __LINE__); \
  } while (0)
