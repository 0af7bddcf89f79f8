// The fused GEMM's tiles and flags: which flags a tile of rows waits for
// (all-gather + GEMM) or feeds (GEMM + reduce-scatter), and the order the
// persistent kernel takes its tiles in. ONE source, compiled by nvcc for the
// kernel (cuda/fused/fused_gemm_kernel.cuh) and by the host compiler for the
// launcher and the tests (tests/native/test_fused_tiles.py), so the mapping
// the tests check is the one the GPU runs.
//
// Rows are those of the GEMM's M dimension: AG's gathered input (every
// rank's shard, shard s at rows s*R..), RS's partial products (destination
// shard s at rows s*R..). The programs (core/build_ag.cc, build_rs.cc) split
// each shard into `chunks` sub-chunks and give each (shard, sub) one flag:
// block b = shard * chunks + sub, flag b. The kernel cuts the same rows into
// tiles of `tile_rows` (its CTA tile's M); a tile may straddle blocks (and
// shards) and a block may span tiles, so a tile waits for, or feeds, every
// block its rows touch.
//
// Tile order. The kernel's persistent CTAs take M tiles in an order given by
// a sequence of blocks: the order blocks ARRIVE (AG: the local shard first,
// then the ring's arrivals) or LEAVE (RS: the order the comm stream sends
// destination chunks). A tile's key is the position, in that sequence, of the
// last block it needs (AG: it can start once that one arrived) or of the first
// block it feeds (RS: it must be done before that one leaves); tiles run by
// key, then by index. The tiles of one key are consecutive (a tile's blocks
// are a consecutive range, and both ends of that range move forward with the
// tile), so the order is a list of runs of consecutive tiles, small enough to
// pass in the kernel's parameters.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JO_FUSED_FN __host__ __device__ __forceinline__
#else
#define JO_FUSED_FN inline
#endif

namespace jo::fused {

// The rows of every fused kernel's CTA tile: the tiles the rows are cut into.
inline constexpr int64_t kTileRows = 128;

// A CTA tile of D: the unit of work of a kernel's persistent grid (PersistentGrid below,
// m_tiles x n_tiles of them). One definition per kernel, which the kernels' static_asserts
// hold their tile shapes to, the fake computes with, and the CUDA executor counts waves with
// (SpareSms); jaxoverlap/_fused_gemm.py FUSED_KERNELS mirrors it (tests/native/
// test_fused_tiles.py reads both).
struct CtaTile {
  int64_t rows = 0;
  int64_t cols = 0;
};
// sm_90a, bfloat16 / float16 (cuda/fused/fused_gemm_kernel.cuh): 128 x 256 x 64.
inline constexpr CtaTile kSm90Tile{kTileRows, 256};
// sm_90a, FP8 (cuda/fused/fused_gemm_fp8.cuh): 128 x 128 x 128, CUTLASS's promoting FP8
// mainloop. Half the columns of the 16-bit tile: twice the N tiles.
inline constexpr CtaTile kSm90Fp8Tile{kTileRows, 128};
// sm_100a, bfloat16 / float16 (cuda/fused/fused_gemm_kernel_sm100.cuh): 2-SM MMA tiles of
// 256 x 256 x 64, each CTA of a cluster's pair computing a 128 x 256 half; the grid strides
// over those halves (PersistentGrid's M slots are CTA tiles), so its units are the sm_90a
// 16-bit kernel's.
inline constexpr CtaTile kSm100Tile{kTileRows, 256};

// The CTA tile of the kernel whose MMA tile spans `pair` CTA tiles (2: sm_100a, 1: sm_90a)
// for 8-bit operands (`fp8`; sm_90a only) or 16-bit ones.
JO_FUSED_FN constexpr CtaTile CtaTileOf(int32_t pair, bool fp8) {
  return pair == 2 ? kSm100Tile : fp8 ? kSm90Fp8Tile : kSm90Tile;
}

// `shards` shards of `shard_rows` rows, each split into `chunks` sub-chunks
// as the program builders split them (build_internal.h SubBegin: sub-chunk c
// starts at shard_rows * c / chunks).
struct RowBlocks {
  int32_t shards = 1;
  int32_t chunks = 1;
  int64_t shard_rows = 1;

