// XLA FFI handlers for the cpu platform (targets jaxoverlap_ag_matmul and
// jaxoverlap_matmul_rs). Defined in ffi_handlers.cc; this header only
// declares the handler symbols for the nanobind module. The instantiate
// handler is shared by both targets.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jo::host {

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* call_frame);  // both targets
XLA_FFI_Error* AgMatmulHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MatmulRsHandler(XLA_FFI_CallFrame* call_frame);

// The instantiate-stage state type, registered as "jaxoverlap_call_site":
// its XLA_FFI_TypeId (in-out, filled by the registration) and TypeInfo.
void* CallSiteTypeId();
const void* CallSiteTypeInfo();

}  // namespace jo::host
