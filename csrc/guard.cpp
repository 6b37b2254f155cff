// Device guard: current device and stream per thread, streams, events and
// device synchronization for the "neuron" device (PrivateUse1).
#include "neuron.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/Stream.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <array>
#include <atomic>
#include <mutex>

namespace torchneuron {
namespace {

constexpr int kMaxDevices = 64;
std::atomic<c10::DeviceIndex> num_devices{1};
thread_local c10::DeviceIndex tls_device = 0;
// Stream id 0 is each device's default stream; new streams count up from 1.
thread_local std::array<c10::StreamId, kMaxDevices> tls_stream{};
std::atomic<bool> bad_fork{false};
std::atomic<bool> unusable{false};
std::mutex unusable_mutex;
std::string unusable_reason;

std::mutex sync_mutex;
std::function<void(c10::DeviceIndex)> sync_callback;

// Streams' timelines and events live in Python (runtime/streams.py): the
// guard forwards each stream and event call there. Held for the life of the
// process (never decref'd: it must outlive the interpreter's teardown order).
pybind11::object* stream_api = nullptr;

template <typename... Args>
pybind11::object call_stream_api(const char* name, Args... args) {
  check_usable();
  pybind11::gil_scoped_acquire gil;
  TORCH_CHECK(stream_api != nullptr, "neuron: streams are not initialized (import torchneuron)");
  return stream_api->attr(name)(args...);
}

// Streams come from a pool per priority, as CUDA's do: ids 1..kPoolSize are
// normal priority, kPoolSize+1..2*kPoolSize high priority (priority < 0).
constexpr c10::StreamId kPoolSize = 32;
std::array<std::array<std::atomic<uint32_t>, 2>, kMaxDevices> next_pool_stream{};

std::atomic<int64_t> next_event_id{1};
struct Event {
  int64_t id;
  bool timing;
};

struct NeuronGuardImpl final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    TORCH_INTERNAL_ASSERT(d.type() == kType);
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return {kType, current_device()}; }
  void setDevice(c10::Device d) const override {
    TORCH_INTERNAL_ASSERT(d.type() == kType);
    set_current_device(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < num_devices.load()) tls_device = d.index();
  }

  c10::Stream getStream(c10::Device d) const noexcept override {
    auto idx = d.index() < 0 ? tls_device : d.index();
    return c10::Stream(c10::Stream::UNSAFE, {kType, idx}, tls_stream[idx]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::UNSAFE, d, 0);
  }
  c10::Stream getNewStream(c10::Device d, int priority) const override {
    auto idx = d.index() < 0 ? tls_device : d.index();
    check_device_index(idx);
    int high = priority < 0 ? 1 : 0;
    auto n = next_pool_stream[idx][high]++ % kPoolSize;
    return c10::Stream(c10::Stream::UNSAFE, {kType, idx}, 1 + n + high * kPoolSize);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool high_priority) const override {
    return getNewStream(d, high_priority ? -1 : 0);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    auto idx = s.device_index();
    auto old = c10::Stream(c10::Stream::UNSAFE, s.device(), tls_stream[idx]);
    tls_stream[idx] = s.id();
    return old;
  }