  JO_FUSED_FN int32_t count() const { return shards * chunks; }
  JO_FUSED_FN int64_t rows() const { return shards * shard_rows; }
  // Every sub-chunk has at least one row (the builders clamp chunks to rows).
  JO_FUSED_FN bool valid() const { return shards >= 1 && chunks >= 1 && shard_rows >= chunks; }
  JO_FUSED_FN int64_t Begin(int32_t block) const {
    const int64_t shard = block / chunks, sub = block % chunks;
    return shard * shard_rows + shard_rows * sub / chunks;
  }
  JO_FUSED_FN int64_t End(int32_t block) const { return Begin(block + 1); }
  JO_FUSED_FN int32_t Shard(int32_t block) const { return block / chunks; }
  // The block holding `row` (0 <= row < rows()): the last sub-chunk c with
  // shard_rows * c / chunks <= row - shard start.
  JO_FUSED_FN int32_t BlockOf(int64_t row) const {
    const int64_t shard = row / shard_rows, x = row % shard_rows;
    return static_cast<int32_t>(shard * chunks + (chunks * (x + 1) - 1) / shard_rows);
  }
};

// Inclusive ranges; empty when last < first.
struct Range {
  int32_t first = 0;
  int32_t last = -1;
  JO_FUSED_FN int32_t size() const { return last < first ? 0 : last - first + 1; }
};

// The row blocks cut into tiles of `tile_rows` rows (the last tile may be short).
struct Tiling {
  RowBlocks blocks;
  int64_t tile_rows = 1;

  JO_FUSED_FN int32_t tiles() const {
    return static_cast<int32_t>((blocks.rows() + tile_rows - 1) / tile_rows);
  }
  // The blocks tile `tile`'s rows touch (none for a tile past the last row:
  // a persistent scheduler may hand out such padding tiles).
  JO_FUSED_FN Range BlocksOf(int32_t tile) const {
    const int64_t begin = tile * tile_rows;
    if (tile < 0 || begin >= blocks.rows()) return Range{};
    const int64_t end = begin + tile_rows < blocks.rows() ? begin + tile_rows : blocks.rows();
    return Range{blocks.BlockOf(begin), blocks.BlockOf(end - 1)};
  }
  // The tiles whose rows touch block `block`.
  JO_FUSED_FN Range TilesOf(int32_t block) const {
    return Range{static_cast<int32_t>(blocks.Begin(block) / tile_rows),
                 static_cast<int32_t>((blocks.End(block) - 1) / tile_rows)};
  }
};

enum class OrderKey : int32_t {
  kLastArrival = 0,     // AG: a tile runs once the last block it reads arrived
  kFirstDeparture = 1,  // RS: a tile runs before the first block it writes leaves
};

// The order of the M tiles: runs of consecutive tiles, run r holding tiles
// first[r] .. first[r] + (end[r] - end[r-1]) - 1 at slots end[r-1] .. end[r] - 1.
struct TileOrder {
  static constexpr int32_t kMaxRuns = 64;
  int32_t tiles = 0;
  int32_t runs = 0;
  int32_t first[kMaxRuns] = {};
  int32_t end[kMaxRuns] = {};

