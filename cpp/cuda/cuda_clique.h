// CudaClique: the GPU transport state of one clique in this process.
//
// Single process (JAX's default on one node: one process drives every local
// GPU) is complete: all ranks' devices are here, so the first rank to need
// a resource creates it for every rank, without a rendezvous:
//   * peer access between every pair (p2p, multicast: flags live in peer memory);
//   * NCCL communicators (transport nccl), non-blocking (every host-side NCCL
//     wait is bounded by the call's timeout; check.h AwaitNccl): one
//     ncclCommInitRankConfig per rank in one group, in Prepare — i.e. at the
//     first execution, never under CUDA-graph capture (the handlers are not
//     command-buffer compatible, and the call refuses a capturing stream);
//   * flags (uint32, cudaMalloc) and the symmetric workspace: cudaMalloc for
//     p2p, cuMemCreate + cuMulticastCreate/AddDevice/BindMem for multicast.
// Cliques spanning processes (one process per GPU or per node, or anything
// between): each process holds the ranks whose GPUs it drives (devices() is
// -1 for the others) and creates resources for those only. Transport nccl:
// every process creates its ranks' communicators (in one NCCL group) with
// the clique's ncclUniqueId, exchanged through jax.distributed at trace time
// (cuda_bootstrap.h). p2p and multicast: peers' buffers must be mapped into
// this process, with one of two kinds of handle, agreed by every process at
// the first buffer generation (Negotiate):
//   * fabric handles (CU_MEM_HANDLE_TYPE_FABRIC: multi-node NVLink with IMEX,
//     e.g. GB200 NVL72), when every process's GPUs support them and may use
//     them; they are plain bytes, so they work across hosts. Buffers are
//     cuMemCreate'd with a fabric handle, exported, allgathered, imported
//     and mapped once per process, accessible to every local GPU;
//   * otherwise CUDA IPC (one host only; processes on different hosts get an
//     error saying why): buffers are cudaMalloc'd; each local GPU opens its
//     own mapping of every remote rank's buffers (cudaIpcOpenMemHandle maps
//     into the opening device's context only).
// The mappings stand in the generation for the remote ranks' buffers, per
// viewing rank. multicast: the process of rank 0 creates the multicast object
// and exports it (a fabric handle allgathered as bytes, or a POSIX fd that the
// exchange moves with share_fds); the others import it; each process adds its
// devices, and after an allgather (all devices added) binds and maps its own
// memory; flags go over the same handles as p2p's.
//
// Buffer generations. GPU work is asynchronous: when a call needs a bigger
// workspace, peers' streams may still run the previous call on the old one.
// So buffers are never freed while the clique lives; a new Generation is
// made, valid from the epoch of the call that needed it (every rank makes
// the same calls, so every rank switches at the same epoch), and the old
// ones are kept until the clique is destroyed. Within a generation, calls
// alternate between two halves by epoch parity (docs/native.md §4; the fork
// and join of every call on XLA's stream make the host argument hold on the
// GPU too).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <mutex>
#include <vector>

#include "core/call.h"
#include "core/clique.h"
#include "core/exchange.h"
#include "core/program.h"
#include "cuda/check.h"
#include "cuda/driver.h"

