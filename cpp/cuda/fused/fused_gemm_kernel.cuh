// The fused GEMM's device side: CUTLASS's stock sm90 warp-specialised
// cooperative persistent GEMM (cutlass/gemm/kernel/
// sm90_gemm_tma_warpspecialized_cooperative.hpp), unchanged, given three
// collectives that extend the stock ones through the kernel's own extension
// points (its CollectiveMainloop, CollectiveEpilogue and TileSchedulerTag
// template arguments). Nothing of CUTLASS is copied or forked:
//
//  * FlagWaitMainloop<Stock>: before the stock load() issues a tile's TMA
//    loads, one elected lane of the producer warp spins until every flag
//    covering the tile's rows has reached the epoch — ld.acquire.sys, bounded
//    (a wait past its time records a FusedGemmFault and gives up) — then the
//    warp syncs and fences the generic proxy against the async proxy
//    (fence.proxy.async.global) that the TMA loads use. Any stock sm90 TMA
//    mainloop fits: the 16-bit one here, the FP8 one (same load()) in
//    fused_gemm_fp8.cuh.
//  * FlagReleaseEpilogue<Stock>: after the stock store() of a tile, the warp
//    that issued its TMA stores waits until they are complete
//    (cp.async.bulk.wait_group 0, not the stock .read form, which only frees
//    the shared memory), fences the proxies, and its first lane counts the
//    tile into every block it touched (atom.acq_rel.gpu); the tile that
//    completes a block publishes its flag (st.release.sys = epoch).
//  * ArrivalOrderScheduler: the stock persistent scheduler, rastering along N
//    (consecutive work shares an M tile), with each M index mapped through
//    the launch's TileOrder (core/fused_tiles.h): local shard first, then
//    arrival (or departure) order.
//
// The memory-model rules relied on (PTX ISA, "Memory Consistency Model" and
// "Asynchronous operations"/"Proxies"): an acquire at system scope
// synchronises with the writer's release (a copy-engine transfer completed
// in stream order before cuStreamWriteValue32, or another kernel's
// st.release); TMA reads global memory through the async proxy, so a proxy
// fence orders them after the acquire; bulk stores are complete only after
// cp.async.bulk.wait_group (without .read); a release is cumulative, so the
// last tile's release covers the stores of the tiles counted before it.
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

namespace jo::cuda::fused_kernel {

template <class Stock>
class FlagWaitMainloop : public Extended<Stock, RowWait> {
 public:
  using Params = typename Extended<Stock, RowWait>::Params;
  static constexpr int kTileRows = cute::size<0>(typename Stock::TileShape{});

  // The stock load(), after the tile's rows are in place. `blk_coord` is
  // (m, n, k, l); m is the tile's M index after the scheduler's mapping.
  template <class Pipeline, class PipelineState, class LoadInputs, class BlockCoord, class... Rest>
  CUTLASS_DEVICE void load(Params const& params, Pipeline pipeline, PipelineState state,
                           LoadInputs const& load_inputs, BlockCoord const& blk_coord,
                           Rest&&... rest) {
    WaitBeforeLoads<kTileRows>(params.extension, static_cast<int32_t>(cute::get<0>(blk_coord)));
    Stock::load(params, pipeline, state, load_inputs, blk_coord, std::forward<Rest>(rest)...);
  }
};

// ---- releases (GEMM + reduce-scatter) ----

template <class Stock>
class FlagReleaseEpilogue : public Extended<Stock, BlockRelease> {
 public:
  using Params = typename Extended<Stock, BlockRelease>::Params;
  static constexpr int kTileRows = cute::size<0>(typename Stock::CtaTileMNK{});

  CUTLASS_HOST_DEVICE FlagReleaseEpilogue(Params const& params,
                                          typename Stock::TensorStorage& shared_tensors)
      : Extended<Stock, BlockRelease>(params, shared_tensors), release_(params.extension) {}

  // The stock store(), then the release of every block the tile completed.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class Accumulators,
            class TiledMma>
  CUTLASS_DEVICE auto store(typename Stock::LoadPipeline load_pipeline,
                            typename Stock::LoadPipelineState load_pipe_consumer_state,
                            typename Stock::StorePipeline store_pipeline,
                            typename Stock::StorePipelineState store_pipe_producer_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_MNK,
                            TileCoordMNKL tile_coord_mnkl, Accumulators accumulators,
                            TiledMma tiled_mma, int thread_idx,
                            typename Stock::TensorStorage& shared_tensors, int subtile_idx = -1) {
    auto next =
        Stock::store(load_pipeline, load_pipe_consumer_state, store_pipeline,
                     store_pipe_producer_state, problem_shape_mnkl, tile_shape_MNK, tile_coord_mnkl,
                     accumulators, tiled_mma, thread_idx, shared_tensors, subtile_idx);
    // The stock epilogue issues and commits the tile's TMA stores from the
    // first warp of the consumer threads (its `issue_tma_store`).
    if (release_.flags != nullptr && thread_idx / cutlass::NumThreadsPerWarp == 0) {
      WaitBulkStoresComplete();
      FenceProxyAsyncGlobal();
      FenceProxyAlias();  // the partial may be read through the multicast alias
      __syncwarp();
      if (thread_idx == 0)
        ReleaseTileRows<kTileRows>(release_, static_cast<int32_t>(cute::get<0>(tile_coord_mnkl)));
    }
    return next;
  }

