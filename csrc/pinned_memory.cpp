// Pinned host memory (`Tensor.pin_memory()`, `torch.empty(..., pin_memory=True)`,
// DataLoader's pin_memory): page-aligned host blocks whose addresses are
// remembered, so `is_pinned()` answers and a non_blocking copy to or from one
// can be queued on a stream instead of waited for. A device imports a whole
// block (IREE's Vulkan driver imports host memory only at page boundaries).
#include "neuron.h"

#include <ATen/core/CachingHostAllocator.h>
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

// An at::HostAllocator, registered for neuron, so that torch.accelerator's
// host-memory functions (empty_host_cache, host_memory_stats) work on neuron.
// Nothing is cached: a freed block goes straight back to the host.
struct PinnedAllocator final : at::HostAllocator {
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
  // A queued copy holds its block until it retires (runtime): no event needed.
  bool record_event(void* /*ptr*/, void* /*ctx*/, c10::Stream /*stream*/) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    at::HostStats stats;
    std::lock_guard<std::mutex> lock(pinned_mutex);
    int64_t bytes = 0;
    for (const auto& [start, size] : pinned_blocks) bytes += static_cast<int64_t>(size);
    stats.active_requests.current = stats.allocations.current = static_cast<int64_t>(pinned_blocks.size());
    stats.active_bytes.current = stats.allocated_bytes.current = bytes;
    return stats;
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

PinnedAllocator pinned_allocator_instance;
REGISTER_HOST_ALLOCATOR(c10::DeviceType::PrivateUse1, &pinned_allocator_instance);

}  // namespace

c10::Allocator* pinned_allocator() { return &pinned_allocator_instance; }

std::pair<uintptr_t, size_t> pinned_block_of(uintptr_t address) {
  std::lock_guard<std::mutex> lock(pinned_mutex);
  return block_containing(pinned_blocks, address);
}

}  // namespace torchneuron
