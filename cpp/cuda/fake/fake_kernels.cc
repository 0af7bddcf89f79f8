// The fake's kernels: the SAME per-thread bodies as the GPU (cuda/kernels/kernel_body.h)
// run on the host for every thread of the grid, in stream order, with FakeOps
// modelling what only a GPU has. Also cudaLaunchKernel and cudaFuncGetAttributes,
// which kernels_common.cc (shared with the GPU build) calls.
//
// Rules modelled, each from the CUDA documentation:
//  * Which compiled variant a device runs (SelectKernelVariant). "A cubin
//    generated for a certain compute capability is supported to run on any GPU
//    with the same major revision and same or higher minor revision"; "PTX is
//    supported to run on any GPU with compute capability higher than the compute
//    capability assumed for generation of that PTX"; "CUDA Runtime applications
//    containing both cubin and PTX code for a given architecture will
//    automatically use the cubin by default" (Blackwell Compatibility Guide,
//    "Application Compatibility on Blackwell Architecture",
//    https://docs.nvidia.com/cuda/blackwell-compatibility-guide/). Targets with
//    the suffix "a" (sm_90a) "include architecture-accelerated features that are
//    supported on the specified architecture only ... PTX code generated for such
//    targets cannot be run on later generation devices" (PTX ISA, "PTX Module
//    Directives: .target"); family targets "f" (sm_100f) run on the same major
//    revision with an equal or higher minor one (NVIDIA technical blog, "NVIDIA
//    Blackwell and NVIDIA CUDA 12.9 Introduce Family-Specific Architecture
//    Features"). Among several candidates the highest is taken. No variant:
//    cudaErrorNoKernelImageForDevice ("no kernel image available that is suitable
//    for the device", driver_types.h). cudaFuncGetAttributes reports the pick:
//    ptxVersion (the virtual architecture compiled from) and binaryVersion (the
//    device's, when JIT-compiled).
//  * A device trap is sticky. A multimem instruction in code compiled for less
//    than compute_90 is the device code's __trap() (cuda/kernels/device_ops.cuh); the
//    GPU reports cudaErrorIllegalInstruction, which "leaves the process in an
//    inconsistent state and any further CUDA work will return the same error"
//    (driver_types.h). The fake poisons the device's context: its queued work is
//    dropped and every later call on it fails (fake::Poison).
//  * Every access a thread makes must fall inside the span of the block the
//    launch describes (source, destination, or the bound multicast range),
//    checked at launch against the allocations and per access against the span:
//    stricter than a GPU (which faults only outside mapped memory), so that an
//    index bug is an error and not a silent write next door. A fault is sticky
//    (cudaErrorIllegalAddress).
//  * Every access is naturally aligned to its size: "the address must be
//    naturally aligned to a multiple of the access size" (PTX ISA, "Addresses
//    as Operands"; multimem refers to the same rule); otherwise the GPU faults
//    (sticky cudaErrorMisalignedAddress), and so does the fake.
#include "cuda/fake/fake_kernels.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/convert.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/fake/fake_waits.h"
#include "cuda/kernels/kernel_body.h"
#include "cuda/kernels/kernel_table.h"
#include "cuda/kernels/kernels.h"

namespace jo::fake {
namespace {

using cuda::kernel::Elem;
using cuda::kernel::Geometry;
using cuda::kernel::ReduceGeometry;
using cuda::kernel::Thread;
using cuda::kernel::Vec;

struct Trapped {};  // the device code's __trap()
struct Faulted {    // an access outside the launch's spans, or not naturally aligned
  cudaError_t code;
  std::string what;
};

// One kernel execution: its spans and, while tracing, what each thread did.
struct Execution {
  std::string kernel;
  int ptx_version = 0;
  std::byte* dst = nullptr;  // unicast destination span (nullptr: the multicast side)
  size_t dst_bytes = 0;
  const std::byte* src = nullptr;  // unicast source span
  size_t src_bytes = 0;
  const std::byte* mc = nullptr;  // multicast span, and the memory behind it on each device
  size_t mc_bytes = 0;
  char mc_region = 0;  // 'd' or 's'
  std::vector<std::byte*> targets;
  // A Reduce's sources (their spans; src above is unused).
  std::vector<std::pair<const std::byte*, size_t>> sources;
  Thread thread{};
  KernelTrace* trace = nullptr;
  bool unreleased_reported = false;  // a read of a fused GEMM's unreleased output, reported
};

// The arithmetic types (kF8 blocks are only stored as bits: no body converts them).
DType DTypeOf(Elem e) {
  return e == Elem::kF32 ? DType::kF32 : e == Elem::kBF16 ? DType::kBF16 : DType::kF16;
}

class FakeOps {
 public:
  explicit FakeOps(Execution* run) : run_(run) {}

