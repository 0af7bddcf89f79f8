// The fake's one-launch all-reduce (cuda/kernels/allreduce_body.h): the SAME per-thread body
// as the GPU runs, phase by phase for every thread of every block, with the GPU-only operations
// modelled here. One poll of a launch runs one phase of each block that can go on, so the
// ranks' kernels interleave with each other and with the other streams.
//
// What is modelled, each from the PTX ISA's memory consistency model
// (https://docs.nvidia.com/cuda/parallel-thread-execution/#memory-consistency-model, §8.9):
//  * a block's phases are separated by bar.sync: a thread starts phase p + 1 only once every
//    thread of its block finished phase p (a wait is re-run until it is done);
//  * data another rank reads (anything stored into an area: a peer's through its mapping, the
//    own one, or every rank's through multimem.st) is NOT visible to other ranks when it is
//    stored: it becomes visible at a st.release.sys of its block that follows it in causality
//    order — a thread's own earlier stores, or any thread's before a bar.sync the releasing
//    thread passed since (§8.9.4 items 2 and 4; §8.9.5: base causality order is transitive) —
//    or when the kernel ends (§8.9.4, API synchronization);
//  * a read of data another rank stored must follow, in causality order, an ld.acquire.sys of
//    that rank's flag (of the round that released the data, at or past the writer's sequence
//    number) by a thread of the block and a bar.sync after it: otherwise it is reported ("read
//    before acquire"); so is a read of a location another rank stored to whose store was not
//    yet made visible;
//  * blocks share no barrier, and a block acquires only its own index's flags: a read of data
//    that another block stored or released — of a peer or of this rank — is reported, unless
//    the kernel that stored it had ended (visibility is kept per (rank, block, round, sequence
//    number) of the release);
//  * every access lies inside the launch's buffers (y; each rank's area, state words and the
//    multicast range; the fault record in page-locked host memory) and is naturally aligned
//    (PTX ISA, "Addresses as Operands"), else the device faults (sticky);
//  * a wait's clock is the GPUs' (the time the fake lets pass while stuck): a flag not reached
//    timeout_ns after a thread began waiting gives up, as the body says.
// Accesses through a CUDA IPC mapping (played processes) are keyed by their own address, so
// the visibility checks do not follow them across such aliases; the values still do.
// Config::allreduce_misuse runs the phases wrongly for the misuse checks: "release_early"
// (a thread releases right after its own stores, before its block's bar.sync) and
// "read_early" (a thread reduces right after its own wait, before its block's bar.sync); and
// "rank0_gives_up" makes rank 0 a rank stalled past its timeout while its peers are on time:
// its waits never see a flag and its clock jumps past the timeout at every read, so each of
// its waits gives up at its second poll.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/convert.h"
#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_kernels.h"
#include "cuda/kernels/allreduce_body.h"
#include "cuda/kernels/allreduce_table.h"

