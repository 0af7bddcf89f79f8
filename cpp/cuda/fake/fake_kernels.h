// The fake's model of kernels (fake_kernels.cc): which compiled variant of a
// kernel a device runs, the launch, and the per-thread execution of the
// shared kernel bodies (cuda/kernels/kernel_body.h) over the grid.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/program.h"

namespace jo::fake {

// What a fatbinary holds for each kernel family ("add", "multimem"): cubins
// "sm_XY[a|f]" and PTX "compute_XY[a|f]". Default: what this build compiled
// (jo::cuda::KernelImages()); tests may install another (e.g. the table read
// from the real module with cuobjdump, or an older build's).
void SetKernelImages(const std::map<std::string, std::vector<std::string>>& images);
const std::map<std::string, std::vector<std::string>>& KernelImagesInUse();

// The variant a device of compute capability `arch` (major * 10 + minor)
// runs, as the driver picks it; false when none can run there.
struct KernelVariant {
  std::string image;  // "sm_90" (a cubin) or "compute_90" (PTX the driver JIT-compiles)
  bool jit = false;
  int ptx_version = 0;     // cudaFuncAttributes::ptxVersion
  int binary_version = 0;  // cudaFuncAttributes::binaryVersion
};
bool SelectKernelVariant(const std::vector<std::string>& images, int arch, KernelVariant* out);

// The most dynamic shared memory a block may opt into: an H100's (227 KB; CUDA programming
// guide, "Compute Capabilities").
inline constexpr int kMaxSharedBytesPerBlock = 232448;

// The fused GEMM's kernel for A, B and D of these types (fake_fused_gemm.cc
// runs it): a handle cudaFuncGetAttributes and cudaFuncSetAttribute take, of
// the kernel family "fused"; its name; whether `device` runs a variant of it.
const void* FusedFunction(DType a, DType b, DType d);
// The sm100 fused GEMM's for a 16-bit type (A, B and D alike), of the kernel
// family "fused_sm100".
const void* FusedFunctionSm100(DType dtype);
std::string FunctionName(const void* function);
bool FunctionRuns(const void* function, int device);
// cudaFuncSetAttribute(function, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) on the
// current device of this thread's played process (fake_fused_gemm.cc keeps it, and checks it at
// the fused launch).
void NoteSharedMemoryGrant(const void* function, int bytes);

// A kernel with a launch of its own (the one-launch all-reduce, fake_allreduce.cc):
// cudaFuncGetAttributes knows it (a variant of kernel family `family`), and cudaLaunchKernel
// hands it to `launch` once the checks every launch shares (stream, device, sticky error, the
// variant, lazy loading) passed, with the variant's ptxVersion. Registered once per name.
using KernelLaunch = cudaError_t (*)(const std::string& name, int ptx_version, dim3 grid,
                                     dim3 block, void** args, size_t shared, cudaStream_t stream);
const void* RegisterKernel(const std::string& op, const std::string& name, const char* family,
                           KernelLaunch launch);

// Forgets which rank made the data of each area address visible (fake_allreduce.cc; Reset).
void ForgetAllReduceMemory();

// Per-access record of kernel executions while tracing is on (tests).
struct KernelAccess {
  uint32_t block_x, block_y, block_z, thread;
  // 'l' load, 's' store, 'm' multimem store, 'r' multimem load-reduce,
  // 'a' fence.proxy.alias, 'f' fence.acq_rel.sys
  char op;
  char region;     // 's' source, 'd' destination (0 for fences)
  int64_t offset;  // bytes from the region's base pointer (the launch's first access)
  int32_t bytes;
};
struct KernelTrace {
  std::string kernel;
  std::string variant;
  uint32_t grid[3];
  uint32_t block[3];
  std::vector<KernelAccess> accesses;  // in the order the threads ran them
};
void TraceKernels(bool on);
std::vector<KernelTrace> TakeKernelTraces();

}  // namespace jo::fake
