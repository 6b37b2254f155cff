// The one fact about a reduction that Python cannot read: the factor of a
// PREMUL_SUM (FSDP2 uses one when a gradient divide factor is set). The c10d
// ops hand Python the ReduceOp as a TorchScript object whose only method is
// op(). gloo has no PREMUL_SUM: distributed/collectives.py scales the inputs
// on the device by this factor and sums with the SUM returned beside it.
#include <pybind11/pybind11.h>

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace torchneuron {

pybind11::tuple premul_sum(const pybind11::object& reduce_op) {
  auto value = torch::jit::toIValue(reduce_op, c10::getCustomClassType<c10::intrusive_ptr<c10d::ReduceOp>>());
  auto op = value.toCustomClass<c10d::ReduceOp>();
  auto* supplement = dynamic_cast<c10d::PreMulSumSupplement*>(op->supplement_.get());
  TORCH_CHECK(op->op_ == c10d::ReduceOp::PREMUL_SUM && supplement != nullptr, "not a PREMUL_SUM reduction");
  const double factor =
      supplement->tensor_factor.defined() ? supplement->tensor_factor.item<double>() : supplement->double_factor;
  auto sum = c10::make_intrusive<c10d::ReduceOp>(c10d::ReduceOp::SUM);
  return pybind11::make_tuple(factor, torch::jit::toPyObject(c10::IValue(sum)));
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
