// Device memory. On the CPU target (local-task) device memory is host memory,
// so storages are aligned host allocations that IREE imports with no copy
// (DLPack); the statistics and the optional limit are exact and per device.
//
// Freed small blocks are kept per device and size and handed out again, most
// recent first, as CUDA's caching allocator does: a loop gets the same
// addresses every step, so the runtime's imported buffer views (cached by
// address) are reused instead of imported again, and malloc is not called.
#include "neuron.h"

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torchneuron {
namespace {

constexpr size_t kAlignment = 64;  // IREE's llvm-cpu buffers want 64-byte alignment
constexpr int kMaxDevices = 64;

constexpr size_t kMaxCachedBlock = 1 << 20;       // larger blocks go straight back
constexpr int64_t kMaxCachedBytes = 64ll << 20;    // per device

std::mutex stats_mutex;  // guards stats and the block caches
std::array<MemoryStats, kMaxDevices> stats;
std::array<std::unordered_map<size_t, std::vector<void*>>, kMaxDevices> free_blocks;

size_t rounded_size(size_t nbytes) {
  return ((std::max<size_t>(nbytes, 1) + kAlignment - 1) / kAlignment) * kAlignment;
}

struct Allocation {
  void* ptr;
  size_t nbytes;
  size_t rounded;
  c10::DeviceIndex device;
  bool guarded;  // from memory_guards.cpp: freed there, never cached here
};

std::string format_bytes(int64_t n) {
  char buf[64];
  if (n >= (1 << 20)) snprintf(buf, sizeof(buf), "%.2f MiB", n / 1048576.0);
  else if (n >= 1024) snprintf(buf, sizeof(buf), "%.2f KiB", n / 1024.0);
  else snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(n));
  return buf;
}

// Host memory on the unified model; an opaque device address on the discrete one.
void* new_block(size_t rounded) {
  return discrete_memory() ? reserve_device_address(rounded) : std::aligned_alloc(kAlignment, rounded);
}

void release_block(void* ptr) {
  if (discrete_memory()) {
    release_device_address(ptr);
  } else {
    std::free(ptr);
  }
}

void free_allocation(void* ctx) {
  auto* a = static_cast<Allocation*>(ctx);
  bool cached = false;
  {
    std::lock_guard<std::mutex> lock(stats_mutex);
    auto& s = stats[a->device];
    s.allocated -= static_cast<int64_t>(a->nbytes);
    s.num_frees += 1;
    if (a->guarded) {
      cached = true;  // released below, by the guards
    } else if (a->rounded <= kMaxCachedBlock && s.cached + static_cast<int64_t>(a->rounded) <= kMaxCachedBytes) {
      free_blocks[a->device][a->rounded].push_back(a->ptr);
      s.cached += static_cast<int64_t>(a->rounded);
      cached = true;
    }
  }
  if (a->guarded) {
    guarded_free(a->ptr);
  } else if (!cached) {
    release_block(a->ptr);
  }
  delete a;
}

void* take_cached_block(c10::DeviceIndex device, size_t rounded) {
  auto& blocks = free_blocks[device];
  auto it = blocks.find(rounded);
  if (it == blocks.end() || it->second.empty()) return nullptr;
  void* ptr = it->second.back();
  it->second.pop_back();
  stats[device].cached -= static_cast<int64_t>(rounded);
  return ptr;
}

// A c10::DeviceAllocator, so that torch.accelerator's memory functions
// (memory_allocated, memory_stats, empty_cache, get_memory_info, ...) work on
// neuron as they do on CUDA.
struct NeuronAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t nbytes) override {
    check_usable();
    note_allocation();
    const c10::DeviceIndex device = current_device();
    const c10::Device dev(c10::DeviceType::PrivateUse1, device);
    {
      std::lock_guard<std::mutex> lock(stats_mutex);
      auto& s = stats[device];
      if (s.limit > 0 && s.allocated + static_cast<int64_t>(nbytes) > s.limit) {
        s.num_ooms += 1;
        TORCH_CHECK_WITH(OutOfMemoryError, false,
            "neuron out of memory. Tried to allocate ", format_bytes(nbytes),
            " on device neuron:", static_cast<int>(device), " with ",
            format_bytes(s.allocated), " already allocated and a limit of ",
            format_bytes(s.limit), " (TORCHNEURON_MEMORY_LIMIT_MB / "
            "torchneuron.set_memory_limit).");
      }
      s.allocated += static_cast<int64_t>(nbytes);
      s.peak = std::max(s.peak, s.allocated);
      s.num_allocs += 1;
    }
    const size_t rounded = rounded_size(nbytes);
    const bool guarded = memory_guards_enabled();
    void* ptr = nullptr;
    if (guarded) {
      ptr = guarded_allocate(nbytes, device);
    } else {
      {
        std::lock_guard<std::mutex> lock(stats_mutex);
        ptr = take_cached_block(device, rounded);
      }
      if (ptr == nullptr) ptr = new_block(rounded);
    }
    if (ptr == nullptr && !guarded) {  // short of memory: give back what is kept, then retry
      empty_cache(device);
      ptr = new_block(rounded);
    }
    if (ptr == nullptr) {
      std::lock_guard<std::mutex> lock(stats_mutex);
      auto& s = stats[device];
      s.allocated -= static_cast<int64_t>(nbytes);
      s.num_allocs -= 1;
      s.num_ooms += 1;
      TORCH_CHECK_WITH(OutOfMemoryError, false,
          "neuron out of memory. Tried to allocate ", format_bytes(nbytes),
          " on device neuron:", static_cast<int>(device),
          ": the host refused the allocation.");
    }
    auto* ctx = new Allocation{ptr, nbytes, rounded, device, guarded};
    return {ptr, ctx, &free_allocation, dev};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t /*pool*/) override {
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) empty_cache(i);
  }

  // A block freed while a stream's queued launch still uses it is kept by
  // that launch (the runtime holds its buffers until it retires), so no
  // stream needs recording here.
  void recordStream(const c10::DataPtr& /*ptr*/, c10::Stream /*stream*/) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const MemoryStats s = memory_stats(device);
    c10::CachingDeviceAllocator::DeviceStats out;
    const auto all = static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE);
    out.allocated_bytes[all].current = s.allocated;
    out.allocated_bytes[all].peak = s.peak;
    out.active_bytes[all] = out.allocated_bytes[all];
    out.requested_bytes[all] = out.allocated_bytes[all];
    out.reserved_bytes[all].current = s.allocated + s.cached;
    out.reserved_bytes[all].peak = s.peak + s.cached;
    out.inactive_split_bytes[all].current = s.cached;
    out.allocation[all].current = s.num_allocs - s.num_frees;
    out.allocation[all].allocated = s.num_allocs;
    out.allocation[all].freed = s.num_frees;
    out.active[all] = out.allocation[all];
    out.num_ooms = s.num_ooms;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override { reset_allocation_counts(device); }

  void resetPeakStats(c10::DeviceIndex device) override { reset_peak_memory(device); }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override { return memory_info(device); }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (discrete_memory()) {
      copy_device_bytes(dest, src, count, current_device());
    } else {
      std::memcpy(dest, src, count);
    }
  }
};

