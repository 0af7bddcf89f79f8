#include "cuda/kernels/allreduce_launch.h"

#include <string>

#include "core/allreduce_layout.h"
#include "cuda/kernels/allreduce_table.h"
#include "cuda/kernels/kernels.h"

namespace jo::cuda {
namespace {

using kernel::Elem;

Elem ElemOf(DType dtype) {
  return dtype == DType::kBF16 ? Elem::kBF16 : dtype == DType::kF16 ? Elem::kF16 : Elem::kF32;
}

constexpr const char* kMulticastName = "one-launch all-reduce over multicast (multimem)";

// What the flags carry: the call's signature with the access width mixed in. Each rank picks
// its width from its own y's address, and the width sets how y is split among the blocks; two
// ranks with different widths would each read what the other's blocks released under flags it
// never acquired. With the width in the signature their flags disagree (kDisagree) instead.
// Never 0 (a zeroed flag's) nor kBrokenSignature (a rank that gave up).
uint32_t FlagSignature(uint32_t signature, int access) {
  uint32_t h = signature ^ (static_cast<uint32_t>(access) * 0x9E3779B1u);
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  return h == 0 || h == kernel::ar::kBrokenSignature ? 1u : h;
}

}  // namespace

int AllReduceAccessBytes(DType dtype, bool multicast, const void* y, int64_t bytes) {
  const auto address = reinterpret_cast<uintptr_t>(y);
  for (int access : {16, 4, 2}) {
    if (access < DTypeSize(dtype) || (multicast && access < 4)) continue;
    if (bytes % access == 0 && address % static_cast<uintptr_t>(access) == 0) return access;
  }
  return 0;
}

Status PrepareAllReduce(const AllReduceCall& call, int device, const ErrorContext& ctx,
                        PreparedAllReduce* out) {
  const std::string what = ctx.Describe() + ": one-launch all-reduce";
  if (call.dtype != DType::kF32 && call.dtype != DType::kBF16 && call.dtype != DType::kF16)
    return InvalidArgument(what + " sums float32, bfloat16 or float16, not " +
                           DTypeName(call.dtype));
  if (call.nranks < 2 || call.nranks > allreduce::kMaxRanks || call.rank < 0 ||
      call.rank >= call.nranks)
    return InvalidArgument(what + ": " + std::to_string(call.nranks) + " ranks (it runs on 2 to " +
                           std::to_string(allreduce::kMaxRanks) + ")");
  if (static_cast<int32_t>(call.area.size()) != call.nranks ||
      static_cast<int32_t>(call.state.size()) != call.nranks || call.fault == nullptr ||
      (call.multicast && call.mc == nullptr))
    return Internal(what + ": its area, state or fault record is missing");
  if (call.timeout_ns <= 0)
    return InvalidArgument(what + ": timeout_ns " + std::to_string(call.timeout_ns) +
                           " <= 0: its waits would give up at once (no wait may be unbounded: "
                           "give a positive timeout)");
  const int access = AllReduceAccessBytes(call.dtype, call.multicast, call.y, call.bytes);
  if (access == 0)
    return InvalidArgument(what + " over multicast moves whole 32-bit words: y (" +
                           std::to_string(call.bytes) +
                           " bytes) needs an even number of 16-bit elements and a 4-byte aligned "
                           "address; use transport='p2p'");
  const int64_t slot =
      allreduce::SlotBytes(call.multicast, call.two_shot, call.nranks, call.bytes, access);
  if (slot == 0)
    return InvalidArgument(what + ": y's " + std::to_string(call.bytes) +
                           " bytes do not fit the kernel's area (" +
                           std::to_string(allreduce::kAreaBytes) +
                           " bytes per half); the plan offers it only below that");
  int sms = 0;
  JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (sms < allreduce::kBlocks)
    return InvalidArgument(what + ": its " + std::to_string(allreduce::kBlocks) +
                           " blocks wait for each other's peers and must all be resident, but "
                           "GPU " +
                           std::to_string(device) + " has " + std::to_string(sms) +
                           " SMs; use algorithm='one_shot' or 'two_shot'");
  const void* k = call.multicast ? kernel::AllReduceMulticastKernel(ElemOf(call.dtype), access)
                                 : kernel::AllReducePeerKernel(ElemOf(call.dtype), access);
  JO_ASSERT(k != nullptr);
  JO_CHECK(PrepareKernel(k, call.multicast ? kMulticastName : nullptr, ctx,
                         "the one-launch all-reduce kernel"));
  kernel::ar::Args& a = out->args;
  a = kernel::ar::Args{};
  a.nranks = call.nranks;
  a.rank = call.rank;
  a.algorithm = call.two_shot ? kernel::ar::Algorithm::kTwoShot : kernel::ar::Algorithm::kOneShot;
  a.accesses = call.bytes / access;
  a.y = call.y;
  for (int32_t j = 0; j < call.nranks; ++j) {
    a.area[j] = reinterpret_cast<char*>(call.area[static_cast<size_t>(j)]);
    a.state[j] = call.state[static_cast<size_t>(j)];
  }
  a.mc = reinterpret_cast<char*>(call.mc);
  a.area_bytes = allreduce::kAreaBytes;
  a.slot_bytes = slot;
  a.fault = call.fault;
  a.signature = FlagSignature(call.signature, access);
  a.timeout_ns = call.timeout_ns;
  out->kernel = k;
  out->access = access;
  return OkStatus();
}

Status LaunchAllReduce(const PreparedAllReduce& prepared, cudaStream_t stream,
                       const ErrorContext& ctx) {
  kernel::ar::Args args = prepared.args;
  void* params[] = {&args};
  JO_CUDA_CHECK(&ctx, cudaLaunchKernel(prepared.kernel, dim3(allreduce::kBlocks),
                                       dim3(allreduce::kThreads), params, 0, stream));
  return OkStatus();
}

}  // namespace jo::cuda