namespace jo::fake {
namespace {

namespace ar = cuda::kernel::ar;
using cuda::kernel::Elem;
using cuda::kernel::Thread;
using cuda::kernel::Vec;

struct Faulted {
  cudaError_t code;
  std::string what;
};

// A store another rank may read, not yet visible to it.
struct Pending {
  std::byte* dst;  // where it lands (canonical: the memory behind a multicast address)
  std::vector<std::byte> bytes;
};

// Who made the data at an address visible: the rank, the round of its release (-1: the
// kernel's end, which makes it visible to every block), the block that released it and that
// block's sequence number.
struct Made {
  int32_t writer = -1;
  int32_t round = -1;
  int32_t block = -1;
  uint32_t seq = 0;
};
// Who stored data not yet made visible: (rank, block).
using Storer = std::pair<int32_t, int32_t>;
// Flags acquired: (writer, round) -> the highest sequence number seen at or past the call's.
using Acquired = std::map<std::pair<int32_t, int32_t>, uint32_t>;
// a at or past b, as 32-bit sequence numbers compare (cyclically).
bool AtOrPast(uint32_t a, uint32_t b) { return static_cast<int32_t>(a - b) >= 0; }
void Note(Acquired* acquired, std::pair<int32_t, int32_t> flag, uint32_t seq) {
  const auto [it, fresh] = acquired->emplace(flag, seq);
  if (!fresh && AtOrPast(seq, it->second)) it->second = seq;
}

struct BlockRun;

// One launch's state (made when it starts: a replayed launch starts afresh).
struct Launch {
  std::string name;
  ar::Args args;
  bool multicast = false;
  int device = 0;
  int ptx_version = 0;
  int access = 0;
  std::string misuse;     // Config::allreduce_misuse
  bool reported = false;  // a visibility misuse was reported (once per launch)
  // Regions every access must fall in: [begin, end), and whether it holds data other ranks read.
  struct Region {
    std::byte* begin;
    std::byte* end;
    bool data;
    const char* what;
  };
  std::vector<Region> regions;
  std::vector<std::byte*> targets;  // multicast: half 0 of the memory behind mc, per bound device
  std::byte* own_target = nullptr;  // multicast: the own area's memory behind mc
  std::vector<BlockRun> blocks;
  int left = 0;  // blocks not done
};

struct ThreadRun {
  ar::ThreadState state;
  int64_t skew_ns = 0;           // "rank0_gives_up": how far its clock jumped
  bool done = false;             // finished the block's current phase
  int early = -1;                // a misuse check ran this phase early
  std::vector<Pending> pending;  // stores not yet ordered before a barrier
  Acquired seen;                 // flags acquired, no barrier yet
};

struct BlockRun {
  int phase = 0;
  ar::BlockShared shared{};
  std::vector<ThreadRun> threads;
  std::vector<Pending> ordered;  // stores before a barrier, not yet released
  Acquired acquired;             // flags acquired and barriered
};

// The fake's view of which rank made the data at each (canonical) address visible, and the
// stores still pending per address, across launches (reset with the fake).
std::map<const std::byte*, Made>& MadeBy() {
  static auto* made = new std::map<const std::byte*, Made>();
  return *made;
}
std::map<const std::byte*, Storer>& PendingBy() {
  static auto* pending = new std::map<const std::byte*, Storer>();
  return *pending;
}

DType DTypeOf(Elem e) {
  return e == Elem::kF32 ? DType::kF32 : e == Elem::kBF16 ? DType::kBF16 : DType::kF16;
}

class ArOps {
 public:
  ArOps(Launch* l, BlockRun* b, ThreadRun* t) : l_(l), b_(b), t_(t) {}

  template <int kBytes>
  Vec<kBytes> Load(const void* p) {
    const auto* at = static_cast<const std::byte*>(p);
    const Launch::Region& r = Check(at, kBytes, "load");
    if (r.data) CheckVisible(Canon(at), kBytes);
    Vec<kBytes> v{};
    std::memcpy(v.word, at, kBytes);
    return v;
  }

  template <int kBytes>
  void Store(void* p, const Vec<kBytes>& v) {
    auto* at = static_cast<std::byte*>(p);
    const Launch::Region& r = Check(at, kBytes, "store");
    if (!r.data) {
      std::memcpy(at, v.word, kBytes);
      return;
    }
    Buffer(Canon(at), v.word, kBytes);
  }

  template <Elem kElem>
  float ToFloat(uint32_t bits) const {
    return LoadElement(DTypeOf(kElem), &bits, 0);
  }
  template <Elem kElem>
  uint32_t FromFloat(float value) const {
    uint32_t bits = 0;
    StoreElement(DTypeOf(kElem), &bits, 0, value);
    return bits;
  }

  template <Elem kElem, int kBytes>
  void MultimemStore(void* mc, const Vec<kBytes>& v) {
    const size_t offset = McOffset(mc, kBytes, "multimem.st");
    for (std::byte* t : l_->targets) Buffer(t + offset, v.word, kBytes);
  }

