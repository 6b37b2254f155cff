// The kineto plugin that brings the device's work into torch.profiler.
//
// torch 2.13 offers no Python route for device events (docs/architecture.md,
// "Profiling"): a libkineto::IActivityProfiler registered with
// REGISTER_PRIVATEUSE1_PROFILER is the only way. This file is that glue and
// nothing more. The session forwards start/stop to the Python recorder
// (torchneuron.profiler.recorder, installed with set_profiler_api) and, at
// processTrace, turns the events it collected into kineto activities. The
// correlation id of the CPU op being dispatched is kept per thread here;
// Python reads it when it enqueues a launch (launches are asynchronous).
#include <pybind11/pybind11.h>

#include <libkineto.h>
#include <output_base.h>
#include <time_since_epoch.h>
#include <torch/csrc/profiler/standalone/privateuse1_profiler.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace torchneuron {

namespace {

pybind11::object* profiler_api = nullptr;
thread_local std::vector<uint64_t> correlation_stack;

// One event as the Python recorder hands it over.
struct DeviceEvent {
  int kind;  // 0: executable launch, 1: copy, 2: runtime (compile, host fallback, sync), 3: launch call
             // on the host thread that issued it (device: pid, stream: thread id)
  std::string name;
  int64_t start_ns;
  int64_t end_ns;
  int64_t device;
  int64_t stream;
  uint64_t correlation;
  std::vector<std::pair<std::string, std::string>> metadata;
  int64_t flow;  // > 0: starts flow `flow` (a launch call), < 0: ends flow `-flow` (its launch), 0: none
};

std::vector<DeviceEvent> call_python(const char* name) {
  std::vector<DeviceEvent> events;
  if (profiler_api == nullptr || Py_IsInitialized() == 0) {
    return events;
  }
  pybind11::gil_scoped_acquire gil;
  try {
    pybind11::object result = profiler_api->attr(name)();
    if (result.is_none()) {
      return events;
    }
    for (auto item : result) {
      auto t = item.cast<pybind11::tuple>();
      DeviceEvent e;
      e.kind = t[0].cast<int>();
      e.name = t[1].cast<std::string>();
      e.start_ns = t[2].cast<int64_t>();
      e.end_ns = t[3].cast<int64_t>();
      e.device = t[4].cast<int64_t>();
      e.stream = t[5].cast<int64_t>();
      e.correlation = t[6].cast<uint64_t>();
      for (auto kv : t[7].cast<pybind11::dict>()) {
        e.metadata.emplace_back(kv.first.cast<std::string>(), kv.second.cast<std::string>());
      }
      e.flow = t.size() > 8 ? t[8].cast<int64_t>() : 0;
      events.push_back(std::move(e));
    }
  } catch (const std::exception& err) {
    // A profiler must not take the program down: the trace just lacks device events.
    PyErr_Clear();
  }
  return events;
}

libkineto::ActivityType activity_type(int kind) {
  switch (kind) {
    case 1:
      return libkineto::ActivityType::GPU_MEMCPY;
    case 2:
    case 3:
      return libkineto::ActivityType::PRIVATEUSE1_RUNTIME;
    default:
      return libkineto::ActivityType::CONCURRENT_KERNEL;
  }
}

// Kineto writes a quoted value between quotes as it is: keep it valid JSON.
std::string json_safe(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"') {
      out += '\'';
    } else if (c == '\\') {
      out += '/';
    } else if (static_cast<unsigned char>(c) >= 0x20) {
      out += c;
    }
  }
  return out;
}

// Host work shown beside the device's streams (profiler/recorder.py ROWS).
std::string row_name(int64_t stream) {
  switch (stream) {
    case -1:
      return "compiles";
    case -2:
      return "host path";
    case -3:
      return "transfers";
    case -4:
      return "synchronize";
    default:
      return "stream " + std::to_string(stream);
  }
}

class NeuronProfilerSession : public libkineto::IActivityProfilerSession {
 public:
  void start() override {
    start_ns_ = libkineto::timeSinceEpoch(std::chrono::system_clock::now());
    call_python("start");
    status_ = libkineto::TraceStatus::RECORDING;
  }

  void stop() override {
    call_python("stop");
    end_ns_ = libkineto::timeSinceEpoch(std::chrono::system_clock::now());
    status_ = libkineto::TraceStatus::PROCESSING;
  }

  std::vector<std::string> errors() override { return {}; }

