// One native call as every layer below the FFI boundary sees it (no XLA
// types): the decoded attributes, where the calling device sits in the rank
// table, what the call needs of its clique, and the call placed on a device.
//
// The lifecycle is the same on both platforms (docs/native.md): the FFI
// instantiate stage makes a call site (one custom call of one executable)
// with a CallDesc and its CallSite identity; the first execution on a device
// places the call there (PlaceCall: the rank, the program, the sizes, the
// agreement signature) and keeps it (PerDevice), and later executions only
// fetch it; each execution then runs the program on the site's clique (host
// executor) or enqueues it (CUDA executor).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/clique.h"
#include "core/program.h"
#include "core/status.h"

namespace jo {

// The mesh's devices in (group, rank) order: each one's process, JAX's
// global device id, and its ordinal within its process.
struct RankTable {
  int64_t axis_size = 0;
  std::vector<int64_t> processes;
  std::vector<int64_t> device_ids;
  std::vector<int64_t> ordinals;
};

// How the FFI names the calling device: XLA:CPU gives the global device id,
// XLA:GPU the local ordinal.
enum class DeviceNaming { kGlobalId, kLocalOrdinal };

// The calling device: its process, its device as the FFI names it, and, for
// a CPU call, its (rank, group) from the coords operand (-1: not given).
struct Caller {
  int64_t process = 0;
  int64_t device = 0;
  DeviceNaming naming = DeviceNaming::kGlobalId;
  int32_t rank = -1;
  int64_t group = -1;
};

// Where one device sits: its rank and group, and its group's ranks.
struct Placement {
  int32_t rank = -1;
  int64_t group = -1;
  std::vector<int64_t> processes;   // the process of each rank of the group
  std::vector<int64_t> device_ids;  // each rank's global device id
  std::vector<int> ordinals;        // each rank's local ordinal here, -1 for another process's
  bool spans_processes() const;
};

// Finds the caller in the table; a clear error when it is absent or listed
// twice (the mesh of the enclosing shard_map must contain it), or when its
// coords disagree with the table. An empty table (a CPU call in one process
// whose mesh was abstract where it lowered) takes the caller's coords. A device
// listed more than once (the CUDA loopback runner: several ranks on one GPU) is
// found by the caller's coords, which must then be given.
Status Place(const RankTable& table, const Caller& caller, const char* op, Placement* out);

// The call's operands and results on the device.
struct CallBuffers {
  const void* x = nullptr;
  const void* w = nullptr;
  // float32, one element: x's / w's dequantization scale; block scales (Problem::block_scaled):
  // e8m0 bytes laid out as x (k/32 per row) and as w ([k/32, cols]).
  const void* x_scale = nullptr;
  const void* w_scale = nullptr;
  void* y = nullptr;
  void* x_gathered = nullptr;  // ag_matmul with return_gathered
};

// Rows per batch of the call's operands x and y, and of the gathered x (0
// unless returned), from its canonical problem: the inverse of
// CanonicalProblem (below, docs/native.md §1), by the op's rows rule.
struct OperandRows {
  int64_t x = 0, y = 0, gathered = 0;
};
OperandRows OperandRowsOf(const Problem& q);

// Where a program's Ref points in one execution of the call: `io` (the
// operands and results), the executor's private `scratch` and
// `workspace(rank)`, the symmetric workspace of a rank; the scale slots lie
// after their buffer's elements (ScalesOffset). nullptr where a buffer is
// absent. The one resolution of both executors.
template <typename WorkspaceOf>
std::byte* Resolve(const Program& p, const CallBuffers& io, std::byte* scratch,
                   WorkspaceOf&& workspace, const Ref& ref) {
  const auto mutable_bytes = [](const void* b) {
    return static_cast<std::byte*>(const_cast<void*>(b));
  };
  const auto scales = [&](std::byte* buffer) {
    return buffer == nullptr ? nullptr : buffer + ScalesOffset(p, ref.buf);
  };
  std::byte* base = nullptr;
  switch (ref.buf) {
    case BufId::kX:
      base = mutable_bytes(io.x);
      break;
    case BufId::kW:
      base = mutable_bytes(io.w);
      break;
    case BufId::kY:
      base = static_cast<std::byte*>(io.y);
      break;
    case BufId::kXGathered:
      base = static_cast<std::byte*>(io.x_gathered);
      break;
    case BufId::kScratch:
      base = scratch;
      break;
    case BufId::kWorkspace:
      base = workspace(ref.rank);
      break;
    case BufId::kXScale:
      base = mutable_bytes(io.x_scale);
      break;
    case BufId::kWScale:
      base = mutable_bytes(io.w_scale);
      break;
    case BufId::kScratchScales:
      base = scales(scratch);
      break;
    case BufId::kWorkspaceScales:
      base = scales(workspace(ref.rank));
      break;
  }
  return base == nullptr ? nullptr : base + ref.offset * ElemBytes(p.problem, ref.buf);
}

// The custom call's attributes, checked and decoded: the problem the call
// becomes (its op, transport, chunks, bidirectional, tf32, algorithm, fused;
// nranks is the table's axis_size), whose shapes and dtypes the operands of
// each execution give (CanonicalProblem) and whose rank the placement does,
// and what the call needs besides: x's sharded dim, its clique and site, its
// timeout, the rank table.
struct CallDesc {
  Problem problem;
  int64_t axis = 0;
  int64_t clique_key = 0;
  int64_t site_key = 0;  // what the call is (CallSite), never 0
  int64_t timeout_ms = 120000;
  RankTable table;
};

// "[2,3,4]": how errors show dims.
std::string DimsText(const std::vector<int64_t>& dims);

// The shapes a call's results must have.
struct ResultShapes {
  std::vector<int64_t> y;
  std::vector<int64_t> x_gathered;  // ag_matmul's gathered x (its dtype is x's)
};

// The canonical problem (docs/native.md §1) of a call of `base` — its op,
// algorithm and nranks; every other field is copied — on x of dims `x` and w
// of dims `w`, x sharded on dim `axis`: batch, rows, k and cols by the op's
// rows rule (core/kinds.h), and the shapes its results must have.
// InvalidArgument, naming the operand or attribute and what it expected, for
// shapes the op does not take. The one rule of both executors' handlers and of
// the performance model (_host.canonical_problem).
Status CanonicalProblem(const Problem& base, const std::vector<int64_t>& x,
                        const std::vector<int64_t>& w, int64_t axis, Problem* out,
                        ResultShapes* shapes);

// What one call needs of its clique, per rank and per parity: the maximum
// over the programs of ALL ranks, so that every rank decides the same way
// whether the call needs bigger buffers (across processes each rank decides
// on its own). The one sizing rule of both executors.
struct CallNeeds {
  int64_t workspace_bytes = 0;
  int32_t num_flags = 0;
  int64_t mail_bytes = 0;     // bytes one rank Sends in one call (host mailbox)
  int32_t mail_messages = 0;  // Sends of one rank in one call
};
Status NeedsOf(const Problem& problem, CallNeeds* out);

// Who a call site is, in every process.
//
// Every process must find the same site for the same custom call, whatever
// else it compiled before (the chief's extra AOT compile, a background
// thread, another order of jit calls): a site is named by what it is, never
// by when it was made. The lowering rule computes the call's `site_key` (a
// hash of the lowered module's name, the call's name stack, its input types,
// its attributes and its ordinal among the native calls of that lowering:
// jaxoverlap/_native/site_key.py), identical in every process.
//
// JAX may lower one native call once and XLA then inline it at several places
// (a nested jit called twice, a partition callback's module): those
// instances of one executable carry the same site_key, and XLA instantiates
// them one after another. They get sibling indices 1, 2, ... in that order,
// which every process repeats (same program, same order): the site id is the
// site_key for the first and a hash of (site_key, index) for the others. An
// instance starts again at 1 when its site_key was lowered again since its
// predecessor was made (a new program: jit, AOT and a persistent-cache hit
// all lower first; XLA instantiates on a compile thread of its own, so the
// note is per key, not per thread) or the predecessor is gone; so the same
// program compiled twice while the first executable lives (AOT and jit,
// jax.clear_caches) gets the same ids, and a process's extra compiles shift
// nothing. Not covered: the same program made twice without lowering it in
// between, both alive (two deserializations of one serialized executable):
// the second gets the next indices, and its calls wait for peers that
// never come (the timeout names the site each process is in).
class CallSite {
 public:
  CallSite() = default;
  // The instantiate stage, on XLA's compiling thread.
  static CallSite Instantiate(int64_t site_key);

