// jaxoverlap._host: the always-built native module.
//
// At this stage it reports what it was built with, so `jo.info()` can tell a
// user which native build they have; the host executor and its FFI handlers
// are added to this module by the native path.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

std::string CompilerName() {
#if defined(__clang__)
  return std::string("clang ") + __clang_version__;
#elif defined(__GNUC__)
  return "gcc " + std::to_string(__GNUC__) + "." + std::to_string(__GNUC_MINOR__) + "." +
         std::to_string(__GNUC_PATCHLEVEL__);
#else
  return "unknown";
#endif
}

nb::dict BuildInfo() {
  nb::dict info;
  info["version"] = JO_VERSION;
  info["compiler"] = CompilerName();
  info["cxx_standard"] = static_cast<long>(__cplusplus);
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  info["jaxlib_headers"] = JO_JAXLIB_VERSION;
  info["blas"] = JO_BLAS_NAME;
  return info;
}

}  // namespace

NB_MODULE(_host, m) {
  m.doc() = "jaxoverlap host extension: build information (native executor to come).";
  m.attr("__version__") = JO_VERSION;
  m.def("build_info", &BuildInfo, "What this extension was built with.");
}
