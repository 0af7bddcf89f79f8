// The fake's fused GEMM (cuda/fused/fused_gemm_launch.h, in place of the CUTLASS
// instantiations): the persistent kernel at tile level. What the real kernel
// does is CUTLASS's code plus the three extensions of fused_gemm_kernel.cuh;
// what is modelled here is what the executor and the other streams can see of
// it, from the same tile mapping (core/fused_tiles.h):
//  * it is sm_90a code: cudaFuncGetAttributes finds no image for any other
//    device (the kernel family "fused", fake_kernels.cc); the sm100 kernel is
//    sm_100a code (family "fused_sm100"), bf16 and f16;
//  * the sm100 kernel computes each 256-row MMA tile with the two CTAs of a
//    cluster (2-SM MMA, fused_gemm_kernel_sm100.cuh): its order is over MMA
//    tiles and CTA slot s holds CTA tile CtaTileAt(order, s, 2); each CTA waits
//    for its own 128 rows, but the pair's MMA reads both halves, so neither
//    half is computed (nor stored, nor released) before every flag of both
//    halves' rows is at the epoch. Both CTAs must wait: each loads its own
//    half of A into its own shared memory (the MMA of cta_group::2 reads its
//    operands from both CTAs' shared memory: PTX ISA, "tcgen05.mma", the
//    .cta_group::2 form issued by one CTA of the pair for both), so the
//    leader's wait covers its own rows only. With the test knob
//    Config::fused_pair_leader_waits_only the peer loads unwaited (the pair's
//    MMA starts once the leader's rows are in place): a peer half read before
//    its rows arrived is poisoned and reported as every early read is;
//  * its CTAs are persistent and hold the launch's sm_count SMs (every SM of the
//    device, but in the loopback, which shares them among the ranks of one
//    GPU, and for a release-only kernel, which leaves some to the reduction
//    beside it) until the last one ends: no other kernel of the device (a block
//    kernel, a cuBLASLt matmul, an NCCL group, another fused GEMM) that finds
//    no SM free starts meanwhile (fake_queues.cc); copies and stream memory
//    operations still run. A kernel that needs SMs queued behind it while the
//    kernel waits for it deadlocks, as the GPU may (docs/gpu-internals.md §5, rule 1);
//  * its output is released block by block: until a block's release flag is at
//    the epoch, a kernel, a copy or a multicast load-reduce that reads the
//    block's rows is a misuse (reported by ReadsUnreleased's callers), however
//    much of the block the tiles stored so far;
//  * CTA c takes the units of work c, c + ctas, ... (PersistentGrid), each one
//    output tile computed with the reference GEMM (f32 accumulation in K order,
//    rounded once: the fake cuBLASLt's arithmetic) once every flag of its
//    rows' blocks has reached the epoch; a tile completing a block raises the
//    block's release flag, counting in the launch's counters as the kernel does;
//  * a tile never reads rows before their data is there: the rows of a block
//    whose flag is not yet at the epoch are poisoned (read as NaN) and the read
//    is recorded as a misuse. Config::fused_flag_shift makes the kernel wait for
//    the flags of block b + shift instead (an off-by-one mapping) for the
//    misuse checks;
//  * no wait is unbounded (fused_gemm.h): a CTA whose tile has waited longer than
//    the launch's timeout_ns on the GPUs' clock (the time the fake lets pass while
//    stuck) records the first such flag in the fault record and gives up, and so
//    does every later wait of the launch, at once: the kernel ends, its results
//    garbage (rows read before their flag: NaN, not a misuse then).
//  * FP8 (fused_gemm_fp8.cuh): 128-column tiles, B read K-major (B^T), each
//    output element accumulated as Hopper's FP8 tensor cores do
//    (fp8_accumulator.h), promoted into float32 every promotion_interval x 32
//    elements of K as CUTLASS's FP8 mainloop does, then scaled by its row's
//    shard's scale times w's (the product rounded to float32 first), rounded
//    once to D's type. A row reads its shard's scale slot, which the programs
//    fill before the shard's first flag: reading the slot of a shard none of
//    whose flags is at the epoch (but the ready shard's) is a misuse, and reads
//    NaN. Config::fused_scale_shard_shift makes row i take shard (shard(i) +
//    shift)'s scale (a tile with the wrong shard's scale).
// One tile per poll of the kernel, so the other streams interleave with it.
// The launch as a whole is replaced: CUTLASS's own host calls inside it
// (cudaGetDriverEntryPoint[ByVersion], cuTensorMapEncodeTiled for A, B and D)
// are not observed here; the enqueue path's list names them (fake_waits.cc).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/convert.h"
#include "cuda/fake/fake_internal.h"
#include "cuda/fake/fake_kernels.h"
#include "cuda/fake/fake_waits.h"
#include "cuda/fake/fp8_accumulator.h"
#include "cuda/fused/fused_gemm_launch.h"

