// The host-side fake of the CUDA runtime, driver, cuBLASLt and NCCL calls
// the CUDA executor makes — the test build (_cuda_fake) links it instead of
// the real libraries, so the executor's argument building runs in CI.
//
// Files, by API family: fake_model.cc (the state, memory checks, the "GPU"
// running the queues), fake_runtime.cc (CUDA runtime: devices, memory,
// streams, events, copies, IPC), fake_driver.cc (driver entry points:
// stream memory operations, virtual memory, multicast, shareable handles),
// fake_nccl.cc, fake_cublaslt.cc, fake_kernels.cc (host equivalents of the
// kernels); fake_internal.h is what they share. What the tests drive is in
// fake_harness.h (the executor and the fake reset together, calls played on
// every rank) and fake_checks.h (the misuse suites).
//
// Model (everything under one lock; the "GPU" runs inside Drain(), and as
// far as it can when the host polls or synchronises):
//  * devices: a configurable count, compute capability, peer-access matrix
//    and multicast support; the current device is per host thread.
//  * memory: host allocations registered with their device; every pointer a
//    call receives is range-checked against them (an offset bug is an error,
//    not a silent read of neighbouring memory).
//  * hardware work queues: each device has CUDA_DEVICE_MAX_CONNECTIONS FIFOs
//    (read from the environment like the driver does, default 8; CUDA
//    programming guide, "CUDA Environment Variables"); streams are mapped
//    onto them round-robin in creation order, and a queue starts only its
//    head: a head that waits (an unmet event or flag wait, a stream whose
//    previous task is still in flight) blocks everything behind it (CUDA
//    driver API, "Stream Memory Operations": improper use deadlocks; the
//    scheduler may serialise tasks in an improper order).
//  * streams: tasks in order; events record/complete in stream order and
//    cudaStreamWaitEvent waits for the record enqueued before it. A vector
//    clock per stream says which work is ordered before what.
//  * handlers: BeginHandler/EndHandler around a handler's enqueue check that
//    every task it put on another stream is ordered before the end of its
//    work on XLA's stream (joined) or already complete: XLA runs the next
//    op on that stream once the handler's work there is done (XLA custom
//    calls, https://openxla.org/xla/custom_call).
//  * stream capture: work on a capturing stream is recorded, not run; host
//    queries of a capturing stream or of an event recorded in a capture are
//    errors (CUDA programming guide, "CUDA Graphs", stream capture:
//    prohibited operations); a stream waiting on a captured event joins the
//    capture, and a graph launch replays every captured stream's nodes on a
//    stream of its own, with the capture's event edges (fake_graphs.cc).
//  * SMs: a kernel (block kernels, cuBLASLt matmuls, NCCL groups) does not
//    start while a persistent kernel (the fused GEMM, fake_fused_gemm.cc)
//    holds the device's SMs; copies and stream memory operations need none.
//  * 32-bit stream memory operations: write; wait with the cyclic GEQ test.
//  * NCCL: send/recv matched in order per (comm, src, dst); a group is a
//    kernel that completes when all its receives have data and all its
//    sends were taken (rendezvous), so a schedule that would deadlock on
//    NCCL deadlocks here; a communicator's groups start in the order they
//    were issued, whatever their stream (NCCL serialises a communicator);
//    any use of a communicator after ncclCommAbort or ncclCommDestroy is an
//    error (both free it), and a non-blocking one must be finalized (and
//    polled until done) before ncclCommDestroy.
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
//  * host calls that wait for the GPU (fake_waits.cc): cudaMalloc/cudaFree,
//    cuMemUnmap/cuMemRelease, lazy loading, ncclCommAbort wait for their device
//    while the other ranks' threads (HostThread) go on; a wait none of them can
//    end is a deadlock, reported. Between a handler's first enqueue on XLA's
//    stream and its return only the non-blocking calls of docs/gpu-internals.md §1 may run.
// Drain() runs the queues; the order among startable queue heads is
// pseudo-random (seeded), one task at a time, so different interleavings get
// exercised. A state where nothing can start or complete but work remains
// is a deadlock: reported (which queue head blocks what), and the work is
// abandoned (its events report a failure, as after a hung GPU).
// Every misuse is recorded in Errors() and makes the call fail.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace jo::fake {

