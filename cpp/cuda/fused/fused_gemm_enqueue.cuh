// The host side every fused GEMM instantiation shares, sm_90a and sm_100a: the
// kernel's arguments from a Launch (the problem, A, D, the waits, the releases,
// the tile order) and the cluster launch. The kernels differ in their
// collectives, not here.
#pragma once

#include <cutlass/cutlass.h>
#include <cutlass/device_kernel.h>
#include <cutlass/gemm/gemm.h>
#include <cute/tensor.hpp>

#include <cstdint>
#include <string>

#include "core/status.h"
#include "cuda/base/check.h"
#include "cuda/fused/fused_gemm_launch.h"
#include "cuda/fused/fused_gemm_sync.cuh"

namespace jo::cuda::fused_kernel {

// The arguments every instantiation shares: the problem, A's pointer and
// strides, D's, the waits, the releases and the tile order (the caller adds
// B, the epilogue's own arguments and the device).
template <class Gemm>
typename Gemm::Kernel::Arguments CommonArguments(const Launch& a) {
  using Kernel = typename Gemm::Kernel;
  using Mainloop = typename Kernel::CollectiveMainloop;
  using Epilogue = typename Kernel::CollectiveEpilogue;
  using cute::Int;

  typename Kernel::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kBatched;
  args.problem_shape = {static_cast<int>(a.m), static_cast<int>(a.n), static_cast<int>(a.k),
                        static_cast<int>(a.batch)};
  using StoredA = cute::remove_cvref_t<decltype(*args.mainloop.ptr_A)>;
  args.mainloop.ptr_A = static_cast<const StoredA*>(a.a);
  args.mainloop.dA = typename Mainloop::StrideA{a.lda, Int<1>{}, a.a_batch_stride};
  args.mainloop.extension =
      RowWait{a.blocks, a.wait_flags, a.ready_shard, a.epoch, a.timeout_ns, a.fault, a.trap};
  args.epilogue.ptr_C = nullptr;
  using StoredD = cute::remove_cvref_t<decltype(*args.epilogue.ptr_D)>;
  args.epilogue.ptr_D = static_cast<StoredD*>(a.d);
  args.epilogue.dD = typename Epilogue::StrideD{a.ldd, Int<1>{}, a.d_batch_stride};
  constexpr int64_t kTileCols = cute::size<1>(typename Kernel::TileShape{});
  const int64_t n_tiles = (a.n + kTileCols - 1) / kTileCols;
  args.epilogue.extension = BlockRelease{a.blocks, a.release_flags, a.counters, a.epoch,
                                         static_cast<int32_t>(n_tiles * a.batch)};
  args.hw_info.sm_count = a.sm_count;
  args.scheduler.order = a.order;
  return args;
}

// Enqueues the kernel (the arguments were checked by CheckFusedGemm, the
// kernel loaded by PrepareFusedGemm on this device).
template <class Gemm>
Status Enqueue(const Launch& a, typename Gemm::Kernel::Arguments args, cudaStream_t stream,
               const ErrorContext& ctx) {
  using Kernel = typename Gemm::Kernel;
  JO_CUDA_CHECK(&ctx, cudaGetDevice(&args.hw_info.device_id));
  if (!Kernel::can_implement(args))
    return Status(Code::kInvalidArgument,
                  ctx.Describe() + ": CUTLASS cannot run the fused GEMM on this problem (" +
                      std::to_string(a.m) + " x " + std::to_string(a.n) + " x " +
                      std::to_string(a.k) + ", batch " + std::to_string(a.batch) + ")");
  JO_ASSERT(Kernel::get_workspace_size(args) == 0);  // the stock parts need none here
  const typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);

  if (a.release_flags != nullptr)
    JO_CUDA_CHECK(&ctx,
                  cudaMemsetAsync(a.counters, 0, Launch::CounterBytes(a.blocks.count()), stream));
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = cute::size<0>(typename Gemm::ClusterShape{});
  cluster.val.clusterDim.y = cute::size<1>(typename Gemm::ClusterShape{});
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = Kernel::get_grid_shape(params);
  config.blockDim = Kernel::get_block_shape();
  config.dynamicSmemBytes = Kernel::SharedStorageSize;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  JO_CUDA_CHECK(&ctx, cudaLaunchKernelEx(&config, &cutlass::device_kernel<Kernel>, params));
  return OkStatus();
}

}  // namespace jo::cuda::fused_kernel