  template <int kBytes>
  Vec<kBytes> Load(const void* p) {
    const auto* b = static_cast<const std::byte*>(p);
    Aligned(b, kBytes, "load");
    char region = 0;
    if (In(b, kBytes, run_->src, run_->src_bytes) || InSources(b, kBytes))
      region = 's';
    else if (In(b, kBytes, run_->dst, run_->dst_bytes))
      region = 'd';
    else
      throw Faulted{cudaErrorIllegalAddress,
                    "load of " + std::to_string(kBytes) + " bytes outside the block"};
    CheckReleased(b, kBytes, "kernel " + run_->kernel, &run_->unreleased_reported);
    Note('l', region, b, kBytes);
    Vec<kBytes> v{};
    std::memcpy(v.word, b, kBytes);
    return v;
  }

  template <int kBytes>
  void Store(void* p, const Vec<kBytes>& v) {
    auto* b = static_cast<std::byte*>(p);
    Aligned(b, kBytes, "store");
    if (!In(b, kBytes, run_->dst, run_->dst_bytes))
      throw Faulted{cudaErrorIllegalAddress,
                    "store of " + std::to_string(kBytes) + " bytes outside the destination"};
    Note('s', 'd', b, kBytes);
    std::memcpy(b, v.word, kBytes);
  }

  template <Elem kElem>
  float ToFloat(uint32_t bits) const {
    return LoadElement(DTypeOf(kElem), &bits, 0);  // little-endian: the low half is element 0
  }

  template <Elem kElem>
  uint32_t FromFloat(float value) const {
    uint32_t bits = 0;
    StoreElement(DTypeOf(kElem), &bits, 0, value);
    return bits;
  }

  // multimem.st: the value lands in every bound device's memory.
  template <Elem kElem, int kBytes>
  void MultimemStore(void* mc, const Vec<kBytes>& v) {
    RequireMultimem();
    const size_t offset = McOffset(mc, kBytes, "multimem.st");
    Note('m', run_->mc_region, static_cast<const std::byte*>(mc), kBytes);
    for (std::byte* t : run_->targets) std::memcpy(t + offset, v.word, kBytes);
  }

  // multimem.ld_reduce ... .add (.acc::f32 for 16-bit pairs): the sum over
  // every bound device's memory, accumulated in f32, rounded once.
  template <Elem kElem, int kBytes>
  Vec<kBytes> MultimemLoadReduce(const void* mc) {
    RequireMultimem();
    const size_t offset = McOffset(mc, kBytes, "multimem.ld_reduce");
    Note('r', run_->mc_region, static_cast<const std::byte*>(mc), kBytes);
    constexpr int kLanes = kBytes / cuda::kernel::ElemBytes(kElem);
    float sum[kLanes] = {};
    for (const std::byte* t : run_->targets) {
      CheckReleased(t + offset, kBytes, "kernel " + run_->kernel, &run_->unreleased_reported);
      Vec<kBytes> part{};
      std::memcpy(part.word, t + offset, kBytes);
      for (int i = 0; i < kLanes; ++i)
        sum[i] += ToFloat<kElem>(cuda::kernel::GetLane<kElem>(part, i));
    }
    Vec<kBytes> v{};
    for (int i = 0; i < kLanes; ++i) cuda::kernel::SetLane<kElem>(&v, i, FromFloat<kElem>(sum[i]));
    return v;
  }

  // Fences order only what the GPU reorders; the fake runs in program order.
  // Traced, so that tests see each thread issue them where the protocol needs them.
  void FenceProxyAlias() { Note('a', 0, nullptr, 0); }
  void FenceReleaseSys() { Note('f', 0, nullptr, 0); }

 private:
  static bool In(const std::byte* p, size_t bytes, const std::byte* lo, size_t span) {
    return lo != nullptr && p >= lo && p + bytes <= lo + span;
  }
  bool InSources(const std::byte* p, size_t bytes) const {
    for (const auto& [lo, span] : run_->sources)
      if (In(p, bytes, lo, span)) return true;
    return false;
  }

  // The device code has multimem only when compiled for compute_90 or newer;
  // otherwise it is the __trap() branch of cuda/device_ops.cuh.
  void RequireMultimem() const {
    if (run_->ptx_version < 90) throw Trapped{};
  }