NeuronAllocator allocator_instance;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &allocator_instance);

} // namespace

c10::Allocator* neuron_allocator() { return &allocator_instance; }

MemoryStats memory_stats(c10::DeviceIndex index) {
  check_device_index(index);
  std::lock_guard<std::mutex> lock(stats_mutex);
  return stats[index];
}

void reset_peak_memory(c10::DeviceIndex index) {
  check_device_index(index);
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats[index].peak = stats[index].allocated;
}

void reset_allocation_counts(c10::DeviceIndex index) {
  check_device_index(index);
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats[index].num_allocs -= stats[index].num_frees;  // the live ones stay counted
  stats[index].num_frees = 0;
  stats[index].num_ooms = 0;
}

std::pair<size_t, size_t> memory_info(c10::DeviceIndex index) {
  const MemoryStats s = memory_stats(index);
  if (s.limit > 0) {
    return {static_cast<size_t>(std::max<int64_t>(0, s.limit - s.allocated - s.cached)),
            static_cast<size_t>(s.limit)};
  }
  // No limit: the device is as big as the host's memory (the CPU target's
  // memory is the host's; IREE reports no size for a device's own memory),
  // and what is free is what the host has available.
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGE_SIZE));
  const size_t total = static_cast<size_t>(sysconf(_SC_PHYS_PAGES)) * page;
  size_t available = static_cast<size_t>(sysconf(_SC_AVPHYS_PAGES)) * page;
  if (FILE* meminfo = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kib = 0;
    while (std::fgets(line, sizeof(line), meminfo)) {
      if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
        available = static_cast<size_t>(kib) * 1024;
        break;
      }
    }
    std::fclose(meminfo);
  }
  const size_t cached = static_cast<size_t>(s.cached);
  return {available > cached ? available - cached : 0, total};
}

void empty_cache(c10::DeviceIndex index) {
  check_device_index(index);
  std::vector<void*> released;
  {
    std::lock_guard<std::mutex> lock(stats_mutex);
    for (auto& [size, blocks] : free_blocks[index]) {
      released.insert(released.end(), blocks.begin(), blocks.end());
    }
    free_blocks[index].clear();
    stats[index].cached = 0;
  }
  for (void* ptr : released) release_block(ptr);
}

void set_memory_limit(c10::DeviceIndex index, int64_t bytes) {
  check_device_index(index);
  TORCH_CHECK(bytes >= 0, "memory limit must be >= 0 bytes (0 means no limit)");
  std::lock_guard<std::mutex> lock(stats_mutex);
  stats[index].limit = bytes;
}

} // namespace torchneuron