  c10::DeviceIndex deviceCount() const noexcept override { return num_devices.load(); }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex /*device_index*/,
              const c10::EventFlag flag) const override {
    if (*event == nullptr) *event = new Event{next_event_id++, flag == c10::EventFlag::BACKEND_DEFAULT};
    auto* e = static_cast<Event*>(*event);
    call_stream_api("record_event", e->id, static_cast<int>(stream.device_index()),
                    static_cast<int64_t>(stream.id()), e->timing);
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;  // never recorded: nothing to wait for
    call_stream_api("wait_event", static_cast<Event*>(event)->id, static_cast<int>(stream.device_index()),
                    static_cast<int64_t>(stream.id()));
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;
    return call_stream_api("query_event", static_cast<Event*>(event)->id).cast<bool>();
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    auto* e = static_cast<Event*>(event);
    if (e == nullptr) return;
    if (Py_IsInitialized() && stream_api != nullptr) {
      try {
        pybind11::gil_scoped_acquire gil;
        stream_api->attr("destroy_event")(e->id);
      } catch (...) {  // at interpreter teardown: nothing left to forget
      }
    }
    delete e;
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    call_stream_api("synchronize_event", static_cast<Event*>(event)->id);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start && end, "Both events must be recorded before calculating elapsed time.");
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a->timing && b->timing,
                "Both events must be created with argument 'enable_timing=True'.");
    return call_stream_api("elapsed_time", a->id, b->id).cast<double>();
  }

  bool queryStream(const c10::Stream& stream) const override {
    return call_stream_api("query_stream", static_cast<int>(stream.device_index()),
                           static_cast<int64_t>(stream.id())).cast<bool>();
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    call_stream_api("synchronize_stream", static_cast<int>(stream.device_index()),
                    static_cast<int64_t>(stream.id()));
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    run_synchronize_callback(device_index < 0 ? tls_device : device_index);
  }
  // A block stays held by every launch that uses it until that launch is
  // done, on whichever stream (runtime/queue.py), so a freed block is never
  // handed out while another stream still uses it: nothing to record.
  void recordDataPtrOnStream(const c10::DataPtr& /*data_ptr*/, const c10::Stream& /*stream*/) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuardImpl);

} // namespace

c10::DeviceIndex device_count() { return num_devices.load(); }

void set_stream_api(pybind11::object api) { stream_api = new pybind11::object(std::move(api)); }

int64_t current_stream_id(c10::DeviceIndex index) { return tls_stream[index]; }

int64_t exchange_stream_id(c10::DeviceIndex index, int64_t id) {
  auto old = tls_stream[index];
  tls_stream[index] = id;
  return old;
}

void set_device_count(c10::DeviceIndex n) {
  TORCH_CHECK(n >= 1 && n <= kMaxDevices, "neuron device count must be in [1, ",
              kMaxDevices, "], got ", static_cast<int>(n));
  num_devices.store(n);
}

void check_device_index(c10::DeviceIndex index) {
  TORCH_CHECK_INDEX(index >= 0 && index < num_devices.load(),
      "Invalid neuron device index ", static_cast<int>(index), ": there ",
      num_devices.load() == 1 ? "is 1 neuron device" : "are " + std::to_string(num_devices.load()) + " neuron devices",
      " (valid indices 0..", static_cast<int>(num_devices.load() - 1),
      "; set TORCHNEURON_DEVICE_COUNT for more).");
}

c10::DeviceIndex current_device() { return tls_device; }

void set_current_device(c10::DeviceIndex index) {
  check_device_index(index);
  tls_device = index;
}

void mark_unusable(const std::string& reason) {
  std::lock_guard<std::mutex> lock(unusable_mutex);
  unusable_reason = reason;
  unusable.store(!reason.empty());
}

void mark_bad_fork() {
  bad_fork.store(true);
  mark_unusable(
      "Cannot re-initialize neuron in forked subprocess. To use neuron with "
      "multiprocessing, you must use the 'spawn' start method "
      "(multiprocessing.set_start_method('spawn')).");
}

bool in_bad_fork() { return bad_fork.load(); }

void check_usable() {
  if (!unusable.load()) return;
  std::lock_guard<std::mutex> lock(unusable_mutex);
  TORCH_CHECK(false, unusable_reason);
}

void set_synchronize_callback(std::function<void(c10::DeviceIndex)> fn) {
  std::lock_guard<std::mutex> lock(sync_mutex);
  sync_callback = std::move(fn);
}

void run_synchronize_callback(c10::DeviceIndex index) {
  check_usable();
  std::function<void(c10::DeviceIndex)> fn;
  {
    std::lock_guard<std::mutex> lock(sync_mutex);
    fn = sync_callback;
  }
  if (fn) {
    pybind11::gil_scoped_acquire gil;
    fn(index);
  }
}

} // namespace torchneuron
