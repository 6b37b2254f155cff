// Python bindings of the device glue: torchneuron._C.
#include "neuron.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/Generator.h>
#include <torch/extension.h>

#include <atomic>
#include <optional>
#include <vector>

namespace torchneuron {
extern std::atomic<uint64_t> supported_dtypes_mask;
void set_stream_api(pybind11::object api);  // guard.cpp
void set_profiler_api(pybind11::object api);  // profiler.cpp
pybind11::tuple premul_sum(const pybind11::object& reduce_op);  // distributed.cpp
uint64_t current_correlation_id();  // profiler.cpp
void register_collective_kernels();  // distributed.cpp
void bind_draws(pybind11::module& m);  // draws.cpp
// recording.cpp
void route_ops(const std::vector<std::string>& names);
void set_fast_mode(int mode, pybind11::object miss_marker);
bool learn_call(pybind11::object handler, pybind11::object payload, const std::string& op_name,
                const std::vector<std::string>& params, const std::vector<at::Tensor>& tensors,
                const std::vector<double>& floats, const std::vector<int64_t>& ints);
void forget_calls(const std::optional<std::string>& op_name);
size_t known_calls();
void set_fast_path_checks(pybind11::dict entry_globals, pybind11::dict trace_globals,
                          pybind11::dict registry_globals, pybind11::object settings, pybind11::object append,
                          pybind11::object dispatched_counts);
// pending_graph.cpp
void set_recorder_api(pybind11::object pending, pybind11::object fresh_graph, pybind11::object cut_loop,
                      pybind11::object cut_size, pybind11::object cut_held, pybind11::object cut_peak,
                      pybind11::object op_record, pybind11::object is_library_file, pybind11::object miss);
void set_adaptive_max_ops(int64_t n);
void set_adaptive_held_bytes(int64_t n);
void set_adaptive_peak_cuts(bool on);
void forget_peak_cuts();
pybind11::object record_append(pybind11::handle recipe, pybind11::handle tensors, pybind11::handle floats,
                               pybind11::handle ints, pybind11::handle location);
void forget_pending_lists();
pybind11::object weak_storage(const c10::Storage& storage);
pybind11::object weak_get(pybind11::handle weak);

namespace {

struct StorageRef {
  c10::Storage storage;
};

void release_storage_ref(void* ctx) { delete static_cast<StorageRef*>(ctx); }

}  // namespace

// On the discrete model the host cannot address device memory: a path that
// tries is a bug, refused here with the tensor named rather than faulting.
void check_host_addressable(const at::Tensor& t) {
  TORCH_CHECK(!discrete_memory(), "neuron: the host cannot read or write neuron:", static_cast<int>(t.device().index()),
              "'s memory in place (the discrete memory model): a ", t.scalar_type(), t.sizes(),
              " tensor reached a host path that has no transfer");
}

// A CPU tensor over the same memory as a neuron tensor (same size, strides and
// offset). It keeps the neuron storage alive. This is the zero-copy host view
// that the host fallback computes on and that IREE imports through DLPack.
at::Tensor host_alias(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_privateuseone(), "host_alias expects a neuron tensor, got ", t.device());
  check_host_addressable(t);
  const auto& storage = t.storage();
  c10::DataPtr data(storage.mutable_data(), new StorageRef{storage}, &release_storage_ref,
                    c10::Device(c10::DeviceType::CPU));
  c10::Storage cpu_storage(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(data),
                           at::getCPUAllocator(), /*resizable=*/true);
  auto out = at::empty({0}, t.options().device(at::kCPU));
  out.set_(cpu_storage, t.storage_offset(), t.sizes(), t.strides());
  return out;
}