namespace jo::fake {
namespace {

using cuda::fused_kernel::Launch;

// The dynamic shared memory the fake kernel asks for: all a block may opt into.
constexpr int kSharedBytes = kMaxSharedBytesPerBlock;
// What a launch may ask for without an opt-in: more than 48 KB of dynamic shared memory per
// block needs cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) on the function
// first (CUDA runtime API, cudaFuncSetAttribute: cudaFuncAttributeMaxDynamicSharedMemorySize,
// "the maximum size in bytes of dynamically-allocated shared memory"; CUDA programming guide,
// "Compute Capabilities", shared memory: allocations above 48 KB per block need that explicit
// opt-in). The attribute belongs to the function as loaded in a device's context, so each
// device needs its own; without it the launch fails on the GPU (the call's error breaks the
// clique), which the fake refuses as a misuse.
constexpr int kSharedBytesWithoutOptIn = 48 * 1024;

// The element types of an instantiation: A, B and D.
struct Types {
  DType a, b, d;
};

struct FusedRun {
  Types types{DType::kBF16, DType::kBF16, DType::kBF16};
  bool fp8 = false;
  int64_t tile_cols = fused::kSm90Tile.cols;  // the kernel's CTA tile's (fused::CtaTileOf)
  int32_t pair = 1;                           // CTA tiles per MMA tile (sm100: 2)
  Launch launch;
  fused::PersistentGrid grid;
  int64_t m_tiles = 0;
  std::vector<int64_t> next;       // per CTA: its next unit of work
  int64_t left = 0;                // units not done
  int32_t shift = 0;               // Config::fused_flag_shift
  int32_t scale_shift = 0;         // Config::fused_scale_shard_shift
  bool leader_waits_only = false;  // Config::fused_pair_leader_waits_only
  size_t turn = 0;                 // the CTA polled first next time
  int device = 0;
  std::pair<int, int> where;  // (played process, device): whose SMs it holds ...
  int holds = 0;              // ... this many: the launch's sm_count (CTAs persist on them)
  bool poisoned_reported = false;
  std::vector<int64_t> waiting_since;  // per CTA: the GPUs' clock when its tile began waiting
  bool gave_up = false;                // a wait ran out of time (the fault record says which)
  std::string what;
};

bool AtEpoch(uint32_t flag, uint32_t epoch) { return static_cast<int32_t>(flag - epoch) >= 0; }

// Whether block b's rows are in place (its own flag, not the one a broken mapping names).
bool Arrived(const FusedRun& r, int32_t b) {
  const Launch& l = r.launch;
  if (l.wait_flags == nullptr || r.launch.blocks.Shard(b) == l.ready_shard) return true;
  return AtEpoch(l.wait_flags[b], l.epoch);
}

// The first flag tile `tile` waits for that is not at the epoch (-1: none; the block it
// guards).
int32_t MissingFlag(const FusedRun& r, int32_t tile) {
  const Launch& l = r.launch;
  if (l.wait_flags == nullptr) return -1;
  const fused::Range blocks = fused::Tiling{l.blocks, fused::kTileRows}.BlocksOf(tile);
  for (int32_t b = blocks.first; b <= blocks.last; ++b) {
    if (l.blocks.Shard(b) == l.ready_shard) continue;
    int32_t waited = b + r.shift;
    if (waited < 0) waited = 0;
    if (waited >= l.blocks.count()) waited = l.blocks.count() - 1;
    if (!AtEpoch(l.wait_flags[waited], l.epoch)) return waited;
  }
  return -1;
}

// The first flag the MMA tile holding CTA tile `tile` waits for that is not at the epoch (-1:
// none): its own rows', then (2-SM MMA) the other half's; with only the leader waiting
// (Config::fused_pair_leader_waits_only), the leader's rows only.
int32_t MissingFlagOfPair(const FusedRun& r, int32_t tile) {
  const int32_t first = tile - tile % r.pair;
  if (r.pair > 1 && r.leader_waits_only) return MissingFlag(r, first);
  const int32_t own = MissingFlag(r, tile);
  if (own >= 0) return own;
  for (int32_t t = first; t < first + r.pair && t < r.m_tiles; ++t) {
    const int32_t missing = t == tile ? -1 : MissingFlag(r, t);
    if (missing >= 0) return missing;
  }
  return -1;
}

// Whether CTA `cta` starts tile `tile`: every flag its MMA tile waits for is at the epoch, or
// the launch gave up waiting (its own timeout, or an earlier wait's: recorded in the fault
// record).
bool TileReady(FusedRun& r, size_t cta, int32_t tile) {
  if (r.gave_up) return true;
  const int32_t missing = MissingFlagOfPair(r, tile);
  if (missing < 0) {
    r.waiting_since[cta] = -1;
    return true;
  }
  if (r.waiting_since[cta] < 0) r.waiting_since[cta] = S().gpu_ns;
  const Launch& l = r.launch;
  if (l.timeout_ns <= 0 || S().gpu_ns - r.waiting_since[cta] <= l.timeout_ns) return false;
  r.gave_up = true;
  // The record (page-locked host memory when the launch traps, read by the watchdog while the
  // kernel may write it: atomic stores, `recorded` last with release).
  uint32_t unclaimed = 0;
  if (__atomic_compare_exchange_n(&l.fault->timed_out, &unclaimed, 1u, false, __ATOMIC_RELAXED,
                                  __ATOMIC_RELAXED)) {
    __atomic_store_n(&l.fault->flag, static_cast<uint32_t>(missing), __ATOMIC_RELAXED);
    __atomic_store_n(&l.fault->seen, l.wait_flags[missing], __ATOMIC_RELAXED);
    __atomic_store_n(&l.fault->epoch, l.epoch, __ATOMIC_RELAXED);
    __atomic_store_n(&l.fault->recorded, 1u, __ATOMIC_RELEASE);
    if (l.trap)  // __trap(): the device's sticky error, its queued work dropped
      PoisonWhenPolled(r.device, cudaErrorIllegalInstruction,
                       r.what + ": a wait gave up after its timeout (block " +
                           std::to_string(missing) + "), recorded why and trapped");
  }
  return true;
}

size_t ElemBytes(DType dtype) { return static_cast<size_t>(DTypeSize(dtype)); }

int MinExponent(DType fp8) { return fp8 == DType::kF8E5M2 ? kE5M2MinExponent : kE4M3MinExponent; }

// The dequantization scale of row i (FP8): its shard's slot (or, with
// Config::fused_scale_shard_shift, another shard's) times w's, rounded to
// float32. A slot is written before the first flag of its shard (build_ag.cc):
// one read while no flag of the shard is at the epoch (and not the ready
// shard's, in place before the launch) is a misuse and reads NaN.
float RowScale(FusedRun& r, int64_t i) {
  const Launch& l = r.launch;
  const int32_t shards = l.blocks.shards;
  int32_t shard = static_cast<int32_t>(i / l.blocks.shard_rows);
  shard = ((shard + r.scale_shift) % shards + shards) % shards;
  bool there = l.wait_flags == nullptr || shard == l.ready_shard || l.scales.x_stride == 0;
  for (int32_t c = 0; c < l.blocks.chunks && !there; ++c)
    there = AtEpoch(l.wait_flags[shard * l.blocks.chunks + c], l.epoch);
  if (!there) {
    if (!r.poisoned_reported && !r.gave_up) {
      r.poisoned_reported = true;
      Fail(r.what + ": a tile read the scale of shard " + std::to_string(shard) +
           " before any flag of the shard reached the epoch (its slot is poisoned: NaN)");
    }
    return std::nanf("");
  }
  return l.scales.x[shard * l.scales.x_stride] * *l.scales.w;
}

// One output element of an FP8 launch, before its scale: the K products of row i of A and
// row j of B^T, accumulated as Hopper's FP8 tensor cores do, promoted every
// promotion_interval wgmmas (32 elements of K each).
float Fp8Dot(const FusedRun& r, const std::byte* a, int64_t i, int64_t j) {
  const Launch& l = r.launch;
  Fp8TensorCore core = Fp8TensorCoreOf(90);  // the kernel is sm_90a code
  core.promotion = 32 * static_cast<int>(l.scales.promotion_interval);
  Fp8Accumulator acc(core, MinExponent(r.types.a), MinExponent(r.types.b));
  for (int64_t p = 0; p < l.k; ++p)
    acc.Add(LoadElement(r.types.a, a, i * l.lda + p), LoadElement(r.types.b, l.b, j * l.ldb + p));
  return acc.Result();
}

// D[l][tile rows][n tile] = A @ B with f32 accumulation (FP8: Hopper's accumulator, each row
// scaled); rows not yet in place read as NaN.
void ComputeTile(FusedRun& r, int32_t l_idx, int32_t tile, int32_t n_tile) {
  const Launch& l = r.launch;
  const int64_t row0 = tile * fused::kTileRows, col0 = n_tile * r.tile_cols;
  const int64_t rows = std::min<int64_t>(fused::kTileRows, l.m - row0);
  const int64_t cols = std::min<int64_t>(r.tile_cols, l.n - col0);
  const auto* a = static_cast<const std::byte*>(l.a) +
                  static_cast<size_t>(l_idx * l.a_batch_stride) * ElemBytes(r.types.a);
  auto* d = static_cast<std::byte*>(l.d) +
            static_cast<size_t>(l_idx * l.d_batch_stride) * ElemBytes(r.types.d);
  for (int64_t i = row0; i < row0 + rows; ++i) {
    const int32_t block = l.blocks.BlockOf(i);
    const bool there = Arrived(r, block);
    if (!there && !r.poisoned_reported && !r.gave_up) {
      r.poisoned_reported = true;
      Fail(r.what + ": a tile read rows of block " + std::to_string(block) +
           " before its flag reached the epoch (the rows are poisoned: NaN)");
    }
    if (r.fp8) {
      const float scale = RowScale(r, i);
      for (int64_t j = col0; j < col0 + cols; ++j)
        StoreElement(r.types.d, d, i * l.ldd + j,
                     there ? Fp8Dot(r, a, i, j) * scale : std::nanf(""));
      continue;
    }
    for (int64_t j = col0; j < col0 + cols; ++j) {
      float acc = 0.0f;
      for (int64_t p = 0; p < l.k; ++p)
        acc +=
            LoadElement(r.types.a, a, i * l.lda + p) * LoadElement(r.types.b, l.b, p * l.ldb + j);
      StoreElement(r.types.d, d, i * l.ldd + j, there ? acc : std::nanf(""));
    }
  }
}

// The tile is stored: count it into every block it touches; the tile
// completing a block releases the block's flag.
void Release(FusedRun& r, int32_t tile) {
  const Launch& l = r.launch;
  if (l.release_flags == nullptr) return;
  const fused::Tiling tiling{l.blocks, fused::kTileRows};
  const fused::Range blocks = tiling.BlocksOf(tile);
  for (int32_t b = blocks.first; b <= blocks.last; ++b) {
    const uint32_t expected = static_cast<uint32_t>(tiling.TilesOf(b).size()) *
                              static_cast<uint32_t>(r.grid.n_tiles * r.grid.batch);
    if (++l.counters[b] == expected) l.release_flags[b] = l.epoch;
  }
}

// One poll of the kernel: the first CTA (from a rotating start) whose next
// tile may start computes it. True once every unit is done (the SMs are free).
bool Poll(FusedRun& r) {
  const size_t ctas = r.next.size();
  for (size_t k = 0; k < ctas && r.left > 0; ++k) {
    const size_t c = (r.turn + k) % ctas;
    const int64_t unit = r.next[c];
    if (unit >= r.grid.work()) continue;
    int32_t l_idx = 0, slot = 0, n_tile = 0;
    r.grid.At(unit, &l_idx, &slot, &n_tile);
    const int32_t tile = fused::CtaTileAt(r.launch.order, slot, r.pair);
    if (tile < r.m_tiles) {
      if (!TileReady(r, c, tile)) continue;  // this CTA spins; the others go on
      ComputeTile(r, l_idx, tile, n_tile);
      Release(r, tile);
    }
    r.next[c] += static_cast<int64_t>(ctas);
    --r.left;
    r.turn = c + 1;
    ++S().side_effects;  // progress another stream may see (a released flag)
    break;
  }
  if (r.left > 0) return false;
  S().sms_held[r.where] -= r.holds;
  return true;
}

// The release-only kernels that run or are queued (their output is checked against reads).
std::vector<std::weak_ptr<FusedRun>>& Releasing() {
  static auto* runs = new std::vector<std::weak_ptr<FusedRun>>();
  return *runs;
}

// The first unreleased block a read of [p, p + bytes) touches in `r`'s output, or -1.
int32_t UnreleasedBlock(const FusedRun& r, const std::byte* p, size_t bytes) {
  const Launch& l = r.launch;
  const auto* d = static_cast<const std::byte*>(l.d);
  const int64_t es = static_cast<int64_t>(ElemBytes(r.types.d));
  const int64_t bs = l.batch > 1 ? l.d_batch_stride : 0;
  const int64_t span = ((l.batch - 1) * bs + (l.m - 1) * l.ldd + l.n) * es;
  if (p + bytes <= d || p >= d + span) return -1;
  const int64_t lo = std::max<int64_t>(0, (p - d) / es);
  const int64_t hi = std::min<int64_t>(span / es, (p + bytes - d + es - 1) / es);
  for (int64_t e = lo; e < hi;) {
    const int64_t batch = bs > 0 ? e / bs : 0;
    const int64_t rest = e - batch * bs, row = rest / l.ldd, col = rest % l.ldd;
    if (batch < l.batch && row < l.m && col < l.n) {
      const int32_t block = l.blocks.BlockOf(row);
      if (!AtEpoch(l.release_flags[block], l.epoch)) return block;
    }
    e = row + 1 < l.m ? batch * bs + (row + 1) * l.ldd : (batch + 1) * bs;
    if (bs == 0 && row + 1 >= l.m) break;
  }
  return -1;
}

bool Span(const void* p, size_t bytes, const std::string& what) {
  return CheckRange(p, bytes, what.c_str());
}

cudaError_t LaunchFused(const Types& types, int32_t pair, const Launch& l, cudaStream_t stream) {
  Count("cudaLaunchKernelEx");
  const void* function =
      pair == 1 ? FusedFunction(types.a, types.b, types.d) : FusedFunctionSm100(types.a);
  const bool fp8 = IsFp8(types.a);
  const std::string name = FunctionName(function);
  const int device = StreamDevice(stream);
  if (device < 0 || device != CurrentDevice()) {
    Fail(name + ": launched on an unknown stream or one of another device than the current");
    return cudaErrorInvalidResourceHandle;
  }
  if (const cudaError_t sticky = StickyError(device); sticky != cudaSuccess) return sticky;
  if (!FunctionRuns(function, device)) return cudaErrorNoKernelImageForDevice;
  // With lazy loading, a first launch loads the kernel (fake_waits.cc): Prepare has.
  if (!LoadFunction(device, name, "cudaLaunchKernelEx")) return cudaErrorUnknown;
  {
    Lock lock(S().mu);
    const auto grant = S().shared_grants.find({stream->process, device, function});
    const int granted =
        std::max(kSharedBytesWithoutOptIn, grant == S().shared_grants.end() ? 0 : grant->second);
    if (kSharedBytes > granted) {
      Fail(name + ": launched with " + std::to_string(kSharedBytes) +
           " bytes of dynamic shared memory on device " + std::to_string(device) + ", which " +
           (grant == S().shared_grants.end() ? std::string("never got cudaFuncSetAttribute(")
                                             : "got only " + std::to_string(grant->second) +
                                                   " bytes from cudaFuncSetAttribute(") +
           "cudaFuncAttributeMaxDynamicSharedMemorySize) for it: more than 48 KB per block needs "
           "that opt-in on each device (CUDA programming guide, \"Compute Capabilities\")");
      return cudaErrorInvalidValue;
    }
  }
  const auto span = [](int64_t batch, int64_t batch_stride, int64_t rows, int64_t ld,
                       int64_t cols) {
    return static_cast<size_t>((batch - 1) * batch_stride + (rows - 1) * ld + cols);
  };
  const int32_t blocks = l.blocks.count();
  const size_t b_span = fp8 ? span(1, 0, l.n, l.ldb, l.k) : span(1, 0, l.k, l.ldb, l.n);
  bool ok =
      Span(l.a, span(l.batch, l.a_batch_stride, l.m, l.lda, l.k) * ElemBytes(types.a),
           name + " A") &&
      Span(l.b, b_span * ElemBytes(types.b), name + " B") &&
      Span(l.d, span(l.batch, l.d_batch_stride, l.m, l.ldd, l.n) * ElemBytes(types.d), name + " D");
  if (fp8)
    ok = ok &&
         Span(l.scales.x, ((l.blocks.shards - 1) * l.scales.x_stride + 1) * sizeof(float),
              name + " x scales") &&
         Span(l.scales.w, sizeof(float), name + " w scale");
  if (l.wait_flags != nullptr) {
    ok = ok && Span(l.wait_flags, blocks * sizeof(uint32_t), name + " wait flags");
    if (!l.trap) {
      ok = ok && Span(l.fault, sizeof(cuda::FusedGemmFault), name + " fault record");
    } else if (!Pinned(l.fault, sizeof(cuda::FusedGemmFault))) {
      Fail(name +
           ": a trapping launch's fault record is not in page-locked host memory (after the "
           "trap the context's device memory cannot be read)");
      return cudaErrorInvalidValue;
    }
  }
  if (l.release_flags != nullptr)
    ok = ok && Span(l.release_flags, blocks * sizeof(uint32_t), name + " release flags") &&
         Span(l.counters, Launch::CounterBytes(blocks), name + " counters");
  if (!ok) return cudaErrorInvalidValue;
  // The launch zero-fills the counters on the stream first, as the real one does.
  if (l.release_flags != nullptr) {
    const cudaError_t zeroed = cudaMemsetAsync(l.counters, 0, Launch::CounterBytes(blocks), stream);
    if (zeroed != cudaSuccess) return zeroed;
  }
  Lock lock(S().mu);
  // For tests: the SMs the launch was given (the executor's, less those it left to the
  // reduction beside it).
  ++S().counters["fused GEMM on " + std::to_string(l.sm_count) + " SMs"];
  auto run = std::make_shared<FusedRun>();
  run->types = types;
  run->fp8 = fp8;
  run->tile_cols = fused::CtaTileOf(pair, fp8).cols;
  run->pair = pair;
  run->launch = l;
  run->m_tiles = (l.m + fused::kTileRows - 1) / fused::kTileRows;
  run->grid = fused::PersistentGrid::Make(run->m_tiles, (l.n + run->tile_cols - 1) / run->tile_cols,
                                          l.batch, l.sm_count);
  run->next.resize(static_cast<size_t>(run->grid.ctas));
  run->waiting_since.assign(run->next.size(), -1);
  for (size_t c = 0; c < run->next.size(); ++c) run->next[c] = static_cast<int64_t>(c);
  run->left = run->grid.work();
  run->shift = S().config.fused_flag_shift;
  run->scale_shift = S().config.fused_scale_shard_shift;
  run->leader_waits_only = S().config.fused_pair_leader_waits_only;
  run->device = device;
  run->where = {stream->process, device};
  run->holds = std::max(1, std::min(l.sm_count, S().config.sms));
  run->what = name + " (" + std::to_string(l.m) + " x " + std::to_string(l.n) + " x " +
              std::to_string(l.k) + ", batch " + std::to_string(l.batch) + ") on device " +
              std::to_string(device);
  FakeTask task;
  task.what = run->what;
  task.sms = true;
  task.persistent = true;
  task.holds_sms = run->holds;
  task.ready = [] { return true; };
  // Each start runs the launch from its beginning (a graph replays the task: fake_graphs.cc),
  // on progress of its own; `run` is the launch as enqueued.
  const std::shared_ptr<const FusedRun> launched = run;
  auto current = std::make_shared<std::shared_ptr<FusedRun>>();
  task.run = [launched, current] {
    auto run = std::make_shared<FusedRun>(*launched);
    *current = run;
    S().sms_held[run->where] += run->holds;
    if (run->launch.release_flags != nullptr) {  // from now on its output is being written
      auto& runs = Releasing();
      runs.erase(
          std::remove_if(runs.begin(), runs.end(), [](const auto& w) { return w.expired(); }),
          runs.end());
      runs.push_back(run);
    }
  };
  task.done = [current] { return Poll(**current); };
  Push(stream, std::move(task));
  return cudaSuccess;
}

}  // namespace

bool ReadsUnreleased(const void* p, size_t bytes, std::string* what) {
  Lock lock(S().mu);
  for (const auto& weak : Releasing()) {
    const std::shared_ptr<FusedRun> run = weak.lock();
    if (run == nullptr || run->left == 0) continue;  // gone or done: everything released
    const int32_t block = UnreleasedBlock(*run, static_cast<const std::byte*>(p), bytes);
    if (block < 0) continue;
    *what = "rows of block " + std::to_string(block) + " of the output of " + run->what +
            ", whose release flag is not at the epoch yet";
    return true;
  }
  return false;
}

void CheckReleased(const void* p, size_t bytes, const std::string& reader, bool* reported) {
  if (*reported) return;
  std::string what;
  if (!ReadsUnreleased(p, bytes, &what)) return;
  *reported = true;
  Fail(reader + " read " + what +
       ": a block of a fused GEMM that releases its output is complete only at its release "
       "(docs/gpu-internals.md §5); wait for the flag first");
}

void NoteSharedMemoryGrant(const void* function, int bytes) {
  const int device = CurrentDevice();
  Lock lock(S().mu);
  S().shared_grants[{t_process, device, function}] = bytes;
}

}  // namespace jo::fake

