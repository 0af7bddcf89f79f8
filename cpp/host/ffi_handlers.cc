// The CPU FFI handlers: decode and check operands, then StartHostCall.
//
// Interface (identical for both targets except the optional second result):
//   operands  x, w, coords: int32[2] = (rank, group)
//   results   y [, x_gathered (ag_matmul, when return_gathered)]
//   attrs     clique_key i64, axis i64, axis_size i64, transport i32,
//             chunks i64, bidirectional bool, timeout_ms i64,
//             devices i64[] (rank table in (group, rank) order, or empty)
// Handlers never throw; every failure is an ffi::Error naming the op, the
// operand, and the expected vs actual value.
//
// Stages: instantiate (once per call site per executable, shared by every
// local device) creates a CallSite state that names the call site; execute
// checks the operands, starts the call (StartHostCall) and returns an
// ffi::Future that a host worker completes, so the XLA device thread never
// blocks on peers (docs/native.md §4). Every stage declares every attribute.
#include "host/ffi_handlers.h"

#include <optional>
#include <string>

#include "host/host_call.h"
#include "ffi/ffi_common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jo::host {

// The instantiate-stage state: one per call site, seen by every device.
struct CallSite {
  static ffi::TypeId id;
  int64_t clique_key = 0;
  int64_t site = 0;
  CallSite(int64_t key, int64_t s) : clique_key(key), site(s) {}
  ~CallSite() { ForgetCallSite(clique_key, site); }
};
ffi::TypeId CallSite::id = {};