  int64_t id() const;      // the same in every process (0 for a default CallSite)
  int64_t serial() const;  // unique in this process: this instance

  struct Token;  // what the instance holds (call.cc)

 private:
  std::shared_ptr<const Token> token_;
};

// The native call `site_key` was lowered (the lowering rule calls it through
// the extensions' note_lowering): its next instance belongs to a new program.
void NoteLowering(int64_t site_key);

// "site 0x0123456789abcdef": how errors name a site id.
std::string SiteName(int64_t site);

// One call site's call placed on one device: its rank and the program that
// rank runs, with what every rank must agree on.
struct PlacedCall {
  Placement place;
  Program program;  // of place.rank; program.problem is the whole problem
  CallNeeds needs;
  // What every rank must agree on: the call (everything but the rank) and the
  // site, so that two sites with calls of the same shape never match.
  std::string signature;
  CliqueKey clique;  // (clique_key, group, site id)
};

// `problem` is the call's canonical problem without its rank (from the
// operands); places the device and builds the program. `site` is the site id.
Status PlaceCall(const CallDesc& desc, const Problem& problem, int64_t site, const Caller& caller,
                 PlacedCall* out);

// What a call site keeps per calling device (HostSite, CudaSite): made by the
// first execution on the device, fetched by later ones. Keyed by (process,
// device, rank): the host-side fake plays several processes in one, whose
// devices share ordinals, and the CUDA loopback runner (cuda/loopback.h) puts
// several ranks on one device, each caller naming its rank (every other caller's
// rank is -1, or fixed by its device). `make` (Status(T*)) runs under the lock,
// so once per device
// however its first executions race; a failure is not kept (the next
// execution tries again).
template <typename T>
class PerDevice {
 public:
  template <typename Make>
  Status Get(const Caller& caller, Make&& make, std::shared_ptr<const T>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::tuple<int64_t, int64_t, int32_t> key{caller.process, caller.device, caller.rank};
    auto it = made_.find(key);
    if (it == made_.end()) {
      auto fresh = std::make_shared<T>();
      JO_CHECK(make(fresh.get()));
      it = made_.emplace(key, std::move(fresh)).first;
    }
    *out = it->second;
    return OkStatus();
  }

 private:
  std::mutex mu_;
  std::map<std::tuple<int64_t, int64_t, int32_t>, std::shared_ptr<const T>> made_;
};

// This process's index in the jax.distributed job (0 alone), set from Python
// when the handlers are registered.
void SetProcessIndex(int64_t index);
int64_t ProcessIndex();

// The call as every rank of a clique must see it (everything but the rank):
// ranks that disagree on it at the same epoch are running different calls.
std::string CallSignature(const Problem& q);

// JAXOVERLAP_LOG=debug: prints each distinct program once (rank 0 prints it);
// `executor` names who runs it ("host", "cuda").
void LogPlanOnce(const Program& program, const CliqueKey& key, const char* executor);

}  // namespace jo
