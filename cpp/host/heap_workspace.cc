#include "host/heap_workspace.h"

#include <new>
#include <string>
#include <vector>

namespace jo::host {
namespace {

class HeapRegion : public WorkspaceRegion {
 public:
  explicit HeapRegion(size_t bytes) : bytes_(bytes) {}
  std::byte* data() override { return bytes_.data(); }
  size_t size() const override { return bytes_.size(); }

 private:
  std::vector<std::byte> bytes_;
};

}  // namespace

Status HeapAllocator::Allocate(size_t bytes, std::unique_ptr<WorkspaceRegion>* out) {
  try {
    *out = std::make_unique<HeapRegion>(bytes);
  } catch (const std::bad_alloc&) {
    return Status(Code::kResource, "workspace allocation of " + std::to_string(bytes) +
                                       " bytes failed");
  }
  return OkStatus();
}

}  // namespace jo::host