  static void Aligned(const std::byte* p, size_t bytes, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
      throw Faulted{cudaErrorMisalignedAddress, std::string(what) + " of " + std::to_string(bytes) +
                                                    " bytes at an address not aligned to it"};
  }

  size_t McOffset(const void* mc, size_t bytes, const char* what) const {
    const auto* b = static_cast<const std::byte*>(mc);
    Aligned(b, bytes, what);
    if (!In(b, bytes, run_->mc, run_->mc_bytes))
      throw Faulted{cudaErrorIllegalAddress, std::string(what) + " outside the multicast block"};
    return static_cast<size_t>(b - run_->mc);
  }

  void Note(char op, char region, const std::byte* p, int bytes) {
    if (run_->trace == nullptr) return;
    const std::byte* base = region == 0                 ? p
                            : region == run_->mc_region ? run_->mc
                            : region == 'd'             ? run_->dst
                            : run_->src != nullptr      ? run_->src
                                                        : SourceBase(p);
    const Thread& t = run_->thread;
    run_->trace->accesses.push_back(
        {t.block_x, t.block_y, t.block_z, t.thread, op, region, p - base, bytes});
  }

  // The first byte of the Reduce source `p` lies in (trace offsets count from it).
  const std::byte* SourceBase(const std::byte* p) const {
    for (const auto& [lo, span] : run_->sources)
      if (In(p, 1, lo, span)) return lo;
    return p;
  }

