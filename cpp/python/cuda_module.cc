// jaxoverlap._cuda: the CUDA executor's module.
//
// Exposes (1) the CUDA FFI handlers as capsules through registrations()
// (registered for platform "CUDA" by jaxoverlap/_executors/runtime.py), (2) what this
// machine offers — capabilities() never fails: without a GPU or driver it
// says so in its "error" field — and (3) build information. Importing it
// needs neither a GPU nor a driver (static CUDA runtime, driver entry points
// looked up on first use).
#include <cublasLt.h>
#include <cuda_runtime_api.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <string>

#include "core/call.h"
#include "cuda/base/driver.h"
#include "cuda/cuda_site.h"
#include "cuda/ffi_handlers.h"
#include "cuda/gemm/gemm.h"
#include "cuda/kernels/kernels.h"
#include "ffi/ffi_call.h"
#include "python/cuda_bootstrap_bindings.h"
#include "python/cuda_loopback_bindings.h"
#include "python/ffi_capsule.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

using jo::python::Encapsulate;

// The targets (platform CUDA) and their execute handlers: one per op of the
// table, each running the same code (the `op` attribute tells the ops apart),
// and jaxoverlap_cuda_replayable, whose handler is command-buffer compatible,
// for the programs that replay (ffi_handlers.cc).
struct Target {
  std::string name;
  XLA_FFI_Handler* execute;
};
std::vector<Target> Targets() {
  std::vector<Target> out;
  for (const jo::OpRow& row : jo::kOps)
    out.push_back({std::string("jaxoverlap_cuda_") + row.name, jo::cuda::ExecuteHandler});
  out.push_back({"jaxoverlap_cuda_replayable", jo::cuda::ExecuteReplayableHandler});
  return out;
}

// name -> {stage: capsule}.
nb::dict Registrations() {
  nb::dict out;
  for (const Target& target : Targets()) {
    nb::dict stages;
    stages["instantiate"] = Encapsulate(jo::cuda::InstantiateHandler);
    stages["execute"] = Encapsulate(target.execute);
    out[target.name.c_str()] = stages;
  }
  return out;
}

// name -> the traits its execute handler reports to XLA (its metadata).
nb::dict HandlerTraits() {
  nb::dict out;
  for (const Target& target : Targets())
    out[target.name.c_str()] = jo::cuda::HandlerTraits(target.execute);
  return out;
}

// name -> {"type_id", "type_info"} for jax.ffi.register_ffi_type (platform CUDA).
nb::dict Types() {
  nb::dict site;
  site["type_id"] = nb::capsule(jo::cuda::SiteTypeId());
  site["type_info"] = nb::capsule(const_cast<void*>(jo::cuda::SiteTypeInfo()));
  nb::dict out;
  out["jaxoverlap_cuda_call_site"] = site;
  return out;
}

std::string Version(int v) {  // 12080 -> "12.8"
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

std::string NcclVersion() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "unknown";
  // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9.
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." +
         std::to_string(v % 100);
}

std::string CublasVersion() {
  const size_t v = jo::cuda::CublasLtVersion();  // MAJOR*10000 + MINOR*100 + PATCH
  return std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." +
         std::to_string(v % 100);
}

std::string CudaErrorText(cudaError_t code) {
  (void)cudaGetLastError();
  return std::string(cudaGetErrorName(code)) + ": " + cudaGetErrorString(code);
}

nb::dict BuildInfo() {
  nb::dict info;
  info["version"] = JO_VERSION;
  info["cuda_toolkit"] = JO_CUDA_TOOLKIT_VERSION;
  int runtime = 0;
  info["cuda_runtime"] =
      cudaRuntimeGetVersion(&runtime) == cudaSuccess ? Version(runtime) : "unknown";
  info["cuda_runtime_linkage"] = "static";
  info["nccl_headers"] = std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) + "." +
                         std::to_string(NCCL_PATCH);
  info["cublas_headers"] = std::to_string(CUBLAS_VER_MAJOR) + "." +
                           std::to_string(CUBLAS_VER_MINOR) + "." +
                           std::to_string(CUBLAS_VER_PATCH);
  info["nvidia_wheels"] = JO_NVIDIA_WHEELS;
  info["kernels"] = jo::cuda::KernelsDescription();
  nb::dict images;  // family -> the cubins ("sm_XY") and PTX ("compute_XY") the build compiled
  for (const auto& [family, list] : jo::cuda::KernelImages()) {
    nb::list entries;
    for (const std::string& image : list) entries.append(nb::str(image.c_str()));
    images[family.c_str()] = nb::tuple(entries);
  }
  info["kernel_images"] = images;
  info["xla_ffi_api"] = std::to_string(XLA_FFI_API_MAJOR) + "." + std::to_string(XLA_FFI_API_MINOR);
  nb::list transports;
  for (const jo::TransportRow& row : jo::kTransports) transports.append(row.name);
  info["transports"] = nb::tuple(transports);
  return info;
}