  template <Elem kElem, int kBytes>
  Vec<kBytes> MultimemLoadReduce(const void* mc) {
    const size_t offset = McOffset(mc, kBytes, "multimem.ld_reduce");
    constexpr int kLanes = kBytes / cuda::kernel::ElemBytes(kElem);
    float sum[kLanes] = {};
    for (const std::byte* t : l_->targets) {
      CheckVisible(t + offset, kBytes);
      Vec<kBytes> part{};
      std::memcpy(part.word, t + offset, kBytes);
      for (int i = 0; i < kLanes; ++i)
        sum[i] += ToFloat<kElem>(cuda::kernel::GetLane<kElem>(part, i));
    }
    Vec<kBytes> v{};
    for (int i = 0; i < kLanes; ++i) cuda::kernel::SetLane<kElem>(&v, i, FromFloat<kElem>(sum[i]));
    return v;
  }

  void FenceProxyAlias() {}
  // fence.acq_rel.sys then a strong store is a release pattern: the thread's own stores go out.
  void FenceReleaseSys() {
    Flush(t_->pending, -1);
    std::atomic_thread_fence(std::memory_order_release);  // before the record's code (a host read)
  }

  uint64_t LoadAcquireSys(const uint64_t* p) {
    const auto* at = reinterpret_cast<const std::byte*>(p);
    Check(at, 8, "ld.acquire.sys");
    uint64_t v = 0;
    if (GivesUp()) return v;  // never sees a flag
    std::memcpy(&v, at, 8);
    int32_t round = 0, writer = 0;
    if (FlagOf(at, &round, &writer) && AtOrPast(static_cast<uint32_t>(v), b_->shared.seq))
      Note(&t_->seen, {writer, round}, static_cast<uint32_t>(v));
    return v;
  }

  void StoreReleaseSys(uint64_t* p, uint64_t v) {
    auto* at = reinterpret_cast<std::byte*>(p);
    Check(at, 8, "st.release.sys");
    int32_t round = -1, writer = 0;
    if (!FlagOf(at, &round, &writer)) round = -1;
    // Everything before it in causality order: the block's barrier-ordered stores, its own.
    Flush(b_->ordered, round);
    Flush(t_->pending, round);
    std::memcpy(at, &v, 8);
    ++S().side_effects;
  }

  // The fault record (page-locked host memory the watchdog reads from another thread while the
  // kernel may write it): atomic accesses, so the fake has no data race there.
  void StoreRelaxedSys(uint32_t* p, uint32_t v) {
    Check(reinterpret_cast<std::byte*>(p), 4, "st.relaxed.sys");
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
  }

  bool Claim(uint32_t* word) {
    Check(reinterpret_cast<std::byte*>(word), 4, "atomicCAS");
    uint32_t expected = 0;
    return __atomic_compare_exchange_n(word, &expected, 1u, false, __ATOMIC_RELAXED,
                                       __ATOMIC_RELAXED);
  }

  int64_t GlobalNs() {
    if (GivesUp()) t_->skew_ns += l_->args.timeout_ns + 1;
    return S().gpu_ns + t_->skew_ns;
  }

 private:
  const Launch::Region& Check(const std::byte* p, size_t bytes, const char* what) const {
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
      throw Faulted{cudaErrorMisalignedAddress, std::string(what) + " of " + std::to_string(bytes) +
                                                    " bytes at an address not aligned to it"};
    for (const Launch::Region& r : l_->regions)
      if (p >= r.begin && p + bytes <= r.end) return r;
    throw Faulted{cudaErrorIllegalAddress, std::string(what) + " of " + std::to_string(bytes) +
                                               " bytes outside the launch's buffers"};
  }

  size_t McOffset(const void* mc, size_t bytes, const char* what) const {
    const auto* p = static_cast<const std::byte*>(mc);
    const auto* base = reinterpret_cast<const std::byte*>(l_->args.mc);
    if (!l_->multicast || p < base || p + bytes > base + 2 * l_->args.area_bytes)
      throw Faulted{cudaErrorIllegalAddress, std::string(what) + " outside the multicast range"};
    if (reinterpret_cast<uintptr_t>(p) % bytes != 0)
      throw Faulted{cudaErrorMisalignedAddress, std::string(what) + " not naturally aligned"};
    if (l_->ptx_version < 90)
      throw Faulted{cudaErrorIllegalInstruction,
                    std::string(what) + " in code compiled for less than compute_90 (__trap())"};
    return static_cast<size_t>(p - base);
  }