  void processTrace(libkineto::ActivityLogger& logger) override {
    buffer_.span = libkineto::TraceSpan(start_ns_, end_ns_, "neuron");
    for (const auto& e : call_python("collect")) {
      const auto row = std::make_pair(e.device, e.stream);
      if (e.kind != 3 && std::find(rows_.begin(), rows_.end(), row) == rows_.end()) {
        rows_.push_back(row);  // a launch call is on the host thread's row, which torch names
      }
      buffer_.emplace_activity(buffer_.span, activity_type(e.kind), e.name);
      auto& act = libkineto::CpuTraceBuffer::toRef(buffer_.activities.back());
      act.startTime = e.start_ns;  // unix-epoch ns, as torch's own events
      act.endTime = std::max(e.end_ns, e.start_ns);
      act.device = e.device;
      act.resource = e.stream;
      act.id = static_cast<int32_t>(e.correlation);
      if (e.flow != 0) {  // the arrow from the launch call to the launch, as CUDA's
        act.flow.id = static_cast<uint32_t>(e.flow > 0 ? e.flow : -e.flow);
        act.flow.type = libkineto::kLinkAsyncCpuGpu;
        act.flow.start = e.flow > 0 ? 1 : 0;
      }
      if (e.correlation != 0 && linked_) {
        act.linked = linked_(static_cast<int32_t>(e.correlation));  // the CPU op that issued it
      }
      for (const auto& [key, value] : e.metadata) {
        act.addMetadataQuoted(key, json_safe(value));
      }
      logger.handleActivity(act);
    }
  }

  void processTrace(libkineto::ActivityLogger& logger, libkineto::getLinkedActivityCallback linked, int64_t,
                    int64_t) override {
    linked_ = std::move(linked);
    processTrace(logger);
  }

  std::unique_ptr<libkineto::DeviceInfo> getDeviceInfo() override {
    return std::make_unique<libkineto::DeviceInfo>(libkineto::DeviceInfo{0, 0, "neuron", "neuron 0"});
  }

  std::vector<libkineto::ResourceInfo> getResourceInfos() override {
    std::vector<libkineto::ResourceInfo> infos;
    for (const auto& [device, stream] : rows_) {
      infos.push_back(libkineto::ResourceInfo{stream, stream, device, row_name(stream)});
    }
    return infos;
  }

  std::unique_ptr<libkineto::CpuTraceBuffer> getTraceBuffer() override {
    return std::make_unique<libkineto::CpuTraceBuffer>(std::move(buffer_));
  }

  void pushCorrelationId(uint64_t id) override { correlation_stack.push_back(id); }

  void popCorrelationId() override {
    if (!correlation_stack.empty()) {
      correlation_stack.pop_back();
    }
  }

 private:
  int64_t start_ns_ = 0;
  int64_t end_ns_ = 0;
  libkineto::CpuTraceBuffer buffer_;
  std::vector<std::pair<int64_t, int64_t>> rows_;
  libkineto::getLinkedActivityCallback linked_;
};

class NeuronActivityProfiler : public libkineto::IActivityProfiler {
 public:
  const std::string& name() const override { return name_; }

  const std::set<libkineto::ActivityType>& availableActivities() const override { return activities_; }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config&) override {
    const bool wanted = std::any_of(types.begin(), types.end(), [this](auto t) { return activities_.count(t) > 0; });
    return wanted ? std::make_unique<NeuronProfilerSession>() : nullptr;
  }

  std::unique_ptr<libkineto::IActivityProfilerSession> configure(int64_t, int64_t,
                                                                 const std::set<libkineto::ActivityType>& types,
                                                                 const libkineto::Config& config) override {
    return configure(types, config);
  }

 private:
  std::string name_{"neuron"};
  std::set<libkineto::ActivityType> activities_{
      libkineto::ActivityType::CONCURRENT_KERNEL,
      libkineto::ActivityType::GPU_MEMCPY,
      libkineto::ActivityType::PRIVATEUSE1_RUNTIME,
      libkineto::ActivityType::PRIVATEUSE1_DRIVER,
  };
};

}  // namespace

REGISTER_PRIVATEUSE1_PROFILER(NeuronActivityProfiler);

void set_profiler_api(pybind11::object api) { profiler_api = new pybind11::object(std::move(api)); }

uint64_t current_correlation_id() { return correlation_stack.empty() ? 0 : correlation_stack.back(); }

}  // namespace torchneuron
