// The CUDA FFI handlers (cpp/cuda/ffi_handlers.cc), exported as capsules by
// the _cuda module and registered by jaxoverlap/_executors/runtime.py for platform CUDA.
#pragma once

#include <cstdint>

#include "xla/ffi/api/c_api.h"

namespace jo::cuda {

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* frame);
XLA_FFI_Error* ExecuteHandler(XLA_FFI_CallFrame* frame);
// The same, command-buffer compatible (XLA FFI's kCmdBufferCompatible trait, compiled in): the
// target of the programs that replay (ffi_handlers.cc).
XLA_FFI_Error* ExecuteReplayableHandler(XLA_FFI_CallFrame* frame);
// The traits a handler reports in its metadata (what XLA reads when it decides whether a call
// may be recorded into a command buffer): for tests and build_info().
uint32_t HandlerTraits(XLA_FFI_Handler* handler);
// The instantiate-stage state type: for jax.ffi.register_ffi_type.
void* SiteTypeId();
const void* SiteTypeInfo();

}  // namespace jo::cuda