  // The own area of a multicast launch is the memory behind the multicast address.
  std::byte* Canon(std::byte* p) const {
    if (l_->own_target == nullptr) return p;
    auto* own = reinterpret_cast<std::byte*>(l_->args.area[l_->args.rank]);
    if (p >= own && p < own + 2 * l_->args.area_bytes) return l_->own_target + (p - own);
    return p;
  }
  const std::byte* Canon(const std::byte* p) const { return Canon(const_cast<std::byte*>(p)); }

  // Whether `at` is a flag word of some rank's state, and whose/which round.
  bool FlagOf(const std::byte* at, int32_t* round, int32_t* writer) const {
    const ar::Args& a = l_->args;
    for (int32_t j = 0; j < a.nranks; ++j) {
      const auto* base = reinterpret_cast<const std::byte*>(a.state[j]);
      const int64_t word = (at - base) / 4;
      if (at < base || word >= ar::CounterWord(a.nranks)) continue;
      const int64_t flag = word / 2;
      *writer = static_cast<int32_t>(flag % a.nranks);
      *round = static_cast<int32_t>(flag / (int64_t{ar::kBlocks} * a.nranks));
      return true;
    }
    return false;
  }

  void Buffer(std::byte* dst, const void* bytes, size_t n) {
    Pending p{dst, std::vector<std::byte>(n)};
    std::memcpy(p.bytes.data(), bytes, n);
    t_->pending.push_back(std::move(p));
    PendingBy()[dst] = {l_->args.rank, Block()};
  }

  void Flush(std::vector<Pending>& stores, int32_t round) {
    for (Pending& p : stores) {
      std::memcpy(p.dst, p.bytes.data(), p.bytes.size());
      MadeBy()[p.dst] = Made{l_->args.rank, round, Block(), b_->shared.seq};
      PendingBy().erase(p.dst);
    }
    stores.clear();
  }

  int32_t Block() const { return static_cast<int32_t>(b_ - l_->blocks.data()); }
  bool GivesUp() const { return l_->misuse == "rank0_gives_up" && l_->args.rank == 0; }

  // Blocks share no barrier and a block acquires only its own index's flags, so data is
  // readable by block b of rank r only when it was made visible by the kernel's end, or stored
  // by block b of rank r itself, or released by block b of its writer in a round whose flag
  // this block acquired at (or past) the writer's sequence number (PTX ISA §8.9.5: no
  // base-causality path orders another block's stores before this read otherwise).
  void CheckVisible(const std::byte* at, size_t) const {
    const int32_t rank = l_->args.rank, block = Block();
    const auto pending = PendingBy().find(at);
    if (pending != PendingBy().end() && pending->second != Storer{rank, block})
      Report("reads data rank " + std::to_string(pending->second.first) + " (block " +
             std::to_string(pending->second.second) +
             ") stored without making it visible (not ordered before a release: a "
             "st.release.sys after a bar.sync)");
    const auto found = MadeBy().find(at);
    if (found == MadeBy().end() || found->second.round < 0) return;
    const Made& made = found->second;
    if (made.block != block) {
      Report("reads data block " + std::to_string(made.block) + " of rank " +
             std::to_string(made.writer) + " released: no flag of this block orders it");
      return;
    }
    if (made.writer == rank) return;
    const auto acquired = b_->acquired.find({made.writer, made.round});
    if (acquired == b_->acquired.end() || !AtOrPast(acquired->second, made.seq))
      Report("reads data rank " + std::to_string(made.writer) + " released in round " +
             std::to_string(made.round) +
             " before acquiring that flag (an ld.acquire.sys of it and a bar.sync after)");
  }