namespace {

// A 1-D uint8 CPU tensor over `nbytes` bytes of a tensor's storage, starting
// `byte_offset` bytes in; it keeps the storage alive. IREE imports it (through
// the buffer protocol) as a device buffer with no copy.
at::Tensor host_bytes(const at::Tensor& t, int64_t byte_offset, int64_t nbytes) {
  check_host_addressable(t);
  const auto& storage = t.storage();
  TORCH_CHECK(byte_offset >= 0 && nbytes >= 0 &&
              byte_offset + nbytes <= static_cast<int64_t>(storage.nbytes()),
              "host_bytes: range outside the storage");
  c10::DataPtr data(storage.mutable_data(), new StorageRef{storage}, &release_storage_ref,
                    c10::Device(c10::DeviceType::CPU));
  c10::Storage cpu_storage(c10::Storage::use_byte_size_t(), storage.nbytes(), std::move(data),
                           nullptr, /*resizable=*/false);
  auto out = at::empty({0}, at::TensorOptions().dtype(at::kByte));
  out.set_(cpu_storage, byte_offset, {nbytes}, {1});
  return out;
}

// New device storage holding a copy of a host tensor; keeps its strides when
// they are dense, as the CPU kernel produced them.
at::Tensor device_copy_of(const at::Tensor& host, int index) {
  auto options = host.options().device(c10::Device(c10::DeviceType::PrivateUse1, index));
  auto out = host.is_non_overlapping_and_dense()
      ? at::empty_strided(host.sizes(), host.strides(), options)
      : at::empty(host.sizes(), options);
  host_alias(out).copy_(host);
  return out;
}

}  // namespace

