// Guarded device memory (TORCHNEURON_CHECK_MEMORY=1): every allocation gets
// guard bytes before its start and past its end, freed blocks are poisoned
// and kept out of reuse for a while, and check_memory_guards() reports any
// guard or poison that changed. The runtime checks after each launch, so a
// compiled op that writes outside the memory it was given is named at once
// instead of corrupting the heap for a later crash. On the discrete memory
// model the blocks are device address blocks: this file keeps the books and
// the runtime reads and writes the bytes with transfers (guard_regions,
// take_blocks_to_poison; runtime/memory_guards.py).
#include "neuron.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <mutex>
#include <map>

namespace torchneuron {
namespace {

constexpr size_t kFront = 64;           // keeps the user pointer 64-byte aligned
constexpr size_t kBack = 256;           // past the 64-byte rounding
constexpr unsigned char kGuard = 0xFD;
constexpr unsigned char kPoison = 0xDD;
constexpr size_t kQuarantineBlocks = 2048;
constexpr size_t kQuarantineBytes = 128ull << 20;
constexpr size_t kQuickPoisonCheck = 64;  // of each quarantined block, in a quick check

struct Block {
  unsigned char* base;
  size_t nbytes;   // what the tensor storage asked for
  size_t padded;   // nbytes rounded up to 64
  c10::DeviceIndex device;
  unsigned char* user() const { return base + kFront; }
  size_t total() const { return kFront + padded + kBack; }
};

std::mutex mutex;
bool enabled = false;
std::map<uintptr_t, Block> live;  // by user address: ordered, to find the block holding an address
std::deque<Block> quarantine;
size_t quarantine_bytes = 0;
std::vector<GuardViolation> found;  // seen while freeing, reported by the next check
std::vector<Block> to_poison;       // freed on the discrete model, not yet poisoned on the device

// Offset of the first byte in [p, p+n) that is not `value`, or -1; eight
// bytes at a time where it can.
int64_t first_changed(const unsigned char* p, size_t n, unsigned char value) {
  uint64_t word;
  std::memset(&word, value, sizeof(word));
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t got;
    std::memcpy(&got, p + i, 8);
    if (got != word) break;
  }
  for (; i < n; ++i) {
    if (p[i] != value) return static_cast<int64_t>(i);
  }
  return -1;
}

// The bytes a check compares: a block's guards, and a freed block's poison
// (its first `poison_limit` bytes). On the unified model the host compares
// them here; on the discrete model they live in device memory and the Python
// runtime reads them with transfers (runtime/memory_guards.py).
void regions_of(const Block& b, bool freed, size_t poison_limit, std::vector<GuardRegion>& out) {
  const auto user = reinterpret_cast<uintptr_t>(b.user());
  const auto nbytes = static_cast<int64_t>(b.nbytes);
  out.push_back({user, nbytes, b.device, "before its start", reinterpret_cast<uintptr_t>(b.base), kFront, kGuard,
                 -static_cast<int64_t>(kFront)});
  out.push_back({user, nbytes, b.device, "past its end", user + b.nbytes, b.padded - b.nbytes + kBack, kGuard,
                 nbytes});
  if (freed) out.push_back({user, nbytes, b.device, "after it was freed", user, std::min(b.nbytes, poison_limit),
                            kPoison, 0});
}

// A changed region is reported once, then restored.
void check_regions(const std::vector<GuardRegion>& regions, std::vector<GuardViolation>& out) {
  for (const auto& r : regions) {
    auto* p = reinterpret_cast<unsigned char*>(r.start);
    const int64_t at = first_changed(p, r.length, r.value);
    if (at < 0) continue;
    out.push_back({r.address, r.nbytes, r.device, r.where, r.offset + at});
    std::memset(p, r.value, r.length);
  }
}

void check_block(const Block& b, bool freed, size_t poison_limit, std::vector<GuardViolation>& out) {
  std::vector<GuardRegion> regions;
  regions_of(b, freed, poison_limit, regions);
  check_regions(regions, out);
}

void release_oldest() {
  Block b = quarantine.front();
  quarantine.pop_front();
  quarantine_bytes -= b.total();
  if (discrete_memory()) {
    // checked at the last synchronization; the host cannot read it here
    release_device_address(b.base);
    return;
  }
  check_block(b, true, b.nbytes, found);
  std::free(b.base);
}

// The live blocks holding `addresses` (each once), or every live block.
std::vector<const Block*> live_blocks_at(const std::vector<uintptr_t>* addresses) {
  std::vector<const Block*> out;
  if (addresses == nullptr) {
    for (const auto& [ptr, b] : live) out.push_back(&b);
    return out;
  }
  for (uintptr_t address : *addresses) {
    auto it = live.upper_bound(address);
    if (it == live.begin()) continue;
    --it;
    const Block& b = it->second;
    if (address > it->first + b.padded) continue;  // not in a guarded block
    if (std::find(out.begin(), out.end(), &b) != out.end()) continue;
    out.push_back(&b);
  }
  return out;
}

// What a check covers. Quick (after each launch): every guard, and the
// start of each freed block, where a stale buffer is written first.
// Thorough (at syncs): the whole of each freed block too. After a launch
// (`addresses`): the guards of the blocks it was given, where an overflow lands.
std::vector<GuardRegion> regions_to_check(const std::vector<uintptr_t>* addresses, bool thorough) {
  std::vector<GuardRegion> regions;
  for (const Block* b : live_blocks_at(addresses)) regions_of(*b, false, 0, regions);
  if (addresses == nullptr) {
    for (const auto& b : quarantine) regions_of(b, true, thorough ? b.nbytes : kQuickPoisonCheck, regions);
  }
  return regions;
}

} // namespace

