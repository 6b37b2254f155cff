// Guarded device memory (TORCHNEURON_CHECK_MEMORY=1): every allocation gets
// guard bytes before its start and past its end, freed blocks are poisoned
// and kept out of reuse for a while, and check_memory_guards() reports any
// guard or poison that changed. The runtime checks after each launch, so a
// compiled op that writes outside the memory it was given is named at once
// instead of corrupting the heap for a later crash.
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

void check_block(const Block& b, std::vector<GuardViolation>& out) {
  // A changed guard is reported once, then restored.
  int64_t at = first_changed(b.base, kFront, kGuard);
  if (at >= 0) {
    out.push_back({reinterpret_cast<uintptr_t>(b.user()), static_cast<int64_t>(b.nbytes), b.device,
                   "before its start", at - static_cast<int64_t>(kFront)});
    std::memset(b.base, kGuard, kFront);
  }
  const size_t tail = b.padded - b.nbytes + kBack;
  at = first_changed(b.user() + b.nbytes, tail, kGuard);
  if (at >= 0) {
    out.push_back({reinterpret_cast<uintptr_t>(b.user()), static_cast<int64_t>(b.nbytes), b.device,
                   "past its end", static_cast<int64_t>(b.nbytes) + at});
    std::memset(b.user() + b.nbytes, kGuard, tail);
  }
}

void check_poison(const Block& b, size_t limit, std::vector<GuardViolation>& out) {
  const int64_t at = first_changed(b.user(), std::min(b.nbytes, limit), kPoison);
  if (at >= 0) {
    out.push_back({reinterpret_cast<uintptr_t>(b.user()), static_cast<int64_t>(b.nbytes), b.device,
                   "after it was freed", at});
    std::memset(b.user(), kPoison, b.nbytes);
  }
}

void release_oldest() {
  Block b = quarantine.front();
  quarantine.pop_front();
  quarantine_bytes -= b.total();
  check_poison(b, b.nbytes, found);
  check_block(b, found);
  std::free(b.base);
}

} // namespace

bool memory_guards_enabled() {
  std::lock_guard<std::mutex> lock(mutex);
  return enabled;
}

void enable_memory_guards(bool on) {
  TORCH_CHECK(!on || !discrete_memory(),
              "neuron: guarded memory (TORCHNEURON_CHECK_MEMORY) needs the unified memory model");
  std::lock_guard<std::mutex> lock(mutex);
  enabled = on;
}

void* guarded_allocate(size_t nbytes, c10::DeviceIndex device) {
  const size_t padded = ((std::max<size_t>(nbytes, 1) + 63) / 64) * 64;
  Block b{nullptr, nbytes, padded, device};
  b.base = static_cast<unsigned char*>(std::aligned_alloc(64, b.total()));
  if (b.base == nullptr) return nullptr;
  std::memset(b.base, kGuard, kFront);
  std::memset(b.user() + nbytes, kGuard, padded - nbytes + kBack);
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
  check_block(b, found);
  std::memset(b.user(), kPoison, b.nbytes);  // the guards past it stay as they are
  quarantine.push_back(b);
  quarantine_bytes += b.total();
  while (quarantine.size() > kQuarantineBlocks || quarantine_bytes > kQuarantineBytes) release_oldest();
  return true;
}

std::vector<GuardViolation> check_memory_guards(bool thorough) {
  // Quick (after each launch): every guard, and the start of each freed
  // block, where a stale buffer is written first. Thorough (at syncs): the
  // whole of each freed block too. Freed blocks are checked whole when they
  // leave the quarantine either way.
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<GuardViolation> out;
  out.swap(found);
  for (const auto& [ptr, b] : live) check_block(b, out);
  for (const auto& b : quarantine) {
    check_block(b, out);
    check_poison(b, thorough ? b.nbytes : kQuickPoisonCheck, out);
  }
  return out;
}

std::vector<GuardViolation> check_memory_guards_at(const std::vector<uintptr_t>& addresses) {
  // After a launch: the guards of the blocks it was given (an overflow lands
  // next to them), plus anything found while freeing.
  std::lock_guard<std::mutex> lock(mutex);
  std::vector<GuardViolation> out;
  out.swap(found);
  std::vector<uintptr_t> seen;
  for (uintptr_t address : addresses) {
    auto it = live.upper_bound(address);
    if (it == live.begin()) continue;
    --it;
    const Block& b = it->second;
    if (address > it->first + b.padded) continue;  // not in a guarded block
    if (std::find(seen.begin(), seen.end(), it->first) != seen.end()) continue;
    seen.push_back(it->first);
    check_block(b, out);
  }
  return out;
}

} // namespace torchneuron
