// Internals shared by the fake's translation units (fake_model.cc: the
// state and memory checks; fake_queues.cc: the "GPU" that runs the work
// queues; fake_runtime.cc:
// CUDA runtime streams, events, memory; fake_driver.cc: driver entry points;
// fake_nccl.cc; fake_cublaslt.cc). Not an interface of the executor: it sees
// only the real CUDA, NCCL and cuBLASLt headers and fake_runtime.h.
#pragma once

#include <cublasLt.h>
#include <cuda.h>
#include <nccl.h>
#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "core/program.h"
#include "cuda/fake/fake_runtime.h"

// Opaque handle types of the real headers, defined by the fake.

// One unit of queued work.
struct FakeTask {
  std::string what;
  std::function<bool()> ready;  // may it start now (its waits are met)? no side effects
  std::function<void()> run;    // its effect, when it starts
  // Null: complete as soon as it starts. Else it stays in flight (a kernel
  // that waits for its peers: an NCCL group) until this returns true; the
  // stream's next task waits for it, other streams' do not.
  std::function<bool()> done;
  bool sms = false;         // a kernel: it needs a free SM to start
  bool persistent = false;  // a persistent kernel (the fused GEMM): holds SMs while it runs ...
  int holds_sms = 0;        // ... this many (its launch's sm_count): it starts once they are free
  // A kernel's SM budget (its launch names it: the SMs its grid is sized to, those a persistent
  // kernel beside it leaves); 0: none. One that finds fewer free beside a persistent kernel when
  // it could start is reported (fake_queues.cc): it would no longer overlap that kernel.
  int sm_budget = 0;
  bool budget_reported = false;   // its lack of SMs was reported
  cudaEvent_t records = nullptr;  // the event this task records, if any
  ncclComm_t comm = nullptr;      // the communicator of an NCCL group, if any
};

struct CUstream_st {
  int process = 0;  // the played process that made it (fake_runtime.h SetPlayedProcess)
  int device = 0;
  int id = 0;
  int queue = 0;                      // the hardware work queue it is mapped onto
  std::deque<FakeTask> tasks;         // enqueued, not started (front: next in stream order)
  std::unique_ptr<FakeTask> running;  // started, in flight
  int64_t enqueued = 0;               // tasks ever enqueued
  int64_t completed = 0;              // tasks completed (in stream order)
  // Vector clock: for each stream, the number of its tasks ordered before
  // this stream's next task (its own, and others' through events).
  std::map<const CUstream_st*, int64_t> clock;
  // Stream capture (cudaStreamBeginCapture): work is recorded, not run.
  uint64_t capture = 0;  // 0: not capturing
};
// A CUDA graph made by a stream capture (fake_graphs.cc): the nodes recorded on the capture's
// streams (its origin and the streams that joined it), in the order they were recorded, each
// with the stream it was recorded on; an event record or wait inside the capture is a node too
// (the edges between the streams). Every launch of an executable made from it runs each node
// again, as recorded.
struct CUgraph_st {
  uint64_t capture = 0;
  int process = 0, device = 0;
  const CUstream_st* origin = nullptr;  // the stream the capture began on
  struct Node {
    enum Kind { kTask, kRecord, kWait };
    Kind kind = kTask;
    const CUstream_st* stream = nullptr;  // the capturing stream it was recorded on
    int event = -1;                       // kRecord, kWait: the capture's record it names
    FakeTask task;                        // kTask
  };
  std::vector<Node> nodes;
  int records = 0;  // event records made in the capture (Node::event < records)
};
struct CUgraphExec_st {
  CUgraph_st graph;  // the graph as instantiated (later changes to the graph do not reach it)
  // Made at the first launch, kept for later ones: a stream for each captured stream but the
  // origin (whose nodes run on the launch's stream), an event for each record of the capture.
  std::map<const CUstream_st*, CUstream_st*> lanes;
  std::vector<CUevent_st*> events;
};
struct CUevent_st {
  int device = 0;
  int64_t recorded = 0;                         // records enqueued
  int64_t completed = 0;                        // records executed
  std::map<const CUstream_st*, int64_t> clock;  // of the last record
  uint64_t captured = 0;                        // last recorded into this stream capture (0: none)
  int captured_record = -1;                     // ... as that capture's record number
  bool abandoned = false;                       // its last record was dropped by a deadlock
};
struct ncclComm {
  int clique = 0;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  bool nonblocking = false;
  // Non-blocking: creation completes once all nranks have joined; a call that
  // answered ncclInProgress must be awaited (ncclCommGetAsyncError) first.
  bool joining = false;
  bool in_progress = false;
  // NCCL serialises a communicator's operations in issue order, across streams.
  int64_t groups_issued = 0;
  int64_t groups_done = 0;
  int splits = 0;  // ncclCommSplit calls made on it (the n-th split of every rank meets)
  // Peers connected for send (true) and receive (false): NCCL connects to a peer at its first
  // send/recv to it (fake_nccl.cc), which waits for the device. A non-blocking communicator
  // connects after ncclGroupEnd returned: `connecting` says when the device work the
  // connection waits for is done, `connecting_to` what it connects.
  std::set<std::pair<int, bool>> connected;
  std::function<bool()> connecting;
  std::string connecting_to;
  std::set<std::pair<int, bool>> connecting_peers;
  bool finalizing = false;  // ncclCommFinalize called
  bool aborted = false;     // freed by ncclCommAbort: every later use is a misuse
  bool destroyed = false;   // freed by ncclCommDestroy
};
struct cublasLtContext {
  int device = 0;
};

