// What a GPU clique's set-up works on: its devices and processes, how it
// reaches peers in other processes, what it has created (communicators,
// per-rank streams and events), and the buffer generations calls run on.
//
// The transports (transports.h) and the peer-handle exchange
// (peer_handles.h) are free functions over a CliqueState; CudaClique
// (cuda_clique.h) owns one and serialises every use of it.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/exchange.h"
#include "core/program.h"
#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/base/device_memory.h"
#include "cuda/transport/nccl_comms.h"

namespace jo::cuda {

// The two events of one call on XLA's stream, the watchdog's view of it: `started`, recorded
// before the call's first work (when the GPU gets there, the call's clock starts), and `done`,
// after it. Every call has a pair of its own for as long as anyone holds it (the watchdog, until
// the call is done; the rank's `last`), so a pending call's events are never re-recorded by a
// later call, however far the host runs ahead of the GPU. Released pairs go back to their
// rank's pool (made at set-up: creating events is not on the enqueue path's list).
struct CallEvents {
  cudaEvent_t started = nullptr;
  cudaEvent_t done = nullptr;
};
class EventPool;

// Buffer generations. GPU work is asynchronous: when a call needs a bigger
// workspace, peers' streams may still run the previous call on the old one.
// So a new Generation is made, valid from the epoch of the call that needed
// it (every rank makes the same calls, so every rank switches at the same
// epoch), and an old one is freed only once every rank is past it
// (CudaClique: this process's ranks have finished a call of a newer
// generation on the GPU; a peer in another process touches a rank's buffers
// only before it signals that rank in the same call, which that rank's call
// waits for). Within a generation, calls alternate between two halves by
// epoch parity (docs/native.md §4; the fork and join of every call on XLA's
// stream make the host argument hold on the GPU too).
struct Generation {
  int64_t since_epoch = 0;
  int64_t workspace_bytes = 0;  // per parity per rank
  int32_t num_flags = 0;        // per parity per rank
  // Halves (parities) allocated: 2, or 1 for a replayable program's buffers (CudaClique::
  // ReplayArea), which run at epoch 0 only.
  int32_t halves = 2;
  // This process's ranks' buffers (null for another process's rank).
  std::vector<std::unique_ptr<DeviceAlloc>> workspace;  // per rank (nccl, p2p)
  std::vector<std::unique_ptr<DeviceAlloc>> flags;      // per rank: halves * num_flags uint32
  std::unique_ptr<MulticastRegion> multicast;           // multicast transport
  // Per rank (this process's, with flags): page-locked host memory the watchdog reads the
  // rank's flags into (halves * num_flags uint32).
  std::vector<std::unique_ptr<PinnedHost>> flag_reads;
  // Cliques spanning processes: other processes' ranks' buffers as local rank
  // `viewer` addresses them, remote[viewer][rank]; `mappings` owns them.
  struct Remote {
    std::byte* flags = nullptr;
    std::byte* workspace = nullptr;
  };
  std::vector<std::vector<Remote>> remote;
  std::vector<std::unique_ptr<DeviceAlloc>> mappings;

  // The first call of local rank `rank` on this generation, once its `done` event was recorded:
  // when it is done on the GPU, so is every call of that rank on older generations (a rank's
  // calls complete in order on XLA's stream).
  void NoteFirstUse(int32_t rank, const std::shared_ptr<const CallEvents>& call) const;
  std::shared_ptr<const CallEvents> FirstUse(int32_t rank) const;

  // Addresses as seen by local rank `viewer` (the rank whose GPU runs the op).
  std::byte* Workspace(int32_t rank, int64_t epoch, int32_t viewer) const;  // unicast
  std::byte* MulticastAddress(int64_t epoch) const;                         // parity of epoch
  CUdeviceptr Flag(int32_t rank, int64_t epoch, int32_t id, int32_t viewer) const;

