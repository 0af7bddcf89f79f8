// The host-side fake of the CUDA runtime, driver, cuBLASLt and NCCL calls
// the CUDA executor makes — the test build (_cuda_fake) links it instead of
// the real libraries, so the executor's argument building runs in CI.
//
// Files, by API family: fake_model.cc (the state, memory checks, the "GPU"
// running the queues), fake_runtime.cc (CUDA runtime: devices, memory,
// streams, events, copies, IPC), fake_driver.cc (driver entry points:
// stream memory operations, virtual memory, multicast, shareable handles),
// fake_nccl.cc, fake_cublaslt.cc, fake_kernels.cc (host equivalents of the
// kernels); fake_internal.h is what they share.
//
// Model (everything under one lock; the "GPU" runs only inside Drain()):
//  * devices: a configurable count, compute capability, peer-access matrix
//    and multicast support; the current device is per host thread.
//  * memory: host allocations registered with their device; every pointer a
//    call receives is range-checked against them (an offset bug is an error,
//    not a silent read of neighbouring memory).
//  * streams: FIFO queues of tasks; events record/complete in stream order
//    and cudaStreamWaitEvent waits for the record enqueued before it.
//  * 32-bit stream memory operations: write; wait with the cyclic GEQ test.
//  * NCCL: send/recv matched in order per (comm, src, dst); a group
//    completes when all its receives have data and all its sends were taken
//    (rendezvous), so a schedule that would deadlock on NCCL deadlocks here.
//  * cuBLASLt: a reference GEMM honouring exactly the attributes we set
//    (order, transposes, leading dims, batch count/strides, alpha/beta,
//    compute/scale type, pointer alignment promised in the preference);
//    any other attribute, or a combination cuBLASLt refuses (C != D with
//    different layouts), fails loudly.
//  * multicast: cuMulticastCreate/AddDevice/BindMem/cuMemCreate/Map; the
//    multimem kernels are replaced by host equivalents (fake_kernels.cc).
//    cuMemExportToShareableHandle (POSIX fd; a memfd) and
//    cuMemImportFromShareableHandle (finds the object by the fd's inode, one
//    more reference) model shareable handles within one OS process; fabric
//    handles (64 bytes) likewise, for multicast objects and cuMemCreate memory.
//  * mappings: device memory is shared anonymous host memory, so CUDA IPC
//    opens and cuMemMap of imported memory get a new address of the same
//    pages; an IPC mapping may be touched only by the device that opened it,
//    a cuMemMap mapping only by the devices cuMemSetAccess named.
// Drain() runs the queues; the order among ready streams is pseudo-random
// (seeded), one task at a time, so different interleavings get exercised.
// A state where no stream can progress but some are non-empty is a deadlock.
// Every misuse is recorded in Errors() and makes the call fail.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace jo::fake {

struct Config {
  int devices = 8;
  int cc_major = 9;
  bool multicast = true;
  bool shareable = true;     // cuMemExportToShareableHandle supports POSIX fds
  bool fabric = false;       // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (multi-node NVLink)
  bool imex_channel = true;  // this user may use fabric handles (an IMEX channel exists)
  std::vector<std::vector<bool>> peer;  // empty: all pairs can access
  uint64_t seed = 1;
  // When no stream can progress, Drain waits this long for another host
  // thread (the watchdog) to release something before calling it a deadlock.
  int grace_ms = 0;
};

void Reset(const Config& config);  // forgets everything (no live objects may remain in use)
std::vector<std::string> Errors();
std::map<std::string, int64_t> Counters();  // calls made, by API name
// Runs every stream until empty; false on deadlock (recorded in Errors()).
bool Drain();
// Host memory of the fake device allocation (for the test driver).
void* Malloc(int device, size_t bytes);

// For fake_kernels.cc.
void Fail(const std::string& text);
bool CheckRange(const void* p, size_t bytes, const char* what);
int DeviceCc(int device);
int CurrentDevice();
int StreamDevice(cudaStream_t stream);  // -1: unknown stream
// Per bound device, the memory behind multicast address `mc` (+ bytes);
// false if `mc` is not a multicast mapping.
bool MulticastTargets(const void* mc, size_t bytes, std::vector<std::byte*>* out);
void Enqueue(cudaStream_t stream, const std::string& what, std::function<void()> run);
void Count(const char* api);

}  // namespace jo::fake
