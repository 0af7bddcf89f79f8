// jaxoverlap._cuda_fake, the kernels part: one launch of a real launcher
// (kernels_common.cc) on the fake, with the shared kernel bodies running over
// the grid; the fake's variant choice; and the deliberate misuse of launching
// a multimem kernel whose variant has no multimem (it traps; the context dies).
#include "python/cuda_fake_kernels.h"

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/program.h"
#include "cuda/base/driver.h"
#include "cuda/fake/fake_kernels.h"
#include "cuda/fake/fake_runtime.h"
#include "cuda/kernels/kernel_table.h"
#include "cuda/kernels/kernels.h"
#include "python/kinds_bindings.h"

namespace nb = nanobind;

namespace jo::python {
namespace {

using jo::cuda::BlockArgs;

jo::DType DTypeOf(const std::string& s) { return ParseDTypeArg("dtype", s); }

nb::object VariantDict(const std::vector<std::string>& images, int arch) {
  jo::fake::KernelVariant v;
  if (!jo::fake::SelectKernelVariant(images, arch, &v)) return nb::none();
  nb::dict out;
  out["image"] = v.image;
  out["jit"] = v.jit;
  out["ptx_version"] = v.ptx_version;
  out["binary_version"] = v.binary_version;
  return out;
}

// A multicast object over devices 0..ranks-1, each device's memory also mapped
// for the test to fill and read (the fake's device memory is host memory).
struct Multicast {
  CUdeviceptr va = 0;
  size_t bytes = 0;
  std::vector<std::byte*> memory;
};

Multicast MakeMulticast(int ranks, size_t needed) {
  const jo::cuda::DriverApi* drv = nullptr;
  if (!jo::cuda::LoadDriver(&drv).ok() || drv == nullptr)
    throw std::runtime_error("fake driver API unavailable");
  Multicast m;
  const size_t gran = size_t{2} << 20;
  m.bytes = (std::max<size_t>(needed, 1) + gran - 1) / gran * gran;
  CUmulticastObjectProp prop{};
  prop.numDevices = static_cast<unsigned>(ranks);
  prop.size = m.bytes;
  CUmemGenericAllocationHandle mc = 0;
  bool ok = drv->cuMulticastCreate(&mc, &prop) == CUDA_SUCCESS;
  for (int d = 0; ok && d < ranks; ++d) ok = drv->cuMulticastAddDevice(mc, d) == CUDA_SUCCESS;
  std::vector<CUmemAccessDesc> access;
  for (int d = 0; ok && d < ranks; ++d) {
    CUmemAllocationProp mp{};
    mp.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    mp.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    mp.location.id = d;
    CUmemGenericAllocationHandle h = 0;
    CUdeviceptr va = 0;
    CUmemAccessDesc desc{};
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = d;
    desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ok = drv->cuMemCreate(&h, m.bytes, &mp, 0) == CUDA_SUCCESS &&
         drv->cuMulticastBindMem(mc, 0, h, 0, m.bytes, 0) == CUDA_SUCCESS &&
         drv->cuMemAddressReserve(&va, m.bytes, 0, 0, 0) == CUDA_SUCCESS &&
         drv->cuMemMap(va, m.bytes, 0, h, 0) == CUDA_SUCCESS &&
         drv->cuMemSetAccess(va, m.bytes, &desc, 1) == CUDA_SUCCESS;
    m.memory.push_back(reinterpret_cast<std::byte*>(va));
    access.push_back(desc);
  }
  ok = ok && drv->cuMemAddressReserve(&m.va, m.bytes, 0, 0, 0) == CUDA_SUCCESS &&
       drv->cuMemMap(m.va, m.bytes, 0, mc, 0) == CUDA_SUCCESS &&
       drv->cuMemSetAccess(m.va, m.bytes, access.data(), access.size()) == CUDA_SUCCESS;
  if (!ok) throw std::runtime_error("fake multicast set-up failed: " + jo::fake::Errors().back());
  return m;
}

cudaStream_t StreamOn(int device) {
  cudaSetDevice(device);
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess)
    throw std::runtime_error("fake stream creation failed");
  return s;
}

std::byte* Device(int device, const nb::bytes& contents) {
  auto* p = static_cast<std::byte*>(jo::fake::Malloc(device, contents.size()));
  std::memcpy(p, contents.c_str(), contents.size());
  return p;
}

nb::list TracesOut() {
  nb::list out;
  for (const jo::fake::KernelTrace& t : jo::fake::TakeKernelTraces()) {
    nb::dict d;
    d["kernel"] = t.kernel;
    d["variant"] = t.variant;
    d["grid"] = nb::make_tuple(t.grid[0], t.grid[1], t.grid[2]);
    d["block"] = nb::make_tuple(t.block[0], t.block[1], t.block[2]);
    nb::list accesses;
    for (const jo::fake::KernelAccess& a : t.accesses)
      accesses.append(
          nb::make_tuple(a.block_x, a.block_y, a.block_z, a.thread, std::string(1, a.op),
                         a.region ? std::string(1, a.region) : std::string(), a.offset, a.bytes));
    d["accesses"] = accesses;
    out.append(d);
  }
  return out;
}

// One launch through the real launcher. kind: "add" (dst += src on device 0),
// "mc_store" (src on device 0 -> the multicast object at dst_offset), "mc_reduce"
// (the multicast object at src_offset, summed over devices -> dst on device 0).
// Buffers are given whole (bytes); offsets count elements; the multicast
// object's per-device memory starts as `memory[d]` and is returned whole.
nb::dict RunBlock(const std::string& kind, const std::string& dtype, int64_t batch, int64_t m,
                  int64_t n, int64_t src_bs, int64_t src_ld, int64_t dst_bs, int64_t dst_ld,
                  int64_t src_offset, int64_t dst_offset, std::optional<nb::bytes> src,
                  std::optional<nb::bytes> dst, std::vector<nb::bytes> memory, bool trace) {
  BlockArgs a;
  a.dtype = DTypeOf(dtype);
  a.batch = batch, a.m = m, a.n = n;
  a.src_batch_stride = src_bs, a.src_ld = src_ld, a.dst_batch_stride = dst_bs, a.dst_ld = dst_ld;
  const int64_t es = jo::DTypeSize(a.dtype);
  const bool mc_store = kind == "mc_store", mc_reduce = kind == "mc_reduce";
  if (!mc_store && !mc_reduce && kind != "add")
    throw nb::value_error("kind: expected add, mc_store or mc_reduce");
  Multicast mc;
  if (mc_store || mc_reduce) {
    if (memory.empty()) throw nb::value_error("memory: one buffer per device of the multicast");
    mc = MakeMulticast(static_cast<int>(memory.size()), memory[0].size());
    for (size_t d = 0; d < memory.size(); ++d) {
      if (memory[d].size() != memory[0].size()) throw nb::value_error("memory: sizes differ");
      std::memcpy(mc.memory[d], memory[d].c_str(), memory[d].size());
    }
  }
  std::byte* src_mem = mc_reduce ? nullptr : Device(0, src.value());
  std::byte* dst_mem = mc_store ? nullptr : Device(0, dst.value());
  a.src = (mc_reduce ? reinterpret_cast<std::byte*>(mc.va) : src_mem) + src_offset * es;
  a.dst = (mc_store ? reinterpret_cast<std::byte*>(mc.va) : dst_mem) + dst_offset * es;
  cudaStream_t s = StreamOn(0);
  jo::fake::TraceKernels(trace);
  jo::cuda::ErrorContext ctx;
  ctx.op = "run_block " + kind;
  const jo::Status status = kind == "add" ? jo::cuda::LaunchAddBlock(a, s, ctx)
                            : mc_store    ? jo::cuda::LaunchMcStore(a, s, ctx)
                                          : jo::cuda::LaunchMcReduce(a, s, ctx);
  const bool drained = jo::fake::Drain();
  nb::dict out;
  out["status"] = status.ok() ? nb::none() : nb::object(nb::str(status.ToString().c_str()));
  out["drained"] = drained;
  out["access_bytes"] = jo::cuda::AccessBytes(a, mc_store || mc_reduce);
  out["traces"] = TracesOut();
  jo::fake::TraceKernels(false);
  if (dst_mem != nullptr)
    out["dst"] = nb::bytes(reinterpret_cast<const char*>(dst_mem), dst.value().size());
  nb::list mem;
  for (size_t d = 0; d < mc.memory.size(); ++d)
    mem.append(nb::bytes(reinterpret_cast<const char*>(mc.memory[d]), memory[d].size()));
  out["memory"] = mem;
  return out;
}

// One Reduce through the real launcher: dst (device 0, given whole) at dst_offset <- the sum
// of `sources`, each (its buffer whole, batch stride, ld, offset), sized to `sms` SMs.
nb::dict RunReduce(const std::string& dtype, int64_t batch, int64_t m, int64_t n, int64_t dst_bs,
                   int64_t dst_ld, int64_t dst_offset, const nb::bytes& dst,
                   const std::vector<std::tuple<nb::bytes, int64_t, int64_t, int64_t>>& sources,
                   int32_t sms, bool trace) {
  jo::cuda::ReduceArgs a;
  a.dtype = DTypeOf(dtype);
  const int64_t es = jo::DTypeSize(a.dtype);
  std::byte* dst_mem = Device(0, dst);
  a.dst = dst_mem + dst_offset * es;
  a.batch = batch, a.m = m, a.n = n, a.dst_batch_stride = dst_bs, a.dst_ld = dst_ld;
  for (const auto& [contents, bs, ld, offset] : sources)
    a.sources.push_back({Device(0, contents) + offset * es, bs, ld});
  a.sms = sms;
  cudaStream_t s = StreamOn(0);
  jo::fake::TraceKernels(trace);
  jo::cuda::ErrorContext ctx;
  ctx.op = "run_reduce";
  jo::Status status = jo::cuda::PrepareReduce(a, ctx);
  if (status.ok()) status = jo::cuda::LaunchReduce(a, s, ctx);
  const bool drained = jo::fake::Drain();
  nb::dict out;
  out["status"] = status.ok() ? nb::none() : nb::object(nb::str(status.ToString().c_str()));
  out["drained"] = drained;
  out["traces"] = TracesOut();
  jo::fake::TraceKernels(false);
  out["dst"] = nb::bytes(reinterpret_cast<const char*>(dst_mem), dst.size());
  return out;
}

// The deliberate misuse: a multimem kernel launched (bypassing the launcher's
// variant check) on a device whose variant of it was compiled without multimem.
// Install such images first (reset(kernel_images=...)). What each later call
// on the device answers shows the context is dead.
nb::dict TrapCheck() {
  Multicast mc = MakeMulticast(1, 4096);
  cudaStream_t s = StreamOn(0);
  auto* src = static_cast<std::byte*>(jo::fake::Malloc(0, 4096));
  jo::cuda::kernel::Geometry g{reinterpret_cast<void*>(mc.va), src, 1, 1, 256, 256, 256, 256, 256};
  void* args[] = {&g};
  const void* k = jo::cuda::kernel::McStoreKernel(jo::cuda::kernel::Elem::kF32, 16);
  nb::dict out;
  out["launch"] =
      static_cast<int>(cudaLaunchKernel(k, dim3(2), dim3(jo::cuda::kernel::kThreads), args, 0, s));
  out["drained"] = jo::fake::Drain();
  out["memset_after"] = static_cast<int>(cudaMemsetAsync(src, 0, 64, s));
  out["last_error"] = static_cast<int>(cudaGetLastError());
  out["last_error_again"] = static_cast<int>(cudaGetLastError());
  jo::cuda::kernel::Geometry add{src, src, 1, 1, 16, 16, 16, 16, 16};  // src += src
  void* add_args[] = {&add};
  out["launch_after"] = static_cast<int>(
      cudaLaunchKernel(jo::cuda::kernel::AddKernel(jo::cuda::kernel::Elem::kF32, 4), dim3(1),
                       dim3(jo::cuda::kernel::kThreads), add_args, 0, s));
  out["drained_after"] = jo::fake::Drain();
  cudaFuncAttributes attr{};
  out["attributes_after"] = static_cast<int>(cudaFuncGetAttributes(&attr, k));
  out["illegal_instruction"] = static_cast<int>(cudaErrorIllegalInstruction);
  out["errors"] = jo::fake::Errors();
  return out;
}

}  // namespace

