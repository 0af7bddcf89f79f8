// The CPU FFI handlers (cpp/host/ffi_handlers.cc), exported as capsules by
// the _host module and registered by jaxoverlap/_executors/runtime.py.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jo::host {

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* ExecuteHandler(XLA_FFI_CallFrame* frame);
// The instantiate-stage state type: for jax.ffi.register_ffi_type.
void* SiteTypeId();
const void* SiteTypeInfo();

}  // namespace jo::host
