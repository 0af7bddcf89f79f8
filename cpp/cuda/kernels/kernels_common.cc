// The launchers of kernels.h, shared by the GPU build and the fake build: the
// access width, the geometry in accesses, the grid, the multimem variant check
// and cudaLaunchKernel. Only the kernels behind kernel_table.h differ.
#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>

#include "cuda/kernels/kernel_table.h"
#include "cuda/kernels/kernels.h"

#ifndef JO_ADD_KERNEL_IMAGES
#error "JO_ADD_KERNEL_IMAGES (the AddBlock kernels' cubins and PTX) comes from CMakeLists.txt"
#endif
#ifndef JO_MULTIMEM_KERNEL_IMAGES
#error "JO_MULTIMEM_KERNEL_IMAGES (the multimem kernels' cubins and PTX) comes from CMakeLists.txt"
#endif
#ifndef JO_FUSED_KERNEL_IMAGES
#error "JO_FUSED_KERNEL_IMAGES (the fused GEMM's cubins) comes from CMakeLists.txt"
#endif
#ifndef JO_FUSED_SM100_KERNEL_IMAGES
#error "JO_FUSED_SM100_KERNEL_IMAGES (the sm100 fused GEMM's cubins) comes from CMakeLists.txt"
#endif

namespace jo::cuda {

static_assert(kernel::kMaxReduceSources == kMaxReduceSources,
              "the Reduce kernel takes as many sources as a program may name");

namespace {

using kernel::Elem;
using kernel::Geometry;

// The multimem instructions exist in code compiled for compute_90 or newer.
constexpr int kMultimemPtxVersion = 90;
// Grid caps: the loops in kernel_body.h stride over whatever does not fit.
constexpr int64_t kMaxBlocks = 2048;
constexpr int64_t kMaxGridYZ = 65535;

// A dtype's element class (core/kinds.h, the elem column).
Elem ElemOf(DType dtype) {
  switch (dtype) {
#define JO_ELEM(e, id, name, short_name, bytes, fp8, out, fused, elem, ...) \
  case DType::e:                                                            \
    return Elem::elem;
    JO_DTYPES(JO_ELEM)
#undef JO_ELEM
  }
  return Elem::kF32;
}

// The block in elements, with rows and batches that lie back to back on both
// sides merged into longer rows (wider accesses, fewer loop trips).
struct Shape {
  int64_t batch, rows, cols;
  int64_t src_bs, src_ld, dst_bs, dst_ld;
};

Shape Merge(const BlockArgs& a) {
  Shape s{a.batch, a.m, a.n, a.src_batch_stride, a.src_ld, a.dst_batch_stride, a.dst_ld};
  if (s.rows == 1 || (s.src_ld == s.cols && s.dst_ld == s.cols)) {
    s.cols *= s.rows;
    s.rows = 1;
    s.src_ld = s.dst_ld = s.cols;
  }
  if (s.batch == 1 || (s.rows == 1 && s.src_bs == s.cols && s.dst_bs == s.cols)) {
    s.cols *= s.batch;
    s.batch = 1;
    s.src_bs = s.dst_bs = s.cols;
  }
  return s;
}

// Whether every address a thread forms with `bytes`-wide accesses is aligned.
bool Fits(const BlockArgs& a, const Shape& s, int64_t bytes) {
  const int64_t es = DTypeSize(a.dtype);
  auto divides = [&](int64_t elems) { return elems * es % bytes == 0; };
  const bool ptrs = reinterpret_cast<uintptr_t>(a.src) % static_cast<uintptr_t>(bytes) == 0 &&
                    reinterpret_cast<uintptr_t>(a.dst) % static_cast<uintptr_t>(bytes) == 0;
  return bytes >= es && ptrs && divides(s.cols) &&
         (s.rows == 1 || (divides(s.src_ld) && divides(s.dst_ld))) &&
         (s.batch == 1 || (divides(s.src_bs) && divides(s.dst_bs)));
}

// How a block kernel launches: the bytes each thread moves per access (0:
// none fits), the block in units of accesses, and the grid.
struct BlockLaunch {
  int bytes = 0;
  Geometry g{};
  dim3 grid;
};

BlockLaunch MakeLaunch(const BlockArgs& a, bool multimem) {
  BlockLaunch p;
  const Shape s = Merge(a);
  for (int bytes : {16, 8, 4, 2}) {
    if (multimem && bytes < 4) break;  // multimem moves 32-bit words (element pairs)
    if (Fits(a, s, bytes)) {
      p.bytes = bytes;
      break;
    }
  }
  if (p.bytes == 0) return p;
  const int64_t per = p.bytes / DTypeSize(a.dtype);  // elements per access
  p.g = Geometry{a.dst,          a.src,          s.batch,        s.rows,         s.cols / per,
                 s.src_bs / per, s.src_ld / per, s.dst_bs / per, s.dst_ld / per, a.sms};
  p.grid = BlockGrid(p.g.cols, p.g.rows, p.g.batch, a.sms);
  return p;
}

// A Reduce in accesses: the widest width every address, row length and stride of the
// destination and of every source divides, with rows (and batches) merged where all of
// them lie back to back.
struct ReduceLaunch {
  int bytes = 0;
  kernel::ReduceGeometry g{};
  dim3 grid;
};

ReduceLaunch MakeReduceLaunch(const ReduceArgs& a) {
  ReduceLaunch p;
  int64_t batch = a.batch, rows = a.m, cols = a.n;
  bool dense_rows = a.dst_ld == a.n, dense_batches = true;
  for (const ReduceArgs::Source& src : a.sources) dense_rows = dense_rows && src.ld == a.n;
  if (rows == 1 || dense_rows) {
    cols *= rows;
    rows = 1;
  }
  const auto batch_dense = [&](int64_t bs) { return bs == cols; };
  dense_batches = rows == 1 && batch_dense(a.dst_batch_stride);
  for (const ReduceArgs::Source& src : a.sources)
    dense_batches = dense_batches && batch_dense(src.batch_stride);
  const bool merge_batches = batch == 1 || dense_batches;
  if (merge_batches) {
    cols *= batch;
    batch = 1;
  }
  const int64_t es = DTypeSize(a.dtype);
  const auto fits = [&](int64_t bytes, const void* ptr, int64_t ld, int64_t bs) {
    const auto divides = [&](int64_t elems) { return elems * es % bytes == 0; };
    return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0 && divides(cols) &&
           (rows == 1 || divides(ld)) && (batch == 1 || divides(bs));
  };
  for (int bytes : {16, 8, 4, 2}) {
    bool ok = bytes >= es && fits(bytes, a.dst, a.dst_ld, a.dst_batch_stride);
    for (const ReduceArgs::Source& src : a.sources)
      ok = ok && fits(bytes, src.ptr, src.ld, src.batch_stride);
    if (ok) {
      p.bytes = bytes;
      break;
    }
  }
  if (p.bytes == 0) return p;
  const int64_t per = p.bytes / es;  // elements per access
  p.g.dst = a.dst;
  p.g.batch = batch;
  p.g.rows = rows;
  p.g.cols = cols / per;
  p.g.dst_batch_stride = merge_batches ? 0 : a.dst_batch_stride / per;
  p.g.dst_ld = rows == 1 ? p.g.cols : a.dst_ld / per;
  p.g.count = static_cast<int32_t>(a.sources.size());
  p.g.sms = a.sms;
  for (size_t k = 0; k < a.sources.size(); ++k) {
    const ReduceArgs::Source& src = a.sources[k];
    p.g.src[k] = kernel::ReduceSource{src.ptr, merge_batches ? 0 : src.batch_stride / per,
                                      rows == 1 ? p.g.cols : src.ld / per};
  }
  p.grid = BlockGrid(p.g.cols, p.g.rows, p.g.batch, a.sms);
  return p;
}

std::string Sm(int arch) { return "sm_" + std::to_string(arch); }

std::mutex g_verdicts_mu;
// (device, kernel) -> "" (it may run) or why not.
std::map<std::pair<int, const void*>, std::string>& Verdicts() {
  static auto* verdicts = new std::map<std::pair<int, const void*>, std::string>();
  return *verdicts;
}

// Once per (device, kernel): loads the kernel and, for a multimem kernel (`what`
// names it; null for another), asks whether the variant this GPU runs has multimem.
// cudaFuncGetAttributes references the kernel, so with lazy loading (CUDA's default)
// it loads it, which "might require context synchronization" (CUDA programming
// guide, "Lazy Loading", potential hazards): done at set-up (PrepareBlockKernel), as
// NCCL's ncclInitKernelsForDevice does, never once a call has enqueued work.
// The driver picks the variant (a cubin for the device, else PTX it JIT-compiles);
// cudaFuncGetAttributes reports it: ptxVersion is the virtual architecture the
// code was compiled from, so below 90 the multimem instructions are absent and the
// kernel would __trap() — a sticky error that ends the context.
// `clocked` (a kernel bounding its waits by %globaltimer, named): refused when the device would
// JIT-compile it (binaryVersion, the device's then, differs from ptxVersion). The premise: this
// build compiles each cubin from its own virtual architecture (JO_ADD_KERNEL_ARCHS "80-real":
// compute_80 -> sm_80), so a cubin reports one number in both; a cubin compiled from an older
// virtual architecture would be refused too. The verdict is cached per (device, kernel): a
// kernel is always prepared with the same `clocked`.
Status LoadKernel(const void* k, const char* what, const ErrorContext& ctx,
                  const char* clocked = nullptr) {
  int device = 0;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&device));
  {
    std::lock_guard<std::mutex> lock(g_verdicts_mu);
    auto it = Verdicts().find({device, k});
    if (it != Verdicts().end())
      return it->second.empty()
                 ? OkStatus()
                 : Status(Code::kInvalidArgument, ctx.Describe() + ": " + it->second);
  }
  cudaFuncAttributes attr{};
  const cudaError_t code = cudaFuncGetAttributes(&attr, k);
  std::string verdict;
  if (what == nullptr) {
    if (code != cudaSuccess) return CudaFailure(code, "cudaFuncGetAttributes", &ctx);
  } else if (code == cudaErrorNoKernelImageForDevice || code == cudaErrorInvalidDeviceFunction ||
             (code == cudaSuccess && attr.ptxVersion < kMultimemPtxVersion)) {
    (void)cudaGetLastError();
    int major = 0, minor = 0;
    JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    verdict =
        std::string(what) + " needs an sm_90 (Hopper) or newer GPU with code compiled for it: ";
    verdict += code == cudaSuccess
                   ? "device " + std::to_string(device) + " (" + Sm(major * 10 + minor) +
                         ") would run this kernel compiled from compute_" +
                         std::to_string(attr.ptxVersion) + ", which has no multimem instructions"
                   : "this build has no code of this kernel that device " + std::to_string(device) +
                         " (" + Sm(major * 10 + minor) + ") can run";
    verdict += " (kernels built: " + KernelsDescription() + "); use transport='p2p' or 'nccl'";
  } else if (code != cudaSuccess) {
    return CudaFailure(code, "cudaFuncGetAttributes", &ctx);  // not cached: not a verdict
  }
  if (verdict.empty() && clocked != nullptr && attr.binaryVersion != attr.ptxVersion) {
    int major = 0, minor = 0;
    JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    JO_CUDA_CHECK(&ctx, cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    verdict = std::string(clocked) + " bounds its waits with the GPU's %globaltimer, whose value " +
              "the PTX ISA leaves unspecified in code JIT-compiled for another target, and " +
              "device " + std::to_string(device) + " (" + Sm(major * 10 + minor) +
              ") has no cubin of it: it would JIT-compile it from compute_" +
              std::to_string(attr.ptxVersion) + " (kernels built: " + KernelsDescription() +
              "); build for this GPU (cpp/cuda/CMakeLists.txt, JO_ADD_KERNEL_ARCHS), or run " +
              "without it: matmul_ar's algorithm='one_shot' or 'two_shot' (separate ops), " +
              "impl='auto' (which leaves these kernels out on such GPUs) or impl='xla'";
  }
  std::lock_guard<std::mutex> lock(g_verdicts_mu);
  Verdicts()[{device, k}] = verdict;
  return verdict.empty() ? OkStatus()
                         : Status(Code::kInvalidArgument, ctx.Describe() + ": " + verdict);
}

Status Launch(const void* k, const BlockLaunch& p, cudaStream_t stream, const ErrorContext& ctx) {
  Geometry g = p.g;
  void* args[] = {&g};
  JO_CUDA_CHECK(&ctx, cudaLaunchKernel(k, p.grid, dim3(kernel::kThreads), args, 0, stream));
  return OkStatus();
}

bool Empty(const BlockArgs& a) { return a.batch <= 0 || a.m <= 0 || a.n <= 0; }

// The Reduce kernel for `a` (null: nothing to launch) and its launch.
Status ReduceKernelFor(const ReduceArgs& a, const ErrorContext& ctx, const void** k,
                       ReduceLaunch* p) {
  *k = nullptr;
  if (a.sources.empty() || a.sources.size() > static_cast<size_t>(kernel::kMaxReduceSources))
    return Status(Code::kInternal, ctx.Describe() + ": a Reduce sums 1 to " +
                                       std::to_string(kernel::kMaxReduceSources) + " blocks, not " +
                                       std::to_string(a.sources.size()));
  if (a.batch <= 0 || a.m <= 0 || a.n <= 0) return OkStatus();
  *p = MakeReduceLaunch(a);
  JO_ASSERT(p->bytes >= DTypeSize(a.dtype));  // the element size always fits
  *k = kernel::ReduceKernel(ElemOf(a.dtype), p->bytes);
  JO_ASSERT(*k != nullptr);
  return OkStatus();
}

// The multimem kernel for `a` (null: nothing to launch), after the pairing rule.
Status MultimemKernel(const char* what, const void* (*table)(Elem, int), const BlockArgs& a,
                      const ErrorContext& ctx, const void** k, BlockLaunch* p) {
  *k = nullptr;
  if (!MulticastBlockOk(a))
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": " + what +
                      (DTypeSize(a.dtype) == 2
                           ? " on 16-bit data needs an even row width, even strides and 4-byte "
                             "aligned addresses (multimem works on element pairs)"
                           : " on fp8 data needs a row width and strides that are multiples of "
                             "4 and 4-byte aligned addresses (multimem moves fp8 as 32- or "
                             "64-bit words)") +
                      "; use transport='p2p' or 'nccl' for this shape");
  if (Empty(a)) return OkStatus();
  *p = MakeLaunch(a, /*multimem=*/true);
  JO_ASSERT(p->bytes >= 4);
  *k = table(ElemOf(a.dtype), p->bytes);
  JO_ASSERT(*k != nullptr);
  return OkStatus();
}

