// The one fact about a reduction that Python cannot read: the factor of a
// PREMUL_SUM (FSDP2 uses one when a gradient divide factor is set). The c10d
// ops hand Python the ReduceOp as a TorchScript object whose only method is
// op(). gloo has no PREMUL_SUM: distributed/collectives.py scales the inputs
// on the device by this factor and sums with the SUM returned beside it.
#include "neuron.h"

#include <pybind11/pybind11.h>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <set>

namespace torchneuron {

// gloo has no PREMUL_SUM(f): the inputs are scaled by f on the device, then summed.
double premul_factor(const c10d::ReduceOp& op) {
  auto* supplement = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(supplement != nullptr, "PREMUL_SUM without a factor");
  return supplement->tensor_factor.defined() ? supplement->tensor_factor.item<double>() : supplement->double_factor;
}

pybind11::tuple premul_sum(const pybind11::object& reduce_op) {
  auto value = torch::jit::toIValue(reduce_op, c10::getCustomClassType<c10::intrusive_ptr<c10d::ReduceOp>>());
  auto op = value.toCustomClass<c10d::ReduceOp>();
  TORCH_CHECK(op->op_ == c10d::ReduceOp::PREMUL_SUM, "not a PREMUL_SUM reduction");
  auto sum = c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM);
  return pybind11::make_tuple(premul_factor(*op), torch::jit::toPyObject(c10::IValue(sum)));
}

// The hot collectives (DDP's buckets, FSDP2's flat all-gathers and
// reduce-scatters) in C++: the same steps as the Python kernels of
// distributed/collectives.py (wait for the device, gloo on host aliases, the
// neuron tensors back), without the ~40 us of boxing a Python kernel's
// arguments costs per call, which is a third of a 1 MB all_reduce on 2 ranks.
namespace {

using Work = c10::intrusive_ptr<c10d::Work>;
using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// The devices' queued work (adaptive eager's pending graph is cut first):
// gloo then reads finished values. Every stream is drained (see collectives.py).
std::vector<at::Tensor> ready(at::TensorList tensors) {
  std::set<c10::DeviceIndex> devices;
  std::vector<at::Tensor> aliases;
  aliases.reserve(tensors.size());
  for (const auto& t : tensors) {
    devices.insert(t.device().index());
    aliases.push_back(host_alias(t));
  }
  c10::impl::VirtualGuardImpl guard(c10::DeviceType::PrivateUse1);
  for (auto index : devices) {
    guard.synchronizeDevice(index);
  }
  return aliases;
}

// The discrete memory model: the host has no alias of a neuron tensor, so
// gloo gets host copies (values, or empty buffers for pure outputs) and what
// it wrote is copied back once it has finished (collectives.py, _staged).
at::Tensor host_copy(const at::Tensor& t, bool with_values) {
  return with_values ? t.to(at::kCPU) : at::empty_like(t, t.options().device(at::kCPU));
}

// An op that reads `input` and writes `output`, run by gloo on host copies.
template <typename Run>
Work staged_output_of(at::Tensor& output, const at::Tensor& input, Run run) {
  auto written = host_copy(output, false);
  auto read = host_copy(input, true);
  auto work = run(written, read);
  work->wait();
  output.copy_(written);
  return work;
}

// A group made for neuron tensors only lends its neuron backend (a gloo) to
// the host aliases, registered as GLOO as collectives.py does.
c10::intrusive_ptr<c10d::Backend> cpu_backend(const Group& group) {
  static std::mutex lock;
  if (!group->hasBackendForDeviceType(c10::DeviceType::CPU)) {
    std::lock_guard<std::mutex> guard(lock);
    if (!group->hasBackendForDeviceType(c10::DeviceType::CPU)) {
      group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                        group->getBackend(c10::DeviceType::PrivateUse1));
    }
  }
  return group->getBackend(c10::DeviceType::CPU);
}

c10d::ReduceOp summed(const c10::intrusive_ptr<c10d::ReduceOp>& op) {
  return op->op_ == c10d::ReduceOp::PREMUL_SUM ? c10d::ReduceOp(c10d::ReduceOp::SUM) : *op;
}

