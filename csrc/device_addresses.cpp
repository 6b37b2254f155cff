// Device addresses of the discrete memory model (TORCHNEURON_MEMORY=discrete,
// and drivers whose devices have memory of their own).
//
// A storage's data_ptr() is then an opaque device address, unique and stable
// for the storage's life, with views at offsets into it, as MPS and XLA give
// device storages addresses: aliasing, version counters, set_ and resize_
// behave as on the unified model. The addresses come from one range of
// address space reserved with no access, so a host read or write through one
// faults at once instead of touching unrelated memory. The memory behind an
// address is a device buffer the Python runtime makes at first use
// (memory/device_memory.py); it lets a buffer go when its block is released.
#include "neuron.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace torchneuron {
namespace {

constexpr size_t kAlignment = 256;          // the strictest storage-offset alignment of the GPU targets
constexpr size_t kReserved = 1ull << 40;   // 1 TiB of address space, no memory behind it

std::atomic<bool> discrete{false};
std::atomic<bool> allocated_any{false};
std::mutex mutex;
uintptr_t space_begin = 0;
std::map<uintptr_t, size_t> free_ranges;   // start -> length, coalesced
std::map<uintptr_t, size_t> live_blocks;   // start -> length
std::vector<std::pair<uintptr_t, size_t>> released;  // for the runtime to let their buffers go
std::function<void(uintptr_t, uintptr_t, size_t, c10::DeviceIndex)> device_copy;

void reserve_space() {
  void* p = mmap(nullptr, kReserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(p != MAP_FAILED, "neuron: cannot reserve address space for device addresses");
  space_begin = (reinterpret_cast<uintptr_t>(p) + kAlignment - 1) / kAlignment * kAlignment;
  free_ranges[space_begin] = kReserved - (space_begin - reinterpret_cast<uintptr_t>(p));
}

}  // namespace

bool discrete_memory() { return discrete.load(std::memory_order_relaxed); }

void set_discrete_memory(bool on) {
  if (on == discrete_memory()) return;
  TORCH_CHECK(!allocated_any.load(), "neuron: the memory model cannot change once device memory was allocated");
  discrete.store(on);
}

void note_allocation() { allocated_any.store(true, std::memory_order_relaxed); }

void* reserve_device_address(size_t nbytes) {
  const size_t length = (std::max<size_t>(nbytes, 1) + kAlignment - 1) / kAlignment * kAlignment;
  std::lock_guard<std::mutex> lock(mutex);
  if (space_begin == 0) reserve_space();
  for (auto it = free_ranges.begin(); it != free_ranges.end(); ++it) {
    if (it->second < length) continue;
    const uintptr_t start = it->first;
    const size_t rest = it->second - length;
    free_ranges.erase(it);
    if (rest > 0) free_ranges[start + length] = rest;
    live_blocks[start] = length;
    return reinterpret_cast<void*>(start);
  }
  return nullptr;
}

void release_device_address(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex);
  auto live = live_blocks.find(reinterpret_cast<uintptr_t>(ptr));
  TORCH_INTERNAL_ASSERT(live != live_blocks.end(), "neuron: released an unknown device address");
  uintptr_t start = live->first;
  size_t length = live->second;
  live_blocks.erase(live);
  released.emplace_back(start, length);
  auto next = free_ranges.lower_bound(start);
  if (next != free_ranges.end() && start + length == next->first) {
    length += next->second;
    next = free_ranges.erase(next);
  }
  if (next != free_ranges.begin()) {
    auto before = std::prev(next);
    if (before->first + before->second == start) {
      before->second += length;
      return;
    }
  }
  free_ranges[start] = length;
}

std::pair<uintptr_t, size_t> device_block_of(uintptr_t address) {
  std::lock_guard<std::mutex> lock(mutex);
  return block_containing(live_blocks, address);
}

std::vector<std::pair<uintptr_t, size_t>> take_released_blocks() {
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<std::pair<uintptr_t, size_t>> out;
  out.swap(released);
  return out;
}

void set_device_copy_callback(std::function<void(uintptr_t, uintptr_t, size_t, c10::DeviceIndex)> fn) {
  device_copy = std::move(fn);
}

void copy_device_bytes(void* dst, const void* src, size_t nbytes, c10::DeviceIndex device) {
  TORCH_CHECK(device_copy, "neuron: no device copy registered for the discrete memory model");
  device_copy(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(src), nbytes, device);
}

}  // namespace torchneuron