// At launch the verdict is the one set-up cached (LoadKernel asks the device only once).
Status LaunchMultimem(const char* what, const void* (*table)(Elem, int), const BlockArgs& a,
                      cudaStream_t stream, const ErrorContext& ctx) {
  const void* k = nullptr;
  BlockLaunch p;
  JO_CHECK(MultimemKernel(what, table, a, ctx, &k, &p));
  if (k == nullptr) return OkStatus();
  JO_CHECK(LoadKernel(k, what, ctx));
  return Launch(k, p, stream, ctx);
}

constexpr const char* kMcStoreName = "multicast store (multimem.st)";
constexpr const char* kMcReduceName = "multicast load-reduce (multimem.ld_reduce)";

std::vector<std::string> Words(const char* text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

}  // namespace

bool MulticastBlockOk(const BlockArgs& a) {
  if (a.dtype == DType::kF32) return true;
  const int64_t per_word = 4 / DTypeSize(a.dtype);  // elements per 32-bit word: 2, or 4 for fp8
  const auto whole = [&](int64_t v) { return v % per_word == 0; };
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 4 == 0; };
  return whole(a.n) && whole(a.src_ld) && whole(a.dst_ld) && whole(a.src_batch_stride) &&
         whole(a.dst_batch_stride) && aligned(a.src) && aligned(a.dst);
}

