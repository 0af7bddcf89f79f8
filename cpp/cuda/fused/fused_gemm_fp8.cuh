// The fused GEMM on FP8 operands: the same stock CUTLASS kernel and the same
// three extensions as the 16-bit one (fused_gemm_kernel.cuh: FlagWaitMainloop,
// FlagReleaseEpilogue, ArrivalOrderScheduler), around CUTLASS's stock FP8
// collectives:
//
//  * the mainloop is the one CollectiveBuilder picks for 8-bit float operands
//    under KernelTmaWarpSpecializedCooperative: MainloopSm90TmaGmmaWarp-
//    SpecializedFP8 (cutlass/gemm/collective/sm90_mma_tma_gmma_ss_warpspecialized_fp8.hpp),
//    which accumulates with promotion: the wgmma instructions accumulate into
//    a temporary set of float32 registers, which GmmaFP8Accumulation
//    (cutlass/gemm/collective/fp8_accumulation.hpp) adds into the main
//    accumulators every `mma_promotion_interval` wgmma instructions and then
//    restarts from zero. Not the FP8FastAccum schedules, which let the tensor
//    cores accumulate the whole K extent. Its load() is the 16-bit mainloop's,
//    so FlagWaitMainloop wraps it unchanged;
//  * the epilogue is the stock TMA epilogue with an epilogue visitor tree
//    (EVT, cutlass/epilogue/fusion/sm90_visitor_*.hpp) of stock nodes —
//    Sm90Compute(multiplies) over Sm90AccFetch — and one node of ours,
//    ShardRowScale: each row's dequantization scale, x's scale of the row's
//    shard times w's. FlagReleaseEpilogue wraps it unchanged (its store() is
//    the stock one's, whatever the visitor tree).
//
// Both operands K-major (A row-major m x k; B given as B^T, n x k row-major):
// wgmma reads 8-bit operands from shared memory K-major only (PTX ISA,
// "wgmma.mma_async": "The transpose operation is only supported for the
// wgmma.mma_async variants with .f16/.bf16 types"); for other layouts the
// builder would switch to a register-sourced mainloop (detail::is_use_rmem_A).
//
// Why one scale per row, read by row: the rows of A are the shards of the
// all-gather, each quantized with its own scale, and a 128-row tile straddles
// two shards (or more, for shards under 128 rows) whenever shard_rows is not a
// multiple of 128. A value per row needs no condition on the shapes, and a
// thread stores few rows (two per 128 x 128 tile), so each thread loads one
// scale per row it holds, and w's, once per tile.
//
// Memory order of the scale loads (PTX ISA, "Memory Consistency Model"): a
// shard's scale is written before any flag of the shard is raised (the
// programs copy it ahead of the shard's first sub-chunk), and a tile's
// epilogue runs after its mainloop consumed stages that the producer warp
// loaded after its ld.acquire.sys of those flags. The producer's
// mbarrier.arrive (release.cta by default) and the consumers'
// mbarrier.try_wait (acquire.cta by default) carry that order to the
// consumer threads, so the scale load, issued after that wait, is after the
// scale's write in causality order. The ready shard's scale (not waited for)
// is written before the kernel starts, in stream order, and so is the one
// scale of a GEMM + reduce-scatter's rows (x_stride 0: x is the rank's own, its
// scale an input of the call). The load is a strong
// relaxed load at GPU scope (ld.relaxed.gpu: LDG.E.STRONG.GPU, not cached in
// L1), so no stale line of an earlier tile can answer it.
#pragma once

#include <cutlass/float8.h>
#include <cutlass/epilogue/fusion/callbacks.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include "cuda/fused/fused_gemm_kernel.cuh"