  void Report(const std::string& what) const {
    if (l_->reported) return;  // once per launch
    // A launch that gave up (the rank's broken word) reads whatever is there: not a misuse.
    uint32_t broken = 0;
    std::memcpy(&broken, l_->args.state[l_->args.rank] + ar::BrokenWord(l_->args.nranks), 4);
    if (broken != 0) return;
    l_->reported = true;
    Fail(l_->name + " on device " + std::to_string(l_->device) + " (rank " +
         std::to_string(l_->args.rank) + ", block " + std::to_string(b_ - l_->blocks.data()) +
         "): " + what);
  }

  Launch* l_;
  BlockRun* b_;
  ThreadRun* t_;
};

// The kernels: one host handle per (body, element type, width).
template <Elem kElem, int kBytes, bool kMulticast>
bool RunPhase(int phase, Launch& l, BlockRun& b, ThreadRun& t, const Thread& where) {
  ArOps ops(&l, &b, &t);
  return ar::AllReduceBody<kElem, kBytes, kMulticast>::Run(phase, ops, l.args, b.shared, t.state,
                                                           where);
}
using PhaseFn = bool (*)(int, Launch&, BlockRun&, ThreadRun&, const Thread&);

struct Kernel {
  PhaseFn run;
  bool multicast;
  int access;
};
std::map<std::string, Kernel>& Kernels() {
  static auto* k = new std::map<std::string, Kernel>();
  return *k;
}

// The barrier after a phase: every thread's stores so far are ordered before what follows, and
// every flag a thread acquired is the block's.
void Barrier(BlockRun& b) {
  for (ThreadRun& t : b.threads) {
    for (Pending& p : t.pending) b.ordered.push_back(std::move(p));
    t.pending.clear();
    for (const auto& [flag, seq] : t.seen) Note(&b.acquired, flag, seq);
    t.seen.clear();
    t.done = false;
  }
}

using Body = ar::AllReduceBody<Elem::kF32, 16, false>;  // the phase numbers (the same for all)

// Runs `phase` for every thread of block `bi` not done with it; true once all are.
bool RunBlockPhase(Launch& l, const Kernel& k, size_t bi, int phase) {
  BlockRun& b = l.blocks[bi];
  bool all = true;
  for (size_t ti = 0; ti < b.threads.size(); ++ti) {
    ThreadRun& t = b.threads[ti];
    if (t.done) continue;
    if (t.early == phase) {  // a misuse check ran it before the barrier already
      t.done = true;
      continue;
    }
    const Thread where{static_cast<uint32_t>(bi),
                       0,
                       0,
                       static_cast<uint32_t>(ar::kBlocks),
                       1,
                       1,
                       static_cast<uint32_t>(ti),
                       static_cast<uint32_t>(ar::kThreads)};
    t.done = k.run(phase, l, b, t, where);
    // Misuse checks: a thread runs the next phase before its block's barrier, instead of after.
    if (t.done && ((l.misuse == "release_early" && phase == Body::kScatter) ||
                   (l.misuse == "read_early" && phase == Body::kWait0))) {
      (void)k.run(phase + 1, l, b, t, where);
      t.early = phase + 1;
    }
    all = all && t.done;
  }
  return all;
}

// One poll: each block runs its current phase as far as it can; true once every block ended.
bool Poll(Launch& l, const Kernel& k) {
  try {
    for (size_t bi = 0; bi < l.blocks.size(); ++bi) {
      BlockRun& b = l.blocks[bi];
      if (b.phase >= Body::kPhases) continue;
      if (!RunBlockPhase(l, k, bi, b.phase)) continue;
      Barrier(b);
      ++b.phase;
      ++S().side_effects;
      if (b.phase >= Body::kPhases) --l.left;
    }
  } catch (const Faulted& f) {
    PoisonWhenPolled(l.device, f.code, l.name + ": " + f.what);  // not from inside this poll
    return true;
  }
  if (l.left > 0) return false;
  // The kernel's end makes everything it stored visible (PTX ISA §8.9.4, API synchronization).
  for (BlockRun& b : l.blocks) {
    for (ThreadRun& t : b.threads)
      for (Pending& p : t.pending) b.ordered.push_back(std::move(p));
    for (Pending& p : b.ordered) {
      std::memcpy(p.dst, p.bytes.data(), p.bytes.size());
      MadeBy()[p.dst] = Made{l.args.rank, -1, -1, 0};
      PendingBy().erase(p.dst);
    }
    b.ordered.clear();
  }
  return true;
}

// The memory behind multicast address `mc` per bound device, and which is `device`'s.
bool Targets(const void* mc, size_t bytes, int device, std::vector<std::byte*>* out,
             std::byte** own) {
  Alloc* a = Find(mc, bytes);
  if (a == nullptr || !a->multicast) return false;
  const size_t offset = static_cast<size_t>(static_cast<const std::byte*>(mc) - a->mem);
  const McObject& obj = S().mcs[a->mc];
  out->clear();
  *own = nullptr;
  for (const auto& [d, handle] : obj.bound) {
    std::byte* t = S().phys[handle].pages->mem + offset;
    out->push_back(t);
    if (d == device) *own = t;
  }
  return obj.bound.size() == obj.num_devices && *own != nullptr;
}

cudaError_t LaunchAllReduce(const std::string& name, int ptx_version, dim3 grid, dim3 block,
                            void** params, size_t shared, cudaStream_t stream) {
  Lock lock(S().mu);
  const auto kernel = Kernels().find(name);
  if (kernel == Kernels().end()) {
    Fail("cudaLaunchKernel " + name + ": not a one-launch all-reduce of this build");
    return cudaErrorInvalidDeviceFunction;
  }
  if (grid.x != static_cast<unsigned>(ar::kBlocks) || grid.y != 1 || grid.z != 1 ||
      block.x != static_cast<unsigned>(ar::kThreads) || block.y != 1 || block.z != 1 ||
      shared != 0) {
    Fail("cudaLaunchKernel " + name + ": launch configuration not the kernel's (" +
         std::to_string(ar::kBlocks) + " blocks of " + std::to_string(ar::kThreads) + ")");
    return cudaErrorInvalidConfiguration;
  }
  auto l = std::make_shared<Launch>();
  l->name = name;
  l->args = *static_cast<const ar::Args*>(params[0]);  // copied at launch, as CUDA does
  l->multicast = kernel->second.multicast;
  l->access = kernel->second.access;
  l->device = stream->device;
  l->ptx_version = ptx_version;
  l->misuse = S().config.allreduce_misuse;
  const ar::Args& a = l->args;
  const int device = stream->device;
  auto bad = [&](const std::string& what) {
    Fail("cudaLaunchKernel " + name + " on device " + std::to_string(device) + ": " + what);
    return cudaErrorInvalidValue;
  };
  if (a.nranks < 2 || a.nranks > ar::kMaxRanks || a.rank < 0 || a.rank >= a.nranks ||
      a.accesses < 1)
    return bad("ranks or length out of range");
  const size_t state_bytes = static_cast<size_t>(allreduce::StateWords(a.nranks)) * 4;
  const size_t area_bytes = static_cast<size_t>(2 * a.area_bytes);
  auto* y = static_cast<std::byte*>(a.y);
  if (!CheckAccess(y, static_cast<size_t>(a.accesses * l->access), device, (name + " y").c_str()))
    return bad("y outside its allocation");
  l->regions.push_back({y, y + a.accesses * l->access, false, "y"});
  for (int32_t j = 0; j < a.nranks; ++j) {
    auto* state = reinterpret_cast<std::byte*>(a.state[j]);
    if (!CheckAccess(state, state_bytes, device, (name + " state").c_str()))
      return bad("rank " + std::to_string(j) + "'s state words out of reach");
    l->regions.push_back({state, state + state_bytes, false, "state"});
    if (l->multicast && j != a.rank) continue;  // multicast: only the own area (and mc)
    auto* area = reinterpret_cast<std::byte*>(a.area[j]);
    if (!CheckAccess(area, area_bytes, device, (name + " area").c_str()))
      return bad("rank " + std::to_string(j) + "'s area out of reach");
    l->regions.push_back({area, area + area_bytes, true, "area"});
  }
  if (l->multicast && !Targets(a.mc, area_bytes, device, &l->targets, &l->own_target))
    return bad("the multicast side is not a bound multicast mapping of this device");
  auto* fault = reinterpret_cast<std::byte*>(a.fault);
  bool pinned = false;
  for (const auto& [base, bytes] : S().pinned)
    pinned = pinned || (reinterpret_cast<uintptr_t>(fault) >= base &&
                        reinterpret_cast<uintptr_t>(fault) + sizeof(ar::Fault) <= base + bytes);
  if (!pinned) return bad("the fault record is not in page-locked host memory (cudaMallocHost)");
  l->regions.push_back({fault, fault + sizeof(ar::Fault), false, "fault record"});
  const Kernel k = kernel->second;
  FakeTask task;
  task.what = name + " (rank " + std::to_string(a.rank) + ") on device " + std::to_string(device);
  task.sms = true;
  task.ready = [] { return true; };
  // A fresh run per start: a replayed launch begins again from its copied arguments.
  auto run = std::make_shared<std::shared_ptr<Launch>>();
  task.run = [run, l] {
    auto fresh = std::make_shared<Launch>(*l);
    fresh->blocks.assign(static_cast<size_t>(ar::kBlocks), BlockRun{});
    for (BlockRun& b : fresh->blocks) b.threads.assign(static_cast<size_t>(ar::kThreads), {});
    fresh->left = ar::kBlocks;
    *run = std::move(fresh);
  };
  task.done = [run, k] { return Poll(**run, k); };
  Push(stream, std::move(task));
  return cudaSuccess;
}

const char* ElemName(Elem e) { return e == Elem::kF32 ? "f32" : e == Elem::kBF16 ? "bf16" : "f16"; }

template <Elem kElem, int kBytes, bool kMulticast>
const void* Make() {
  const std::string name = std::string(kMulticast ? "AllReduceMulticast<" : "AllReducePeer<") +
                           ElemName(kElem) + ", " + std::to_string(kBytes) + " bytes>";
  {
    Lock lock(S().mu);
    Kernels()[name] = Kernel{&RunPhase<kElem, kBytes, kMulticast>, kMulticast, kBytes};
  }
  return RegisterKernel("AllReduce", name, kMulticast ? "multimem" : "add", &LaunchAllReduce);
}

template <Elem kElem, bool kMulticast>
const void* Pick(int bytes) {
  switch (bytes) {
    case 16:
      return Make<kElem, 16, kMulticast>();
    case 4:
      return Make<kElem, 4, kMulticast>();
    case 2:
      if constexpr (!kMulticast && cuda::kernel::ElemBytes(kElem) == 2)
        return Make<kElem, 2, kMulticast>();
      return nullptr;
  }
  return nullptr;
}

template <bool kMulticast>
const void* For(Elem elem, int bytes) {
  switch (elem) {
    case Elem::kF32:
      return Pick<Elem::kF32, kMulticast>(bytes);
    case Elem::kBF16:
      return Pick<Elem::kBF16, kMulticast>(bytes);
    case Elem::kF16:
      return Pick<Elem::kF16, kMulticast>(bytes);
    case Elem::kF8:
      return nullptr;
  }
  return nullptr;
}

}  // namespace

void ForgetAllReduceMemory() {
  Lock lock(S().mu);
  MadeBy().clear();
  PendingBy().clear();
}

}  // namespace jo::fake

namespace jo::cuda::kernel {

const void* AllReducePeerKernel(Elem elem, int bytes) { return fake::For<false>(elem, bytes); }
const void* AllReduceMulticastKernel(Elem elem, int bytes) { return fake::For<true>(elem, bytes); }

}  // namespace jo::cuda::kernel