int AccessBytes(const BlockArgs& a, bool multimem) { return MakeLaunch(a, multimem).bytes; }

Status PrepareKernel(const void* kernel, const char* multimem, const ErrorContext& ctx,
                     const char* clocked) {
  return LoadKernel(kernel, multimem, ctx, clocked);
}

void ForgetKernelVerdicts() {
  std::lock_guard<std::mutex> lock(g_verdicts_mu);
  Verdicts().clear();
}

Status LaunchAddBlock(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  if (Empty(a)) return OkStatus();
  const BlockLaunch p = MakeLaunch(a, /*multimem=*/false);
  JO_ASSERT(p.bytes >= DTypeSize(a.dtype));  // the element size always fits
  const void* k = kernel::AddKernel(ElemOf(a.dtype), p.bytes);
  JO_ASSERT(k != nullptr);
  return Launch(k, p, stream, ctx);
}

Status LaunchReduce(const ReduceArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  const void* k = nullptr;
  ReduceLaunch p;
  JO_CHECK(ReduceKernelFor(a, ctx, &k, &p));
  if (k == nullptr) return OkStatus();
  void* args[] = {&p.g};
  JO_CUDA_CHECK(&ctx, cudaLaunchKernel(k, p.grid, dim3(kernel::kThreads), args, 0, stream));
  return OkStatus();
}

