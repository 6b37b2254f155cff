// Shared declarations of the thin C++ device glue (see docs/architecture.md).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Allocator.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace torchneuron {

// Device count and current device (thread-local), owned by the guard.
c10::DeviceIndex device_count();
void set_device_count(c10::DeviceIndex n);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex index);
void check_device_index(c10::DeviceIndex index);
// The calling thread's current stream id on a device, and swapping it.
int64_t current_stream_id(c10::DeviceIndex index);
int64_t exchange_stream_id(c10::DeviceIndex index, int64_t id);

// A device that cannot be used (forked child, unavailable driver) refuses
// every allocation and sync with the reason given.
void mark_unusable(const std::string& reason);
void mark_bad_fork();
bool in_bad_fork();
void check_usable();

// Allocator statistics, per device, exact.
struct MemoryStats {
  int64_t allocated = 0;       // bytes in live allocations
  int64_t peak = 0;            // high-water mark since the last reset
  int64_t num_allocs = 0;      // allocations made
  int64_t num_frees = 0;       // allocations freed
  int64_t num_ooms = 0;        // allocations refused by the limit
  int64_t limit = 0;           // 0: no limit
  int64_t cached = 0;          // bytes in freed blocks kept for reuse
};
MemoryStats memory_stats(c10::DeviceIndex index);
void reset_peak_memory(c10::DeviceIndex index);
void set_memory_limit(c10::DeviceIndex index, int64_t bytes);
void empty_cache(c10::DeviceIndex index);  // frees the blocks kept for reuse
void reset_allocation_counts(c10::DeviceIndex index);
std::pair<size_t, size_t> memory_info(c10::DeviceIndex index);  // (free, total) bytes
c10::Allocator* neuron_allocator();

// Guarded memory (memory_guards.cpp): guard bytes around every allocation,
// poisoned and quarantined frees, checked on demand.
struct GuardViolation {
  uintptr_t address;   // the allocation's start
  int64_t nbytes;      // its size
  c10::DeviceIndex device;
  const char* where;   // "past its end", "before its start", "after it was freed"
  int64_t offset;      // of the first changed byte, from the start
};
bool memory_guards_enabled();
void enable_memory_guards(bool on);
void* guarded_allocate(size_t nbytes, c10::DeviceIndex device);  // nullptr when the host refuses
bool guarded_free(void* ptr);  // false: not a guarded allocation
std::vector<GuardViolation> check_memory_guards(bool thorough);
std::vector<GuardViolation> check_memory_guards_at(const std::vector<uintptr_t>& addresses);
// The discrete model's guards, read and written by the runtime with transfers:
struct GuardRegion {
  uintptr_t address;   // the allocation's start
  int64_t nbytes;      // its size
  c10::DeviceIndex device;
  const char* where;
  uintptr_t start;     // the bytes that must all be `value`
  size_t length;
  unsigned char value;
  int64_t offset;      // of `start`, from the allocation's start
};
std::vector<GuardRegion> guard_regions(const std::vector<uintptr_t>* addresses, bool thorough);
std::vector<GuardRegion> take_blocks_to_poison();

// The discrete memory model (device_addresses.cpp): storages get opaque
// device addresses, and the Python runtime keeps the device buffer behind each.
bool discrete_memory();
void set_discrete_memory(bool on);  // before the first allocation only
void note_allocation();
void* reserve_device_address(size_t nbytes);  // nullptr when the space is spent
void release_device_address(void* ptr);
std::pair<uintptr_t, size_t> device_block_of(uintptr_t address);  // (0, 0): none
std::vector<std::pair<uintptr_t, size_t>> take_released_blocks();
void set_device_copy_callback(std::function<void(uintptr_t, uintptr_t, size_t, c10::DeviceIndex)> fn);
void copy_device_bytes(void* dst, const void* src, size_t nbytes, c10::DeviceIndex device);

// Pinned host memory (pinned_memory.cpp).
c10::Allocator* pinned_allocator();
std::pair<uintptr_t, size_t> pinned_block_of(uintptr_t address);  // (0, 0): not pinned

// The block of `blocks` (start -> length) holding `address`, or (0, 0); the caller holds their lock.
inline std::pair<uintptr_t, size_t> block_containing(const std::map<uintptr_t, size_t>& blocks, uintptr_t address) {
  auto it = blocks.upper_bound(address);
  if (it == blocks.begin()) return {0, 0};
  --it;
  if (address >= it->first + it->second) return {0, 0};
  return {it->first, it->second};
}

// A CPU tensor over a neuron tensor's memory (same sizes, strides, offset);
// it keeps the neuron storage alive (module.cpp).
at::Tensor host_alias(const at::Tensor& t);

// Called (with the GIL taken) by synchronize(); set by the Python runtime.
void set_synchronize_callback(std::function<void(c10::DeviceIndex)> fn);
void run_synchronize_callback(c10::DeviceIndex index);

const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);

} // namespace torchneuron
