// jaxoverlap_testing's view of core/fused_tiles.h (the fused GEMM's tiles,
// row blocks, flags and tile order), for tests/native/test_fused_tiles.py.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "core/fused_tiles.h"
#include "core/issue_order.h"
#include "core/program.h"
#include "python/kinds_bindings.h"

namespace nb = nanobind;

namespace {

using Pair = std::tuple<int32_t, int32_t>;

jo::fused::Tiling MakeTiling(int32_t shards, int32_t chunks, int64_t shard_rows,
                             int64_t tile_rows) {
  const jo::fused::Tiling tiling{jo::fused::RowBlocks{shards, chunks, shard_rows}, tile_rows};
  if (!tiling.blocks.valid() || tile_rows < 1)
    throw nb::value_error("shards, chunks, tile_rows >= 1 and shard_rows >= chunks");
  return tiling;
}

// Everything the mapping says about one shape, as plain lists.
nb::dict Mapping(int32_t shards, int32_t chunks, int64_t shard_rows, int64_t tile_rows) {
  const jo::fused::Tiling t = MakeTiling(shards, chunks, shard_rows, tile_rows);
  std::vector<Pair> block_rows, tiles_of_block, blocks_of_tile;
  std::vector<int32_t> block_of_row, shard_of_block;
  for (int32_t b = 0; b < t.blocks.count(); ++b) {
    block_rows.emplace_back(static_cast<int32_t>(t.blocks.Begin(b)),
                            static_cast<int32_t>(t.blocks.End(b)));
    const jo::fused::Range r = t.TilesOf(b);
    tiles_of_block.emplace_back(r.first, r.last);
    shard_of_block.push_back(t.blocks.Shard(b));
  }
  for (int64_t row = 0; row < t.blocks.rows(); ++row) block_of_row.push_back(t.blocks.BlockOf(row));
  // One tile past the end: a persistent scheduler's padding tile touches no block.
  for (int32_t tile = 0; tile <= t.tiles(); ++tile) {
    const jo::fused::Range r = t.BlocksOf(tile);
    blocks_of_tile.emplace_back(r.first, r.last);
  }
  nb::dict out;
  out["tiles"] = t.tiles();
  out["blocks"] = t.blocks.count();
  out["rows"] = t.blocks.rows();
  out["block_rows"] = block_rows;
  out["block_of_row"] = block_of_row;
  out["shard_of_block"] = shard_of_block;
  out["tiles_of_block"] = tiles_of_block;
  out["blocks_of_tile"] = blocks_of_tile;
  return out;
}

// The tile at every slot of the order (and one slot past it), and the runs.
nb::dict Order(int32_t shards, int32_t chunks, int64_t shard_rows, int64_t tile_rows,
               const std::vector<int32_t>& sequence, const std::string& key) {
  const jo::fused::Tiling t = MakeTiling(shards, chunks, shard_rows, tile_rows);
  jo::fused::OrderKey k;
  if (key == "last_arrival")
    k = jo::fused::OrderKey::kLastArrival;
  else if (key == "first_departure")
    k = jo::fused::OrderKey::kFirstDeparture;
  else
    throw nb::value_error("key must be 'last_arrival' or 'first_departure'");
  jo::fused::TileOrder order;
  const jo::fused::OrderError e = jo::fused::MakeTileOrder(
      t, sequence.data(), static_cast<int32_t>(sequence.size()), k, &order);
  switch (e) {
    case jo::fused::OrderError::kOk:
      break;
    case jo::fused::OrderError::kBadBlocks:
      throw nb::value_error("bad_blocks");
    case jo::fused::OrderError::kBadSequence:
      throw nb::value_error("bad_sequence");
    case jo::fused::OrderError::kTooManyRuns:
      throw nb::value_error("too_many_runs");
    case jo::fused::OrderError::kNotConsecutive:
      throw nb::value_error("not_consecutive");
  }
  std::vector<int32_t> tiles;
  for (int32_t slot = 0; slot <= order.tiles; ++slot) tiles.push_back(order.TileAt(slot));
  nb::dict out;
  out["tiles"] = tiles;
  out["runs"] = order.runs;
  return out;
}

// PersistentGrid: the CTAs and every unit of work's (batch, M slot, N tile).
nb::dict Grid(int64_t m_tiles, int64_t n_tiles, int64_t batch, int32_t sm_count) {
  if (m_tiles < 1 || n_tiles < 1 || batch < 1 || sm_count < 2)
    throw nb::value_error("m_tiles, n_tiles, batch >= 1 and sm_count >= 2");
  const jo::fused::PersistentGrid g =
      jo::fused::PersistentGrid::Make(m_tiles, n_tiles, batch, sm_count);
  std::vector<std::tuple<int32_t, int32_t, int32_t>> units;
  for (int64_t i = 0; i < g.work(); ++i) {
    int32_t l = 0, slot = 0, n = 0;
    g.At(i, &l, &slot, &n);
    units.emplace_back(l, slot, n);
  }
  nb::dict out;
  out["ctas"] = g.ctas;
  out["m_slots"] = g.m_slots;
  out["units"] = units;
  return out;
}

// The issue order (core/issue_order.h) of one rank of a bf16 call: the first op of
// each unit, in order (the fused GEMM's rule is checked against it).
std::vector<int32_t> IssueOrderOf(const std::string& op, const std::string& transport,
                                  int32_t nranks, int32_t rank, int64_t rows, int64_t chunks,
                                  bool bidirectional, bool return_gathered, bool fused,
                                  bool block_scaled) {
  jo::Problem q;
  // "matmul_ar/<algorithm>": matmul_ar with that algorithm.
  const size_t slash = op.find('/');
  q.op = jo::python::ParseOpArg("op", op.substr(0, slash));
  if (slash != std::string::npos)
    q.algorithm = jo::python::ParseAlgorithmArg("algorithm", op.substr(slash + 1));
  q.transport = jo::python::ParseTransportArg("transport", transport);
  q.nranks = nranks;
  q.rank = rank;
  q.rows = rows;
  q.k = 8;
  q.cols = 8;
  q.x_dtype = q.w_dtype = q.out_dtype = jo::DType::kBF16;
  q.chunks = chunks;
  q.bidirectional = bidirectional;
  q.return_gathered = return_gathered;
  q.fused = fused;
  if (block_scaled) {  // MXFP8: e4m3 operands with k of two blocks of 32
    q.x_dtype = q.w_dtype = jo::DType::kF8E4M3;
    q.k = 64;
    q.cols = 2;
    q.batch = 2;
    q.block_scaled = true;
  }
  std::vector<jo::IssueUnit> order;
  const jo::Status status = jo::IssueOrder(q, &order);
  if (!status.ok()) throw nb::value_error(status.ToString().c_str());
  std::vector<int32_t> out;
  for (const jo::IssueUnit& unit : order) out.push_back(unit.begin);
  return out;
}

}  // namespace