// What this machine offers; never raises. Keys: error (str or None),
// driver / runtime / nccl / cublas versions, devices (list of dicts with
// ordinal, name, compute capability, multicast), peer_access (matrix).
nb::dict Capabilities() {
  nb::dict caps;
  caps["nccl"] = NcclVersion();
  caps["cublas"] = CublasVersion();
  int runtime = 0, driver = 0;
  caps["cuda_runtime"] =
      cudaRuntimeGetVersion(&runtime) == cudaSuccess ? Version(runtime) : "unknown";
  const cudaError_t drv_code = cudaDriverGetVersion(&driver);
  caps["cuda_driver"] = drv_code == cudaSuccess && driver > 0
                            ? nb::object(nb::str(Version(driver).c_str()))
                            : nb::none();
  caps["cuda_driver_int"] = driver;
  caps["runtime_int"] = runtime;
  nb::list devices, peers;
  caps["devices"] = devices;
  caps["peer_access"] = peers;
  caps["driver_multicast_api"] = false;
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) {
    caps["error"] = "no usable GPU: " + CudaErrorText(code);
    return caps;
  }
  const jo::cuda::DriverApi* drv = nullptr;
  jo::Status drv_status = jo::cuda::LoadDriver(&drv);
  caps["driver_multicast_api"] = drv != nullptr && drv->has_multicast;
  std::string errors;
  if (!drv_status.ok()) errors += drv_status.message() + "; ";
  for (int d = 0; d < count; ++d) {
    nb::dict dev;
    dev["ordinal"] = d;
    cudaDeviceProp prop{};
    const cudaError_t pc = cudaGetDeviceProperties(&prop, d);
    if (pc != cudaSuccess) {
      errors += "device " + std::to_string(d) + ": " + CudaErrorText(pc) + "; ";
      dev["name"] = "unknown";
      dev["compute_capability"] = nb::make_tuple(0, 0);
    } else {
      dev["name"] = std::string(prop.name);
      dev["compute_capability"] = nb::make_tuple(prop.major, prop.minor);
      dev["memory_bytes"] = static_cast<long long>(prop.totalGlobalMem);
    }
    int mc = 0;
    if (drv != nullptr) {
      CUdevice handle = 0;
      if (drv->cuDeviceGet(&handle, d) != CUDA_SUCCESS ||
          drv->cuDeviceGetAttribute(&mc, CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED, handle) !=
              CUDA_SUCCESS)
        mc = 0;
    }
    dev["multicast"] = mc != 0;
    devices.append(dev);
    nb::list row;
    for (int e = 0; e < count; ++e) {
      int can = 0;
      if (e == d) {
        can = 1;
      } else if (cudaDeviceCanAccessPeer(&can, d, e) != cudaSuccess) {
        (void)cudaGetLastError();
        can = 0;
      }
      row.append(can != 0);
    }
    peers.append(row);
  }
  caps["error"] = errors.empty() ? nb::none() : nb::object(nb::str(errors.c_str()));
  return caps;
}

}  // namespace

NB_MODULE(_cuda, m) {
  m.doc() = "jaxoverlap CUDA extension: CUDA executor and CUDA FFI handlers.";
  m.attr("__version__") = JO_VERSION;
  jo::ffi_call::LibraryVersion() = JO_VERSION;
  m.def("build_info", &BuildInfo, "What this extension was built with.");
  m.def("registrations", &Registrations,
        "FFI target name -> {stage: handler capsule} (platform CUDA).");
  m.def("types", &Types, "FFI type name -> {'type_id', 'type_info'} capsules (platform CUDA).");
  m.def("handler_traits", &HandlerTraits,
        "FFI target name -> the traits its execute handler reports to XLA (1: command-buffer "
        "compatible).");
  m.def("capabilities", &Capabilities,
        "GPUs, driver/runtime/NCCL/cuBLAS versions, peer access, multicast (never raises).");
  m.def("set_process_index", &jo::SetProcessIndex, nb::arg("index"),
        "The process index the handlers find themselves with in the rank table.");
  m.def("cliques", &jo::cuda::DescribeCudaCliques, "One line per live GPU clique.");
  m.def("_reset_cliques", &jo::cuda::ResetCudaCliques, "Tests only: forget every clique.");
  m.def("note_lowering", &jo::NoteLowering, nb::arg("site_key"),
        "The native call `site_key` was lowered: its next instance belongs to a new program "
        "(core/call.h CallSite).");
  jo::python::BindCudaBootstrap(m);
  // The loopback runner on a GPU: rank threads need no bookkeeping; bytes move by cudaMemcpy
  // (before the calls and after the GPU finished them: never on an enqueue path).
  jo::python::BindLoopback(m, [] {
    jo::cuda::LoopbackHooks hooks;
    hooks.rank_thread = [] { return std::shared_ptr<void>(); };
    hooks.begin_handler = [](cudaStream_t) {};
    hooks.end_handler = [](cudaStream_t, const std::string&) {};
    hooks.upload = [](void* device, const void* host, size_t bytes) {
      JO_CUDA_CHECK(nullptr, cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
      return jo::OkStatus();
    };
    hooks.download = [](void* host, const void* device, size_t bytes) {
      JO_CUDA_CHECK(nullptr, cudaMemcpy(host, device, bytes, cudaMemcpyDeviceToHost));
      return jo::OkStatus();
    };
    return hooks;
  });
}
