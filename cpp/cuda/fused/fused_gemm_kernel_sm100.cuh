// The fused GEMM's device side on sm_100a (B200, GB200): CUTLASS's stock
// sm100 warp-specialised persistent GEMM (cutlass/gemm/kernel/
// sm100_gemm_tma_warpspecialized.hpp: tcgen05 MMA into tensor memory, 2-SM
// MMA, TMA loads, a TMEM -> registers -> shared memory -> TMA store
// epilogue), unchanged, given three collectives that extend the stock ones
// through the kernel's own template arguments, as fused_gemm_kernel.cuh does
// for sm90. Nothing of CUTLASS is copied or forked; the flag protocol is
// fused_gemm_sync.cuh's, the tile mapping core/fused_tiles.h's.
//
//  * FlagWaitMainloop<Stock>: the stock load() (sm100_mma_warpspecialized.hpp)
//    is run by the whole producer warp, one elected lane issuing the TMA
//    loads. Before the first load() of a CTA tile (the kernel calls it twice
//    per tile: a prologue of up to Stages k tiles, then the rest), one lane
//    spins until every flag covering the CTA tile's rows has reached the
//    epoch, then every lane fences the proxies. With 2-SM MMA each CTA of the
//    pair loads its own 128 rows of A into its own shared memory (and half of
//    B), so each waits for its own rows; the leader CTA's MMA consumes both
//    halves only after both CTAs' loads have arrived on its barrier
//    (PipelineTmaUmmaAsync counts both CTAs' transaction bytes), so the pair
//    computes the 256-row tile only once all of its rows are in place.
//  * FlagReleaseEpilogue<Stock>: the stock store() (sm100_epilogue_tma_
//    warpspecialized.hpp) copies the CTA's accumulators TMEM -> registers ->
//    shared memory in subtiles and the first of its four warps issues and
//    commits each subtile's TMA store. After it returns, that warp waits for
//    its stores' completion, fences, and counts the CTA tile (128 rows, its
//    half of a 2-SM tile) into its blocks; a block is released once every
//    CTA tile touching it is stored, so a block spanning both halves of a
//    pair is released only after both CTAs' stores.
//  * ArrivalOrderScheduler<kPair>: CUTLASS's static persistent scheduler for
//    sm100 (StaticPersistentTileScheduler100), not the default cluster-launch-
//    control one, with each CTA's M coordinate mapped through the launch's
//    TileOrder over MMA tiles of kPair CTA tiles (fused_tiles.h CtaTileAt).
//    Why static: the CLC scheduler (sm100_tile_scheduler.hpp) launches a
//    grid of every tile and ignores hw_info.sm_count, so the kernel cannot be
//    held to fewer SMs (a reduction beside it needs them), and which tile a
//    CTA gets next depends on the hardware's order of cancelled clusters,
//    which the PTX ISA leaves unspecified (clusterlaunchcontrol.try_cancel);
//    the static one strides over the work exactly as the sm90 scheduler does
//    (fused_tiles.h PersistentGrid mirrors it for the fake and the model).
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cute/tensor.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include <cstdint>
#include <string>
#include <utility>

#include "core/fused_tiles.h"
#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/fused/fused_gemm_enqueue.cuh"
#include "cuda/fused/fused_gemm_launch.h"
#include "cuda/fused/fused_gemm_sync.cuh"

namespace jo::cuda::fused_kernel::sm100 {

// ---- waits (all-gather + GEMM) ----

template <class Stock>
class FlagWaitMainloop : public Extended<Stock, RowWait> {
  using Base = Extended<Stock, RowWait>;

 public:
  using Params = typename Base::Params;

  template <class ClusterShape>
  CUTLASS_DEVICE FlagWaitMainloop(Params const& params, ClusterShape cluster_shape,
                                  uint32_t block_rank_in_cluster)
      : Base(params, cluster_shape, block_rank_in_cluster), wait_(&params.extension) {}

