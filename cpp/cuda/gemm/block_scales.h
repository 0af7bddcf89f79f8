// cuBLASLt's layout of 1D block scales (MXFP8's VEC32_UE8M0 mode; cuBLAS docs,
// "1D Block Scaling Factors Layout",
// https://docs.nvidia.com/cuda/cublas/index.html#d-block-scaling-factors-layout):
// tiles of 128 outer rows by 4 scale blocks (of 32 along k), 512 bytes each, in
// row-of-tiles order; within a tile, rows r, r + 32, r + 64 and r + 96 sit side
// by side in 16 bytes. The CUDA executor's GEMMs (gemm.cc) take whole tiles only;
// the fake cuBLASLt reads scales by this offset, and its checks write them by it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jo::cuda {

// Outer rows (or w's columns) of a tile; also the k elements its 4 blocks of 32 cover.
inline constexpr uint64_t kScaleTileRows = 128;
inline constexpr uint64_t kScaleTileBlocks = 4;  // scale blocks along k of a tile
inline constexpr uint64_t kScaleTileBytes = kScaleTileRows * kScaleTileBlocks;

// Byte offset of the scale of (outer row r, k block j) in a tensor of `k_tiles`
// tiles per row of tiles.
inline constexpr size_t TiledScaleOffset(uint64_t r, uint64_t j, uint64_t k_tiles) {
  constexpr uint64_t kQuarter = kScaleTileRows / 4;  // rows r % 32 share 16 bytes
  return static_cast<size_t>(
      ((r / kScaleTileRows) * k_tiles + j / kScaleTileBlocks) * kScaleTileBytes +
      (r % kQuarter) * 16 + (r % kScaleTileRows / kQuarter) * kScaleTileBlocks +
      j % kScaleTileBlocks);
}

}  // namespace jo::cuda