namespace {

const XLA_FFI_TypeInfo kCallSiteTypeInfo = ffi::MakeTypeInfo<CallSite>();

using ffi_common::CheckResult;
using ffi_common::Dims;
using ffi_common::Invalid;
using ffi_common::ToFfi;

struct Attrs {
  int64_t clique_key, axis, axis_size;
  int32_t transport;
  int64_t chunks;
  bool bidirectional;
  int64_t timeout_ms;
  ffi::Span<const int64_t> devices;
};

// Checks everything common to both ops and fills `args` (not the buffers).
ffi::Error CheckCommon(Collective collective, int32_t device_ordinal, const ffi::AnyBuffer& x,
                       const ffi::AnyBuffer& w, const ffi::Buffer<ffi::S32>& coords,
                       const Attrs& a, CallArgs* args) {
  const char* op = CollectiveName(collective);
  if (ffi::Error error = ffi_common::CheckOperands(op, x, w, a); error.failure()) return error;
  if (coords.element_count() != 2) return Invalid(op, "operand coords expected int32[2] (rank, group), got shape " + Dims(coords.dimensions()));
  const int32_t* c = coords.typed_data();
  const int64_t rank = c[0], group = c[1];
  if (rank < 0 || rank >= a.axis_size) return Invalid(op, "operand coords: rank expected in [0, " + std::to_string(a.axis_size) + "), got " + std::to_string(rank));
  if (group < 0) return Invalid(op, "operand coords: group expected >= 0, got " + std::to_string(group));
  if (a.devices.size() != 0) {
    const int64_t index = group * a.axis_size + rank;
    if (static_cast<int64_t>(a.devices.size()) % a.axis_size != 0 || index >= static_cast<int64_t>(a.devices.size()))
      return Invalid(op, "attribute devices (" + std::to_string(a.devices.size()) + " entries) has no entry for group " + std::to_string(group) + ", rank " + std::to_string(rank));
    if (a.devices[index] != device_ordinal)
      return Invalid(op, "device mismatch: the rank table puts device " + std::to_string(a.devices[index]) + " at (group " + std::to_string(group) + ", rank " + std::to_string(rank) + "), but this call runs on device " + std::to_string(device_ordinal));
  }

  Problem& q = args->problem;
  if (ffi::Error error = ffi_common::FillProblem(collective, x, w, a, &q); error.failure())
    return error;
  q.rank = static_cast<int32_t>(rank);
  args->clique_key = a.clique_key;
  args->group = group;
  args->timeout_ms = a.timeout_ms;
  args->device = device_ordinal;
  return ffi::Error::Success();
}

// Starts the call; a host worker completes the future (never the calling
// thread of a peer: completing runs XLA's continuation of this device).
ffi::Future Start(const CallArgs& args) {
  ffi::Promise promise;
  ffi::Future future(promise);
  StartHostCall(args, [promise](const Status& status) mutable {
    if (status.ok()) promise.SetAvailable();
    else promise.SetError(ToFfi(status));
  });
  return future;
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

ffi::ErrorOr<std::unique_ptr<CallSite>> InstantiateImpl(
    ffi::RemainingArgs, ffi::RemainingRets, int64_t clique_key, int64_t, int64_t, int32_t, int64_t, bool, int64_t,
    ffi::Span<const int64_t>) {
  return std::make_unique<CallSite>(clique_key, NewCallSite(clique_key));
}

ffi::Future AgMatmulImpl(int32_t device_ordinal, CallSite* site, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                        std::optional<ffi::Result<ffi::AnyBuffer>> x_gathered, int64_t clique_key,
                        int64_t axis, int64_t axis_size, int32_t transport, int64_t chunks,
                        bool bidirectional, int64_t timeout_ms, ffi::Span<const int64_t> devices) {
  const char* op = "ag_matmul";
  CallArgs args;
  const Attrs a{clique_key, axis, axis_size, transport, chunks, bidirectional, timeout_ms, devices};
  if (auto e = CheckCommon(Collective::kAgMatmul, device_ordinal, x, w, coords, a, &args); e.failure()) return Failed(e);
  const int64_t gathered_dim = x.dimensions()[axis] * axis_size;
  if (auto e = CheckResult(op, "y", x, y->dimensions(), y->element_type(), axis, gathered_dim, args.problem.n); e.failure()) return Failed(e);
  args.problem.return_gathered = x_gathered.has_value();
  if (x_gathered.has_value()) {
    auto& g = *x_gathered;
    if (auto e = CheckResult(op, "x_gathered", x, g->dimensions(), g->element_type(), axis, gathered_dim, args.problem.k); e.failure()) return Failed(e);
    args.io.x_gathered = g->untyped_data();
  }
  args.io.x = x.untyped_data();
  args.io.w = w.untyped_data();
  args.io.y = y->untyped_data();
  args.site = site->site;
  return Start(args);
}

ffi::Future MatmulRsImpl(int32_t device_ordinal, CallSite* site, ffi::AnyBuffer x, ffi::AnyBuffer w,
                        ffi::Buffer<ffi::S32> coords, ffi::Result<ffi::AnyBuffer> y,
                        int64_t clique_key, int64_t axis, int64_t axis_size, int32_t transport,
                        int64_t chunks, bool bidirectional, int64_t timeout_ms,
                        ffi::Span<const int64_t> devices) {
  const char* op = "matmul_rs";
  CallArgs args;
  const Attrs a{clique_key, axis, axis_size, transport, chunks, bidirectional, timeout_ms, devices};
  if (auto e = CheckCommon(Collective::kMatmulRs, device_ordinal, x, w, coords, a, &args); e.failure()) return Failed(e);
  const int64_t scattered_dim = x.dimensions()[axis] / axis_size;
  if (auto e = CheckResult(op, "y", x, y->dimensions(), y->element_type(), axis, scattered_dim, args.problem.n); e.failure()) return Failed(e);
  args.io.x = x.untyped_data();
  args.io.w = w.untyped_data();
  args.io.y = y->untyped_data();
  args.site = site->site;
  return Start(args);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER(kAgMatmul, AgMatmulImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::DeviceOrdinal>()             // global device id on CPU
                           .Ctx<ffi::State<CallSite>>()           // from the instantiate stage
                           .Arg<ffi::AnyBuffer>()                 // x
                           .Arg<ffi::AnyBuffer>()                 // w
                           .Arg<ffi::Buffer<ffi::S32>>()          // coords = (rank, group)
                           .Ret<ffi::AnyBuffer>()                 // y
                           .OptionalRet<ffi::AnyBuffer>()         // x_gathered
                           .Attr<int64_t>("clique_key")
                           .Attr<int64_t>("axis")
                           .Attr<int64_t>("axis_size")
                           .Attr<int32_t>("transport")
                           .Attr<int64_t>("chunks")
                           .Attr<bool>("bidirectional")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<ffi::Span<const int64_t>>("devices"));

XLA_FFI_DEFINE_HANDLER(kMatmulRs, MatmulRsImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::DeviceOrdinal>()             // global device id on CPU
                           .Ctx<ffi::State<CallSite>>()           // from the instantiate stage
                           .Arg<ffi::AnyBuffer>()                 // x
                           .Arg<ffi::AnyBuffer>()                 // w
                           .Arg<ffi::Buffer<ffi::S32>>()          // coords = (rank, group)
                           .Ret<ffi::AnyBuffer>()                 // y
                           .Attr<int64_t>("clique_key")
                           .Attr<int64_t>("axis")
                           .Attr<int64_t>("axis_size")
                           .Attr<int32_t>("transport")
                           .Attr<int64_t>("chunks")
                           .Attr<bool>("bidirectional")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<ffi::Span<const int64_t>>("devices"));

// Both targets have the same attributes, so they share one instantiate handler.
XLA_FFI_DEFINE_HANDLER(kInstantiate, InstantiateImpl,
                       ffi::Ffi::BindInstantiate()
                           .RemainingArgs()   // none on jax 0.10.2, placeholders on newer XLA
                           .RemainingRets()
                           .Attr<int64_t>("clique_key")
                           .Attr<int64_t>("axis")
                           .Attr<int64_t>("axis_size")
                           .Attr<int32_t>("transport")
                           .Attr<int64_t>("chunks")
                           .Attr<bool>("bidirectional")
                           .Attr<int64_t>("timeout_ms")
                           .Attr<ffi::Span<const int64_t>>("devices"));

XLA_FFI_Error* InstantiateHandler(XLA_FFI_CallFrame* call_frame) { return kInstantiate(call_frame); }
XLA_FFI_Error* AgMatmulHandler(XLA_FFI_CallFrame* call_frame) { return kAgMatmul(call_frame); }
XLA_FFI_Error* MatmulRsHandler(XLA_FFI_CallFrame* call_frame) { return kMatmulRs(call_frame); }

void* CallSiteTypeId() { return &CallSite::id; }
const void* CallSiteTypeInfo() { return &kCallSiteTypeInfo; }

}  // namespace jo::host