void BindFusedTiles(nb::module_& m) {
  m.def("issue_order", &IssueOrderOf, nb::arg("op"), nb::arg("transport"), nb::arg("nranks"),
        nb::arg("rank"), nb::arg("rows"), nb::arg("chunks"), nb::arg("bidirectional"),
        nb::arg("return_gathered"), nb::arg("fused"), nb::arg("block_scaled") = false,
        "core/issue_order.h for one rank of a bf16 call (batch 1, k and cols 8; block_scaled: "
        "e4m3 with block scales, batch 2, k 64, cols 2; op "
        "'matmul_ar/<algorithm>' for matmul_ar): the index of "
        "each unit's first op in the program (build_program's), in issue order.");
  m.def("fused_grid", &Grid, nb::arg("m_tiles"), nb::arg("n_tiles"), nb::arg("batch"),
        nb::arg("sm_count"),
        "PersistentGrid::Make: the persistent CTAs, the M slots, and (batch, M slot, N tile) of "
        "every unit of work in order.");
  m.def(
      "fused_cta_tile",
      [](int32_t pair, bool fp8) {
        const jo::fused::CtaTile t = jo::fused::CtaTileOf(pair, fp8);
        return std::make_tuple(t.rows, t.cols);
      },
      nb::arg("pair"), nb::arg("fp8"),
      "CtaTileOf: (rows, cols) of the CTA tile the kernel of MMA pair `pair` (2: sm_100a, 1: "
      "sm_90a) schedules for 8-bit (`fp8`) or 16-bit operands.");
  m.def("fused_spare_sms", &jo::fused::SpareSms, nb::arg("m_tiles"), nb::arg("n_tiles"),
        nb::arg("batch"), nb::arg("device_sms"), nb::arg("most"),
        "SpareSms: the SMs a release-only fused GEMM leaves to the reduction beside it.");
  m.def("fused_mapping", &Mapping, nb::arg("shards"), nb::arg("chunks"), nb::arg("shard_rows"),
        nb::arg("tile_rows"),
        "core/fused_tiles.h for one shape: each block's rows [begin, end), the block of every "
        "row, each block's shard and (first, last) tiles, each tile's (first, last) blocks "
        "(one padding tile past the end: (0, -1)).");
  m.def("fused_order", &Order, nb::arg("shards"), nb::arg("chunks"), nb::arg("shard_rows"),
        nb::arg("tile_rows"), nb::arg("sequence"), nb::arg("key"),
        "MakeTileOrder + TileAt: the tile at each slot (one slot past the end included) and the "
        "number of runs; ValueError naming the OrderError on refusal.");
}
