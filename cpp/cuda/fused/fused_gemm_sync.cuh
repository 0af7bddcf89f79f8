// The fused GEMM's flag protocol on the device, shared by the sm90 kernel
// (fused_gemm_kernel.cuh) and the sm100 one (fused_gemm_kernel_sm100.cuh):
// the PTX the extensions add, the wait a producer makes before loading a
// tile's rows, the release an epilogue makes after storing them, and the
// adapter that gives a stock CUTLASS collective one more argument. The tile
// mapping is core/fused_tiles.h's; what a kernel adds is only where in its
// stock collectives these calls go.
//
// The memory-model rules relied on (PTX ISA, "Memory Consistency Model":
// scopes, release and acquire patterns, causality order; "Proxies" and
// "fence.proxy"; "cp.async.bulk.wait_group"): an acquire at system scope
// synchronises with the writer's release (a copy-engine transfer completed in
// stream order before cuStreamWriteValue32, or another kernel's st.release);
// TMA reads and writes global memory through the async proxy, so a proxy
// fence orders them with the generic-proxy acquire or release; bulk stores
// are complete (their writes performed) only after cp.async.bulk.wait_group
// without .read, which only waits until the shared-memory source was read;
// a release is cumulative, so the last tile's release covers the stores of
// the tiles counted before it through the counter's acq_rel atomics.
#pragma once

#include <cutlass/cutlass.h>
#include <cute/tensor.hpp>

#include <cstdint>

#include "core/fused_tiles.h"
#include "cuda/fused/fused_gemm_launch.h"

namespace jo::cuda::fused_kernel {

// ---- the PTX the extensions add ----

__device__ __forceinline__ uint32_t LoadAcquireSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t LoadRelaxedGpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void StoreReleaseSys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t AddAcqRelGpu(uint32_t* p, uint32_t v) {
  uint32_t old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(old)
               : "l"(p), "r"(v)
               : "memory");
  return old;
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Orders this thread's generic-proxy accesses of global memory with its
// async-proxy (TMA) ones.
__device__ __forceinline__ void FenceProxyAsyncGlobal() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Orders this thread's writes through one virtual alias of a memory before
// accesses through another (PTX ISA, memory consistency model, "proxies":
// fence.proxy.alias; CUDA Programming Guide, "Virtual Aliasing Support": writes
// through one alias are otherwise not guaranteed visible through another before
// the writing grid completes). A GEMM + reduce-scatter's partial is stored
// through this rank's own address and read by peers through the multicast
// address (multimem.ld_reduce) while this grid still runs.
__device__ __forceinline__ void FenceProxyAlias() {
  asm volatile("fence.proxy.alias;" ::: "memory");
}

// Waits until every bulk (TMA) store this thread committed has completed —
// its writes made, not just its shared-memory source read.
__device__ __forceinline__ void WaitBulkStoresComplete() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// A stock collective whose Arguments and Params carry one more member,
// `extension` (what the kernel passes through to the collective untouched).
template <class Stock, class Extension>
class Extended : public Stock {
 public:
  struct Arguments : Stock::Arguments {
    Extension extension;
  };
  struct Params : Stock::Params {
    Extension extension;
  };

  // The sm90 and sm100 kernels call it with 3 and 4 arguments (sm100: the
  // hardware info too): the rest is forwarded.
  template <class ProblemShape, class... Rest>
  static Params to_underlying_arguments(ProblemShape const& problem_shape, Arguments const& args,
                                        void* workspace, Rest const&... rest) {
    return Params{Stock::to_underlying_arguments(problem_shape, args, workspace, rest...),
                  args.extension};
  }