namespace jo::cuda {

// Device memory a rank addresses: cudaMalloc'd on `device` (kMalloc);
// another process's allocation opened with cudaIpcOpenMemHandle on `device`
// (kIpc); or cuMem physical memory — created here with a fabric handle, or
// imported from one — mapped at `ptr` for the local GPUs (kVmm).
struct DeviceAlloc {
  enum class Kind { kMalloc, kIpc, kVmm };
  Kind kind = Kind::kMalloc;
  int device = -1;
  void* ptr = nullptr;
  size_t bytes = 0;
  // kVmm only.
  const DriverApi* drv = nullptr;
  CUmemGenericAllocationHandle handle = 0;
  size_t mapped_bytes = 0;  // bytes rounded up to the allocation granularity
  bool mapped = false;
  DeviceAlloc() = default;
  DeviceAlloc(const DeviceAlloc&) = delete;
  DeviceAlloc& operator=(const DeviceAlloc&) = delete;
  ~DeviceAlloc();
};

// The multicast workspace: physical memory per device bound to one multicast object.
struct MulticastRegion {
  const DriverApi* drv = nullptr;
  std::vector<int> devices;
  size_t bytes = 0;
  CUmemGenericAllocationHandle mc = 0;
  bool mc_created = false;
  std::vector<CUmemGenericAllocationHandle> phys;  // per rank (0: not created)
  std::vector<int> bound;                          // per rank: bound to mc
  std::vector<CUdeviceptr> unicast;                // per rank: its own mapping
  CUdeviceptr mc_va = 0;                           // one mapping, accessible by every device
  bool mc_mapped = false;
  MulticastRegion() = default;
  MulticastRegion(const MulticastRegion&) = delete;
  MulticastRegion& operator=(const MulticastRegion&) = delete;
  ~MulticastRegion();
};

struct Generation {
  int64_t since_epoch = 0;
  int64_t workspace_bytes = 0;  // per parity per rank
  int32_t num_flags = 0;        // per parity per rank
  // This process's ranks' buffers (null for another process's rank).
  std::vector<std::unique_ptr<DeviceAlloc>> workspace;  // per rank (p2p)
  std::vector<std::unique_ptr<DeviceAlloc>> flags;      // per rank: 2 * num_flags uint32
  std::unique_ptr<MulticastRegion> multicast;           // multicast transport
  // Cliques spanning processes: other processes' ranks' buffers as local rank
  // `viewer` addresses them, remote[viewer][rank]; `mappings` owns them.
  struct Remote {
    std::byte* flags = nullptr;
    std::byte* workspace = nullptr;
  };
  std::vector<std::vector<Remote>> remote;
  std::vector<std::unique_ptr<DeviceAlloc>> mappings;

  // Addresses as seen by local rank `viewer` (the rank whose GPU runs the op).
  std::byte* Workspace(int32_t rank, int64_t epoch, int32_t viewer) const;  // unicast
  std::byte* MulticastAddress(int64_t epoch) const;                          // parity of epoch
  CUdeviceptr Flag(int32_t rank, int64_t epoch, int32_t id, int32_t viewer) const;
};

// How peers' buffers reach a process (cliques spanning processes; Negotiate).
enum class Handles { kUnset, kIpc, kFabric };

// Per-rank execution resources: comm streams, events, private scratch.
struct RankResources {
  int device = -1;
  std::vector<cudaStream_t> streams;  // program streams 1.. (stream 0 is XLA's)
  std::vector<cudaEvent_t> events;    // program events, then fork/join
  // Recorded on XLA's stream after call `epoch` (slot epoch % size): the watchdog's view
  // of which calls the GPU has finished.
  std::vector<cudaEvent_t> done;
  static constexpr int64_t kDoneSlots = 32;
  std::unique_ptr<DeviceAlloc> scratch;
  std::vector<std::unique_ptr<DeviceAlloc>> retired_scratch;  // may still be in use on the GPU
  cudaStream_t setup = nullptr;       // zero-fills new buffers
  RankResources() = default;
  RankResources(const RankResources&) = delete;
  RankResources& operator=(const RankResources&) = delete;
  ~RankResources();
  // Grows streams/events/scratch to what `program` needs.
  Status Reserve(const Program& program, const ErrorContext& ctx);
};

class CudaClique : public Clique {
 public:
  // `devices`: the local ordinal of each rank, -1 for a rank of another
  // process; then `nccl_id` is the clique's ncclUniqueId (transport nccl).
  // `processes`: the process of each rank. `timeout` bounds the creation of
  // NCCL communicators (peers joining).
  CudaClique(CliqueKey key, Transport transport, std::vector<int> devices,
             std::vector<int64_t> processes, const ncclUniqueId* nccl_id = nullptr,
             std::shared_ptr<Exchange> exchange = nullptr,
             std::chrono::milliseconds timeout = std::chrono::milliseconds(120000));
  ~CudaClique() override;

