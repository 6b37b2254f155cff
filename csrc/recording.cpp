// The PrivateUse1 entry of every aten op without a C++ kernel of its own, and
// adaptive eager's recording fast path.
//
// The Python dispatch entry (torchneuron/dispatch/entry.py) is registered at
// PrivateUse2; entry() here passes every call on to it, except calls adaptive
// eager has recorded before: same op, argument layouts and constants as a call
// whose recipe the Python recorder learned (torchneuron/adaptive/recorder.py).
// Those go straight to the recorder's append, without torch's conversion of the
// whole call into Python arguments and the dispatch entry's checks (a Python
// kernel costs ~4x a CPU op before it does anything).
//
// A call's key is built from every argument as the dispatcher holds it. Which
// numbers are runtime inputs (their values are not in the key) comes from the
// recorder, per op. A key is learned only after checking that it takes the
// call apart (tensors, runtime numbers) exactly as the Python recorder did.
#include "neuron.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace torchneuron {
PyObject* append_learned(PyObject* recipe, PyObject* tensors, PyObject* floats, PyObject* ints);  // pending_graph.cpp

namespace {

constexpr c10::DispatchKey kPythonEntry = c10::DispatchKey::PrivateUse2;
constexpr size_t kMaxKnown = 16384;

// 0: every call goes to the Python entry; else the eager mode whose learned
// calls are taken here (a learned call is keyed with the mode it was learned in).
std::atomic<int> fast_mode{0};

// Guarded by the GIL.
PyObject* miss = nullptr;  // what a handler returns when it cannot take a call
// Per op and mode (the schema's address plus the mode): bit j set when
// argument j's numbers are runtime inputs.
std::unordered_map<uintptr_t, uint64_t> param_masks;
uintptr_t mask_key(const c10::FunctionSchema* schema, int mode) {
  return reinterpret_cast<uintptr_t>(schema) + static_cast<uintptr_t>(mode);  // schemas are 8-aligned
}

// A learned call: handler(payload, tensors, floats, ints) takes it (the
// recorder's append in adaptive eager, the cached launch in op mode). The
// recorder's append is called here directly (pending_graph.cpp).
struct Known {
  PyObject* handler;
  PyObject* payload;
  PyObject* name;  // the op's Python name
};
PyObject* recorder_append = nullptr;  // the handler that stands for append_learned
PyObject* dispatched = nullptr;  // dispatch.stats.dispatched: calls per op name

// dispatched[name] += 1, as the dispatch entry counts every call.
bool count_call(PyObject* name) {
  PyObject* n = PyDict_GetItemWithError(dispatched, name);
  if (n == nullptr && PyErr_Occurred()) return false;
  PyObject* more = PyLong_FromLongLong((n != nullptr ? PyLong_AsLongLong(n) : 0) + 1);
  const bool ok = more != nullptr && PyDict_SetItem(dispatched, name, more) == 0;
  Py_XDECREF(more);
  return ok;
}

// What the dispatch entry checks before anything is taken this way
// (dispatch/entry.py fast_path_open), read from the modules that hold it.
struct OpenCheck {
  PyObject* entry_globals = nullptr;     // unusable_reason: set in a forked child
  PyObject* trace_globals = nullptr;     // sink: a profiler records
  PyObject* registry_globals = nullptr;  // _recorder: a shape registry records every call
  PyObject* settings = nullptr;          // config.settings: execution must be "compile"
  PyObject* unusable = nullptr;
  PyObject* sink = nullptr;
  PyObject* recorder = nullptr;
  PyObject* execution = nullptr;
};
OpenCheck open_check;

bool fast_path_open() {
  const auto& c = open_check;
  if (c.entry_globals == nullptr) return false;
  PyObject* unusable = PyDict_GetItem(c.entry_globals, c.unusable);
  if (unusable == nullptr || PyObject_IsTrue(unusable) != 0) return false;
  PyObject* sink = PyDict_GetItem(c.trace_globals, c.sink);
  if (sink != Py_None) return false;
  PyObject* recorder = PyDict_GetItem(c.registry_globals, c.recorder);
  if (recorder != Py_None) return false;
  PyObject* execution = PyObject_GetAttr(c.settings, c.execution);
  if (execution == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool compile = PyUnicode_Check(execution) && PyUnicode_CompareWithASCIIString(execution, "compile") == 0;
  Py_DECREF(execution);
  return compile;
}
std::unordered_map<std::string, Known> known;  // key -> handler (both held)

struct Call {
  std::string key;
  std::vector<at::Tensor> tensors;
  std::vector<double> floats;
  std::vector<int64_t> ints;

  void clear() {
    key.clear();
    tensors.clear();
    floats.clear();
    ints.clear();
  }
  template <typename T>
  void put(T v) {
    key.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
};

// The last call that went on to Python on this thread, for learning its key.
struct Missed {
  const c10::FunctionSchema* schema = nullptr;
  std::vector<c10::IValue> args;
};
thread_local Missed missed;

bool is_default(const c10::Argument& arg, const c10::IValue& v) {
  const auto& d = arg.default_value();
  if (!d.has_value()) return false;
  if (d->isNone()) return v.isNone();
  if (v.isTensor() || v.isTensorList() || v.isNone()) return false;
  if (v.tagKind() != d->tagKind()) return false;
  return v == *d;
}

bool leaf(const c10::IValue& v, bool param, Call& call);

bool tensor_leaf(const at::Tensor& t, Call& call) {
  if (!t.defined()) {
    call.put('N');
    return true;
  }
  if (t.layout() != c10::kStrided || t.is_conj() || t.is_neg()) return false;
  call.put('T');
  call.put(static_cast<int8_t>(t.device().type()));
  call.put(t.device().index());
  call.put(static_cast<int8_t>(t.scalar_type()));
  call.put(static_cast<int32_t>(t.dim()));
  for (auto s : t.sizes()) call.put(s);
  for (auto s : t.strides()) call.put(s);
  // Where the data lies within 64 bytes: op mode's plans import misaligned
  // and strided tensors by the span around them (lowering/call.py tensor_spec).
  call.put(static_cast<int8_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 64));
  call.put(static_cast<int8_t>((t.storage_offset() * static_cast<int64_t>(t.element_size())) % 64));
  call.tensors.push_back(t);
  return true;
}

bool number_leaf(const c10::IValue& v, bool param, Call& call) {
  if (v.isDouble()) {
    if (param) {
      call.put('f');
      call.floats.push_back(v.toDouble());
    } else {
      call.put('d');
      call.put(v.toDouble());
    }
    return true;
  }
  if (v.isInt()) {
    if (param) {
      call.put('i');
      call.ints.push_back(v.toInt());
    } else {
      call.put('I');
      call.put(v.toInt());
    }
    return true;
  }
  return false;
}

bool leaf(const c10::IValue& v, bool param, Call& call) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    // A Python number in a Tensor argument (`x * 0.5`) reaches the dispatcher
    // as a "wrapped number" tensor, and a Python kernel as the Python number
    // again: it is taken apart as that number (a complex one: not at all).
    if (t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number()) return leaf(c10::IValue(t.item()), param, call);
    return tensor_leaf(t, call);
  }
  if (v.isDouble() || v.isInt()) return number_leaf(v, param, call);
  if (v.isBool()) {
    call.put('b');
    call.put(v.toBool());
    return true;
  }
  if (v.isNone()) {
    call.put('N');
    return true;
  }
  if (v.isString()) {
    const auto& s = v.toStringRef();
    call.put('S');
    call.put(s.size());
    call.key.append(s);
    return true;
  }
  if (v.isDevice()) {
    auto d = v.toDevice();
    if (!d.has_index()) return false;  // the current device, which may change
    call.put('V');
    call.put(static_cast<int8_t>(d.type()));
    call.put(d.index());
    return true;
  }
  if (v.isList()) {  // int[], float[], bool[], Tensor[], Tensor?[]
    const auto& list = v.toListRef();
    call.put('L');
    call.put(list.size());
    for (const auto& x : list) {
      if (!leaf(x, param, call)) return false;
    }
    return true;
  }
  return false;  // generators, complex numbers, ...: the Python entry takes them
}

