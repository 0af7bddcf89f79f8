// The CPU FFI handlers: jaxoverlap_<op> for every op of core/kinds.h (the
// same handler: the `op` attribute says which). ffi/ffi_call.h has their
// interface; the CPU call has a fifth operand, coords = (rank, group) from
// lax.axis_index, checked against the rank table. instantiate makes the call site's state (a
// HostSite, shared by every local device); execute decodes and checks the operands, starts the call
// (HostSite::Start) and returns an ffi::Future that a host worker completes, so the XLA device
// thread never blocks on peers. Nothing throws across this boundary; every failure is an ffi::Error
// naming the op, the operand and the expected vs actual value.
#include "host/ffi_handlers.h"

#include <memory>
#include <optional>

#include "ffi/ffi_call.h"
#include "host/host_site.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jo::host {
namespace {

// The instantiate-stage state type ("jaxoverlap_call_site", platform cpu).
using SiteState = ffi_call::SiteState<HostSite>;

ffi::Future Failed(const Status& status) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(ffi_call::ToFfi(status));
  return future;
}

ffi::Future Execute(int32_t device, SiteState* state, ffi::AnyBuffer x, ffi::AnyBuffer w,
                    ffi::AnyBuffer x_scale, ffi::AnyBuffer w_scale, ffi::Buffer<ffi::S32> coords,
                    ffi::Result<ffi::AnyBuffer> y,
                    std::optional<ffi::Result<ffi::AnyBuffer>> x_gathered) {
  HostSite& site = state->site;
  Problem problem;
  CallBuffers io;
  const ffi::AnyBuffer* gathered = x_gathered.has_value() ? &**x_gathered : nullptr;
  Status decoded =
      ffi_call::DecodeOperands(site.desc(), x, w, x_scale, w_scale, *y, gathered, &problem, &io);
  if (!decoded.ok()) return Failed(decoded);
  if (coords.element_count() != 2)
    return Failed(InvalidArgument(std::string(CollectiveName(problem.op)) +
                                  ": operand coords expected int32[2] (rank, group), got " +
                                  ffi_call::Dims(coords.dimensions())));
  Caller caller;
  caller.process = ProcessIndex();
  caller.device = device;
  caller.naming = DeviceNaming::kGlobalId;
  caller.rank = coords.typed_data()[0];
  caller.group = coords.typed_data()[1];
  ffi::Promise promise;
  ffi::Future future(promise);
  // A host worker completes the future (never the calling thread of a peer:
  // completing runs XLA's continuation of this device).
  site.Start(caller, problem, io, [promise](const Status& status) mutable {
    if (status.ok()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ffi_call::ToFfi(status));
    }
  });
  return future;
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kInstantiate, ffi_call::Instantiate<HostSite>, ffi_call::BindInstantiate());
XLA_FFI_DEFINE_HANDLER(kExecute, Execute,
                       ffi_call::BindResults(ffi_call::BindOperands<HostSite>(ffi::Ffi::Bind())
                                                 .Arg<ffi::Buffer<ffi::S32>>()));  // coords

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* frame) { return kInstantiate(frame); }
XLA_FFI_Error* ExecuteHandler(XLA_FFI_CallFrame* frame) { return kExecute(frame); }
void* SiteTypeId() { return &SiteState::id; }
const void* SiteTypeInfo() { return &SiteState::type_info; }

}  // namespace jo::host