 private:
  mutable std::mutex use_mu_;
  mutable std::map<int32_t, std::shared_ptr<const CallEvents>> first_use_;
};

// The one-launch all-reduce's fixed area (core/allreduce_layout.h; docs/gpu-internals.md §7): a
// generation whose workspace halves are the kernel's data halves and whose flags are the ranks'
// state words, made once per clique (zero-filled) and never replaced — a captured call keeps
// these addresses for as long as its executable lives — and, per local rank, the kernel's fault
// record in page-locked host memory, which the watchdog reads.
// A replayable program's own buffers (CudaClique::ReplayArea, docs/gpu-internals.md §8) are the
// same shape: a generation (its programs use half 0) and, per local rank, the fault record of
// its bounded flag waits (kernels/flag_wait_body.h fw::Fault) and of its fused GEMM's waits
// (FusedGemmFault); `replay` says which records it has.
struct KernelArea {
  std::shared_ptr<Generation> gen;
  std::vector<std::unique_ptr<PinnedHost>> faults;        // per rank (this process's ranks)
  std::vector<std::unique_ptr<PinnedHost>> fused_faults;  // per rank (`replay` only)
  bool replay = false;  // the records are fw::Faults (a replayable program's), not ar::Faults
  // A replayable program's: its op's name and its first acknowledgement flag (the watchdog's
  // report names them; core/build_internal.h Acknowledge).
  std::string op;
  int32_t acks = -1;
};

// What a call needs of each local rank's pool: the largest need of any rank's program (every
// rank makes the same calls, so every local rank's pool grows to it at the same epoch).
struct PoolNeeds {
  size_t scratch = 0;         // ScratchBytes (elements, then scales)
  size_t fused_state = 0;     // the fused GEMM's fault record and counters (FusedStateBytes)
  int32_t workspaces = 0;     // program streams with a GEMM's cuBLASLt workspace: 0..n-1
  size_t warm = 0;            // the largest new GEMM's warm-up (WarmUpBytes)
  int32_t connect_ranks = 0;  // transport nccl: the connect buffer's clique size (0: none)
};

// A rank's pooled device memory as one call sees it: immutable, replaced when the pool grows
// (the memory of an outgrown snapshot stays allocated until teardown).
struct RankPool {
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  void* fused_state = nullptr;  // FusedGemmFault, then a tile counter per row block
  size_t fused_bytes = 0;
  std::vector<void*> workspaces;   // per program stream, kGemmWorkspaceBytes each
  void* warm_workspace = nullptr;  // kGemmWorkspaceBytes: the GEMM warm-ups'
  void* warm = nullptr;            // the GEMM warm-ups' operands
  size_t warm_bytes = 0;
  bool connect = false;  // RankResources' connect stream and buffer are made (transport nccl)
  // With fused_state: page-locked memory the watchdog reads the fault record into.
  std::shared_ptr<PinnedHost> fault_read;
};

// Per-rank execution resources: comm streams, events, the pooled device memory.
struct RankResources {
  int device = -1;
  std::vector<cudaStream_t> streams;       // program streams 1.. (stream 0 is XLA's)
  std::vector<cudaEvent_t> events;         // program events, then fork/join
  std::shared_ptr<EventPool> call_events;  // CallEvents not in use
  cudaStream_t setup = nullptr;            // zero-fills new buffers
  cudaEvent_t setup_done = nullptr;        // recorded after the zero-fills, polled (AwaitSetup)
  // Transport nccl: where the rank's communicators connect to their peers at set-up
  // (NcclComms::Connect): a stream and one float to send, one per rank to receive.
  cudaStream_t connect = nullptr;
  cudaEvent_t connect_done = nullptr;  // recorded after a connecting group, polled
  std::unique_ptr<DeviceAlloc> connect_buffer;
  RankResources() = default;
  RankResources(const RankResources&) = delete;
  RankResources& operator=(const RankResources&) = delete;
  ~RankResources();
  // Grows streams and events to what `program` needs and takes the call's CallEvents (set-up,
  // before the call's first enqueue; nothing here allocates device memory: GrowPool does).
  Status Reserve(const Program& program, const ErrorContext& ctx,
                 std::shared_ptr<const CallEvents>* events);
  // The events of a call that reserves nothing else (a one-launch all-reduce's execution).
  Status TakeEvents(const ErrorContext& ctx, std::shared_ptr<const CallEvents>* events);
  // The pool: scratch, the fused GEMM's state, the cuBLASLt workspaces and warm-up buffers (and,
  // transport nccl, the connect buffer). Allocating or freeing device memory waits for the
  // device and for every peer that maps its memory (peer access), whose queued work may wait for
  // this very rank's next call: so the pool only grows, by the first local rank to reserve an
  // epoch, for every local rank, while the others wait before they reserve it (CudaClique's
  // barrier, the one past generations are freed under: docs/gpu-internals.md §1), and is freed only
  // at teardown. A growth at least doubles what it grows, so outgrown memory kept until then is at
  // most what the pool holds.
  bool PoolCovers(const PoolNeeds& needs) const;
  Status GrowPool(const PoolNeeds& needs, const ErrorContext& ctx);
  std::shared_ptr<const RankPool> Pool() const;
  // The setup stream and its event (before buffers are zero-filled on it).
  Status MakeSetup(const ErrorContext& ctx);
  // The connect stream and buffer, for a clique of `nranks` (transport nccl; GrowPool).
  Status MakeConnect(int32_t nranks, const ErrorContext& ctx);
  // The events of the last call whose `done` event was recorded (for freeing generations;
  // null: none yet).
  void SetLast(std::shared_ptr<const CallEvents> events);
  std::shared_ptr<const CallEvents> Last() const;