namespace jo::cuda::fused_kernel {

__device__ __forceinline__ float LoadScale(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// ---- the epilogue visitor tree's node for the scales ----

// A leaf of the visitor tree (the node contract of the stock
// Sm90ColBroadcast, sm90_visitor_load_tma_warpspecialized.hpp): the value of
// element (i, j) is x_scale[shard(i)] * w_scale, read once per tile for each
// row the thread stores.
struct ShardRowScale {
  struct SharedStorage {};
  struct Arguments {
    Fp8Scales scales;
    int64_t shard_rows = 1;  // RowBlocks::shard_rows: shard(i) = i / shard_rows
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.scales.x != nullptr && args.scales.w != nullptr && args.shard_rows >= 1 &&
           args.scales.x_stride >= 0;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE ShardRowScale() {}
  CUTLASS_HOST_DEVICE ShardRowScale(Params const& params, SharedStorage const&) : params(params) {}

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(
      cutlass::epilogue::fusion::detail::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  // GRow: the rows' broadcast along N, partitioned as the thread's stores (its
  // zero strides say which modes are N); RScale: one register per element,
  // shared along N; Coord: the thread's element coordinates relative to
  // `first_row` (the stock epilogue's tRS_cD).
  template <class GRow, class RScale, class Coord>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(GRow g_row, RScale r_scale, Coord coord, int first_row,
                                          int rows_left, Params const& params)
        : g_row(g_row),
          r_scale(r_scale),
          coord(coord),
          first_row(first_row),
          rows_left(rows_left),
          shard_rows(static_cast<int>(params.shard_rows)),
          params(params) {}

    GRow g_row;
    RScale r_scale;  // (CPY,CPY_M,CPY_N,EPI_M,EPI_N), stride 0 along N
    Coord coord;     // (CPY,CPY_M,CPY_N,EPI_M,EPI_N)
    int first_row;
    int rows_left;  // rows of the problem from first_row on
    int shard_rows;
    Params const& params;

    // Before the tile's first subtile: one scale per distinct row (the
    // zero-stride modes filtered out, as the stock column broadcast does).
    CUTLASS_DEVICE void begin() {
      using namespace cute;
      const float w = LoadScale(params.scales.w);
      Tensor scale = filter_zeros(r_scale);
      Tensor row_coord = filter_zeros(coord, g_row.stride());
      static_assert(decltype(size(scale))::value == decltype(size(row_coord))::value);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(scale); ++i) {
        const int r = get<0>(row_coord(i));
        float s = 0.0f;  // a row past m (the last tile's padding) is not stored
        if (r < rows_left) {
          const int shard = (first_row + r) / shard_rows;  // m < 2^31 (CheckFusedGemm)
          s = LoadScale(params.scales.x + shard * params.scales.x_stride) * w;
        }
        scale(i) = s;
      }
    }

    template <class ElementAccumulator, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<float, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n) {
      using namespace cute;
      cutlass::Array<float, FragmentSize> out;
      Tensor subtile = r_scale(_, _, _, epi_m, epi_n);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; ++i) out[i] = subtile(epi_v * FragmentSize + i);
      return out;
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(
      cutlass::epilogue::fusion::detail::ConsumerStoreArgs<Args...> const& args) {
    using namespace cute;
    auto [M, N, K, L] = args.problem_shape_mnkl;
    // The layout of a column vector broadcast along N (never dereferenced: it
    // only gives the partition its zero strides).
    Tensor m_row =
        make_tensor(make_gmem_ptr(params.scales.x),
                    make_layout(make_layout(M), make_layout(N, _0{}), make_layout(L, _0{})));
    Tensor g_row = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        m_row, args.tile_shape_mnk, args.tile_coord_mnkl, args.epi_tile, args.tiled_copy,
        args.thread_idx);
    Tensor r_scale = make_tensor_like<float>(g_row);
    // The stock epilogue's coordinates are relative to the thread's first
    // element; its residue is (M, N) minus that element's coordinates.
    const int rows_left = get<0>(args.residue_tCcD);
    const int first_row = M - rows_left;
    return ConsumerStoreCallbacks<decltype(g_row), decltype(r_scale), decltype(args.tCcD)>(
        g_row, r_scale, args.tCcD, first_row, rows_left, params);
  }

  Params params;
};

// ---- the kernel ----

// FP8 operands ElementA x ElementB (float_e4m3_t / float_e5m2_t), D of
// ElementD (bfloat16_t, half_t or float): 128 x 128 x 128 CTA tiles (a
// 128 x 256 tile would need 2 x 128 accumulator registers per consumer thread
// with promotion, past the 232 the cooperative kernel gives them), clusters
// of 2 x 1, f32 accumulation with promotion, no C operand.
template <class ElementA, class ElementB, class ElementD>
struct FusedGemmFp8 {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  static constexpr int kAlignmentAB = 16;  // 16 bytes of 8-bit elements (TMA)
  static constexpr int kAlignmentD = 16 / static_cast<int>(sizeof(ElementD));

