// Pinned host memory (`Tensor.pin_memory()`, `torch.empty(..., pin_memory=True)`,
// DataLoader's pin_memory): page-aligned host blocks whose addresses are
// remembered, so `is_pinned()` answers and a non_blocking copy to or from one
// can be queued on a stream instead of waited for. A device imports a whole
// block (IREE's Vulkan driver imports host memory only at page boundaries).
#include "neuron.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>

namespace torchneuron {
namespace {

constexpr size_t kPage = 4096;
std::mutex pinned_mutex;
std::map<uintptr_t, size_t> pinned_blocks;  // start -> bytes (whole pages)

void free_pinned(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned_blocks.erase(reinterpret_cast<uintptr_t>(ptr));
  }
  std::free(ptr);
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    const size_t size = (std::max<size_t>(nbytes, 1) + kPage - 1) / kPage * kPage;
    void* ptr = nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, posix_memalign(&ptr, kPage, size) == 0,
                     "neuron: could not allocate ", nbytes, " bytes of pinned host memory");
    {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned_blocks[reinterpret_cast<uintptr_t>(ptr)] = size;
    }
    return {ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator_instance;

}  // namespace

c10::Allocator* pinned_allocator() { return &pinned_allocator_instance; }

std::pair<uintptr_t, size_t> pinned_block_of(uintptr_t address) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  return block_containing(pinned_blocks, address);
}

}  // namespace torchneuron
