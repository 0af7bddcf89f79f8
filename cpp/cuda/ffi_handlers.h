// The CUDA FFI handlers (platform "CUDA"): decode and check operands, then CudaCall.
//
// Interface (docs/gpu.md):
//   context   XLA's stream (PlatformStream<cudaStream_t>), DeviceOrdinal (local ordinal)
//   operands  x, w            (no coords operand: a device scalar would need a host sync)
//   results   y [, x_gathered (ag_matmul, when return_gathered)]
//   attrs     clique_key i64, axis i64, axis_size i64, transport i32, chunks i64,
//             bidirectional bool, timeout_ms i64,
//             devices i64[] / processes i64[]: the rank table in (group, rank) order
// Not command-buffer compatible (no traits): see cuda_call.cc.
#pragma once

#include "xla/ffi/api/c_api.h"

namespace jo::cuda {

XLA_FFI_Error* AgMatmulHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* MatmulRsHandler(XLA_FFI_CallFrame* call_frame);

}  // namespace jo::cuda