  Execution* run_;
};

// ---- the host kernels behind kernel_table.h ----

enum class McSide { kNone, kDst, kSrc };

struct HostKernel {
  std::string op;      // "AddBlock", "Reduce", "McStore", "McReduce" (counted per launch)
  std::string name;    // op<element type, access width>
  std::string family;  // "add" or "multimem": a key of the kernel images
  McSide mc;
  int bytes;
  void (*run)(FakeOps&, const Geometry&, const Thread&);
  // A Reduce: its parameter is a ReduceGeometry, its threads run this instead of `run`.
  void (*run_reduce)(FakeOps&, const ReduceGeometry&, const Thread&) = nullptr;
  // A kernel with a launch of its own (the one-launch all-reduce, fake_allreduce.cc): called by
  // cudaLaunchKernel once the checks every launch shares passed.
  KernelLaunch launch = nullptr;
};

template <class Body>
void RunBody(FakeOps& ops, const Geometry& g, const Thread& t) {
  cuda::kernel::RunThread<Body>(ops, g, t);
}

const char* ElemName(Elem e) {
  return e == Elem::kF32 ? "f32" : e == Elem::kBF16 ? "bf16" : e == Elem::kF8 ? "f8" : "f16";
}

template <template <Elem, int> class Body, Elem kElem, int kBytes>
const HostKernel* Make(const char* name, const char* family, McSide mc) {
  static const HostKernel k{
      name,   std::string(name) + "<" + ElemName(kElem) + ", " + std::to_string(kBytes) + " bytes>",
      family, mc,
      kBytes, &RunBody<Body<kElem, kBytes>>};
  return &k;
}

template <template <Elem, int> class Body, Elem kElem>
const void* Pick(int bytes, const char* name, const char* family, McSide mc) {
  switch (bytes) {
    case 16:
      return Make<Body, kElem, 16>(name, family, mc);
    case 8:
      return Make<Body, kElem, 8>(name, family, mc);
    case 4:
      return Make<Body, kElem, 4>(name, family, mc);
    case 2:
      if constexpr (cuda::kernel::ElemBytes(kElem) == 2 &&
                    std::is_same_v<Body<kElem, 2>, cuda::kernel::AddBody<kElem, 2>>)
        return Make<Body, kElem, 2>(name, family, mc);
      return nullptr;
  }
  return nullptr;
}

template <template <Elem, int> class Body>
const void* For(Elem e, int bytes, const char* name, const char* family, McSide mc) {
  switch (e) {
    case Elem::kF32:
      return Pick<Body, Elem::kF32>(bytes, name, family, mc);
    case Elem::kBF16:
      return Pick<Body, Elem::kBF16>(bytes, name, family, mc);
    case Elem::kF16:
      return Pick<Body, Elem::kF16>(bytes, name, family, mc);
    case Elem::kF8:  // stored as bits only (kernel_body.h)
      if constexpr (std::is_same_v<Body<Elem::kF8, 4>, cuda::kernel::McStoreBody<Elem::kF8, 4>>)
        return Pick<Body, Elem::kF8>(bytes, name, family, mc);
      return nullptr;
  }
  return nullptr;
}

template <Elem kElem, int kBytes>
void RunReduceBody(FakeOps& ops, const ReduceGeometry& g, const Thread& t) {
  cuda::kernel::RunReduceThread<cuda::kernel::ReduceBody<kElem, kBytes>>(ops, g, t);
}

template <Elem kElem, int kBytes>
const HostKernel* MakeReduce() {
  static const HostKernel k{
      "Reduce",
      std::string("Reduce<") + ElemName(kElem) + ", " + std::to_string(kBytes) + " bytes>",
      "add",
      McSide::kNone,
      kBytes,
      nullptr,
      &RunReduceBody<kElem, kBytes>};
  return &k;
}

template <Elem kElem>
const void* PickReduce(int bytes) {
  switch (bytes) {
    case 16:
      return MakeReduce<kElem, 16>();
    case 8:
      return MakeReduce<kElem, 8>();
    case 4:
      return MakeReduce<kElem, 4>();
    case 2:
      if constexpr (cuda::kernel::ElemBytes(kElem) == 2) return MakeReduce<kElem, 2>();
      return nullptr;
  }
  return nullptr;
}

// Every handle handed out, so that a launch of anything else is refused.
std::mutex g_mu;
std::vector<const HostKernel*>& Known() {
  static auto* known = new std::vector<const HostKernel*>();
  return *known;
}
const void* Register(const void* k) {
  if (k == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  for (const HostKernel* h : Known())
    if (h == k) return k;
  Known().push_back(static_cast<const HostKernel*>(k));
  return k;
}
const HostKernel* Find(const void* k) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const HostKernel* h : Known())
    if (h == k) return h;
  return nullptr;
}

std::map<std::string, std::vector<std::string>>& Images() {
  static auto* images = new std::map<std::string, std::vector<std::string>>(cuda::KernelImages());
  return *images;
}

bool g_tracing = false;
std::vector<KernelTrace>& Traces() {
  static auto* traces = new std::vector<KernelTrace>();
  return *traces;
}

// "sm_90a" -> {cubin, 90, 'a'}; "compute_100f" -> {PTX, 100, 'f'}.
struct Image {
  bool cubin = false;
  int arch = 0;
  char suffix = 0;
};
bool Parse(const std::string& text, Image* out) {
  const bool cubin = text.rfind("sm_", 0) == 0;
  const bool ptx = text.rfind("compute_", 0) == 0;
  if (!cubin && !ptx) return false;
  std::string rest = text.substr(cubin ? 3 : 8);
  out->cubin = cubin;
  out->suffix = 0;
  if (!rest.empty() && (rest.back() == 'a' || rest.back() == 'f')) {
    out->suffix = rest.back();
    rest.pop_back();
  }
  if (rest.empty() || rest.find_first_not_of("0123456789") != std::string::npos) return false;
  out->arch = std::stoi(rest);
  return true;
}

bool Runs(const Image& im, int arch) {
  const bool same_major = im.arch / 10 == arch / 10;
  if (im.suffix == 'a') return im.arch == arch;
  if (im.cubin || im.suffix == 'f') return same_major && im.arch % 10 <= arch % 10;
  return im.arch <= arch;  // plain PTX: any later device
}

std::string Sm(int arch) { return "sm_" + std::to_string(arch); }

// The variant `kernel` runs on `device`, or cudaErrorNoKernelImageForDevice.
cudaError_t Variant(const HostKernel* k, int device, KernelVariant* v) {
  const auto& images = Images();
  auto it = images.find(k->family);
  const int arch = DeviceArch(device);
  if (it == images.end() || !SelectKernelVariant(it->second, arch, v))
    return cudaErrorNoKernelImageForDevice;
  return cudaSuccess;
}

}  // namespace

const void* FusedFunction(DType a, DType b, DType d) {
  // A handle with no body per instantiation: launched only by the fused GEMM's own launch
  // (fake_fused_gemm.cc). Handles live as long as the process (Known() keeps them).
  static std::mutex mu;
  static auto* handles = new std::map<std::tuple<DType, DType, DType>, HostKernel*>();
  std::lock_guard<std::mutex> lock(mu);
  HostKernel*& k = (*handles)[{a, b, d}];
  if (k == nullptr) {
    const std::string types =
        a == b && b == d ? std::string(DTypeName(a))
                         : std::string(DTypeName(a)) + " x " + DTypeName(b) + " -> " + DTypeName(d);
    k = new HostKernel{"FusedGemm", "FusedGemm<" + types + ">", "fused", McSide::kNone, 0, nullptr};
  }
  return Register(k);
}