  // The stock load(), after the CTA tile's rows are in place. `cta_coord_mnkl`
  // is (m, n, k, l); m is the CTA tile's M index after the scheduler's mapping.
  template <class Pipeline, class PipelineState, class LoadInputs, class CtaCoord,
            class KTileIterator>
  CUTLASS_DEVICE auto load(Pipeline pipeline, PipelineState state, LoadInputs const& load_inputs,
                           CtaCoord const& cta_coord_mnkl, KTileIterator k_tile_iter,
                           int k_tile_count) {
    const int32_t tile = static_cast<int32_t>(cute::get<0>(cta_coord_mnkl));
    if (k_tile_count > 0 && tile != waited_) {  // a tile's second load() finds it waited for
      WaitBeforeLoads<fused::kTileRows>(*wait_, tile);
      waited_ = tile;
    }
    return Stock::load(pipeline, state, load_inputs, cta_coord_mnkl, k_tile_iter, k_tile_count);
  }

 private:
  RowWait const* wait_ = nullptr;
  int32_t waited_ = -1;  // the CTA tile whose rows this thread waited for last
};

// ---- releases (GEMM + reduce-scatter) ----

template <class Stock>
class FlagReleaseEpilogue : public Extended<Stock, BlockRelease> {
  using Base = Extended<Stock, BlockRelease>;

 public:
  using Params = typename Base::Params;

  CUTLASS_DEVICE FlagReleaseEpilogue(Params const& params,
                                     typename Stock::TensorStorage& shared_tensors)
      : Base(params, shared_tensors), release_(&params.extension) {}

  // The stock store() of a CTA tile (the TMEM-accumulator form the kernel
  // calls), then the release of every block the tile completed.
  template <bool ReuseTmem = false, class AccumulatorPipeline, class AccumulatorPipelineState,
            class ProblemShapeMNKL, class CtaTileMNK, class CtaCoordMNKL, class MmaTileMNK,
            class TiledMma, class AccEngine, class AccLayout>
  CUTLASS_DEVICE auto store(typename Stock::LoadPipeline load_pipeline,
                            typename Stock::LoadPipelineState load_pipe_consumer_state,
                            typename Stock::StorePipeline store_pipeline,
                            typename Stock::StorePipelineState store_pipe_producer_state,
                            AccumulatorPipeline acc_pipeline,
                            AccumulatorPipelineState acc_pipe_consumer_state,
                            ProblemShapeMNKL problem_shape_mnkl, CtaTileMNK cta_tile_mnk,
                            CtaCoordMNKL cta_coord_mnkl, MmaTileMNK mma_tile_mnk,
                            TiledMma tiled_mma, cute::Tensor<AccEngine, AccLayout> accumulators,
                            typename Stock::TensorStorage& shared_tensors) {
    auto next = Stock::template store<ReuseTmem>(
        load_pipeline, load_pipe_consumer_state, store_pipeline, store_pipe_producer_state,
        acc_pipeline, acc_pipe_consumer_state, problem_shape_mnkl, cta_tile_mnk, cta_coord_mnkl,
        mma_tile_mnk, tiled_mma, accumulators, shared_tensors);
    // The stock store() issues and commits the tile's TMA stores from the
    // first warp of its ThreadCount epilogue threads (its `issue_tma_store`).
    const int epilogue_warp =
        static_cast<int>(threadIdx.x % Stock::ThreadCount) / cutlass::NumThreadsPerWarp;
    if (epilogue_warp == 0)
      ReleaseAfterStores<fused::kTileRows>(*release_,
                                           static_cast<int32_t>(cute::get<0>(cta_coord_mnkl)));
    return next;
  }

