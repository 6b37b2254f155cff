// Random values drawn ahead on a thread of their own, as CPU draws them
// (dispatch/draws_ahead.py decides what to draw and when a draw may be used):
// dropout masks, and the uniform and normal values of random ops in
// torch.compile graphs.
//
// The thread is C++ and never takes the GIL: a Python thread drawing beside
// a busy program waited for the GIL at every step of its draw (the switch
// interval, 5 ms) and was rarely done in time.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/extension.h>
#include <pthread.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace torchneuron {
namespace {

using Drawn = std::pair<at::Tensor, at::Tensor>;  // (values, generator state after them)

enum Kind : int { kMask = 0, kUniform = 1, kNormal = 2 };

// kMask: CPU's dropout mask, bernoulli(param) drawn in `options`' dtype as
// CPU's native_dropout draws it, then as bool; kUniform: torch.rand's values;
// kNormal: torch.randn's.
Drawn draw_values(const at::Tensor& state, int kind, int64_t numel, const at::TensorOptions& options, double param) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>();
  generator.set_state(state);
  auto values = at::empty({numel}, options);
  if (kind == kMask) {
    values = values.bernoulli_(param, generator).to(at::kBool);
  } else if (kind == kUniform) {
    values.uniform_(0, 1, generator);
  } else if (kind == kNormal) {
    values.normal_(0, 1, generator);
  } else {
    TORCH_CHECK(false, "neuron: no such kind of draw: ", kind);
  }
  return {values, generator.get_state()};
}

struct Job {
  at::Tensor state;  // drawn from this state, or else from the state `after` leaves
  std::shared_future<Drawn> after;
  int kind;
  int64_t numel;
  at::TensorOptions options;
  double param;
  std::promise<Drawn> done;
};

// Per-thread OpenMP/MKL thread count setters (dispatch/host_threads.py): the
// drawing thread uses one, so a parallel kernel there starts no second team.
std::vector<void (*)(int)> thread_count_setters;

class Drawer {
 public:
  Drawer() : pid_(getpid()), thread_([this] { run(); }) { thread_.detach(); }

  std::shared_future<Drawn> submit(at::Tensor state, std::shared_future<Drawn> after, int kind, int64_t numel,
                                   at::TensorOptions options, double param) {
    Job job{std::move(state), std::move(after), kind, numel, options, param, {}};
    auto future = job.done.get_future().share();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
    return future;
  }

  pid_t pid() const { return pid_; }

 private:
  void run() {
    for (auto set : thread_count_setters) set(1);
    pthread_setname_np(pthread_self(), "neuron-draws");  // as /proc and profilers list it
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      ready_.wait(lock, [this] { return !jobs_.empty(); });
      Job job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      try {
        // A chained job comes after the one it follows in the queue: that one is done.
        const at::Tensor& state = job.state.defined() ? job.state : job.after.get().second;
        job.done.set_value(draw_values(state, job.kind, job.numel, job.options, job.param));
      } catch (...) {
        job.done.set_exception(std::current_exception());
      }
    }
  }

  pid_t pid_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Job> jobs_;
  std::thread thread_;
};

Drawer* drawer = nullptr;  // never destroyed: its thread lives as long as the process

Drawer& the_drawer() {
  // A forked child has the object but not its thread: it makes its own.
  if (drawer == nullptr || drawer->pid() != getpid()) drawer = new Drawer();
  return *drawer;
}

struct PendingDraw {
  std::shared_future<Drawn> future;

  bool done() const { return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }

  pybind11::tuple result() const {
    Drawn drawn;
    {
      pybind11::gil_scoped_release no_gil;
      drawn = future.get();  // rethrows the draw's error
    }
    return pybind11::make_tuple(drawn.first, drawn.second);
  }
};

}  // namespace

void bind_draws(pybind11::module& m) {
  pybind11::class_<PendingDraw>(m, "PendingDraw")
      .def("done", &PendingDraw::done)
      .def("result", &PendingDraw::result);
  // Drawn now, on the calling thread (the GIL released while it draws).
  m.def("draw_values", [](const at::Tensor& state, int kind, int64_t numel, const at::Tensor& like, double param) {
    Drawn drawn;
    {
      pybind11::gil_scoped_release no_gil;
      drawn = draw_values(state, kind, numel, like.options(), param);
    }
    return pybind11::make_tuple(drawn.first, drawn.second);
  });
  // Drawn on the drawing thread; the state is copied, so the caller may change its own.
  m.def("draw_values_ahead", [](const at::Tensor& state, int kind, int64_t numel, const at::Tensor& like,
                                double param) {
    return PendingDraw{the_drawer().submit(state.clone(), {}, kind, numel, like.options(), param)};
  });
  // Drawn on the drawing thread from the state `previous` leaves.
  m.def("draw_values_after", [](const PendingDraw& previous, int kind, int64_t numel, const at::Tensor& like,
                                double param) {
    return PendingDraw{the_drawer().submit(at::Tensor(), previous.future, kind, numel, like.options(), param)};
  });
  m.def("set_draw_thread_setup", [](const std::vector<uintptr_t>& setters) {
    thread_count_setters.clear();
    for (auto address : setters) thread_count_setters.push_back(reinterpret_cast<void (*)(int)>(address));
  });
}

}  // namespace torchneuron