Status PrepareReduce(const ReduceArgs& a, const ErrorContext& ctx) {
  const void* k = nullptr;
  ReduceLaunch p;
  JO_CHECK(ReduceKernelFor(a, ctx, &k, &p));
  return k == nullptr ? OkStatus() : LoadKernel(k, nullptr, ctx);
}

dim3 BlockGrid(int64_t cols, int64_t rows, int64_t batch, int32_t sms) {
  const int64_t most = sms > 0 ? std::min(kMaxBlocks, sms * kBlocksPerSm) : kMaxBlocks;
  const int64_t x = std::min((cols + kernel::kThreads - 1) / kernel::kThreads, most);
  const int64_t z = std::min({batch, std::max<int64_t>(1, most / x), kMaxGridYZ});
  const int64_t y = std::min({rows, std::max<int64_t>(1, most / (x * z)), kMaxGridYZ});
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
}

Status LaunchMcStore(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchMultimem(kMcStoreName, kernel::McStoreKernel, a, stream, ctx);
}

Status LaunchMcReduce(const BlockArgs& a, cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchMultimem(kMcReduceName, kernel::McReduceKernel, a, stream, ctx);
}

Status PrepareBlockKernel(BlockKernel kind, const BlockArgs& a, const ErrorContext& ctx) {
  if (kind == BlockKernel::kAdd) {
    if (Empty(a)) return OkStatus();
    const BlockLaunch p = MakeLaunch(a, /*multimem=*/false);
    const void* k = kernel::AddKernel(ElemOf(a.dtype), p.bytes);
    JO_ASSERT(k != nullptr);
    return LoadKernel(k, nullptr, ctx);
  }
  const bool store = kind == BlockKernel::kMcStore;
  const char* what = store ? kMcStoreName : kMcReduceName;
  const void* k = nullptr;
  BlockLaunch p;
  JO_CHECK(
      MultimemKernel(what, store ? kernel::McStoreKernel : kernel::McReduceKernel, a, ctx, &k, &p));
  return k == nullptr ? OkStatus() : LoadKernel(k, what, ctx);
}

const std::map<std::string, std::vector<std::string>>& KernelImages() {
  static const auto* images = new std::map<std::string, std::vector<std::string>>{
      {"add", Words(JO_ADD_KERNEL_IMAGES)},
      {"multimem", Words(JO_MULTIMEM_KERNEL_IMAGES)},
      {"fused", Words(JO_FUSED_KERNEL_IMAGES)},
      {"fused_sm100", Words(JO_FUSED_SM100_KERNEL_IMAGES)}};
  return *images;
}

std::string KernelsDescription() {
  std::string out;
  for (const auto& [family, images] : KernelImages()) {
    out += out.empty() ? "" : "; ";
    out += family + ":";
    for (const std::string& image : images) out += " " + image;
  }
  return out;
}

}  // namespace jo::cuda
