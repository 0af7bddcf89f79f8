// The CUDA FFI handlers (cpp/cuda/ffi_handlers.cc), exported as capsules by
// the _cuda module and registered by jaxoverlap/_executors/runtime.py for platform CUDA.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jo::cuda {

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* ExecuteHandler(XLA_FFI_CallFrame* frame);
// The instantiate-stage state type: for jax.ffi.register_ffi_type.
void* SiteTypeId();
const void* SiteTypeInfo();

}  // namespace jo::cuda