 private:
  BlockRelease const* release_ = nullptr;
};

// ---- tile order ----

// The tile scheduler tag (GemmUniversal's fourth argument): kPair CTA tiles
// per MMA tile (2 with 2-SM MMA).
template <int kPair>
struct ArrivalOrder {};

template <int kPair>
class ArrivalOrderScheduler
    : public cutlass::gemm::kernel::detail::StaticPersistentTileScheduler100 {
  using Stock = cutlass::gemm::kernel::detail::StaticPersistentTileScheduler100;

 public:
  using WorkTileInfo = typename Stock::WorkTileInfo;
  using CLCResponse = typename Stock::CLCResponse;
  struct Arguments : Stock::Arguments {
    fused::TileOrder order;
  };
  struct Params : Stock::Params {
    fused::TileOrder order;
  };

  // Raster along N without swizzle: consecutive work of a CTA shares one M
  // tile, so the M order is the order tiles start in (as on sm90).
  template <class ProblemShapeMNKL, class TileShape, class AtomThrShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        AtomThrShape atom_thr_shape, ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr) {
    typename Stock::Arguments along_n;
    along_n.max_swizzle_size = 1;
    along_n.raster_order = RasterOrderOptions::AlongN;
    return Params{Stock::to_underlying_arguments(problem_shape_mnkl, tile_shape, atom_thr_shape,
                                                 cluster_shape, hw_info, along_n, workspace),
                  args.order};
  }

  CUTLASS_DEVICE ArrivalOrderScheduler(CLCResponse* clc_response, Params const& params,
                                       dim3 block_id_in_cluster)
      : Stock(clc_response, params, block_id_in_cluster), order_(&params.order) {}

  // The stock CTA coordinate (the cluster's M index plus the CTA's place in
  // the cluster) with its M slot mapped to a CTA tile through the order.
  CUTLASS_DEVICE auto work_tile_to_cta_coord(WorkTileInfo work_tile_info) const {
    auto coord = Stock::work_tile_to_cta_coord(work_tile_info);
    const int32_t slot = cute::get<0>(coord);
    return cute::make_coord(fused::CtaTileAt(*order_, slot, kPair), cute::get<1>(coord),
                            cute::get<2>(coord), cute::get<3>(coord));
  }

 private:
  fused::TileOrder const* order_ = nullptr;
};

}  // namespace jo::cuda::fused_kernel::sm100

// The stock kernel finds its scheduler through this selector.
namespace cutlass::gemm::kernel::detail {
template <int kPair, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<jo::cuda::fused_kernel::sm100::ArrivalOrder<kPair>, arch::Sm100,
                             TileShape, ClusterShape, SchedulerPipelineStageCount> {
  using Scheduler = jo::cuda::fused_kernel::sm100::ArrivalOrderScheduler<kPair>;
};
}  // namespace cutlass::gemm::kernel::detail

namespace jo::cuda::fused_kernel::sm100 {

// ---- the kernels ----

// One configuration per instantiation: 2-SM MMA (KernelTmaWarpSpecialized2-
// SmSm100) on 256 x 256 tiles (each CTA 128 x 256, its accumulator 256 of
// TMEM's 512 columns, so two accumulator stages overlap one tile's epilogue
// with the next tile's MMA), clusters of 2 x 1 (the MMA pair), f32
// accumulation, no C operand. A row-major (K-major), B row-major (N-major:
// tcgen05 takes MN-major 16- and 8-bit operands), D row-major.
template <class ElementA_, class ElementB_, class ElementD_, class OpClass, class MmaTileShape_,
          class MainloopSchedule, class EpilogueSchedule>
struct Config {
  using ElementA = ElementA_;
  using ElementB = ElementB_;
  using ElementD = ElementD_;
  using MmaTileShape = MmaTileShape_;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  static constexpr int kPair =
      cute::is_base_of_v<cutlass::gemm::KernelSchedule2Sm, MainloopSchedule> ? 2 : 1;
  static constexpr int kAlignmentD = 16 / static_cast<int>(sizeof(ElementD));

  using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, OpClass, MmaTileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignmentD, ElementD, cutlass::layout::RowMajor, kAlignmentD,
      EpilogueSchedule>::CollectiveOp;

  static constexpr int kAlignmentAB = 16 / static_cast<int>(sizeof(ElementA));
  using StockMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, OpClass, ElementA, cutlass::layout::RowMajor, kAlignmentAB, ElementB,
      cutlass::layout::RowMajor, kAlignmentAB, float, MmaTileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename StockEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                           FlagWaitMainloop<StockMainloop>,
                                           FlagReleaseEpilogue<StockEpilogue>, ArrivalOrder<kPair>>;