const void* FusedFunctionSm100(DType dtype) {
  static const HostKernel bf16{
      "FusedGemmSm100", "FusedGemmSm100<bf16>", "fused_sm100", McSide::kNone, 0, nullptr};
  static const HostKernel f16{
      "FusedGemmSm100", "FusedGemmSm100<f16>", "fused_sm100", McSide::kNone, 0, nullptr};
  return Register(dtype == DType::kF16 ? &f16 : &bf16);
}

const void* RegisterKernel(const std::string& op, const std::string& name, const char* family,
                           KernelLaunch launch) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const HostKernel* h : Known())
    if (h->name == name) return h;
  auto* k = new HostKernel{op, name, family, McSide::kNone, 0, nullptr, nullptr, launch};
  Known().push_back(k);
  return k;
}

std::string FunctionName(const void* function) {
  const HostKernel* k = Find(function);
  return k == nullptr ? std::string("?") : k->name;
}

bool FunctionRuns(const void* function, int device) {
  const HostKernel* k = Find(function);
  KernelVariant v;
  return k != nullptr && Variant(k, device, &v) == cudaSuccess;
}

void SetKernelImages(const std::map<std::string, std::vector<std::string>>& images) {
  Images() = images;
}

const std::map<std::string, std::vector<std::string>>& KernelImagesInUse() { return Images(); }

bool SelectKernelVariant(const std::vector<std::string>& images, int arch, KernelVariant* out) {
  for (const bool cubin : {true, false}) {
    const Image* best = nullptr;
    std::vector<Image> parsed(images.size());
    size_t best_i = 0;
    for (size_t i = 0; i < images.size(); ++i) {
      if (!Parse(images[i], &parsed[i]) || parsed[i].cubin != cubin || !Runs(parsed[i], arch))
        continue;
      if (best == nullptr || parsed[i].arch > best->arch) {
        best = &parsed[i];
        best_i = i;
      }
    }
    if (best != nullptr) {
      out->image = images[best_i];
      out->jit = !cubin;
      out->ptx_version = best->arch;
      out->binary_version = cubin ? best->arch : arch;
      return true;
    }
  }
  return false;
}

void TraceKernels(bool on) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_tracing = on;
  if (!on) Traces().clear();
}

std::vector<KernelTrace> TakeKernelTraces() {
  std::lock_guard<std::mutex> lock(g_mu);
  std::vector<KernelTrace> out;
  out.swap(Traces());
  return out;
}

}  // namespace jo::fake

namespace jo::cuda::kernel {

const void* AddKernel(Elem e, int bytes) {
  return fake::Register(fake::For<AddBody>(e, bytes, "AddBlock", "add", fake::McSide::kNone));
}
const void* ReduceKernel(Elem e, int bytes) {
  switch (e) {
    case Elem::kF32:
      return fake::Register(fake::PickReduce<Elem::kF32>(bytes));
    case Elem::kBF16:
      return fake::Register(fake::PickReduce<Elem::kBF16>(bytes));
    case Elem::kF16:
      return fake::Register(fake::PickReduce<Elem::kF16>(bytes));
    case Elem::kF8:  // nothing sums fp8 (kernel_body.h)
      return nullptr;
  }
  return nullptr;
}
const void* McStoreKernel(Elem e, int bytes) {
  return fake::Register(
      fake::For<McStoreBody>(e, bytes, "McStore", "multimem", fake::McSide::kDst));
}
const void* McReduceKernel(Elem e, int bytes) {
  return fake::Register(
      fake::For<McReduceBody>(e, bytes, "McReduce", "multimem", fake::McSide::kSrc));
}

}  // namespace jo::cuda::kernel

