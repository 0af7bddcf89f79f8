#include "cuda/base/check.h"

#include <thread>

#include "core/log.h"
#include "cuda/base/driver.h"

namespace jo::cuda {
namespace {

Status Failure(Code code, const std::string& what, const char* call, const ErrorContext* ctx) {
  std::string text = ctx == nullptr ? std::string("jaxoverlap") : ctx->Describe();
  text += ": " + std::string(call) + " failed: " + what;
  JO_WARN(text);
  return Status(code, text);
}

}  // namespace

std::string ErrorContext::Describe() const {
  std::string out = op;
  if (rank >= 0) out += " rank " + std::to_string(rank);
  if (!clique.empty()) out += " (" + clique + ")";
  return out;
}

Status CudaFailure(cudaError_t code, const char* call, const ErrorContext* ctx) {
  (void)cudaGetLastError();  // clear the sticky error so that it is reported once
  const Code jo_code = code == cudaErrorMemoryAllocation ? Code::kResource : Code::kInternal;
  return Failure(jo_code,
                 std::string(cudaGetErrorName(code)) + " (" + cudaGetErrorString(code) + ")", call,
                 ctx);
}

Status DriverFailure(CUresult code, const char* call, const ErrorContext* ctx) {
  const Code jo_code = code == CUDA_ERROR_OUT_OF_MEMORY ? Code::kResource : Code::kInternal;
  return Failure(
      jo_code,
      "CUresult " + std::to_string(static_cast<int>(code)) + " (" + DriverErrorText(code) + ")",
      call, ctx);
}

Status CublasFailure(cublasStatus_t code, const char* call, const ErrorContext* ctx) {
  const Code jo_code = code == CUBLAS_STATUS_ALLOC_FAILED ? Code::kResource : Code::kInternal;
  return Failure(
      jo_code,
      std::string(cublasLtGetStatusName(code)) + " (" + cublasLtGetStatusString(code) + ")", call,
      ctx);
}

Status NcclFailure(ncclResult_t code, const char* call, const ErrorContext* ctx) {
  std::string what = std::string(ncclGetErrorString(code));
  const char* last = ncclGetLastError(nullptr);
  if (last != nullptr && last[0] != '\0') what += ": " + std::string(last);
  return Failure(code == ncclInvalidArgument || code == ncclInvalidUsage ? Code::kInvalidArgument
                                                                         : Code::kInternal,
                 what, call, ctx);
}

Status AwaitNccl(ncclComm_t comm, std::chrono::steady_clock::time_point deadline, const char* what,
                 const ErrorContext* ctx) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t asked = ncclCommGetAsyncError(comm, &state);
    if (asked != ncclSuccess) return NcclFailure(asked, "ncclCommGetAsyncError", ctx);
    if (state == ncclSuccess) return OkStatus();
    if (state != ncclInProgress) return NcclFailure(state, what, ctx);
    if (std::chrono::steady_clock::now() >= deadline)
      return Status(Code::kTimeout,
                    (ctx ? ctx->Describe() + ": " : std::string()) + what +
                        " did not complete within JAXOVERLAP_TIMEOUT_S: a peer rank did not take "
                        "part (it failed, exited, or runs different calls)");
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

}  // namespace jo::cuda
