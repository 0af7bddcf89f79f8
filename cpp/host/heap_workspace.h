// The single-process workspace allocator: zeroed heap memory.
#pragma once

#include "core/workspace.h"

namespace jo::host {

class HeapAllocator : public WorkspaceAllocator {
 public:
  Status Allocate(size_t bytes, std::unique_ptr<WorkspaceRegion>* out) override;
  const char* name() const override { return "heap"; }
};

}  // namespace jo::host
