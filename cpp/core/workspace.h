// The symmetric-workspace allocator interface.
//
// The only place the executors assume anything about address spaces: the
// host executor uses the heap (one process); a multi-process host executor
// would hand out shm_open mappings, the CUDA executor cudaMalloc/cuMemCreate
// memory with IPC or multicast handles.
#pragma once

#include <cstddef>
#include <memory>

#include "core/status.h"

namespace jo {

class WorkspaceRegion {
 public:
  virtual ~WorkspaceRegion() = default;
  virtual std::byte* data() = 0;
  virtual size_t size() const = 0;
};

class WorkspaceAllocator {
 public:
  virtual ~WorkspaceAllocator() = default;
  // Zero-filled region of at least `bytes`.
  virtual Status Allocate(size_t bytes, std::unique_ptr<WorkspaceRegion>* out) = 0;
  virtual const char* name() const = 0;
};

}  // namespace jo