  // The tile at position `slot` of the order. A slot past the last tile is
  // returned unchanged (a padding tile stays out of range).
  JO_FUSED_FN int32_t TileAt(int32_t slot) const {
    if (slot < 0 || slot >= tiles) return slot;
    int32_t lo = 0, hi = runs - 1;  // the first run whose end is past `slot`
    while (lo < hi) {
      const int32_t mid = (lo + hi) / 2;
      if (end[mid] > slot)
        hi = mid;
      else
        lo = mid + 1;
    }
    return first[lo] + slot - (lo == 0 ? 0 : end[lo - 1]);
  }
};

// The CTA tile at slot `slot` of the order when one MMA tile spans `pair`
// CTA tiles of kTileRows rows (sm100's 2-SM MMA: pair = 2, the two CTAs of a
// cluster computing one 256-row tile, CTA v holding its rows v*128..; else
// 1). The order was made over MMA tiles (MakeTileOrder with tile_rows =
// pair * kTileRows), so the two halves of an MMA tile stay together, in
// consecutive slots of one cluster. A slot past the last tile stays out of
// range.
JO_FUSED_FN int32_t CtaTileAt(const TileOrder& order, int32_t slot, int32_t pair) {
  return pair * order.TileAt(slot / pair) + slot % pair;
}

// Where the persistent CTAs go: the stock sm90 scheduler's assignment
// (CUTLASS 4.2, PersistentTileSchedulerSm90 on StaticPersistentTileScheduler,
// tile_scheduler_params.h) with the arguments the kernel gives it: clusters of
// 2 x 1 CTAs along M, raster along N, no swizzle, no cluster-occupancy query.
// The grid has `ctas` CTAs; CTA c takes the units of work c, c + ctas, c + 2
// ctas, ... (static striding); unit i is output tile (batch l, M slot, N
// tile), batches outermost, then pairs of M slots (a cluster's two CTAs),
// then N tiles; M slot s holds M tile TileOrder::TileAt(s) (a slot past the
// last M tile, when their number is odd, is a padding tile: computed out of
// bounds, touching no block). The kernel runs CUTLASS's own code; the fake and
// the model (jaxoverlap/sim/fused.py) use this mirror of it, which
// tests/native/test_fused_tiles.py checks is a permutation of the work.
//
// The sm100 kernel (cuda/fused/fused_gemm_kernel_sm100.cuh) runs CUTLASS's static
// persistent scheduler (StaticPersistentTileScheduler100, sm100_static_tile_
// scheduler.hpp on static_tile_scheduler.hpp), whose assignment with the same
// arguments (clusters of 2 x 1, raster along N, swizzle 1, the same
// PersistentTileSchedulerSm90Params grid heuristic) is this one, with M slots
// in CTA tiles: 1-SM MMA, slot s holds TileOrder::TileAt(s); 2-SM MMA, the
// cluster's two CTAs are the two halves of one 256-row MMA tile and slot s
// holds CtaTileAt(order, s, 2). m_slots is the same in both (the M tiles of
// 128 rows rounded up to whole clusters = 2 x the 256-row MMA tiles).
struct PersistentGrid {
  int32_t m_slots = 0;  // M tiles rounded up to whole clusters (2)
  int32_t n_tiles = 0;
  int32_t batch = 1;
  int32_t ctas = 0;