namespace jo::cuda::fused_kernel {

// Function<Name>, SharedBytes<Name> and Launch<Name> of one instantiation (fused_gemm_launch.h).
#define JO_FAKE_FUSED_INSTANCE(Name, A, B, D)                                                  \
  const void* Function##Name() { return fake::FusedFunction(DType::A, DType::B, DType::D); }   \
  int SharedBytes##Name() { return fake::kSharedBytes; }                                       \
  Status Launch##Name(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx) {    \
    JO_CUDA_CHECK(&ctx, fake::LaunchFused({DType::A, DType::B, DType::D}, 1, launch, stream)); \
    return OkStatus();                                                                         \
  }

JO_FAKE_FUSED_INSTANCE(BF16, kBF16, kBF16, kBF16)
JO_FAKE_FUSED_INSTANCE(F16, kF16, kF16, kF16)
JO_FAKE_FUSED_INSTANCE(E4M3_BF16, kF8E4M3, kF8E4M3, kBF16)
JO_FAKE_FUSED_INSTANCE(E4M3_F16, kF8E4M3, kF8E4M3, kF16)
JO_FAKE_FUSED_INSTANCE(E4M3_F32, kF8E4M3, kF8E4M3, kF32)
JO_FAKE_FUSED_INSTANCE(E5M2E4M3_BF16, kF8E5M2, kF8E4M3, kBF16)
#undef JO_FAKE_FUSED_INSTANCE