bool memory_guards_enabled() {
  std::lock_guard<std::mutex> lock(mutex);
  return enabled;
}

void enable_memory_guards(bool on) {
  std::lock_guard<std::mutex> lock(mutex);
  enabled = on;
}

void* guarded_allocate(size_t nbytes, c10::DeviceIndex device) {
  const size_t padded = ((std::max<size_t>(nbytes, 1) + 63) / 64) * 64;
  Block b{nullptr, nbytes, padded, device};
  if (discrete_memory()) {
    // A device address block holding the guards too; the runtime fills the
    // device buffer behind it with guard bytes when it makes it.
    b.base = static_cast<unsigned char*>(reserve_device_address(b.total()));
    if (b.base == nullptr) return nullptr;
  } else {
    b.base = static_cast<unsigned char*>(std::aligned_alloc(64, b.total()));
    if (b.base == nullptr) return nullptr;
    std::memset(b.base, kGuard, kFront);
    std::memset(b.user() + nbytes, kGuard, padded - nbytes + kBack);
  }
  std::lock_guard<std::mutex> lock(mutex);
  live.emplace(reinterpret_cast<uintptr_t>(b.user()), b);
  return b.user();
}

bool guarded_free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = live.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live.end()) return false;
  Block b = it->second;
  live.erase(it);
  if (discrete_memory()) {
    to_poison.push_back(b);  // by the runtime, before its next device work
  } else {
    check_block(b, false, 0, found);
    std::memset(b.user(), kPoison, b.nbytes);  // the guards past it stay as they are
  }
  quarantine.push_back(b);
  quarantine_bytes += b.total();
  while (quarantine.size() > kQuarantineBlocks || quarantine_bytes > kQuarantineBytes) release_oldest();
  return true;
}

std::vector<GuardViolation> check_memory_guards(bool thorough) {
  TORCH_CHECK(!discrete_memory(), "neuron: the host cannot read device memory's guards (runtime/memory_guards.py)");
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<GuardViolation> out;
  out.swap(found);
  check_regions(regions_to_check(nullptr, thorough), out);
  return out;
}

std::vector<GuardViolation> check_memory_guards_at(const std::vector<uintptr_t>& addresses) {
  TORCH_CHECK(!discrete_memory(), "neuron: the host cannot read device memory's guards (runtime/memory_guards.py)");
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<GuardViolation> out;
  out.swap(found);
  check_regions(regions_to_check(&addresses, false), out);
  return out;
}

std::vector<GuardRegion> guard_regions(const std::vector<uintptr_t>* addresses, bool thorough) {
  std::lock_guard<std::mutex> lock(mutex);
  return regions_to_check(addresses, thorough);
}

std::vector<GuardRegion> take_blocks_to_poison() {
  // The whole of each freed block, to be filled with poison on the device.
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<GuardRegion> out;
  for (const auto& b : to_poison) {
    out.push_back({reinterpret_cast<uintptr_t>(b.user()), static_cast<int64_t>(b.nbytes), b.device,
                   "after it was freed", reinterpret_cast<uintptr_t>(b.user()), b.nbytes, kPoison, 0});
  }
  to_poison.clear();
  return out;
}

} // namespace torchneuron