// Takes a call apart as the Python recorder does: the arguments torch hands a
// Python kernel (trailing positional and keyword-only arguments equal to their
// defaults are left out), tensors in order, runtime numbers by `mask`.
bool take_apart(int mode, const c10::FunctionSchema& schema, const c10::IValue* args, uint64_t mask, Call& call) {
  const auto& formal = schema.arguments();
  const size_t n = formal.size();
  if (n > 64) return false;
  call.put(&schema);
  call.put(static_cast<int8_t>(mode));
  size_t positional_end = 0;
  for (size_t j = 0; j < n; ++j) {
    if (!formal[j].kwarg_only() && !is_default(formal[j], args[j])) positional_end = j + 1;
  }
  for (size_t j = 0; j < n; ++j) {
    const bool given = formal[j].kwarg_only() ? !is_default(formal[j], args[j]) : j < positional_end;
    if (!given) {
      call.put('D');
      continue;
    }
    if (!leaf(args[j], (mask >> j) & 1, call)) return false;
  }
  return true;
}

thread_local Call scratch;

[[noreturn]] void raise_python_error() {
  python_error e;
  e.persist();
  throw e;
}

// Pushes a Python result onto the stack as the op's schema returns it.
void push_results(const c10::FunctionSchema& schema, PyObject* result, torch::jit::Stack* stack) {
  const auto& returns = schema.returns();
  if (returns.empty()) return;
  if (returns.size() == 1) {
    stack->push_back(torch::jit::toIValue(result, returns[0].type()));
    return;
  }
  TORCH_CHECK(PyTuple_Check(result) && PyTuple_GET_SIZE(result) == static_cast<Py_ssize_t>(returns.size()),
              "neuron: the recorder returned the wrong number of results for ", schema.name());
  for (size_t i = 0; i < returns.size(); ++i) {
    stack->push_back(torch::jit::toIValue(PyTuple_GET_ITEM(result, i), returns[i].type()));
  }
}

