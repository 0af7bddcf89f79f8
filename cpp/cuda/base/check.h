// Return-code checks for the CUDA runtime, the driver API, cuBLASLt and NCCL.
//
// Every foreign call of the CUDA executor goes through one of these macros:
// a failure becomes a jo::Status naming the call (its source text), the
// foreign error name and text, and the context the caller set (op, rank,
// clique), plus the usual file:line breadcrumb — the NCCL habit of
// converting foreign codes at the call. Nothing here
// aborts. After a failed runtime call the sticky "last error" is cleared so
// that it is not reported again by an unrelated later check.
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <string>

#include "core/status.h"

namespace jo::cuda {

// Who is calling, for error messages: "ag_matmul rank 2 (clique 0x.../group 0)".
struct ErrorContext {
  std::string op = "jaxoverlap";
  int32_t rank = -1;
  std::string clique;
  std::string Describe() const;
};

Status CudaFailure(cudaError_t code, const char* call, const ErrorContext* ctx);
Status DriverFailure(CUresult code, const char* call, const ErrorContext* ctx);
Status CublasFailure(cublasStatus_t code, const char* call, const ErrorContext* ctx);
Status NcclFailure(ncclResult_t code, const char* call, const ErrorContext* ctx);

// Our communicators are non-blocking (config.blocking = 0), so that nothing
// NCCL does on the host — joining peers at creation, connecting to a peer at
// the first send/recv — can wait forever: a call may answer ncclInProgress,
// and the communicator must then be polled (ncclCommGetAsyncError) until it
// reports success before its next call. This polls until `deadline` (then a
// kTimeout status saying `what` did not complete). `what` names the call.
Status AwaitNccl(ncclComm_t comm, std::chrono::steady_clock::time_point deadline, const char* what,
                 const ErrorContext* ctx);

}  // namespace jo::cuda

// `ctx` is a `const ErrorContext*` in scope (nullptr when there is none yet).
#define JO_CUDA_CHECK(ctx, call)                                                        \
  do {                                                                                  \
    const cudaError_t jo_code_ = (call);                                                \
    if (jo_code_ != cudaSuccess)                                                        \
      return ::jo::cuda::CudaFailure(jo_code_, #call, (ctx)).Trail(__FILE__, __LINE__); \
  } while (0)

#define JO_CU_CHECK(ctx, call)                                                            \
  do {                                                                                    \
    const CUresult jo_code_ = (call);                                                     \
    if (jo_code_ != CUDA_SUCCESS)                                                         \
      return ::jo::cuda::DriverFailure(jo_code_, #call, (ctx)).Trail(__FILE__, __LINE__); \
  } while (0)

#define JO_CUBLAS_CHECK(ctx, call)                                                        \
  do {                                                                                    \
    const cublasStatus_t jo_code_ = (call);                                               \
    if (jo_code_ != CUBLAS_STATUS_SUCCESS)                                                \
      return ::jo::cuda::CublasFailure(jo_code_, #call, (ctx)).Trail(__FILE__, __LINE__); \
  } while (0)

#define JO_NCCL_CHECK(ctx, call)                                                        \
  do {                                                                                  \
    const ncclResult_t jo_code_ = (call);                                               \
    if (jo_code_ != ncclSuccess)                                                        \
      return ::jo::cuda::NcclFailure(jo_code_, #call, (ctx)).Trail(__FILE__, __LINE__); \
  } while (0)

// For calls on non-blocking communicators: ncclInProgress is not a failure
// (the caller then awaits the communicator, AwaitNccl).
#define JO_NCCL_CHECK_ASYNC(ctx, call)                                                  \
  do {                                                                                  \
    const ncclResult_t jo_code_ = (call);                                               \
    if (jo_code_ != ncclSuccess && jo_code_ != ncclInProgress)                          \
      return ::jo::cuda::NcclFailure(jo_code_, #call, (ctx)).Trail(__FILE__, __LINE__); \
  } while (0)