namespace {

using jo::fake::HostKernel;

// Accesses from the block's first one to its last, in bytes.
size_t SpanBytes(const jo::cuda::kernel::Geometry& g, bool src, int bytes) {
  const int64_t bs = src ? g.src_batch_stride : g.dst_batch_stride;
  const int64_t ld = src ? g.src_ld : g.dst_ld;
  return static_cast<size_t>(((g.batch - 1) * bs + (g.rows - 1) * ld + g.cols) * bytes);
}

// Every thread of the grid runs `body` (the kernel's per-thread code), in block order; a trap or
// a fault poisons the device, as the GPU's sticky errors do; traced while tracing is on.
template <class Body>
void RunGrid(const HostKernel* k, const std::shared_ptr<jo::fake::Execution>& run, dim3 grid,
             int device, const std::string& variant, Body body) {
  jo::fake::KernelTrace trace;
  {
    std::lock_guard<std::mutex> lock(jo::fake::g_mu);
    if (jo::fake::g_tracing) run->trace = &trace;
  }
  trace.kernel = k->name;
  trace.variant = variant;
  trace.grid[0] = grid.x, trace.grid[1] = grid.y, trace.grid[2] = grid.z;
  trace.block[0] = jo::cuda::kernel::kThreads, trace.block[1] = trace.block[2] = 1;
  jo::fake::FakeOps ops(run.get());
  try {
    for (uint32_t bz = 0; bz < grid.z; ++bz)
      for (uint32_t by = 0; by < grid.y; ++by)
        for (uint32_t bx = 0; bx < grid.x; ++bx)
          for (uint32_t tx = 0; tx < static_cast<uint32_t>(jo::cuda::kernel::kThreads); ++tx) {
            run->thread = jo::cuda::kernel::Thread{
                bx,     by,     bz, grid.x,
                grid.y, grid.z, tx, static_cast<uint32_t>(jo::cuda::kernel::kThreads)};
            body(ops, run->thread);
          }
  } catch (const jo::fake::Trapped&) {
    jo::fake::Poison(device, cudaErrorIllegalInstruction,
                     k->name + " trapped on device " + std::to_string(device) + " (" +
                         jo::fake::Sm(jo::fake::DeviceArch(device)) + ", running " + variant +
                         "): multimem in code compiled for less than compute_90 is __trap()");
  } catch (const jo::fake::Faulted& f) {
    jo::fake::Poison(device, f.code, k->name + ": " + f.what);
  }
  if (run->trace != nullptr) {
    run->trace = nullptr;
    std::lock_guard<std::mutex> lock(jo::fake::g_mu);
    jo::fake::Traces().push_back(std::move(trace));
  }
}

// cudaLaunchKernel of a Reduce: its destination and each of its sources inside their
// allocations, a grid no larger than its SM budget holds, then the grid in stream order.
cudaError_t LaunchReduce(const HostKernel* k, dim3 grid, void** args, cudaStream_t stream,
                         int device, const jo::fake::KernelVariant& v) {
  using jo::fake::Fail;
  const auto g = std::make_shared<jo::cuda::kernel::ReduceGeometry>(
      *static_cast<const jo::cuda::kernel::ReduceGeometry*>(args[0]));  // copied at launch
  if (g->batch < 1 || g->rows < 1 || g->cols < 1 || g->count < 1 ||
      g->count > jo::cuda::kernel::kMaxReduceSources || g->sms < 0) {
    Fail("cudaLaunchKernel " + k->name + ": empty block, or no or too many sources");
    return cudaErrorInvalidValue;
  }
  const int64_t blocks = int64_t{grid.x} * grid.y * grid.z;
  if (g->sms > 0 && blocks > g->sms * jo::cuda::kBlocksPerSm) {
    Fail("cudaLaunchKernel " + k->name + ": a grid of " + std::to_string(blocks) +
         " blocks does not fit the " + std::to_string(g->sms) + " SMs it is sized to");
    return cudaErrorInvalidConfiguration;
  }
  if (!jo::fake::LoadFunction(device, k->name, "cudaLaunchKernel")) return cudaErrorUnknown;
  auto run = std::make_shared<jo::fake::Execution>();
  run->kernel = k->name;
  run->ptx_version = v.ptx_version;
  const auto span = [&](int64_t bs, int64_t ld) {
    return static_cast<size_t>(((g->batch - 1) * bs + (g->rows - 1) * ld + g->cols) * k->bytes);
  };
  run->dst = static_cast<std::byte*>(g->dst);
  run->dst_bytes = span(g->dst_batch_stride, g->dst_ld);
  const std::string what = "kernel " + k->name;
  bool ok = jo::fake::CheckRange(g->dst, run->dst_bytes, (what + " destination").c_str());
  for (int32_t i = 0; i < g->count; ++i) {
    const jo::cuda::kernel::ReduceSource& src = g->src[i];
    run->sources.emplace_back(static_cast<const std::byte*>(src.ptr),
                              span(src.batch_stride, src.ld));
    ok =
        ok && jo::fake::CheckRange(src.ptr, run->sources.back().second, (what + " source").c_str());
  }
  if (!ok) {
    Fail("cudaLaunchKernel " + k->name + ": a block outside its allocations");
    return cudaErrorInvalidValue;
  }
  jo::fake::EnqueueKernel(
      stream, k->name,
      [k, run, g, grid, device, variant = v.image] {
        RunGrid(k, run, grid, device, variant,
                [&](jo::fake::FakeOps& ops, const jo::cuda::kernel::Thread& t) {
                  k->run_reduce(ops, *g, t);
                });
      },
      g->sms);
  return cudaSuccess;
}

}  // namespace