  // D = RN(acc * RN(x_scale[shard(row)] * w_scale)), in float32, rounded once to ElementD.
  using Scaled = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      ShardRowScale, cutlass::epilogue::fusion::Sm90AccFetch>;

  using StockEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignmentD, ElementD, cutlass::layout::RowMajor, kAlignmentD,
      cutlass::epilogue::TmaWarpSpecializedCooperative, Scaled>::CollectiveOp;

  using StockMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cutlass::layout::RowMajor,
      kAlignmentAB, ElementB, cutlass::layout::ColumnMajor, kAlignmentAB, float, TileShape,
      ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename StockEpilogue::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
  // The promoting FP8 mainloop, not the fast-accumulation one.
  static_assert(cute::is_same_v<typename StockMainloop::DispatchPolicy,
                                cutlass::gemm::MainloopSm90TmaGmmaWarpSpecializedFP8<
                                    StockMainloop::DispatchPolicy::Stages, ClusterShape,
                                    cutlass::gemm::KernelTmaWarpSpecializedCooperative>>);

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>,
                                           FlagWaitMainloop<StockMainloop>,
                                           FlagReleaseEpilogue<StockEpilogue>, ArrivalOrder>;
  static_assert(cute::size<0>(TileShape{}) == fused::kSm90Fp8Tile.rows);
  static_assert(cute::size<1>(TileShape{}) == fused::kSm90Fp8Tile.cols);
  // The promotion interval counts wgmma instructions (K 32 each for 8-bit
  // operands) and must be a multiple of those of one K tile (the mainloop's
  // can_implement): the default, every 128 elements of K, is.
  static_assert(Fp8Scales{}.promotion_interval % (cute::size<2>(TileShape{}) / 32) == 0);
};

template <class A, class B, class D>
const void* Fp8FunctionAs() {
  return reinterpret_cast<const void*>(
      &cutlass::device_kernel<typename FusedGemmFp8<A, B, D>::Kernel>);
}

template <class A, class B, class D>
int Fp8SharedBytesAs() {
  return static_cast<int>(FusedGemmFp8<A, B, D>::Kernel::SharedStorageSize);
}

// The FP8 launch: B K-major (B^T, n x k row-major, leading dimension ldb), D
// scaled per row.
template <class A, class B, class D>
Status Fp8LaunchAs(const Launch& a, cudaStream_t stream, const ErrorContext& ctx) {
  using Gemm = FusedGemmFp8<A, B, D>;
  using Mainloop = typename Gemm::Kernel::CollectiveMainloop;
  typename Gemm::Kernel::Arguments args = CommonArguments<Gemm>(a);
  args.mainloop.ptr_B = static_cast<const B*>(a.b);
  args.mainloop.dB = typename Mainloop::StrideB{a.ldb, cute::Int<1>{}, 0};  // B is every batch's
  args.mainloop.mma_promotion_interval = a.scales.promotion_interval;
  // The tree's arguments, children first: {ShardRowScale, Sm90AccFetch, Sm90Compute}.
  args.epilogue.thread = {ShardRowScale::Arguments{a.scales, a.blocks.shard_rows}, {}, {}};
  return Enqueue<Gemm>(a, args, stream, ctx);
}

}  // namespace jo::cuda::fused_kernel

// Defines fused_kernel::Function<Name>, SharedBytes<Name> and Launch<Name>
// (fused_gemm_launch.h) for one FP8 triple (its line in fused_gemm_sm90_fp8.cu).
#define JO_FUSED_GEMM_FP8_INSTANCE(Name, A, B, D)                                           \
  namespace jo::cuda::fused_kernel {                                                        \
  const void* Function##Name() { return Fp8FunctionAs<A, B, D>(); }                         \
  int SharedBytes##Name() { return Fp8SharedBytesAs<A, B, D>(); }                           \
  Status Launch##Name(const Launch& launch, cudaStream_t stream, const ErrorContext& ctx) { \
    return Fp8LaunchAs<A, B, D>(launch, stream, ctx);                                       \
  }                                                                                         \
  }