 private:
  mutable std::mutex last_mu_;
  std::shared_ptr<const CallEvents> last_;
  mutable std::mutex pool_mu_;  // guards pool_ (the snapshot), held only to swap or copy it
  std::shared_ptr<const RankPool> pool_ = std::make_shared<RankPool>();
  std::vector<std::unique_ptr<DeviceAlloc>> pool_memory_;  // every allocation, outgrown too
};

// How peers' buffers reach a process (cliques spanning processes).
enum class Handles { kUnset, kIpc, kFabric };

struct CliqueState {
  Transport transport = Transport::kNccl;
  std::vector<int> devices;                   // local ordinal of each rank (-1: another process's)
  std::vector<int64_t> processes;             // process of each rank
  std::vector<int> local_devices;             // this process's GPUs of the clique
  int32_t local_ranks = 0;                    // their number
  ncclUniqueId nccl_id{};                     // spanning cliques, transport nccl
  std::shared_ptr<Exchange> exchange;         // spanning cliques, transports p2p and multicast
  std::chrono::milliseconds timeout{120000};  // bounds waiting for peers in set-up
  Handles handles = Handles::kUnset;          // spanning p2p / multicast (peer_handles.h Negotiate)
  bool peers_enabled = false;
  // Transport nccl: this process's ranks' communicators (shared with the watchdog's watch of
  // their aborts).
  std::shared_ptr<NcclComms> nccl;
  std::vector<std::unique_ptr<RankResources>> ranks;

  int32_t nranks() const { return static_cast<int32_t>(devices.size()); }
  bool spans_processes() const { return local_ranks != nranks(); }
};

// This process's ranks' flags and (with_workspace) workspace for `gen`:
// cudaMalloc'd, or cuMemCreate'd with a fabric handle when peers map them so;
// zero-filled on each rank's setup stream (not waited for: AwaitSetup).
Status AllocLocalBuffers(CliqueState& s, Generation* gen, bool with_workspace,
                         const ErrorContext& ctx);

// Waits, polling and at most `s.timeout`, until every local rank's setup
// stream has run what was enqueued on it (the zero-fills of a new
// generation), so that no peer can use the buffers before. Never called
// with a lock held that another rank, the watchdog or a peer needs to make
// progress: the setup stream may share a hardware queue with earlier calls
// that wait for peers (CUDA_DEVICE_MAX_CONNECTIONS).
Status AwaitSetup(CliqueState& s, const ErrorContext& ctx);

}  // namespace jo::cuda