struct Config {
  int devices = 8;
  int cc_major = 9;
  int cc_minor = 0;
  int sms = 132;  // multiprocessors per device (an H100 SXM's)
  bool multicast = true;
  bool shareable = true;     // cuMemExportToShareableHandle supports POSIX fds
  bool fabric = false;       // CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED (multi-node NVLink)
  bool imex_channel = true;  // this user may use fabric handles (an IMEX channel exists)
  // CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES: cuStreamWaitValue32 accepts
  // CU_STREAM_WAIT_VALUE_FLUSH (refused where the attribute is 0, as the driver does).
  bool flush_remote_writes = false;
  std::vector<std::vector<bool>> peer;  // empty: all pairs can access
  uint64_t seed = 1;
  // When no stream can progress, Drain lets up to this much time pass, in
  // steps of pass_time (the test driver moves the watchdog's virtual clock:
  // it may release the streams), before calling it a deadlock; so does a
  // host call that waits for the GPU while every rank's thread waits too
  // (fake_waits.h). Never real time: whether a test passes does not depend
  // on the machine's speed.
  int grace_ms = 0;
  std::function<void(std::chrono::milliseconds)> pass_time;
  // Hardware work queues per device; 0: CUDA_DEVICE_MAX_CONNECTIONS from the
  // environment (the driver's default, 8, when unset).
  int connections = 0;
  // Module loading (CUDA programming guide, "Lazy Loading"): 0 reads CUDA_MODULE_LOADING
  // from the environment as CUDA does (lazy unless it says EAGER), 1 lazy, 2 eager.
  int module_loading = 0;
  // Nonzero: the ranks' host threads (HostThread) pause for seeded random moments at
  // the fake's calls, so that they run at uneven speeds (another order per seed).
  uint64_t host_jitter = 0;
  // What the fatbinary holds for each kernel family (fake_kernels.h,
  // SetKernelImages); unset: what this build compiled.
  std::optional<std::map<std::string, std::vector<std::string>>> kernel_images;
  // Tests: the fused GEMM's kernel waits for the flag of block b + this
  // instead of block b (a broken tile -> flag mapping; fake_fused_gemm.cc).
  int fused_flag_shift = 0;
  // Tests: the FP8 fused GEMM scales row i by the scale of shard shard(i) +
  // this (mod the shards) instead of its own (a tile with the wrong shard's
  // scale; fake_fused_gemm.cc).
  int fused_scale_shard_shift = 0;
  // Tests: the sm100 fused GEMM's 2-SM pairs wait only in the leader CTA, for its
  // own 128 rows; the peer CTA loads its half of the MMA tile without waiting
  // (fake_fused_gemm.cc: the pair's both-halves rule broken).
  bool fused_pair_leader_waits_only = false;
  // Tests: the one-launch all-reduce's phases run wrongly (fake_allreduce.cc): "release_early"
  // (a thread releases its flags before its block's barrier after the stores), "read_early" (a
  // thread reads its peers' data before its block's barrier after the acquires);
  // "rank0_gives_up": rank 0's waits never see a flag and time out at once (its peers are on
  // time).
  std::string allreduce_misuse;
};

void Reset(const Config& config);  // forgets everything (no live objects may remain in use)
std::vector<std::string> Errors();
std::map<std::string, int64_t> Counters();  // calls made, by API name
// Runs every stream until empty; false on deadlock (recorded in Errors()).
bool Drain();
// The tests play several processes in one: streams this thread makes from
// now on belong to played process `process`, whose GPU d has work queues of
// its own (not those of another played process's GPU d).
void SetPlayedProcess(int process);
// Hardware work queues per device in effect (after Reset).
int Connections();
// Around one handler's enqueue on XLA's stream `xla` (this thread): at the
// end, every task the handler put on another stream must be joined into
// `xla` or complete; else a misuse naming `who`.
void BeginHandler(cudaStream_t xla);
void EndHandler(cudaStream_t xla, const std::string& who);
// A rank's host thread (the test driver's, one per rank as XLA has one per
// device) while it lives. A host call that waits for the GPU waits as long as
// some other such thread may still enqueue what the GPU needs; when none can
// (all wait too, or are gone) the wait is a deadlock, reported, never a hang.
class HostThread {
 public:
  HostThread();
  ~HostThread();
  HostThread(const HostThread&) = delete;
  HostThread& operator=(const HostThread&) = delete;
};
// Whether functions are loaded lazily (after Reset; Config::module_loading).
bool LazyLoading();
// Tests: `hook` runs at the start of every cudaEventQuery, on the querying thread, without the
// fake's lock (it may block there: a query "may block", CUDA driver API, "API synchronization
// behavior"). Empty: none.
void SetEventQueryHook(std::function<void(cudaEvent_t)> hook);
// Host memory of the fake device allocation (for the test driver).
void* Malloc(int device, size_t bytes,
             int fill = 0);  // `fill`: all of it up to 4 MiB, else its ends

// For fake_kernels.cc.
void Fail(const std::string& text);
bool CheckRange(const void* p, size_t bytes, const char* what);
// Whether [p, p + bytes) lies in one page-locked host allocation (cudaMallocHost).
bool Pinned(const void* p, size_t bytes);
int DeviceArch(int device);  // compute capability major * 10 + minor
int DeviceSms(int device);   // multiprocessors
int CurrentDevice();
int StreamDevice(cudaStream_t stream);  // -1: unknown stream
// Per bound device, the memory behind multicast address `mc` (+ bytes);
// false if `mc` is not a multicast mapping.
bool MulticastTargets(const void* mc, size_t bytes, std::vector<std::byte*>* out);
void Enqueue(cudaStream_t stream, const std::string& what, std::function<void()> run);
// A kernel: like Enqueue, but it needs a free SM, so it does not start while
// persistent kernels (the fused GEMM) hold every SM of its device. With an SM
// budget (`sm_budget` > 0: the SMs its grid is sized to, those a release-only
// fused GEMM leaves it), finding fewer free beside a persistent kernel when it
// could start is reported: its blocks would wait for that kernel to end, and
// what it does would no longer overlap it.
void EnqueueKernel(cudaStream_t stream, const std::string& what, std::function<void()> run,
                   int sm_budget = 0);
// Whether [p, p + bytes) reads rows of a running fused GEMM's output whose block it has
// not released yet (fake_fused_gemm.cc); `*what` then says which.
bool ReadsUnreleased(const void* p, size_t bytes, std::string* what);
// Records, once per `*reported`, the misuse of reading before the release.
void CheckReleased(const void* p, size_t bytes, const std::string& reader, bool* reported);
void Count(const char* api);

// Sticky errors (a kernel that trapped or faulted): the device's context is
// dead — its queued work is dropped and every later call on it fails with
// `code` ("any further CUDA work will return the same error", driver_types.h).
void Poison(int device, cudaError_t code, const std::string& why);
// The same from inside a task's poll (FakeTask::done): applied by the GPU's step right after it.
void PoisonWhenPolled(int device, cudaError_t code, std::string why);
cudaError_t StickyError(int device);  // cudaSuccess while the context is usable

}  // namespace jo::fake