namespace {

// As the real launch (fused_gemm_kernel_sm100.cuh LaunchAs), it refuses an order not made over
// its 256-row MMA tiles before enqueueing anything.
Status LaunchSm100(DType dtype, const Launch& launch, cudaStream_t stream,
                   const ErrorContext& ctx) {
  const int64_t mma_rows = kSm100MmaPair * fused::kTileRows;
  if (launch.order.tiles != (launch.m + mma_rows - 1) / mma_rows)
    return Status(Code::kInternal, ctx.Describe() + ": the sm_100a fused GEMM's tile order has " +
                                       std::to_string(launch.order.tiles) + " tiles, not one per " +
                                       std::to_string(mma_rows) + "-row MMA tile of " +
                                       std::to_string(launch.m) + " rows (CheckFusedGemm)");
  JO_CUDA_CHECK(&ctx, fake::LaunchFused({dtype, dtype, dtype}, kSm100MmaPair, launch, stream));
  return OkStatus();
}

}  // namespace

const void* FunctionSm100BF16() { return fake::FusedFunctionSm100(DType::kBF16); }
int SharedBytesSm100BF16() { return fake::kSharedBytes; }
Status LaunchSm100BF16(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchSm100(DType::kBF16, launch, stream, ctx);
}
const void* FunctionSm100F16() { return fake::FusedFunctionSm100(DType::kF16); }
int SharedBytesSm100F16() { return fake::kSharedBytes; }
Status LaunchSm100F16(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx) {
  return LaunchSm100(DType::kF16, launch, stream, ctx);
}

}  // namespace jo::cuda::fused_kernel