namespace jo::fake {

// Every fake "device" memory range is a shared anonymous mapping, so a second
// mapping of the same pages (mremap with old size 0) models what the driver
// does for CUDA IPC opens and cuMemMap of imported memory: a new address,
// valid only where the driver made it valid.
size_t PageRound(size_t bytes);
std::byte* MapShared(size_t bytes);
void Unmap(std::byte* p, size_t bytes);
// A second address for the pages at `p` (at `at` when given, replacing what was there).
std::byte* Alias(std::byte* p, size_t bytes, std::byte* at = nullptr);

struct Alloc {
  size_t bytes = 0;
  int device = -1;
  bool multicast = false;  // a multicast mapping: only multimem may touch it
  CUmemGenericAllocationHandle mc = 0;
  std::byte* mem = nullptr;
  // A cuMemMap mapping: only the devices cuMemSetAccess named may touch it.
  bool vmm = false;
  std::set<int> access;
  // A cudaIpcOpenMemHandle mapping: only the device that opened it may touch it.
  int viewer = -1;
  Alloc() = default;
  Alloc(size_t b, int d, bool m, CUmemGenericAllocationHandle h, std::byte* p)
      : bytes(b), device(d), multicast(m), mc(h), mem(p) {}
};

// Physical memory (cuMemCreate); imported handles share the pages.
struct Pages {
  std::byte* mem = nullptr;
  size_t bytes = 0;
  explicit Pages(size_t n) : mem(MapShared(n)), bytes(n) {}
  ~Pages() { Unmap(mem, bytes); }
  Pages(const Pages&) = delete;
  Pages& operator=(const Pages&) = delete;
};

struct Phys {
  int device = 0;
  size_t bytes = 0;
  std::shared_ptr<Pages> pages;
  unsigned long long handle_types = 0;  // CUmemAllocationProp::requestedHandleTypes
};

struct McObject {
  size_t bytes = 0;
  unsigned num_devices = 0;
  std::vector<int> devices;
  std::map<int, CUmemGenericAllocationHandle> bound;  // device -> phys
  unsigned long long handle_types = 0;                // CUmulticastObjectProp::handleTypes
  int refs = 1;  // creation + imports, each dropped by cuMemRelease
};

struct Message {
  std::vector<std::byte> data;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  bool taken = false;
  std::shared_ptr<bool> taken_flag;
};

struct NcclP2p {
  bool send = false;
  void* buf = nullptr;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  int peer = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
};

struct Desc {
  int32_t compute = -1, scale = -1, transa = CUBLAS_OP_N, transb = CUBLAS_OP_N;
  // CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / B_SCALE_POINTER (device float32; null: 1).
  const void* a_scale = nullptr;
  const void* b_scale = nullptr;
  int8_t fast_accum = 0;  // CUBLASLT_MATMUL_DESC_FAST_ACCUM
  // CUBLASLT_MATMUL_DESC_A_SCALE_MODE / B_SCALE_MODE (cublasLtMatmulMatrixScale_t): SCALAR_32F
  // (the default) or VEC32_UE8M0 (block scales, fake_cublaslt.cc).
  int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
  int32_t b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
};
struct Layout {
  int32_t type = -1;
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t order = CUBLASLT_ORDER_COL;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct Pref {
  uint64_t workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};
};

struct State {
  std::recursive_mutex mu;
  Config config;
  std::mt19937_64 rng{1};
  std::vector<std::string> errors;
  std::map<std::string, int64_t> counters;
  std::map<uintptr_t, Alloc> allocs;  // by base address
  // Page-locked host memory (cudaMallocHost): base -> bytes. Host memory outside it is pageable.
  std::map<uintptr_t, size_t> pinned;
  // Malloc's ranges (cudaMalloc, the test driver's buffers): once freed, kept for the next
  // Malloc of their size, up to kSpareBytes, instead of unmapped — a new mapping costs a page
  // fault and a zero-fill per page (the executor allocates 32 MiB of cuBLASLt workspace per
  // device and stream after every reset), a kept one only the allocation's fill. Not reset.
  static constexpr size_t kSpareBytes = size_t{1} << 30;
  std::set<std::byte*> malloced;
  std::multimap<size_t, std::byte*> spare;  // by page-rounded size
  size_t spare_bytes = 0;
  std::vector<std::unique_ptr<CUstream_st>> streams;
  std::vector<std::unique_ptr<CUevent_st>> events;
  std::set<std::pair<int, int>> peer_enabled;
  std::map<CUmemGenericAllocationHandle, Phys> phys;
  std::map<CUmemGenericAllocationHandle, McObject> mcs;
  CUmemGenericAllocationHandle next_handle = 1;
  std::vector<std::unique_ptr<ncclComm>> comms;
  int next_clique = 0;
  // ncclCommInitRank: the clique each unique id names, and its ranks so far.
  std::map<std::string, std::pair<int, std::set<int>>> id_cliques;
  // ncclCommSplit: (parent clique, n-th split, colour) -> the new clique.
  std::map<std::tuple<int, int, int>, int> split_cliques;
  uint64_t next_unique_id = 1;
  std::map<uintptr_t, int> ipc_open;  // cudaIpcOpenMemHandle mappings (base -> opens)
  std::map<ino_t, CUmemGenericAllocationHandle> exported;  // memfd inode -> multicast object
  std::map<std::tuple<int, int, int>, std::deque<std::shared_ptr<Message>>> channels;
  std::map<cublasLtMatmulDesc_t, Desc> descs;
  std::map<cublasLtMatrixLayout_t, Layout> layouts;
  std::map<cublasLtMatmulPreference_t, Pref> prefs;
  std::vector<std::unique_ptr<cublasLtContext>> handles;
  int stream_ids = 0;
  int64_t side_effects = 0;  // NCCL matches done inside done() checks
  // The hardware work queues: per device, CUDA_DEVICE_MAX_CONNECTIONS FIFOs,
  // each entry the stream whose next task it is.
  int connections = 8;
  // Keyed by (played process, device): each played process's GPU d is its own GPU.
  std::map<std::pair<int, int>, std::vector<std::deque<CUstream_st*>>> queues;
  std::map<std::pair<int, int>, int> streams_made;  // streams created (round-robin onto queues)
  uint64_t next_capture = 1;
  std::map<uint64_t, CUgraph_st*> capturing;  // capture id -> the graph it records into
  std::vector<std::unique_ptr<CUgraph_st>> graphs;
  std::vector<std::unique_ptr<CUgraphExec_st>> graph_execs;
  std::map<int, std::pair<cudaError_t, std::string>> sticky;  // poisoned device -> (error, why)
  // A kernel that trapped while the GPU polled it (PoisonWhenPolled): its device is poisoned
  // once the poll is over, not from inside the task being polled (which the poison drops).
  std::vector<std::tuple<int, cudaError_t, std::string>> traps;
  // Per (played process, device): the SMs persistent kernels running there hold.
  std::map<std::pair<int, int>, int> sms_held;
  // cudaFuncAttributeMaxDynamicSharedMemorySize set per (played process, device, function).
  std::map<std::tuple<int, int, const void*>, int> shared_grants;
  // The GPUs' clock for device-side time (%globaltimer: the fused GEMM's and the one-launch
  // all-reduce's bounded waits): moves with the time the fake lets pass while stuck
  // (Config::pass_time steps, in Drain and in host waits).
  int64_t gpu_ns = 0;
};

// Config::pass_time(step) and the GPUs' clock with it (gpu_ns). Without S().mu held.
void PassTime(std::chrono::milliseconds step);

// The one fake world (never destroyed: handler threads may run late).
State& S();

extern thread_local int t_device;
extern thread_local int t_process;
extern thread_local int t_group_depth;
extern thread_local std::vector<NcclP2p> t_group;
extern thread_local bool t_group_nonblocking_init;  // the open group created a non-blocking comm
extern thread_local cudaError_t t_last;

using Lock = std::lock_guard<std::recursive_mutex>;

bool ValidDevice(int d);
bool CanAccessPeer(int a, int b);
// Records the misuse and sets the runtime's last error.
cudaError_t RtFail(cudaError_t code, const std::string& text);
// The allocation containing [p, p+bytes), or nullptr.
Alloc* Find(const void* p, size_t bytes);
// Memory `device` may touch: its own, or a peer's with access enabled.
bool CheckAccess(const void* p, size_t bytes, int device, const char* what);
bool KnownStream(cudaStream_t s);
bool StreamOk(cudaStream_t s, const char* what);
// Enqueues `task` on `s` (its hardware queue too); recorded, not run, while
// `s` is capturing.
void Push(cudaStream_t s, FakeTask task);
void Push(cudaStream_t s, std::string what, std::function<bool()> ready, std::function<void()> run);
// A task enqueued on a capturing stream: recorded into the capture's graph (fake_graphs.cc).
void RecordIntoCapture(cudaStream_t s, FakeTask task);
// An event record on a capturing stream, and a capturing stream's wait for an event recorded
// in its capture: nodes of the capture's graph, the edges between its streams (fake_graphs.cc).
void RecordEventIntoCapture(cudaEvent_t e, cudaStream_t s);
void WaitIntoCapture(cudaStream_t s, cudaEvent_t e);
// What cudaEventRecord / cudaStreamWaitEvent enqueue on a stream that is not capturing, without
// the calls' checks and counts (fake_runtime.cc): a graph launch's replay of those nodes too.
void RecordEvent(cudaEvent_t e, cudaStream_t s);
void WaitEvent(cudaStream_t s, cudaEvent_t e);
// Lets the fake GPU run, without choosing at random, until `until` holds or
// nothing more can run (a host poll or synchronisation: the real GPU runs
// meanwhile). Returns `until()`.
bool RunUntil(const std::function<bool()>& until);
// Forgets the work queues and sets their number (Config::connections, else
// CUDA_DEVICE_MAX_CONNECTIONS as the driver reads it).
void ResetQueues();
int ConnectionsFromEnvironment();
// Whether a persistent kernel (the fused GEMM) enqueued on `device` of played process `process`
// has not finished (queued or running). Requires S().mu.
bool PersistentKernelPending(int process, int device);
// Maps a new stream onto one of its device's work queues (round-robin).
void MapOntoQueue(CUstream_st* st);
jo::DType FromCuda(int32_t type, bool* ok);
size_t NcclSize(ncclDataType_t t);

}  // namespace jo::fake
