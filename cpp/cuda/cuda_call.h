// One collective-matmul call on the CUDA executor, with no XLA types: find
// the rank from the rank table, find or create the clique, take the epoch,
// build the program, prepare buffers and enqueue. The CUDA FFI handlers
// decode and check their operands, then call this; the host-side fake test
// (tests/cuda) calls it too, so its argument building is what CI runs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/program.h"
#include "core/status.h"
#include "cuda/executor.h"

namespace jo::cuda {

// The rank table attribute: one entry per device of the mesh in
// (group, rank) order, as (process index, local device ordinal).
struct RankTable {
  int64_t axis_size = 0;
  std::vector<int64_t> processes;
  std::vector<int64_t> devices;
};

struct Placement {
  int32_t rank = -1;
  int64_t group = -1;
  std::vector<int> clique_devices;  // local ordinals of the group's ranks, rank order (-1: remote)
  std::vector<int64_t> clique_processes;  // the process of each of the group's ranks
  int64_t remote_process = -1;      // a process holding another rank of the group, or -1
};

// Finds (process_index, device_ordinal) in the table. Fails with a clear
// message when absent or duplicated. Ranks of the group in other processes
// get device -1 (see cuda_bootstrap.h for what works across processes).
Status Place(const RankTable& table, int64_t process_index, int device_ordinal, const char* op,
             Placement* out);

struct CudaCallArgs {
  Problem problem;  // rank is filled in by Place
  int64_t clique_key = 0;
  RankTable table;
  int64_t process_index = 0;
  int device = -1;  // DeviceOrdinal: the local ordinal on GPU
  cudaStream_t stream = nullptr;
  int64_t timeout_ms = 120000;  // the watchdog's deadline for this call on the GPU
  CudaBuffers io;
};

Status CudaCall(const CudaCallArgs& args);

// The process index the handlers look themselves up with (set from Python).
void SetProcessIndex(int64_t index);
int64_t ProcessIndex();

// One line per live clique (for info()).
std::string DescribeCudaCliques();
// Tests only: forgets every clique (waits for their queued work first).
void ResetCudaCliques();

}  // namespace jo::cuda
