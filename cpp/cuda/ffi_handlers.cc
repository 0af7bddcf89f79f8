#include "cuda/ffi_handlers.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <optional>
#include <string>

#include "cuda/cuda_call.h"
#include "ffi/ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jo::cuda {
namespace {

using ffi_common::CheckResult;
using ffi_common::Invalid;
using ffi_common::ToFfi;

struct Attrs {
  int64_t clique_key, axis, axis_size;
  int32_t transport;
  int64_t chunks;
  bool bidirectional;
  int64_t timeout_ms;
  ffi::Span<const int64_t> devices, processes;
};

// Checks what both ops share and fills `args` (not the results).
ffi::Error Decode(Collective collective, cudaStream_t stream, int32_t device,
                  const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const Attrs& a,
                  CudaCallArgs* args) {
  const char* op = CollectiveName(collective);
  if (ffi::Error error = ffi_common::CheckOperands(op, x, w, a); error.failure()) return error;
  if (a.devices.size() != a.processes.size() || a.devices.size() == 0)
    return Invalid(op, "attributes devices/processes (the rank table) expected equal, non-zero lengths, got " +
                           std::to_string(a.devices.size()) + " and " + std::to_string(a.processes.size()));
  Problem& q = args->problem;
  if (ffi::Error error = ffi_common::FillProblem(collective, x, w, a, &q); error.failure())
    return error;
  args->clique_key = a.clique_key;
  args->table.axis_size = a.axis_size;
  args->table.devices.assign(a.devices.begin(), a.devices.end());
  args->table.processes.assign(a.processes.begin(), a.processes.end());
  args->process_index = ProcessIndex();
  args->timeout_ms = a.timeout_ms;
  args->device = device;
  args->stream = stream;
  args->io.x = x.untyped_data();
  args->io.w = w.untyped_data();
  return ffi::Error::Success();
}

ffi::Error Run(const CudaCallArgs& args) {
  try {
    return ToFfi(CudaCall(args));
  } catch (const std::exception& e) {  // bad_alloc and friends never cross the FFI boundary
    return ffi::Error::Internal(std::string(CollectiveName(args.problem.op)) + ": " + e.what());
  } catch (...) {
    return ffi::Error::Internal(std::string(CollectiveName(args.problem.op)) + ": unknown exception");
  }
}

ffi::Error AgMatmulImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> y,
                        std::optional<ffi::Result<ffi::AnyBuffer>> x_gathered, int64_t clique_key,
                        int64_t axis, int64_t axis_size, int32_t transport, int64_t chunks,
                        bool bidirectional, int64_t timeout_ms, ffi::Span<const int64_t> devices,
                        ffi::Span<const int64_t> processes) {
  const char* op = "ag_matmul";
  CudaCallArgs args;
  const Attrs a{clique_key, axis, axis_size, transport, chunks, bidirectional, timeout_ms, devices, processes};
  if (auto e = Decode(Collective::kAgMatmul, stream, device, x, w, a, &args); e.failure()) return e;
  const int64_t gathered = x.dimensions()[axis] * axis_size;
  if (auto e = CheckResult(op, "y", x, y->dimensions(), y->element_type(), axis, gathered, args.problem.n); e.failure()) return e;
  args.problem.return_gathered = x_gathered.has_value();
  if (x_gathered.has_value()) {
    if (auto e = CheckResult(op, "x_gathered", x, (*x_gathered)->dimensions(),
                                (*x_gathered)->element_type(), axis, gathered, args.problem.k); e.failure()) return e;
    args.io.x_gathered = (*x_gathered)->untyped_data();
  }
  args.io.y = y->untyped_data();
  return Run(args);
}

ffi::Error MatmulRsImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Result<ffi::AnyBuffer> y, int64_t clique_key, int64_t axis,
                        int64_t axis_size, int32_t transport, int64_t chunks, bool bidirectional,
                        int64_t timeout_ms, ffi::Span<const int64_t> devices,
                        ffi::Span<const int64_t> processes) {
  const char* op = "matmul_rs";
  CudaCallArgs args;
  const Attrs a{clique_key, axis, axis_size, transport, chunks, bidirectional, timeout_ms, devices, processes};
  if (auto e = Decode(Collective::kMatmulRs, stream, device, x, w, a, &args); e.failure()) return e;
  const int64_t scattered = x.dimensions()[axis] / axis_size;
  if (auto e = CheckResult(op, "y", x, y->dimensions(), y->element_type(), axis, scattered, args.problem.n); e.failure()) return e;
  args.io.y = y->untyped_data();
  return Run(args);
}

}  // namespace

// No traits: NOT command-buffer compatible (research/xla_ffi.md §2; and the
// CUDA plugin rejects traits passed at registration).
XLA_FFI_DEFINE_HANDLER(kAgMatmul, AgMatmulImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::DeviceOrdinal>()                 // local GPU ordinal
                           .Arg<ffi::AnyBuffer>()                     // x
                           .Arg<ffi::AnyBuffer>()                     // w
                           .Ret<ffi::AnyBuffer>()                     // y
                           .OptionalRet<ffi::AnyBuffer>()             // x_gathered
                           .Attr<int64_t>("clique_key")
                           .Attr<int64_t>("axis")
                           .Attr<int64_t>("axis_size")
                           .Attr<int32_t>("transport")
                           .Attr<int64_t>("chunks")
                           .Attr<bool>("bidirectional")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<ffi::Span<const int64_t>>("devices")
                           .Attr<ffi::Span<const int64_t>>("processes"));

XLA_FFI_DEFINE_HANDLER(kMatmulRs, MatmulRsImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()  // XLA's stream
                           .Ctx<ffi::DeviceOrdinal>()                 // local GPU ordinal
                           .Arg<ffi::AnyBuffer>()                     // x
                           .Arg<ffi::AnyBuffer>()                     // w
                           .Ret<ffi::AnyBuffer>()                     // y
                           .Attr<int64_t>("clique_key")
                           .Attr<int64_t>("axis")
                           .Attr<int64_t>("axis_size")
                           .Attr<int32_t>("transport")
                           .Attr<int64_t>("chunks")
                           .Attr<bool>("bidirectional")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<ffi::Span<const int64_t>>("devices")
                           .Attr<ffi::Span<const int64_t>>("processes"));

XLA_FFI_Error* AgMatmulHandler(XLA_FFI_CallFrame* call_frame) { return kAgMatmul(call_frame); }
XLA_FFI_Error* MatmulRsHandler(XLA_FFI_CallFrame* call_frame) { return kMatmulRs(call_frame); }

}  // namespace jo::cuda
