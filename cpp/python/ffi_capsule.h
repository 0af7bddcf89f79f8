// An XLA FFI handler as the capsule jax.ffi.register_ffi_target takes; the
// static_assert keeps anything but a handler out.
#pragma once

#include <nanobind/nanobind.h>

#include <type_traits>

#include "xla/ffi/api/c_api.h"

namespace jo::python {

template <typename Fn>
nanobind::capsule Encapsulate(Fn* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Fn, XLA_FFI_CallFrame*>,
                "Encapsulate takes an XLA FFI handler");
  return nanobind::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace jo::python