  // The flags are per CTA tile of fused::kTileRows rows, the order per MMA tile, the
  // persistent grid per CTA tile (each CTA's half of an MMA tile).
  static_assert(cute::size<0>(typename Kernel::CtaShape_MNK{}) == fused::kSm100Tile.rows);
  static_assert(cute::size<1>(typename Kernel::CtaShape_MNK{}) == fused::kSm100Tile.cols);
  static_assert(cute::size<0>(MmaTileShape{}) == kPair * fused::kSm100Tile.rows);
  static_assert(cute::size<1>(MmaTileShape{}) == fused::kSm100Tile.cols);
  static_assert(fused::CtaTileOf(kPair, false).cols == fused::kSm100Tile.cols);
};

using BF16 = Config<cutlass::bfloat16_t, cutlass::bfloat16_t, cutlass::bfloat16_t,
                    cutlass::arch::OpClassTensorOp, cute::Shape<cute::_256, cute::_256, cute::_64>,
                    cutlass::gemm::KernelTmaWarpSpecialized2SmSm100,
                    cutlass::epilogue::TmaWarpSpecialized2Sm>;
using F16 = Config<cutlass::half_t, cutlass::half_t, cutlass::half_t,
                   cutlass::arch::OpClassTensorOp, cute::Shape<cute::_256, cute::_256, cute::_64>,
                   cutlass::gemm::KernelTmaWarpSpecialized2SmSm100,
                   cutlass::epilogue::TmaWarpSpecialized2Sm>;

template <class Gemm>
const void* FunctionAs() {
  return reinterpret_cast<const void*>(&cutlass::device_kernel<typename Gemm::Kernel>);
}

template <class Gemm>
int SharedBytesAs() {
  return static_cast<int>(Gemm::Kernel::SharedStorageSize);
}

// The 2-SM launch: the tile order must be over MMA tiles; B row-major (k x n),
// D = A @ B; enqueued as every fused GEMM is (fused_gemm_enqueue.cuh).
template <class Gemm>
Status LaunchAs(const Launch& a, cudaStream_t stream, const ErrorContext& ctx) {
  static_assert(Gemm::kPair == kSm100MmaPair, "the host makes the order over 2-SM MMA tiles");
  // An order made over CTA tiles would compute some CTA tiles twice and others never.
  constexpr int64_t kMmaRows = Gemm::kPair * fused::kTileRows;
  if (a.order.tiles != (a.m + kMmaRows - 1) / kMmaRows)
    return Status(Code::kInternal, ctx.Describe() + ": the sm_100a fused GEMM's tile order has " +
                                       std::to_string(a.order.tiles) + " tiles, not one per " +
                                       std::to_string(kMmaRows) + "-row MMA tile of " +
                                       std::to_string(a.m) + " rows (CheckFusedGemm)");
  using Mainloop = typename Gemm::Kernel::CollectiveMainloop;
  typename Gemm::Kernel::Arguments args = CommonArguments<Gemm>(a);
  using StoredB = cute::remove_cvref_t<decltype(*args.mainloop.ptr_B)>;
  args.mainloop.ptr_B = static_cast<const StoredB*>(a.b);
  args.mainloop.dB = typename Mainloop::StrideB{cute::Int<1>{}, a.ldb, 0};  // B is every batch's
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return Enqueue<Gemm>(a, args, stream, ctx);
}

}  // namespace jo::cuda::fused_kernel::sm100

// Defines fused_kernel::FunctionSm100<Name>, SharedBytesSm100<Name> and
// LaunchSm100<Name> (fused_gemm_launch.h) for one configuration (its line in
// fused_gemm_sm100.cu).
#define JO_FUSED_GEMM_SM100_INSTANCE(Name)                                                       \
  namespace jo::cuda::fused_kernel {                                                             \
  const void* FunctionSm100##Name() { return sm100::FunctionAs<sm100::Name>(); }                 \
  int SharedBytesSm100##Name() { return sm100::SharedBytesAs<sm100::Name>(); }                   \
  Status LaunchSm100##Name(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx) { \
    return sm100::LaunchAs<sm100::Name>(launch, stream, ctx);                                    \
  }                                                                                              \
  }
