// PrivateUse1 hooks and the per-device random generator. The generator keeps
// the CPU generator's algorithm and state format, so a seeded program draws the
// same numbers on neuron as on CPU.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <mutex>

namespace torchneuron {
namespace {

class NeuronGeneratorImpl : public at::CPUGeneratorImpl {
 public:
  explicit NeuronGeneratorImpl(c10::DeviceIndex index) {
    device_ = c10::Device(c10::DeviceType::PrivateUse1, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

std::once_flag generators_once;
std::deque<at::Generator> default_generators;  // deque: stable references

void init_generators() {
  std::call_once(generators_once, [] {
    for (c10::DeviceIndex i = 0; i < 64; ++i) {
      auto gen = at::make_generator<NeuronGeneratorImpl>(i);
      gen.set_current_seed(c10::detail::getNonDeterministicRandom());
      default_generators.push_back(gen);
    }
  });
}

struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return device_count(); }
  c10::DeviceIndex getCurrentDevice() const override { return current_device(); }
  void setCurrentDevice(c10::DeviceIndex index) const override { set_current_device(index); }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto old = current_device();
    set_current_device(index);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return new_generator(index);
  }
  c10::Device getDeviceFromPtr(void* /*data*/) const override {
    return {c10::DeviceType::PrivateUse1, current_device()};
  }
  bool isPinnedPtr(const void* data) const override {
    return pinned_block_of(reinterpret_cast<uintptr_t>(data)).second != 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  // `storage.resize_()` (FSDP2 frees and regrows its parameters' memory so),
  // and out= results grown from empty. The old memory may still be read or
  // written by queued launches or a pending adaptive graph, and freeing it
  // returns it to the cache: wait for the device first. A storage shrunk to
  // nothing keeps its device (resize_bytes_cpu's empty DataPtr says CPU).
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    const c10::Device device = impl->device();
    const size_t old_size = impl->nbytes();
    if (old_size > 0) run_synchronize_callback(device.index());
    c10::DataPtr fresh(nullptr, device);
    if (newsize > 0) {
      const c10::DeviceIndex previous = current_device();
      set_current_device(device.index());
      try {
        fresh = impl->allocator()->allocate(newsize);
      } catch (...) {
        set_current_device(previous);
        throw;
      }
      set_current_device(previous);
      const size_t kept = std::min(newsize, old_size);
      if (kept > 0 && discrete_memory()) {
        copy_device_bytes(fresh.get(), impl->data_ptr().get(), kept, device.index());
      } else if (kept > 0) {
        std::memcpy(fresh.get(), impl->data_ptr().get(), kept);
      }
    }
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

} // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  init_generators();
  if (index < 0) index = current_device();
  check_device_index(index);
  return default_generators[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  if (index < 0) index = current_device();
  check_device_index(index);
  return at::make_generator<NeuronGeneratorImpl>(index);
}

// Registered at load time, like the allocator and the guard.
static bool hooks_registered = [] {
  static NeuronHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}();

} // namespace torchneuron