// The compute capability (the launcher names it when it refuses a variant);
// any other attribute is not modelled.
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  jo::fake::Count("cudaDeviceGetAttribute");
  const int arch = jo::fake::DeviceArch(device);
  if (attr == cudaDevAttrComputeCapabilityMajor) {
    *value = arch / 10;
    return cudaSuccess;
  }
  if (attr == cudaDevAttrComputeCapabilityMinor) {
    *value = arch % 10;
    return cudaSuccess;
  }
  if (attr == cudaDevAttrMultiProcessorCount) {
    *value = jo::fake::DeviceSms(device);
    return cudaSuccess;
  }
  jo::fake::Fail("cudaDeviceGetAttribute: attribute " + std::to_string(static_cast<int>(attr)) +
                 " not modelled");
  return cudaErrorInvalidValue;
}

// cudaFuncGetAttributes: what the variant the current device runs was compiled for.
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, const void* func) {
  jo::fake::Count("cudaFuncGetAttributes");
  const HostKernel* k = jo::fake::Find(func);
  if (k == nullptr || attr == nullptr) {
    jo::fake::Fail("cudaFuncGetAttributes: not a kernel of this build");
    return cudaErrorInvalidDeviceFunction;
  }
  const int device = jo::fake::CurrentDevice();
  if (const cudaError_t sticky = jo::fake::StickyError(device); sticky != cudaSuccess)
    return sticky;
  jo::fake::KernelVariant v;
  if (const cudaError_t code = jo::fake::Variant(k, device, &v); code != cudaSuccess) return code;
  // It references the kernel: with lazy loading, that loads it (fake_waits.cc).
  if (!jo::fake::LoadFunction(device, k->name, "cudaFuncGetAttributes")) return cudaErrorUnknown;
  std::memset(attr, 0, sizeof(*attr));
  attr->ptxVersion = v.ptx_version;
  attr->binaryVersion = v.binary_version;
  attr->maxThreadsPerBlock = jo::cuda::kernel::kThreads;  // __launch_bounds__
  return cudaSuccess;
}

// cudaFuncSetAttribute: only the dynamic shared memory a kernel may use, at
// most what a block of the device may opt into (227 KB on compute capability
// 9.0: CUDA programming guide, "Compute Capabilities"). Recorded per device
// (of the played process): a function is loaded, and its attributes set, in
// each device's context; the fused launch checks it (fake_fused_gemm.cc).
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  jo::fake::Count("cudaFuncSetAttribute");
  const HostKernel* k = jo::fake::Find(func);
  if (k == nullptr || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > jo::fake::kMaxSharedBytesPerBlock) {
    jo::fake::Fail(
        "cudaFuncSetAttribute: not a kernel of this build, an attribute other than "
        "the dynamic shared memory, or more than a block may have");
    return cudaErrorInvalidValue;
  }
  jo::fake::NoteSharedMemoryGrant(func, value);
  return cudaSuccess;
}