// A learned call: its handler takes it. False: the Python entry takes it.
bool take_known(int mode, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const c10::IValue* args = stack->data() + stack->size() - n;
  pybind11::gil_scoped_acquire gil;
  auto found = param_masks.find(mask_key(&schema, mode));
  Known handler{nullptr, nullptr, nullptr};
  Call& call = scratch;
  call.clear();
  if (found != param_masks.end() && take_apart(mode, schema, args, found->second, call)) {
    auto k = known.find(call.key);
    if (k != known.end()) handler = k->second;
  }
  if (handler.handler != nullptr && !fast_path_open()) handler.handler = nullptr;
  if (handler.handler == nullptr) {
    call.tensors.clear();  // held, they would keep results alive
    missed.schema = &schema;
    missed.args.assign(args, args + n);
    return false;
  }
  missed.schema = nullptr;
  PyObject* tensors = PyTuple_New(static_cast<Py_ssize_t>(call.tensors.size()));
  PyObject* floats = PyList_New(static_cast<Py_ssize_t>(call.floats.size()));
  PyObject* ints = PyList_New(static_cast<Py_ssize_t>(call.ints.size()));
  if (!tensors || !floats || !ints) {
    Py_XDECREF(tensors);
    Py_XDECREF(floats);
    Py_XDECREF(ints);
    raise_python_error();
  }
  for (size_t i = 0; i < call.tensors.size(); ++i) PyTuple_SET_ITEM(tensors, i, THPVariable_Wrap(call.tensors[i]));
  for (size_t i = 0; i < call.floats.size(); ++i) PyList_SET_ITEM(floats, i, PyFloat_FromDouble(call.floats[i]));
  for (size_t i = 0; i < call.ints.size(); ++i) PyList_SET_ITEM(ints, i, PyLong_FromLongLong(call.ints[i]));
  call.tensors.clear();
  Py_INCREF(handler.handler);  // the call may forget it
  Py_INCREF(handler.payload);
  Py_INCREF(handler.name);
  PyObject* result = nullptr;
  if (handler.handler == recorder_append) {
    result = append_learned(handler.payload, tensors, floats, ints);
    if (result != nullptr && result != miss && !count_call(handler.name)) Py_CLEAR(result);
  } else {
    result = PyObject_CallFunctionObjArgs(handler.handler, handler.payload, tensors, floats, ints, nullptr);
  }
  Py_DECREF(handler.handler);
  Py_DECREF(handler.payload);
  Py_DECREF(handler.name);
  Py_DECREF(tensors);
  Py_DECREF(floats);
  Py_DECREF(ints);
  if (result == nullptr) raise_python_error();
  if (result == miss) {
    Py_DECREF(result);
    return false;
  }
  try {
    torch::jit::drop(*stack, n);
    push_results(schema, result, stack);
  } catch (...) {
    Py_DECREF(result);
    throw;
  }
  Py_DECREF(result);
  return true;
}

// Drops the stashed call when the Python entry returns: its arguments must not
// outlive the call (a held result would look alive to the recorder).
struct ForgetMissed {
  ~ForgetMissed() {
    if (missed.schema != nullptr || !missed.args.empty()) {
      missed.schema = nullptr;
      pybind11::gil_scoped_acquire gil;  // the arguments may hold Python objects
      missed.args.clear();
    }
  }
};

void entry(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const int mode = fast_mode.load(std::memory_order_relaxed);
  if (mode != 0) {
    if (take_known(mode, op, stack)) return;
    ForgetMissed forget;
    op.redispatchBoxed(c10::DispatchKeySet(kPythonEntry), stack);
    return;
  }
  op.redispatchBoxed(c10::DispatchKeySet(kPythonEntry), stack);
}

std::string python_name(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  auto colons = name.find("::");
  if (colons != std::string::npos) name.replace(colons, 2, ".");
  return name + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
}

void release(const Known& k) {
  Py_DECREF(k.handler);
  Py_DECREF(k.payload);
  Py_DECREF(k.name);
}