 private:
  BlockRelease release_;
};

// ---- tile order ----

// The tile scheduler tag (GemmUniversal's fourth argument).
struct ArrivalOrder {};

class ArrivalOrderScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90 {
  using Stock = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using WorkTileInfo = typename Stock::WorkTileInfo;
  struct Arguments : Stock::Arguments {
    fused::TileOrder order;
  };
  struct Params : Stock::Params {
    fused::TileOrder order;
  };

  // Raster along N without swizzle: consecutive work of a CTA shares one M
  // tile, so the M order is the order tiles start in.
  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape,
                                        cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1,
                                        uint32_t ktile_start_alignment_count = 1u) {
    typename Stock::Arguments along_n;
    along_n.max_swizzle_size = 1;
    along_n.raster_order = RasterOrderOptions::AlongN;
    return Params{Stock::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape,
                                                 hw_info, along_n, workspace, epilogue_subtile,
                                                 ktile_start_alignment_count),
                  args.order};
  }

  CUTLASS_HOST_DEVICE ArrivalOrderScheduler() {}
  CUTLASS_DEVICE explicit ArrivalOrderScheduler(Params const& params)
      : Stock(params), order_(&params.order) {}

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape cluster_shape) {
    return Ordered(Stock::initial_work_tile_info(cluster_shape));
  }

  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info) {
    auto [next, increment_pipe] = Stock::fetch_next_work(work_tile_info);
    return cute::make_tuple(Ordered(next), increment_pipe);
  }

  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo work_tile_info, TileSchedulerPipeline&,
                                      TileSchedulerPipelineState) {
    return fetch_next_work(work_tile_info);
  }

 private:
  CUTLASS_DEVICE WorkTileInfo Ordered(WorkTileInfo work) const {
    if (work.is_valid()) work.M_idx = order_->TileAt(work.M_idx);
    return work;
  }

  fused::TileOrder const* order_ = nullptr;
};

}  // namespace jo::cuda::fused_kernel

// The stock kernel finds its scheduler through this selector.
namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<jo::cuda::fused_kernel::ArrivalOrder, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = jo::cuda::fused_kernel::ArrivalOrderScheduler;
};
}  // namespace cutlass::gemm::kernel::detail

namespace jo::cuda::fused_kernel {

// ---- the kernel ----

// The 16-bit kernel: 128 x 256 x 64 CTA tiles, clusters of 2 x 1 (B
// multicast to both CTAs), f32 accumulation, no C operand. (FP8, with B
// K-major and the scales in the epilogue: fused_gemm_fp8.cuh.)
template <class Element>
struct FusedGemm {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  static constexpr int kAlignment = 16 / static_cast<int>(sizeof(Element));

  using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignment, Element, cutlass::layout::RowMajor, kAlignment,
      cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

  using StockMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor,
      kAlignment, Element, cutlass::layout::RowMajor, kAlignment, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename StockEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                           FlagWaitMainloop<StockMainloop>,
                                           FlagReleaseEpilogue<StockEpilogue>, ArrivalOrder>;
  static_assert(cute::size<0>(TileShape{}) == fused::kSm90Tile.rows);
  static_assert(cute::size<1>(TileShape{}) == fused::kSm90Tile.cols);
};

// The kernel as cudaFuncGetAttributes / cudaFuncSetAttribute take it, and the
// dynamic shared memory it needs (fused_gemm.cc's PrepareFusedGemm loads it
// and grants that once per device, before any launch).
template <class Element>
const void* FunctionAs() {
  return reinterpret_cast<const void*>(
      &cutlass::device_kernel<typename FusedGemm<Element>::Kernel>);
}

template <class Element>
int SharedBytesAs() {
  return static_cast<int>(FusedGemm<Element>::Kernel::SharedStorageSize);
}

// The 16-bit launch: B row-major (k x n), D = A @ B.
template <class Element>
Status LaunchAs(const Launch& a, cudaStream_t stream, const ErrorContext& ctx) {
  using Gemm = FusedGemm<Element>;
  using Mainloop = typename Gemm::Kernel::CollectiveMainloop;
  typename Gemm::Kernel::Arguments args = CommonArguments<Gemm>(a);
  args.mainloop.ptr_B = static_cast<const Element*>(a.b);
  args.mainloop.dB = typename Mainloop::StrideB{cute::Int<1>{}, a.ldb, 0};  // B is every batch's
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return Enqueue<Gemm>(a, args, stream, ctx);
}

}  // namespace jo::cuda::fused_kernel

// Defines fused_kernel::Function<Name>, SharedBytes<Name> and Launch<Name>
// (fused_gemm_launch.h) for one element type (its line in fused_gemm_sm90.cu).
#define JO_FUSED_GEMM_INSTANCE(Name, Element)                                               \
  namespace jo::cuda::fused_kernel {                                                        \
  const void* Function##Name() { return FunctionAs<Element>(); }                            \
  int SharedBytes##Name() { return SharedBytesAs<Element>(); }                              \
  Status Launch##Name(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx) { \
    return LaunchAs<Element>(launch, stream, ctx);                                          \
  }                                                                                         \
  }