void BindFakeKernels(nb::module_& m) {
  m.def(
      "kernel_variant",
      [](const std::string& family, int cc_major, int cc_minor,
         std::optional<std::map<std::string, std::vector<std::string>>> images) {
        const auto& table = images ? *images : jo::fake::KernelImagesInUse();
        auto it = table.find(family);
        if (it == table.end()) throw nb::value_error(("no kernel family " + family).c_str());
        return VariantDict(it->second, cc_major * 10 + cc_minor);
      },
      nb::arg("family"), nb::arg("cc_major"), nb::arg("cc_minor") = 0,
      nb::arg("images") = nb::none(),
      "The variant of a kernel family a device runs, as the fake's driver picks it (None: none).");
  m.def("kernel_images", &jo::fake::KernelImagesInUse,
        "The cubins and PTX the fake believes each kernel family has.");
  m.def("build_kernel_images", &jo::cuda::KernelImages,
        "What this build compiled for each kernel family (its CMake record).");
  m.def("run_block", &RunBlock, nb::arg("kind"), nb::arg("dtype"), nb::arg("batch"), nb::arg("m"),
        nb::arg("n"), nb::arg("src_bs"), nb::arg("src_ld"), nb::arg("dst_bs"), nb::arg("dst_ld"),
        nb::arg("src_offset") = 0, nb::arg("dst_offset") = 0, nb::arg("src") = nb::none(),
        nb::arg("dst") = nb::none(), nb::arg("memory") = std::vector<nb::bytes>{},
        nb::arg("trace") = false,
        "One block through the real launcher and the shared kernel bodies on the fake.");
  m.def("run_reduce", &RunReduce, nb::arg("dtype"), nb::arg("batch"), nb::arg("m"), nb::arg("n"),
        nb::arg("dst_bs"), nb::arg("dst_ld"), nb::arg("dst_offset"), nb::arg("dst"),
        nb::arg("sources"), nb::arg("sms") = 0, nb::arg("trace") = false,
        "One Reduce (d <- the sum of its sources) through the real launcher and the shared "
        "kernel body on the fake.");
  m.def("trap_check", &TrapCheck,
        "Launches a multimem kernel whose variant lacks multimem; what every later call answers.");
}

}  // namespace jo::python