std::tuple<std::vector<at::Tensor>, Work> allreduce(at::TensorList tensors, const Group& group,
                                                    const c10::intrusive_ptr<c10d::ReduceOp>& reduce_op,
                                                    const std::optional<at::Tensor>& sparse_indices, bool async_op,
                                                    int64_t timeout) {
  if (reduce_op->op_ == c10d::ReduceOp::PREMUL_SUM) {
    const double factor = premul_factor(*reduce_op);
    for (const auto& t : tensors) {
      t.mul_(factor);
    }
  }
  c10d::AllreduceOptions options;
  options.reduceOp = summed(reduce_op);
  options.timeout = std::chrono::milliseconds(timeout);
  options.asyncOp = async_op;
  options.sparseIndices = sparse_indices;
  if (discrete_memory()) {
    std::vector<at::Tensor> copies;
    for (const auto& t : tensors) {
      copies.push_back(host_copy(t, true));
    }
    auto work = cpu_backend(group)->allreduce(copies, options);
    work->wait();
    for (size_t i = 0; i < copies.size(); ++i) {
      tensors[i].copy_(copies[i]);
    }
    return {tensors.vec(), work};
  }
  auto aliases = ready(tensors);
  auto work = cpu_backend(group)->allreduce(aliases, options);
  return {tensors.vec(), work};
}

std::tuple<at::Tensor, Work> allgather_base(at::Tensor& output, at::Tensor& input, const Group& group, bool async_op,
                                            int64_t timeout) {
  c10d::AllgatherOptions options;
  options.timeout = std::chrono::milliseconds(timeout);
  options.asyncOp = async_op;
  if (discrete_memory()) {
    return {output, staged_output_of(output, input, [&](at::Tensor& out, at::Tensor& in) {
              return cpu_backend(group)->_allgather_base(out, in, options);
            })};
  }
  auto aliases = ready({output, input});
  auto work = cpu_backend(group)->_allgather_base(aliases[0], aliases[1], options);
  return {output, work};
}

std::tuple<at::Tensor, Work> reduce_scatter_base(at::Tensor& output, at::Tensor& input, const Group& group,
                                                 const c10::intrusive_ptr<c10d::ReduceOp>& reduce_op, bool async_op,
                                                 int64_t timeout) {
  // A scaled copy is reduced: the input is the caller's and stays as it is.
  const at::Tensor reduced = reduce_op->op_ == c10d::ReduceOp::PREMUL_SUM ? input * premul_factor(*reduce_op) : input;
  c10d::ReduceScatterOptions options;
  options.reduceOp = summed(reduce_op);
  options.timeout = std::chrono::milliseconds(timeout);
  options.asyncOp = async_op;
  if (discrete_memory()) {
    return {output, staged_output_of(output, reduced, [&](at::Tensor& out, at::Tensor& in) {
              return cpu_backend(group)->_reduce_scatter_base(out, in, options);
            })};
  }
  auto aliases = ready({output, reduced});
  auto work = cpu_backend(group)->_reduce_scatter_base(aliases[0], aliases[1], options);
  return {output, work};
}

}  // namespace

// They replace the neuron kernels PyTorch registers (each of which asks the
// group's neuron backend, which cannot read neuron tensors); called once by
// distributed/collectives.py, which registers the other collectives.
void register_collective_kernels() {
  static std::unique_ptr<torch::Library> library;
  if (library) {
    return;
  }
  struct Quiet : c10::WarningHandler {
    void process(const c10::Warning& /*warning*/) override {}
  };
  static Quiet quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);  // "overriding a previously registered kernel"
  library = std::make_unique<torch::Library>(torch::Library::IMPL, "c10d", c10::DispatchKey::PrivateUse1, __FILE__,
                                             __LINE__);
  library->impl("allreduce_", TORCH_FN(allreduce));
  library->impl("_allgather_base_", TORCH_FN(allgather_base));
  library->impl("_reduce_scatter_base_", TORCH_FN(reduce_scatter_base));
}

}  // namespace torchneuron

// DDP's reducer times each iteration (forward, backward compute, communication)
// with a timer registered for the device type, and warns once for a device
// without one. Neuron work is asynchronous, so, as the CPU timer does, these
// are host timestamps: when the reducer saw each event.
#include <torch/csrc/distributed/c10d/reducer_timer.hpp>

namespace torchneuron {
namespace {

class NeuronTimer : public c10d::Timer {
 public:
  explicit NeuronTimer(c10::Device /* device */) {}

  std::optional<int64_t> measureDifference(Event start, Event end) override {
    const int64_t start_time = getTimeRef(start);
    const int64_t end_time = getTimeRef(end);
    if (start_time == c10d::kUnsetTime || end_time == c10d::kUnsetTime || end_time < start_time) {
      return std::nullopt;
    }
    return end_time - start_time;
  }
};

}  // namespace
}  // namespace torchneuron

namespace c10d {
C10_REGISTER_TYPED_CLASS(TimerRegistry, c10::kPrivateUse1, torchneuron::NeuronTimer);
}  // namespace c10d
