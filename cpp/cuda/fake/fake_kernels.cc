// Host equivalents of the device kernels (kernels.h), for the fake build
// only: each launch is range-checked and enqueued on the fake stream, and
// runs in stream order like the kernel would. The multicast ones resolve the
// multicast address to every bound device's memory, which is what
// multimem.st / multimem.ld_reduce do in hardware.
#include <cstring>
#include <string>
#include <vector>

#include "core/convert.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/kernels.h"

namespace jo::cuda {
namespace {

size_t Span(const BlockArgs& a, bool src) {
  const int64_t bs = src ? a.src_batch_stride : a.dst_batch_stride;
  const int64_t ld = src ? a.src_ld : a.dst_ld;
  return static_cast<size_t>(((a.batch - 1) * bs + (a.m - 1) * ld + a.n) * DTypeSize(a.dtype));
}

Status Refuse(const ErrorContext& ctx, const std::string& what) {
  fake::Fail(what);
  return Status(Code::kInternal, ctx.Describe() + ": " + what);
}

Status CheckLaunch(const char* name, cudaStream_t stream, const ErrorContext& ctx) {
  fake::Count(name);
  const int device = fake::StreamDevice(stream);
  if (device < 0) return Refuse(ctx, std::string(name) + ": unknown stream");
  if (device != fake::CurrentDevice())
    return Refuse(ctx, std::string(name) + ": launched on a stream of device " +
                           std::to_string(device) + " while device " +
                           std::to_string(fake::CurrentDevice()) + " is current");
  return OkStatus();
}

Status CheckMulticast(const char* name, const BlockArgs& a, const ErrorContext& ctx) {
  if (fake::DeviceCc(fake::CurrentDevice()) < 9)
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": " + name + " needs an sm_90 (Hopper) or newer GPU");
  if (!MulticastBlockOk(a))
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": " + name + " on 16-bit data needs an even row width");
  return OkStatus();
}

template <typename F>
void ForEach(const BlockArgs& a, F&& f) {
  for (int64_t b = 0; b < a.batch; ++b)
    for (int64_t i = 0; i < a.m; ++i)
      for (int64_t j = 0; j < a.n; ++j)
        f(b * a.src_batch_stride + i * a.src_ld + j, b * a.dst_batch_stride + i * a.dst_ld + j);
}

}  // namespace

Status LaunchAddBlock(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  JO_CHECK(CheckLaunch("AddBlock", stream, ctx));
  if (!fake::CheckRange(a.src, Span(a, true), "AddBlock src") ||
      !fake::CheckRange(a.dst, Span(a, false), "AddBlock dst"))
    return Refuse(ctx, "AddBlock: out of range");
  fake::Enqueue(stream, "AddBlock", [a] {
    ForEach(a, [&](int64_t s, int64_t d) {
      StoreElement(a.dtype, a.dst, d,
                   LoadElement(a.dtype, a.dst, d) + LoadElement(a.dtype, a.src, s));
    });
  });
  return OkStatus();
}

Status LaunchMcStore(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  JO_CHECK(CheckLaunch("McStore", stream, ctx));
  JO_CHECK(CheckMulticast("multicast store (multimem.st)", a, ctx));
  std::vector<std::byte*> targets;
  if (!fake::CheckRange(a.src, Span(a, true), "McStore src") ||
      !fake::MulticastTargets(a.dst, Span(a, false), &targets))
    return Refuse(ctx, "McStore: source out of range or destination not a bound multicast address");
  fake::Enqueue(stream, "McStore", [a, targets] {
    const size_t es = static_cast<size_t>(DTypeSize(a.dtype));
    for (std::byte* t : targets)
      ForEach(a, [&](int64_t s, int64_t d) {
        std::memcpy(t + d * es, static_cast<const std::byte*>(a.src) + s * es, es);
      });
  });
  return OkStatus();
}

Status LaunchMcReduce(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  JO_CHECK(CheckLaunch("McReduce", stream, ctx));
  JO_CHECK(CheckMulticast("multicast load-reduce (multimem.ld_reduce)", a, ctx));
  std::vector<std::byte*> sources;
  if (!fake::CheckRange(a.dst, Span(a, false), "McReduce dst") ||
      !fake::MulticastTargets(a.src, Span(a, true), &sources))
    return Refuse(ctx,
                  "McReduce: destination out of range or source not a bound multicast address");
  fake::Enqueue(stream, "McReduce", [a, sources] {
    ForEach(a, [&](int64_t s, int64_t d) {
      float sum = 0.0f;  // acc::f32, as the .acc::f32 instructions
      for (const std::byte* src : sources) sum += LoadElement(a.dtype, src, s);
      StoreElement(a.dtype, a.dst, d, sum);
    });
  });
  return OkStatus();
}

const char* KernelsDescription() { return "host equivalents (fake build)"; }

}  // namespace jo::cuda