  using Stock::Stock;
};

// ---- waits (all-gather + GEMM) ----

struct RowWait {
  fused::RowBlocks blocks;
  const uint32_t* flags = nullptr;  // null: the launch waits for nothing
  int32_t ready_shard = -1;
  uint32_t epoch = 0;
  int64_t timeout_ns = 0;
  FusedGemmFault* fault = nullptr;
  bool trap = false;  // a give-up traps once recorded (Launch::trap)
};

// Spins until `flag` reaches the epoch (cyclically). False when it gave up:
// its own time ran out (recorded in the fault, first one only) or an earlier
// wait of the launch already gave up.
__device__ __forceinline__ bool WaitFlag(const RowWait& w, int32_t block) {
  const uint32_t* flag = w.flags + block;
  const uint64_t start = GlobalTimerNs();
  uint32_t sleep_ns = 32;
  for (;;) {
    const uint32_t seen = LoadAcquireSys(flag);
    if (static_cast<int32_t>(seen - w.epoch) >= 0) return true;
    // An earlier wait of the launch gave up: go on without waiting. Not read by a trapping
    // launch, whose record is page-locked host memory (a round trip per poll): the wait that
    // gave up traps, which ends this one too.
    if (!w.trap && LoadRelaxedGpu(&w.fault->timed_out) != 0) return false;
    if (GlobalTimerNs() - start > static_cast<uint64_t>(w.timeout_ns)) {
      if (atomicCAS(&w.fault->timed_out, 0u, 1u) == 0u) {
        w.fault->flag = static_cast<uint32_t>(block);
        w.fault->seen = seen;
        w.fault->epoch = w.epoch;
        __threadfence_system();
        StoreReleaseSys(&w.fault->recorded, 1u);  // the fields before it
        // A replayable call: no host gate stops the rank's later work, so the launch ends the
        // context's (PTX ISA, "trap"; flag_wait_body.h), the record fenced before.
        if (w.trap) {
          __threadfence_system();
          __trap();
        }
      }
      return false;
    }
    __nanosleep(sleep_ns);
    if (sleep_ns < 1024) sleep_ns *= 2;
  }
}

template <int kTileRows>
__device__ __forceinline__ void WaitForTileRows(const RowWait& w, int32_t tile) {
  const fused::Range blocks = fused::Tiling{w.blocks, kTileRows}.BlocksOf(tile);
  for (int32_t b = blocks.first; b <= blocks.last; ++b)
    if (w.blocks.Shard(b) != w.ready_shard && !WaitFlag(w, b)) return;
}

// What a producer warp does before the TMA loads of a tile's rows: one
// elected lane waits, then every lane fences (whichever lane the stock load()
// elects issues the TMA, and a fence orders only its own thread's accesses).
template <int kTileRows>
__device__ __forceinline__ void WaitBeforeLoads(const RowWait& w, int32_t tile) {
  if (w.flags == nullptr) return;
  if (cute::elect_one_sync()) WaitForTileRows<kTileRows>(w, tile);
  __syncwarp();
  FenceProxyAsyncGlobal();
}

// ---- releases (GEMM + reduce-scatter) ----

struct BlockRelease {
  fused::RowBlocks blocks;
  uint32_t* flags = nullptr;     // null: the launch releases nothing
  uint32_t* counters = nullptr;  // one per block, zero at the launch
  uint32_t epoch = 0;
  int32_t tiles_per_m = 1;  // tiles sharing an M index: N tiles x batch
};

// Counts tile `tile` (stored) into every block it touches; the tile that
// completes a block publishes its flag. One thread, after the tile's stores
// are complete and fenced.
template <int kTileRows>
__device__ __forceinline__ void ReleaseTileRows(const BlockRelease& r, int32_t tile) {
  const fused::Tiling tiling{r.blocks, kTileRows};
  const fused::Range blocks = tiling.BlocksOf(tile);
  for (int32_t b = blocks.first; b <= blocks.last; ++b) {
    const uint32_t expected =
        static_cast<uint32_t>(tiling.TilesOf(b).size()) * static_cast<uint32_t>(r.tiles_per_m);
    if (AddAcqRelGpu(r.counters + b, 1u) + 1u == expected) StoreReleaseSys(r.flags + b, r.epoch);
  }
}

// What the warp that issued a tile's TMA stores does after the stock store()
// (sm100; the sm90 epilogue runs the same steps inline): every lane waits for
// its committed bulk stores to complete and fences, then one lane releases.
template <int kTileRows>
__device__ __forceinline__ void ReleaseAfterStores(const BlockRelease& r, int32_t tile) {
  if (r.flags == nullptr) return;
  WaitBulkStoresComplete();
  FenceProxyAsyncGlobal();
  FenceProxyAlias();  // the partial may be read through the multicast alias
  __syncwarp();
  if (cute::elect_one_sync()) ReleaseTileRows<kTileRows>(r, tile);
}

}  // namespace jo::cuda::fused_kernel