  Transport transport() const { return transport_; }
  const std::vector<int>& devices() const { return devices_; }
  const std::vector<int64_t>& processes() const { return processes_; }
  bool spans_processes() const { return local_ranks_ != nranks(); }

  // Reserve, before call `epoch` of `rank` (the agreement check has passed):
  // creates what the transport needs (once) and a buffer generation as big
  // as `needs` (core/call.h: the same on every rank), and the rank's streams,
  // events and scratch for `program`. Returns the generation the call must
  // use, the rank's resources and its communicator.
  Status Reserve(const Program& program, const CallNeeds& needs, int64_t epoch,
                 const ErrorContext& ctx, const Generation** gen, RankResources** resources,
                 ncclComm_t* comm);

  // Aborts the NCCL communicators (the watchdog releasing stuck kernels).
  void AbortComms();

  std::string Describe() const;

 private:
  Status ReserveLocked(const Program& program, const CallNeeds& needs, int64_t epoch,
                       const ErrorContext& ctx, const Generation** gen,
                       RankResources** resources, ncclComm_t* comm);  // requires mu_
  Status EnablePeerAccess(const ErrorContext& ctx);           // requires mu_
  Status CreateComms(const ErrorContext& ctx);                // requires mu_
  Status NewGeneration(int64_t epoch, int64_t workspace_bytes, int32_t num_flags,
                       const ErrorContext& ctx);              // requires mu_
  Status AllocMulticast(Generation* gen, const ErrorContext& ctx);
  Status ShareMulticastObject(const DriverApi* drv, const CUmulticastObjectProp* prop,
                              MulticastRegion* region, const ErrorContext& ctx);  // spanning
  // Spanning processes: every process agrees on handles_ (and all run on one
  // host unless fabric handles work everywhere). `local` is this process's
  // own set-up so far: a failure is told to the peers, so that they fail at
  // once naming it instead of waiting for this process until the timeout.
  Status Negotiate(const ErrorContext& ctx, const Status& local = OkStatus());
  // A buffer of local rank `rank` that peers address: cudaMalloc'd, or (fabric)
  // cuMemCreate'd with a fabric handle and mapped for every local GPU.
  Status AllocShared(int32_t rank, size_t bytes, const ErrorContext& ctx,
                     std::unique_ptr<DeviceAlloc>* out);
  // Spanning processes: p2p (flags, workspace) and multicast (flags), through
  // CUDA IPC or fabric handles.
  Status ImportPeerBuffers(Generation* gen, const ErrorContext& ctx);
  Status ExportBuffer(const DeviceAlloc& buf, unsigned char* handle, uint64_t* bytes,
                      const ErrorContext& ctx);
  Status MapRemoteBuffer(const unsigned char* handle, uint64_t bytes, Generation* gen,
                         std::vector<std::byte*>* views, const ErrorContext& ctx);

  const Transport transport_;
  const std::vector<int> devices_;  // local ordinal of each rank (-1: another process's)
  const std::vector<int64_t> processes_;  // process of each rank
  const std::vector<int> local_devices_;  // this process's GPUs of the clique
  const int32_t local_ranks_;             // their number
  ncclUniqueId nccl_id_{};          // spanning cliques, transport nccl
  std::shared_ptr<Exchange> exchange_;  // spanning cliques, transports p2p and multicast
  const std::chrono::milliseconds timeout_;
  mutable std::mutex mu_;
  Handles handles_ = Handles::kUnset;   // spanning p2p / multicast (Negotiate)
  bool peers_enabled_ = false;
  std::vector<ncclComm_t> comms_;
  std::vector<std::unique_ptr<Generation>> generations_;  // newest last
  std::vector<std::unique_ptr<RankResources>> ranks_;

 protected:
  int32_t LocalRanks() const override { return local_ranks_; }
};

// Tests (the fake's reset changes the machine): probe fabric support again.
void ForgetFabricProbes();

}  // namespace jo::cuda