// A new contiguous device tensor, without the dispatcher and argument
// parsing of torch.empty: the per-launch output allocation of compiled ops.
at::Tensor empty_device(const std::vector<int64_t>& sizes, at::ScalarType dtype, int index) {
  check_usable();
  TORCH_CHECK_TYPE((supported_dtypes_mask.load() >> static_cast<int>(dtype)) & 1ull,
                   "neuron: dtype ", c10::toString(dtype), " cannot be held by the current target");
  const c10::Device device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(index));
  const c10::DeviceGuard guard(device);
  return at::detail::empty_generic(sizes, neuron_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   dtype, std::nullopt);
}

} // namespace torchneuron

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace torchneuron;
  m.def("device_count", []() { return static_cast<int>(device_count()); });
  m.def("set_device_count", [](int n) { set_device_count(static_cast<c10::DeviceIndex>(n)); });
  m.def("current_device", []() { return static_cast<int>(current_device()); });
  m.def("set_device", [](int i) { set_current_device(static_cast<c10::DeviceIndex>(i)); });
  m.def("check_device_index", [](int i) { check_device_index(static_cast<c10::DeviceIndex>(i)); });
  m.def("mark_bad_fork", &mark_bad_fork);
  m.def("in_bad_fork", &in_bad_fork);
  m.def("mark_unusable", &mark_unusable);
  m.def("empty", &empty_device);
  m.def("memory_stats", [](int i) {
    auto s = memory_stats(static_cast<c10::DeviceIndex>(i));
    pybind11::dict d;
    d["allocated"] = s.allocated;
    d["peak"] = s.peak;
    d["num_allocs"] = s.num_allocs;
    d["num_frees"] = s.num_frees;
    d["num_ooms"] = s.num_ooms;
    d["limit"] = s.limit;
    d["cached"] = s.cached;
    return d;
  });
  m.def("empty_cache", [](int i) { empty_cache(static_cast<c10::DeviceIndex>(i)); });
  m.def("mem_get_info", [](int i) { return memory_info(static_cast<c10::DeviceIndex>(i)); });
  m.def("reset_peak_memory", [](int i) { reset_peak_memory(static_cast<c10::DeviceIndex>(i)); });
  m.def("set_memory_limit", [](int i, int64_t bytes) {
    set_memory_limit(static_cast<c10::DeviceIndex>(i), bytes);
  });
  m.def("set_supported_dtypes", [](const std::vector<at::ScalarType>& dtypes) {
    uint64_t mask = 0;
    for (auto d : dtypes) mask |= 1ull << static_cast<int>(d);
    supported_dtypes_mask.store(mask);
  });
  m.def("set_stream_api", [](pybind11::object api) { set_stream_api(std::move(api)); });
  m.def("set_profiler_api", [](pybind11::object api) { set_profiler_api(std::move(api)); });
  m.def("correlation_id", &current_correlation_id);
  m.def("current_stream", [](int i) { return current_stream_id(static_cast<c10::DeviceIndex>(i)); });
  m.def("exchange_stream", [](int i, int64_t id) {
    return exchange_stream_id(static_cast<c10::DeviceIndex>(i), id);
  });
  m.def("set_synchronize_callback", [](pybind11::object fn) {
    if (fn.is_none()) {
      set_synchronize_callback(nullptr);
    } else {
      // Hold the callable for the life of the process: it must outlive the
      // interpreter's teardown order, so it is never decref'd.
      auto* held = new pybind11::object(fn);
      set_synchronize_callback([held](c10::DeviceIndex i) { (*held)(static_cast<int>(i)); });
    }
  });
  m.def("default_generator", [](int i) {
    return pybind11::reinterpret_steal<pybind11::object>(
        THPGenerator_initDefaultGenerator(default_generator(static_cast<c10::DeviceIndex>(i))));
  });
  m.def("enable_memory_guards", &enable_memory_guards);
  auto as_tuples = [](const std::vector<GuardViolation>& found) {
    pybind11::list out;
    for (const auto& v : found) {
      out.append(pybind11::make_tuple(v.address, v.nbytes, static_cast<int>(v.device), v.where, v.offset));
    }
    return out;
  };
  m.def("check_memory_guards", [as_tuples](bool thorough) { return as_tuples(check_memory_guards(thorough)); },
        pybind11::arg("thorough") = true);
  m.def("check_memory_guards_at", [as_tuples](const std::vector<uintptr_t>& addresses) {
    return as_tuples(check_memory_guards_at(addresses));
  });
  auto regions_as_tuples = [](const std::vector<GuardRegion>& regions) {
    pybind11::list out;
    for (const auto& r : regions) {
      out.append(pybind11::make_tuple(r.address, r.nbytes, static_cast<int>(r.device), r.where, r.start, r.length,
                                      static_cast<int>(r.value), r.offset));
    }
    return out;
  };
  m.def("guard_regions", [regions_as_tuples](std::optional<std::vector<uintptr_t>> addresses, bool thorough) {
    return regions_as_tuples(guard_regions(addresses ? &*addresses : nullptr, thorough));
  }, pybind11::arg("addresses") = pybind11::none(), pybind11::arg("thorough") = false);
  m.def("take_blocks_to_poison", [regions_as_tuples]() { return regions_as_tuples(take_blocks_to_poison()); });
  m.def("host_alias", &host_alias);
  m.def("set_discrete_memory", &set_discrete_memory);
  m.def("discrete_memory", &discrete_memory);
  m.def("device_block_of", [](uintptr_t address) { return device_block_of(address); });
  m.def("pinned_block_of", [](uintptr_t address) { return pinned_block_of(address); });
  m.def("take_released_blocks", &take_released_blocks);
  m.def("set_device_copy_callback", [](pybind11::object fn) {
    auto* held = new pybind11::object(fn);  // for the life of the process, as the synchronize callback
    set_device_copy_callback([held](uintptr_t dst, uintptr_t src, size_t n, c10::DeviceIndex i) {
      pybind11::gil_scoped_acquire gil;
      (*held)(dst, src, n, static_cast<int>(i));
    });
  });
  m.def("premul_sum", &premul_sum);
  m.def("register_collective_kernels", &register_collective_kernels);
  m.def("device_copy_of", &device_copy_of);
  bind_draws(m);
  m.def("host_bytes", &host_bytes);
  m.def("route_ops", &route_ops);
  m.def("set_fast_mode", &set_fast_mode, pybind11::arg("mode"), pybind11::arg("miss") = pybind11::none());
  m.def("learn_call", &learn_call);
  m.def("forget_calls", &forget_calls, pybind11::arg("op_name") = pybind11::none());
  m.def("known_calls", &known_calls);
  m.def("set_fast_path_checks", &set_fast_path_checks);
  m.def("set_recorder_api", &set_recorder_api);
  m.def("set_adaptive_max_ops", &set_adaptive_max_ops);
  m.def("set_adaptive_held_bytes", &set_adaptive_held_bytes);
  m.def("set_adaptive_peak_cuts", &set_adaptive_peak_cuts);
  m.def("forget_peak_cuts", &forget_peak_cuts);
  m.def("record_append", &record_append);
  m.def("forget_pending_lists", &forget_pending_lists);
  m.def("weak_storage", &weak_storage);
  m.def("weak_get", &weak_get);
}
