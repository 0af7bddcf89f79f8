// The CUDA driver API, reached only through cudaGetDriverEntryPointByVersion.
//
// There is no link-time dependency on libcuda (build machines may have no
// driver at all): every driver function we use is looked up once, at the CUDA version
// that introduced the signature we call, and kept in Driver(). A machine
// without a driver fails the lookup with a clear status, never at load time.
#pragma once

#include <cuda.h>

#include "core/status.h"

namespace jo::cuda {

struct DriverApi {
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, CUdevice_attribute, CUdevice) = nullptr;
  // 32-bit stream memory operations (flags).
  CUresult (*cuStreamWriteValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  CUresult (*cuStreamWaitValue32)(CUstream, CUdeviceptr, cuuint32_t, unsigned int) = nullptr;
  // Virtual memory management (the multicast workspace).
  CUresult (*cuMemGetAllocationGranularity)(size_t*, const CUmemAllocationProp*,
                                            CUmemAllocationGranularity_flags) = nullptr;
  CUresult (*cuMemCreate)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                          unsigned long long) = nullptr;
  CUresult (*cuMemRelease)(CUmemGenericAllocationHandle) = nullptr;
  CUresult (*cuMemAddressReserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr,
                                  unsigned long long) = nullptr;
  CUresult (*cuMemAddressFree)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long) = nullptr;
  CUresult (*cuMemUnmap)(CUdeviceptr, size_t) = nullptr;
  CUresult (*cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t) = nullptr;
  // Shareable handles (multicast across processes; null when the driver lacks them).
  CUresult (*cuMemExportToShareableHandle)(void*, CUmemGenericAllocationHandle,
                                           CUmemAllocationHandleType, unsigned long long) = nullptr;
  CUresult (*cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle*, void*,
                                             CUmemAllocationHandleType) = nullptr;
  // Multicast objects (CUDA >= 12.1 driver; null when the driver lacks them).
  CUresult (*cuMulticastCreate)(CUmemGenericAllocationHandle*,
                                const CUmulticastObjectProp*) = nullptr;
  CUresult (*cuMulticastAddDevice)(CUmemGenericAllocationHandle, CUdevice) = nullptr;
  CUresult (*cuMulticastBindMem)(CUmemGenericAllocationHandle, size_t, CUmemGenericAllocationHandle,
                                 size_t, size_t, unsigned long long) = nullptr;
  CUresult (*cuMulticastUnbind)(CUmemGenericAllocationHandle, CUdevice, size_t, size_t) = nullptr;
  CUresult (*cuMulticastGetGranularity)(size_t*, const CUmulticastObjectProp*,
                                        CUmulticastGranularity_flags) = nullptr;
  bool has_multicast = false;
  bool has_shareable = false;  // both shareable-handle entry points found
};

// Looks every entry point up once. Fails (with the reason) when the driver
// is missing or lacks a required function; multicast entry points are
// optional (has_multicast says whether all were found).
Status LoadDriver(const DriverApi** out);

// The flags of a flag wait on `device`: CU_STREAM_WAIT_VALUE_GEQ, plus
// CU_STREAM_WAIT_VALUE_FLUSH where the device supports it
// (CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES; asked once per device). The
// data a flag announces arrives as remote writes (a peer's copy engine, or
// multimem stores through the switch) before the flag, itself a remote write;
// the driver documents FLUSH for exactly this: "two remote writes arrive in a
// defined order, the wait is satisfied by the second write, and downstream
// work needs to observe the first write" (cuda.h, CUstreamWaitValue_flags).
Status WaitValueFlags(int device, unsigned* flags);

// Forgets what WaitValueFlags learnt (tests: the fake's devices change).
void ForgetDeviceAttributes();

// Text of a driver error (falls back to the number when no driver is loaded).
std::string DriverErrorText(CUresult code);

}  // namespace jo::cuda
