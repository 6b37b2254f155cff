// The only aten kernels written in C++: allocation and tensor metadata (views,
// resize, set_). They move no data. Every other op goes to the Python dispatch
// entry point (torchneuron/dispatch).
#include "neuron.h"

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/resize_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <atomic>

namespace torchneuron {

// Bit i set: ScalarType i can be held by the target; set from Python per target.
std::atomic<uint64_t> supported_dtypes_mask{~0ull};

namespace {

constexpr c10::DispatchKeySet kNeuronKeys(c10::DispatchKey::PrivateUse1);

void check_dtype(c10::ScalarType dtype) {
  TORCH_CHECK_TYPE(
      (supported_dtypes_mask.load() >> static_cast<int>(dtype)) & 1ull,
      "neuron: dtype ", c10::toString(dtype),
      " cannot be held by the current target (see torchneuron.supported_dtypes()).");
}

c10::Device check_factory_args(std::optional<c10::Device> device_opt,
                               std::optional<c10::Layout> layout_opt,
                               std::optional<bool> pin_memory_opt) {
  check_usable();
  auto device = c10::device_or_default(device_opt);
  TORCH_CHECK(device.is_privateuseone(), "expected a neuron device, got ", device);
  TORCH_CHECK(c10::layout_or_default(layout_opt) == c10::Layout::Strided,
              "neuron supports only the strided layout");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory_opt),
              "pin_memory applies only to CPU tensors");
  if (device.has_index()) check_device_index(device.index());
  return device;
}

at::Tensor empty_memory_format(c10::IntArrayRef size,
                               std::optional<c10::ScalarType> dtype_opt,
                               std::optional<c10::Layout> layout_opt,
                               std::optional<c10::Device> device_opt,
                               std::optional<bool> pin_memory_opt,
                               std::optional<c10::MemoryFormat> memory_format_opt) {
  auto device = check_factory_args(device_opt, layout_opt, pin_memory_opt);
  auto dtype = c10::dtype_or_default(dtype_opt);
  check_dtype(dtype);
  const c10::DeviceGuard guard(device);
  return at::detail::empty_generic(size, neuron_allocator(), kNeuronKeys, dtype, memory_format_opt);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype_opt,
                         std::optional<c10::Layout> layout_opt,
                         std::optional<c10::Device> device_opt,
                         std::optional<bool> pin_memory_opt) {
  auto device = check_factory_args(device_opt, layout_opt, pin_memory_opt);
  auto dtype = c10::dtype_or_default(dtype_opt);
  check_dtype(dtype);
  const c10::DeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, neuron_allocator(), kNeuronKeys, dtype);
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size,
                      c10::SymIntArrayRef stride, std::optional<c10::SymInt> storage_offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(storage_offset));
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

// Views that reinterpret the storage's bytes as another dtype (complex as
// pairs of reals and back, bit casts): metadata only, as on CPU.
at::Tensor view_dtype(const at::Tensor& self, c10::ScalarType dtype) {
  check_dtype(dtype);
  return at::native::view_dtype(self, dtype);
}

at::Tensor view_as_real(const at::Tensor& self) { return at::native::view_as_real(self); }

at::Tensor view_as_complex(const at::Tensor& self) { return at::native::view_as_complex(self); }

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

at::Tensor unfold(const at::Tensor& self, int64_t dimension, int64_t size, int64_t step) {
  return at::native::unfold(self, dimension, size, step);
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());  // growth allocates on self's device
  // Growing copies the old contents on the host: queued device work that
  // writes them must finish first.
  run_synchronize_callback(self.device().index());
  if (discrete_memory()) {
    // The CPU resize would memcpy device addresses: grow the storage first
    // through the hooks, which copy on the device.
    const auto sizes = C10_AS_INTARRAYREF_SLOW(size);
    const size_t needed = at::detail::computeStorageNbytesContiguous(sizes, self.dtype().itemsize(),
                                                                     self.storage_offset());
    const auto& storage = self.storage();
    if (needed > storage.nbytes()) at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(storage, needed);
  }
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  return at::native::set_(self, std::move(source));
}

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage source, int64_t offset,
                                      c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::cpu::set_(self, std::move(source), offset, size, stride);
}

// Module.to() keeps Parameter identity (and so tied weights) only when a CPU
// tensor and its device copy count as shallow-copy compatible, which PyTorch
// grants to its built-in dense backends only.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == at::kStrided && !t.is_sparse() && (t.is_cpu() || t.device().is_privateuseone());
  };
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set()) ||
      (dense(self) && dense(from));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("view.dtype", view_dtype);
  m.impl("view_as_real", view_as_real);
  m.impl("view_as_complex", view_as_complex);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", unfold);
  m.impl("resize_", resize_);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
}

} // namespace
} // namespace torchneuron
