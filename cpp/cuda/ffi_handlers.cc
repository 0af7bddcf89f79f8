// The CUDA FFI handlers: jaxoverlap_cuda_<op> for every op of core/kinds.h
// (the same handler: the `op` attribute says which). ffi/ffi_call.h has their
// interface (no coords operand: the GPU handler finds its rank in the rank
// table from its device ordinal; the scale operands stay on the device:
// cuBLASLt reads them).
// instantiate makes the call site's state (a CudaSite); execute decodes and
// checks the operands and enqueues the call on XLA's stream. Nothing throws
// across this boundary.
//
// Two execute handlers, the same code: one without traits, for the programs
// whose host side must run at every call (host-side epochs in what they
// enqueue: a replay would reuse the epoch of the capture), and one
// command-buffer compatible (XLA FFI's kCmdBufferCompatible, compiled into the
// handler: XLA reads it from the handler's metadata), for the programs that
// replay: matmul_ar's kernel algorithms, whose flags and sequence numbers live
// on the device (docs/gpu-internals.md §7), and the programs built replayable
// (the `replayable` attribute: Problem::replayable, docs/gpu-internals.md §8).
// The lowering picks the target; each handler refuses a call whose program
// asks for the other (ffi_call.h CheckTarget).
#include "cuda/ffi_handlers.h"

#include <cuda_runtime_api.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>

#include "cuda/cuda_site.h"
#include "ffi/ffi_call.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jo::cuda {
namespace {

// The instantiate-stage state type ("jaxoverlap_cuda_call_site", platform CUDA).
using SiteState = ffi_call::SiteState<CudaSite>;

Status Run(bool command_buffer_compatible, cudaStream_t stream, int32_t device, CudaSite& site,
           const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& x_scale,
           const ffi::AnyBuffer& w_scale, const ffi::AnyBuffer& y, const ffi::AnyBuffer* gathered) {
  // The target the call came through is the one its program asks for (ffi_call.h CheckTarget).
  JO_CHECK(ffi_call::CheckTarget(site.desc(), command_buffer_compatible));
  Problem problem;
  CallBuffers io;
  JO_CHECK(
      ffi_call::DecodeOperands(site.desc(), x, w, x_scale, w_scale, y, gathered, &problem, &io));
  Caller caller;
  caller.process = ProcessIndex();
  caller.device = device;
  caller.naming = DeviceNaming::kLocalOrdinal;
  return site.Enqueue(caller, problem, io, stream);
}

// kCompatible: the handler is jaxoverlap_cuda_replayable's (the command-buffer trait).
template <bool kCompatible>
ffi::Error Execute(cudaStream_t stream, int32_t device, SiteState* state, ffi::AnyBuffer x,
                   ffi::AnyBuffer w, ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale,
                   ffi::Result<ffi::AnyBuffer> y,
                   std::optional<ffi::Result<ffi::AnyBuffer>> x_gathered) {
  const ffi::AnyBuffer* gathered = x_gathered.has_value() ? &**x_gathered : nullptr;
  try {  // bad_alloc and friends never cross the FFI boundary
    return ffi_call::ToFfi(
        Run(kCompatible, stream, device, state->site, x, w, x_scale, w_scale, *y, gathered));
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jaxoverlap: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("jaxoverlap: unknown exception");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kInstantiate, ffi_call::Instantiate<CudaSite>, ffi_call::BindInstantiate());
XLA_FFI_DEFINE_HANDLER(kExecute, Execute<false>,
                       ffi_call::BindResults(ffi_call::BindOperands<CudaSite>(
                           ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())));
XLA_FFI_DEFINE_HANDLER(kExecuteReplayable, Execute<true>,
                       ffi_call::BindResults(ffi_call::BindOperands<CudaSite>(
                           ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())),
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* frame) { return kInstantiate(frame); }
XLA_FFI_Error* ExecuteHandler(XLA_FFI_CallFrame* frame) { return kExecute(frame); }
XLA_FFI_Error* ExecuteReplayableHandler(XLA_FFI_CallFrame* frame) {
  return kExecuteReplayable(frame);
}

uint32_t HandlerTraits(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  if (handler(&frame) != nullptr) return ~0u;  // cannot happen with these struct sizes
  return metadata.traits;
}
void* SiteTypeId() { return &SiteState::id; }
const void* SiteTypeInfo() { return &SiteState::type_info; }

}  // namespace jo::cuda
