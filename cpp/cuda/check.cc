#include "cuda/check.h"

#include <thread>

#include "core/log.h"
#include "cuda/driver.h"

namespace jo::cuda {
namespace {

Status Failure(Code code, const std::string& what, const char* call, const CallSite* site) {
  std::string text = site == nullptr ? std::string("jaxoverlap") : site->Describe();
  text += ": " + std::string(call) + " failed: " + what;
  JO_WARN(text);
  return Status(code, text);
}

}  // namespace

std::string CallSite::Describe() const {
  std::string out = op;
  if (rank >= 0) out += " rank " + std::to_string(rank);
  if (!clique.empty()) out += " (" + clique + ")";
  return out;
}

Status CudaFailure(cudaError_t code, const char* call, const CallSite* site) {
  (void)cudaGetLastError();  // clear the sticky error so that it is reported once
  const Code jo_code = code == cudaErrorMemoryAllocation ? Code::kResource : Code::kInternal;
  return Failure(jo_code,
                 std::string(cudaGetErrorName(code)) + " (" + cudaGetErrorString(code) + ")", call,
                 site);
}

Status DriverFailure(CUresult code, const char* call, const CallSite* site) {
  const Code jo_code = code == CUDA_ERROR_OUT_OF_MEMORY ? Code::kResource : Code::kInternal;
  return Failure(jo_code, "CUresult " + std::to_string(static_cast<int>(code)) + " (" +
                              DriverErrorText(code) + ")",
                 call, site);
}

Status CublasFailure(cublasStatus_t code, const char* call, const CallSite* site) {
  const Code jo_code = code == CUBLAS_STATUS_ALLOC_FAILED ? Code::kResource : Code::kInternal;
  return Failure(jo_code, std::string(cublasLtGetStatusName(code)) + " (" +
                              cublasLtGetStatusString(code) + ")",
                 call, site);
}

Status NcclFailure(ncclResult_t code, const char* call, const CallSite* site) {
  std::string what = std::string(ncclGetErrorString(code));
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') what += ": " + std::string(last);
  return Failure(code == ncclInvalidArgument || code == ncclInvalidUsage ? Code::kInvalidArgument
                                                                          : Code::kInternal,
                 what, call, site);
}

Status AwaitNccl(ncclComm_t comm, std::chrono::steady_clock::time_point deadline, const char* what,
                 const CallSite* site) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm, &state);
    if (asked != ncclSuccess) return NcclFailure(asked, "ncclCommGetAsyncError", site);
    if (state == ncclSuccess) return OkStatus();
    if (state != ncclInProgress) return NcclFailure(state, what, site);
    if (std::chrono::steady_clock::now() >= deadline)
      return Status(Code::kTimeout,
                    (site ? site->Describe() + ": " : std::string()) + what +
                        " did not complete within JAXOVERLAP_TIMEOUT_S: a peer rank did not take "
                        "part (it failed, exited, or runs different calls)");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace jo::cuda