  // The launch of `m_tiles` x `n_tiles` x `batch` tiles on `sm_count` SMs.
  static JO_FUSED_FN PersistentGrid Make(int64_t m_tiles, int64_t n_tiles, int64_t batch,
                                         int32_t sm_count) {
    PersistentGrid g;
    g.m_slots = static_cast<int32_t>((m_tiles + 1) / 2 * 2);
    g.n_tiles = static_cast<int32_t>(n_tiles);
    g.batch = static_cast<int32_t>(batch);
    // get_max_cta_occupancy(18 SMs per GPC, cluster of 2, sm_count): whole
    // clusters per GPC, plus those of the last, partial GPC.
    constexpr int32_t kSmPerGpc = 18;
    const int32_t gpcs = sm_count < kSmPerGpc ? 1 : sm_count / kSmPerGpc;
    const int32_t residual = sm_count < kSmPerGpc ? 0 : sm_count % kSmPerGpc;
    int32_t per_device = gpcs * kSmPerGpc + residual - residual % 2;
    if (per_device > sm_count) per_device = sm_count;
    const int64_t clusters = g.work() / 2;
    g.ctas = 2 * static_cast<int32_t>(per_device / 2 < clusters ? per_device / 2 : clusters);
    return g;
  }
  JO_FUSED_FN int64_t work() const { return int64_t{m_slots} * n_tiles * batch; }
  // Unit of work `i` (0 <= i < work()).
  JO_FUSED_FN void At(int64_t i, int32_t* l, int32_t* m_slot, int32_t* n) const {
    const int64_t per_batch = int64_t{m_slots} * n_tiles;
    const int64_t r = i % per_batch, pair = r / 2;
    *l = static_cast<int32_t>(i / per_batch);
    *n = static_cast<int32_t>(pair % n_tiles);
    *m_slot = static_cast<int32_t>(2 * (pair / n_tiles) + r % 2);
  }
};

// The SMs a fused GEMM that waits for nothing leaves to the reduction beside it, on a device of
// `device_sms` SMs: the most, up to `most`, it can leave without taking another wave of its
// persistent grid (a kernel on fewer SMs runs the same tiles on fewer CTAs, and a wave more is
// a tile's time more for every CTA); when even two SMs cost a wave, two. Even: the grid is
// clusters of two, an odd SM would stay idle. 0 when `most` is (nothing to leave).
JO_FUSED_FN int32_t SpareSms(int64_t m_tiles, int64_t n_tiles, int64_t batch, int32_t device_sms,
                             int32_t most) {
  if (most < 2) return 0;
  const PersistentGrid full = PersistentGrid::Make(m_tiles, n_tiles, batch, device_sms);
  const int64_t waves = (full.work() + full.ctas - 1) / full.ctas;
  for (int32_t spare = most - most % 2; spare > 2; spare -= 2) {
    const PersistentGrid g = PersistentGrid::Make(m_tiles, n_tiles, batch, device_sms - spare);
    if (g.ctas >= 2 && (g.work() + g.ctas - 1) / g.ctas == waves) return spare;
  }
  return 2;
}

// Why MakeTileOrder refused (kOk: it did not).
enum class OrderError : int32_t {
  kOk = 0,
  kBadBlocks,       // RowBlocks not valid(), tile_rows < 1, or more than kMaxBlocks blocks
  kBadSequence,     // the sequence is not every block exactly once
  kTooManyRuns,     // the order needs more than TileOrder::kMaxRuns runs
  kNotConsecutive,  // a key's tiles are not consecutive (cannot happen; checked)
};
inline constexpr int32_t kMaxBlocks = 512;

// Orders the tiles of `tiling` by `key` over `sequence` (every block once,
// `count` == tiling.blocks.count()), merging runs that continue each other.
// Host only: the launcher builds the order, the kernel reads it (TileAt).
inline OrderError MakeTileOrder(const Tiling& tiling, const int32_t* sequence, int32_t count,
                                OrderKey key, TileOrder* order) {
  const RowBlocks& rb = tiling.blocks;
  if (!rb.valid() || tiling.tile_rows < 1 || rb.count() > kMaxBlocks) return OrderError::kBadBlocks;
  if (count != rb.count()) return OrderError::kBadSequence;
  int32_t position[kMaxBlocks];
  for (int32_t b = 0; b < count; ++b) position[b] = -1;
  for (int32_t i = 0; i < count; ++i) {
    const int32_t b = sequence[i];
    if (b < 0 || b >= count || position[b] != -1) return OrderError::kBadSequence;
    position[b] = i;
  }
  // Per key (a position in the sequence): its first tile and how many.
  int32_t key_first[kMaxBlocks], key_count[kMaxBlocks];
  for (int32_t i = 0; i < count; ++i) key_count[i] = 0;
  const int32_t tiles = tiling.tiles();
  for (int32_t t = 0; t < tiles; ++t) {
    const Range blocks = tiling.BlocksOf(t);
    int32_t k = position[blocks.first];
    for (int32_t b = blocks.first + 1; b <= blocks.last; ++b)
      k = key == OrderKey::kLastArrival ? (position[b] > k ? position[b] : k)
                                        : (position[b] < k ? position[b] : k);
    if (key_count[k] == 0)
      key_first[k] = t;
    else if (key_first[k] + key_count[k] != t)
      return OrderError::kNotConsecutive;
    ++key_count[k];
  }
  order->tiles = tiles;
  order->runs = 0;
  int32_t slots = 0;
  for (int32_t k = 0; k < count; ++k) {
    if (key_count[k] == 0) continue;
    const int32_t r = order->runs;
    if (r > 0 && order->first[r - 1] + (slots - (r > 1 ? order->end[r - 2] : 0)) == key_first[k]) {
      order->end[r - 1] += key_count[k];  // continues the previous run
    } else {
      if (r == TileOrder::kMaxRuns) return OrderError::kTooManyRuns;
      order->first[r] = key_first[k];
      order->end[r] = slots + key_count[k];
      ++order->runs;
    }
    slots += key_count[k];
  }
  return OrderError::kOk;
}

}  // namespace jo::fused