// cudaLaunchKernel: checks what the launch describes, then enqueues the grid:
// every thread of every block runs the kernel's body, in stream order.
cudaError_t cudaLaunchKernel(const void* func, dim3 grid, dim3 block, void** args, size_t shared,
                             cudaStream_t stream) {
  using jo::fake::Fail;
  jo::fake::Count("cudaLaunchKernel");
  const HostKernel* k = jo::fake::Find(func);
  if (k == nullptr || (k->run == nullptr && k->run_reduce == nullptr && k->launch == nullptr) ||
      args == nullptr || args[0] == nullptr) {
    Fail(
        "cudaLaunchKernel: not a kernel of this build launched with cudaLaunchKernel, or no "
        "arguments");
    return cudaErrorInvalidDeviceFunction;
  }
  jo::fake::Count(k->op.c_str());
  const int device = jo::fake::StreamDevice(stream);
  if (device < 0) {
    Fail("cudaLaunchKernel " + k->name + ": unknown or default stream");
    return cudaErrorInvalidResourceHandle;
  }
  if (device != jo::fake::CurrentDevice()) {
    Fail("cudaLaunchKernel " + k->name + ": launched on a stream of device " +
         std::to_string(device) + " while device " + std::to_string(jo::fake::CurrentDevice()) +
         " is current");
    return cudaErrorInvalidResourceHandle;
  }
  if (const cudaError_t sticky = jo::fake::StickyError(device); sticky != cudaSuccess)
    return sticky;
  if (k->launch != nullptr) {
    jo::fake::KernelVariant v;
    if (const cudaError_t code = jo::fake::Variant(k, device, &v); code != cudaSuccess) return code;
    if (!jo::fake::LoadFunction(device, k->name, "cudaLaunchKernel")) return cudaErrorUnknown;
    return k->launch(k->name, v.ptx_version, grid, block, args, shared, stream);
  }
  // The launch configuration the kernels are built for (__launch_bounds__(kThreads)),
  // within the documented grid limits (y, z <= 65535).
  if (block.x != static_cast<unsigned>(jo::cuda::kernel::kThreads) || block.y != 1 ||
      block.z != 1 || shared != 0 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 ||
      grid.z > 65535) {
    Fail("cudaLaunchKernel " + k->name + ": launch configuration not the kernels' (grid " +
         std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" + std::to_string(grid.z) +
         ", block " + std::to_string(block.x) + "x" + std::to_string(block.y) + "x" +
         std::to_string(block.z) + ", shared " + std::to_string(shared) + ")");
    return cudaErrorInvalidConfiguration;
  }
  jo::fake::KernelVariant v;
  if (const cudaError_t code = jo::fake::Variant(k, device, &v); code != cudaSuccess) return code;
  if (k->run_reduce != nullptr) return LaunchReduce(k, grid, args, stream, device, v);
  // The kernel parameter is copied at launch, as CUDA does.
  const jo::cuda::kernel::Geometry g = *static_cast<const jo::cuda::kernel::Geometry*>(args[0]);
  if (g.batch < 1 || g.rows < 1 || g.cols < 1 || g.sms < 0) {
    Fail("cudaLaunchKernel " + k->name + ": empty block");
    return cudaErrorInvalidValue;
  }
  if (g.sms > 0 && int64_t{grid.x} * grid.y * grid.z > g.sms * jo::cuda::kBlocksPerSm) {
    Fail("cudaLaunchKernel " + k->name + ": a grid larger than the " + std::to_string(g.sms) +
         " SMs it is sized to hold");
    return cudaErrorInvalidConfiguration;
  }
  // With lazy loading, the first launch on a device loads the kernel (fake_waits.cc).
  if (!jo::fake::LoadFunction(device, k->name, "cudaLaunchKernel")) return cudaErrorUnknown;
  auto run = std::make_shared<jo::fake::Execution>();
  run->kernel = k->name;
  run->ptx_version = v.ptx_version;
  const size_t src_bytes = SpanBytes(g, true, k->bytes), dst_bytes = SpanBytes(g, false, k->bytes);
  const std::string what = "kernel " + k->name;
  bool ok = true;
  if (k->mc == jo::fake::McSide::kDst) {
    run->mc = static_cast<const std::byte*>(g.dst);
    run->mc_bytes = dst_bytes;
    run->mc_region = 'd';
    ok = jo::fake::MulticastTargets(g.dst, dst_bytes, &run->targets);
  } else {
    run->dst = static_cast<std::byte*>(g.dst);
    run->dst_bytes = dst_bytes;
    ok = jo::fake::CheckRange(g.dst, dst_bytes, (what + " destination").c_str());
  }
  if (k->mc == jo::fake::McSide::kSrc) {
    run->mc = static_cast<const std::byte*>(g.src);
    run->mc_bytes = src_bytes;
    run->mc_region = 's';
    ok = ok && jo::fake::MulticastTargets(g.src, src_bytes, &run->targets);
  } else {
    run->src = static_cast<const std::byte*>(g.src);
    run->src_bytes = src_bytes;
    ok = ok && jo::fake::CheckRange(g.src, src_bytes, (what + " source").c_str());
  }
  if (!ok) {
    Fail("cudaLaunchKernel " + k->name +
         ": a block outside its allocations, or a multicast side that is not a bound multicast "
         "mapping");
    return cudaErrorInvalidValue;
  }
  jo::fake::EnqueueKernel(
      stream, k->name,
      [k, run, g, grid, device, variant = v.image] {
        RunGrid(
            k, run, grid, device, variant,
            [&](jo::fake::FakeOps& ops, const jo::cuda::kernel::Thread& t) { k->run(ops, g, t); });
      },
      g.sms);
  return cudaSuccess;
}
