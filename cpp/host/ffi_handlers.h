// XLA FFI handlers for the cpu platform (targets jaxoverlap_ag_matmul and
// jaxoverlap_matmul_rs). Defined in ffi_handlers.cc; this header only
// declares the handler symbols for the nanobind module.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jo::host {

XLA_FFI_Error* AgMatmulHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MatmulRsHandler(XLA_FFI_CallFrame* call_frame);

}  // namespace jo::host