// Forgets every learned call of one op, in every mode.
void forget_op(const c10::FunctionSchema* schema) {
  std::string prefix(reinterpret_cast<const char*>(&schema), sizeof(schema));
  for (auto k = known.begin(); k != known.end();) {
    if (k->first.compare(0, prefix.size(), prefix) == 0) {
      release(k->second);
      k = known.erase(k);
    } else {
      ++k;
    }
  }
  for (auto it = param_masks.begin(); it != param_masks.end();) {
    if ((it->first & ~uintptr_t{7}) == reinterpret_cast<uintptr_t>(schema)) {
      it = param_masks.erase(it);
    } else {
      ++it;
    }
  }
}

void forget_all_locked() {
  for (auto& entry : known) release(entry.second);
  known.clear();
  param_masks.clear();
}

}  // namespace

// The ops whose calls go through entry() by name (the fallback takes the rest).
void route_ops(const std::vector<std::string>& names) {
  static auto* library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                            __FILE__, __LINE__);
  for (const auto& name : names) {
    library->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&entry>());
  }
}

void set_fast_path_checks(pybind11::dict entry_globals, pybind11::dict trace_globals,
                          pybind11::dict registry_globals, pybind11::object settings, pybind11::object append,
                          pybind11::object dispatched_counts) {
  auto& c = open_check;
  c.entry_globals = entry_globals.release().ptr();
  c.trace_globals = trace_globals.release().ptr();
  c.registry_globals = registry_globals.release().ptr();
  c.settings = settings.release().ptr();
  c.unusable = PyUnicode_InternFromString("unusable_reason");
  c.sink = PyUnicode_InternFromString("sink");
  c.recorder = PyUnicode_InternFromString("_recorder");
  c.execution = PyUnicode_InternFromString("execution");
  recorder_append = append.release().ptr();
  dispatched = dispatched_counts.release().ptr();
}

// mode 0: every call goes to the Python entry; else calls learned in `mode`
// are taken by their handlers, which return `miss_marker` to decline one.
void set_fast_mode(int mode, pybind11::object miss_marker) {
  if (!miss_marker.is_none()) {
    Py_XDECREF(miss);
    miss = miss_marker.release().ptr();
  }
  fast_mode.store(miss != nullptr ? mode : 0);
}

// After Python took the call that last went on to it on this thread (as
// `tensors`, `floats`, `ints`): from now on `handler(payload, ...)` takes
// calls like it, if this file's key takes the call apart the same way.
// Returns whether it was learned.
bool learn_call(pybind11::object handler, pybind11::object payload, const std::string& op_name,
                const std::vector<std::string>& params, const std::vector<at::Tensor>& tensors,
                const std::vector<double>& floats, const std::vector<int64_t>& ints) {
  const int mode = fast_mode.load();
  const c10::FunctionSchema* schema = missed.schema;
  if (schema == nullptr || python_name(*schema) != op_name) return false;
  const auto& formal = schema->arguments();
  uint64_t mask = 0;
  for (size_t j = 0; j < formal.size() && j < 64; ++j) {
    for (const auto& p : params) {
      if (formal[j].name() == p) mask |= 1ull << j;
    }
  }
  auto existing = param_masks.find(mask_key(schema, mode));
  if (existing != param_masks.end() && existing->second != mask) forget_op(schema);  // its scalars were baked
  Call call;
  if (mode == 0 || !take_apart(mode, *schema, missed.args.data(), mask, call)) return false;
  if (call.tensors.size() != tensors.size() || call.floats != floats || call.ints != ints) return false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!call.tensors[i].is_same(tensors[i])) return false;
  }
  if (known.size() >= kMaxKnown) forget_all_locked();
  param_masks[mask_key(schema, mode)] = mask;
  auto& slot = known[call.key];
  if (slot.handler != nullptr) release(slot);
  slot.handler = handler.release().ptr();
  slot.payload = payload.release().ptr();
  slot.name = PyUnicode_FromStringAndSize(op_name.data(), static_cast<Py_ssize_t>(op_name.size()));
  missed.schema = nullptr;
  return true;
}

// Forget what was learned about one op (by its Python name), or everything.
void forget_calls(const std::optional<std::string>& op_name) {
  if (!op_name) {
    forget_all_locked();
    return;
  }
  std::vector<const c10::FunctionSchema*> named;
  for (const auto& entry : param_masks) {
    auto* schema = reinterpret_cast<const c10::FunctionSchema*>(entry.first & ~uintptr_t{7});
    if (python_name(*schema) == *op_name) named.push_back(schema);
  }
  for (auto* schema : named) forget_op(schema);
}

size_t known_calls() { return known.size(); }

}  // namespace torchneuron

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&torchneuron::entry>());
}
