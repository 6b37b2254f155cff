// Appending one op to adaptive eager's pending graph: the per-op half of
// torchneuron/adaptive/recorder.py, in C++ because it runs for every recorded
// op. The graph itself stays a Python object (PendingGraph: lists the
// executor reads at the cut); this fills its lists as recorder._append did.
// Cuts (a loop's next iteration, the size cap, a stream switch) call back
// into the recorder.
#include "neuron.h"

#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <c10/util/intrusive_ptr.h>

#include <frameobject.h>

#include <array>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace torchneuron {
at::Tensor empty_device(const std::vector<int64_t>& sizes, at::ScalarType dtype, int index);  // module.cpp

namespace {

constexpr const char* kWeakName = "torchneuron.weak_storage";
constexpr Py_ssize_t kLoopMinOps = 4;  // recorder._LOOP_MIN_OPS
constexpr Py_ssize_t kLoopConfirm = 4;  // recorder._LOOP_CONFIRM

// Set once by the recorder (held for the life of the process).
struct Api {
  PyObject* pending = nullptr;     // recorder._pending: device index -> PendingGraph
  PyObject* fresh_graph = nullptr;  // recorder._fresh_graph(index, stream) -> PendingGraph
  PyObject* cut_loop = nullptr;    // recorder._cut_loop(graph)
  PyObject* cut_size = nullptr;    // recorder._cut_size(graph)
  PyObject* cut_held = nullptr;    // recorder._cut_held(graph)
  PyObject* cut_peak = nullptr;    // recorder._cut_peak(graph)
  PyTypeObject* op_record = nullptr;  // recorder.OpRecord (a tuple subclass)
  PyObject* is_library_file = nullptr;  // runtime.errors.is_library_file(filename)
  PyObject* miss = nullptr;
};
Api api;
Py_ssize_t max_ops = 32;
int64_t max_held_bytes = -1;  // config.adaptive_held_kb in bytes (negative: no such cut)

// Memory peaks. Deferring ops keeps the graph's inputs alive until its cut,
// after the program dropped them (op mode would have freed them). When that
// makes the device's allocated memory pass the highest level op mode would
// have reached (the level without those inputs), the recorder learns to cut
// graphs of the same ops right after their last read of those inputs: from
// the next iteration on they are freed before the peak. A learned cut point
// is the hash of the recipes recorded since the graph began.
bool peak_cuts_on = true;  // config.adaptive_peak_cuts
std::unordered_set<uint64_t> peak_cuts;
constexpr size_t kMaxPeakCuts = 4096;
constexpr int64_t kMinPeakCutBytes = 64 * 1024;
std::array<int64_t, 64> op_level_peak{};  // per device: the highest allocated level less held inputs

uint64_t hash_step(uint64_t h, long long recipe_id) {
  return (h ^ static_cast<uint64_t>(recipe_id)) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
}
constexpr uint64_t kPrefixSeed = 0xcbf29ce484222325ULL;

// -- weak references to result storages, as capsules --------------------------

void free_weak(PyObject* capsule) {
  auto* impl = static_cast<c10::StorageImpl*>(PyCapsule_GetPointer(capsule, kWeakName));
  if (impl != nullptr) c10::raw::weak_intrusive_ptr::decref(impl);
}

PyObject* new_weak(const c10::Storage& storage) {
  auto* impl = storage.unsafeGetStorageImpl();
  c10::raw::weak_intrusive_ptr::incref(impl);
  PyObject* capsule = PyCapsule_New(impl, kWeakName, &free_weak);
  if (capsule == nullptr) c10::raw::weak_intrusive_ptr::decref(impl);
  return capsule;
}

bool is_weak(PyObject* o) { return PyCapsule_CheckExact(o) && PyCapsule_IsValid(o, kWeakName); }

c10::StorageImpl* weak_impl(PyObject* o) {
  return static_cast<c10::StorageImpl*>(PyCapsule_GetPointer(o, kWeakName));
}

bool expired(PyObject* weak) { return c10::raw::weak_intrusive_ptr::use_count(weak_impl(weak)) == 0; }

// -- the user's source line -----------------------------------------------------

struct CodeInfo {
  bool library;
  PyObject* filename;  // held
  // (filename, line) per instruction met: a loop's ops come from the same few
  // instructions, and computing a line from an instruction is not free.
  std::unordered_map<int, PyObject*> at;  // held
};
std::unordered_map<PyCodeObject*, CodeInfo> codes;  // held code objects: their addresses stay theirs

// (filename, line) of the innermost frame outside torch and torchneuron, as
// runtime.errors.user_location (which the recorder uses while a profiler
// records: it also tells the profiler).
PyObject* user_location() {
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  while (frame != nullptr) {
    PyCodeObject* code = PyFrame_GetCode(frame);
    auto it = codes.find(code);
    if (it == codes.end()) {
      PyObject* filename = PyObject_GetAttrString(reinterpret_cast<PyObject*>(code), "co_filename");
      if (filename == nullptr) {
        Py_DECREF(code);
        Py_DECREF(frame);
        return nullptr;
      }
      PyObject* library = PyObject_CallOneArg(api.is_library_file, filename);
      if (library == nullptr) {
        Py_DECREF(filename);
        Py_DECREF(code);
        Py_DECREF(frame);
        return nullptr;
      }
      Py_INCREF(code);
      it = codes.emplace(code, CodeInfo{PyObject_IsTrue(library) == 1, filename}).first;
      Py_DECREF(library);
    }
    Py_DECREF(code);
    if (!it->second.library) {
      auto& at = it->second.at;
      const int lasti = PyFrame_GetLasti(frame);
      auto found = at.find(lasti);
      if (found == at.end()) {
        PyObject* result = Py_BuildValue("(Oi)", it->second.filename, PyFrame_GetLineNumber(frame));
        if (result == nullptr) {
          Py_DECREF(frame);
          return nullptr;
        }
        found = at.emplace(lasti, result).first;
      }
      Py_DECREF(frame);
      return Py_NewRef(found->second);
    }
    PyFrameObject* back = PyFrame_GetBack(frame);
    Py_DECREF(frame);
    frame = back;
  }
  return Py_BuildValue("(si)", "<unknown>", 0);
}

// -- the graph's lists ----------------------------------------------------------

// The lists of the graph appended to last (held, with the graph).
struct Fields {
  PyObject* graph = nullptr;
  PyObject* slot_of = nullptr;
  PyObject* storages = nullptr;
  PyObject* addresses = nullptr;
  PyObject* dtypes = nullptr;
  PyObject* numels = nullptr;
  PyObject* external = nullptr;
  PyObject* ops = nullptr;
  PyObject* identity = nullptr;
  PyObject* floats = nullptr;
  PyObject* ints = nullptr;
  int64_t stream = 0;
  long index = -1;
  std::vector<uint64_t> prefix;  // prefix[k]: hash of the recipes of ops[0:k]

  void clear() {
    prefix.clear();
    for (PyObject** p : {&graph, &slot_of, &storages, &addresses, &dtypes, &numels, &external, &ops, &identity,
                         &floats, &ints}) {
      Py_CLEAR(*p);
    }
  }
};
Fields fields;

bool load(PyObject* graph) {
  if (fields.graph == graph) return true;
  fields.clear();
  Fields f;
  struct Named {
    PyObject** slot;
    const char* name;
  };
  for (auto [slot, name] : {Named{&f.slot_of, "slot_of"}, Named{&f.storages, "storages"},
                            Named{&f.addresses, "addresses"}, Named{&f.dtypes, "dtypes"},
                            Named{&f.numels, "numels"}, Named{&f.external, "external"}, Named{&f.ops, "ops"},
                            Named{&f.identity, "identity"}, Named{&f.floats, "floats"}, Named{&f.ints, "ints"}}) {
    *slot = PyObject_GetAttrString(graph, name);
    if (*slot == nullptr) {
      f.clear();
      return false;
    }
  }
  PyObject* stream = PyObject_GetAttrString(graph, "stream");
  PyObject* index = PyObject_GetAttrString(graph, "index");
  if (stream == nullptr || index == nullptr) {
    Py_XDECREF(stream);
    Py_XDECREF(index);
    f.clear();
    return false;
  }
  f.stream = PyLong_AsLongLong(stream);
  f.index = PyLong_AsLong(index);
  Py_DECREF(stream);
  Py_DECREF(index);
  f.prefix.push_back(kPrefixSeed);
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(f.ops); ++i) {
    PyObject* id = PyObject_GetAttrString(PyTuple_GET_ITEM(PyList_GET_ITEM(f.ops, i), 0), "id");
    if (id == nullptr) {
      f.clear();
      return false;
    }
    f.prefix.push_back(hash_step(f.prefix.back(), PyLong_AsLongLong(id)));
    Py_DECREF(id);
  }
  Py_INCREF(graph);
  f.graph = graph;
  fields = f;
  return true;
}

// Steals every argument's reference; false on a Python error.
bool append_steal(PyObject* list, PyObject* item) {
  if (item == nullptr) return false;
  int rc = PyList_Append(list, item);
  Py_DECREF(item);
  return rc == 0;
}

// A new slot (graph.add_slot); -1 on error.
Py_ssize_t add_slot(PyObject* storage, uintptr_t address, at::ScalarType dtype, int64_t numel, bool external) {
  Py_ssize_t slot = PyList_GET_SIZE(fields.storages);
  PyObject* key = PyLong_FromVoidPtr(reinterpret_cast<void*>(address));
  PyObject* value = PyLong_FromSsize_t(slot);
  bool ok = key && value && PyDict_SetItem(fields.slot_of, key, value) == 0;
  Py_XDECREF(value);
  PyObject* dtype_obj = reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype));
  ok = ok && PyList_Append(fields.storages, storage) == 0 && append_steal(fields.addresses, key) &&
       PyList_Append(fields.dtypes, dtype_obj) == 0 && append_steal(fields.numels, PyLong_FromLongLong(numel)) &&
       PyList_Append(fields.external, external ? Py_True : Py_False) == 0;
  if (!ok) return -1;
  if (external) {
    ok = append_steal(fields.identity, Py_BuildValue("(OL)", dtype_obj, static_cast<long long>(numel)));
    if (!ok) return -1;
  }
  return slot;
}

PyObject* assemble(PyObject* tmpl, PyObject* tensors, PyObject* outs) {
  if (tmpl == Py_None) Py_RETURN_NONE;
  PyObject* kind = PyTuple_GET_ITEM(tmpl, 0);
  const char* k = PyUnicode_AsUTF8(kind);
  if (k == nullptr) return nullptr;
  if (std::strcmp(k, "out") == 0 || std::strcmp(k, "arg") == 0) {
    PyObject* from = k[0] == 'o' ? outs : tensors;
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(tmpl, 1));
    PyObject* item = PySequence_GetItem(from, i);
    return item;
  }
  PyObject* parts = PyTuple_GET_ITEM(tmpl, 1);
  Py_ssize_t n = PySequence_Size(parts);
  PyObject* items = PyList_New(n);
  if (items == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* part = PySequence_GetItem(parts, i);
    PyObject* item = part ? assemble(part, tensors, outs) : nullptr;
    Py_XDECREF(part);
    if (item == nullptr) {
      Py_DECREF(items);
      return nullptr;
    }
    PyList_SET_ITEM(items, i, item);
  }
  if (std::strcmp(k, "list") == 0) return items;
  PyObject* tuple = PyList_AsTuple(items);
  Py_DECREF(items);
  return tuple;
}

// Attribute names, interned once (a name made from a C string on every call
// is decoded and hashed each time).
struct Names {
  PyObject *index, *out_slots, *id, *returns, *loop_start;
  Names()
      : index(PyUnicode_InternFromString("index")),
        out_slots(PyUnicode_InternFromString("out_slots")),
        id(PyUnicode_InternFromString("id")),
        returns(PyUnicode_InternFromString("returns")),
        loop_start(PyUnicode_InternFromString("loop_start")) {}
};
const Names& names() {
  static const Names n;  // made under the GIL, at the first append
  return n;
}

PyObject* get_attr(PyObject* o, PyObject* name) { return PyObject_GetAttr(o, name); }

// Bytes of the graph's inputs that nothing but the graph holds any more: the
// program dropped them (autograd let a saved activation go, say) and op mode
// would have freed them already. Only the graph's list holds the storage
// object, and only that object holds the storage.
// `dropped`, when given, marks their slots.
int64_t held_only_here(std::vector<char>* dropped = nullptr) {
  int64_t bytes = 0;
  const Py_ssize_t n = PyList_GET_SIZE(fields.storages);
  if (dropped != nullptr) dropped->assign(n, 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* held = PyList_GET_ITEM(fields.storages, i);
    if (Py_REFCNT(held) != 1 || !THPStorage_Check(held)) continue;
    const c10::Storage& storage = THPStorage_Unpack(held);
    if (storage.use_count() == 1) {
      bytes += static_cast<int64_t>(storage.nbytes());
      if (dropped != nullptr) (*dropped)[i] = 1;
    }
  }
  return bytes;
}

// After an append: when the graph's dropped inputs lift the device's memory
// past the level op mode would have reached, remember to cut graphs of the
// same ops right after their last read of those inputs (see peak_cuts).
void learn_peak_cut(c10::DeviceIndex index) {
  if (index < 0 || static_cast<size_t>(index) >= op_level_peak.size()) return;
  const MemoryStats s = memory_stats(index);
  int64_t& peak = op_level_peak[index];
  if (s.peak < peak) peak = s.peak;  // the program reset the peak statistics
  if (s.allocated <= peak) return;
  std::vector<char> dropped;
  const int64_t held = held_only_here(&dropped);
  peak = std::max(peak, s.allocated - held);
  // A cut costs a launch: not for a few dropped bytes (a chain of tiny ops
  // drops each graph's input at its first op).
  const int64_t worth = std::max(kMinPeakCutBytes, peak / 256);
  if (held < worth || s.allocated <= peak || peak_cuts.size() >= kMaxPeakCuts) return;
  Py_ssize_t last = -1;  // the last op reading a dropped input
  PyObject* ops = fields.ops;
  for (Py_ssize_t i = PyList_GET_SIZE(ops) - 1; i >= 0 && last < 0; --i) {
    PyObject* refs = PyTuple_GET_ITEM(PyList_GET_ITEM(ops, i), 1);
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(refs); k += 2) {
      const Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(refs, k));
      if (slot >= 0 && slot < static_cast<Py_ssize_t>(dropped.size()) && dropped[slot]) {
        last = i;
        break;
      }
    }
  }
  if (last >= 0) peak_cuts.insert(fields.prefix[last + 1]);
}

// The op's results, or api.miss (nothing appended) when the op path must take
// it; nullptr with a Python error set.
PyObject* append(PyObject* recipe, PyObject* tensors, PyObject* floats, PyObject* ints, PyObject* location) {
  PyObject* index_obj = get_attr(recipe, names().index);
  if (index_obj == nullptr) return nullptr;
  const long index = PyLong_AsLong(index_obj);
  const int64_t stream = current_stream_id(static_cast<c10::DeviceIndex>(index));
  PyObject* graph = PyDict_GetItemWithError(api.pending, index_obj);  // borrowed
  if (graph == nullptr && PyErr_Occurred()) {
    Py_DECREF(index_obj);
    return nullptr;
  }
  if (graph == nullptr || fields.graph != graph || fields.stream != stream) {
    if (graph != nullptr && !load(graph)) {
      Py_DECREF(index_obj);
      return nullptr;
    }
    if (graph == nullptr || fields.stream != stream) {
      PyObject* fresh = PyObject_CallFunction(api.fresh_graph, "Ol", index_obj, static_cast<long>(stream));
      if (fresh == nullptr || !load(fresh)) {
        Py_XDECREF(fresh);
        Py_DECREF(index_obj);
        return nullptr;
      }
      Py_DECREF(fresh);  // _pending holds it
    }
  }
  Py_DECREF(index_obj);
  PyObject* graph_held = fields.graph;
  Py_INCREF(graph_held);
  auto done = [&](PyObject* result) {
    Py_DECREF(graph_held);
    return result;
  };

  // Arguments: each storage a slot.
  PyObject* seq = PySequence_Fast(tensors, "tensors");
  if (seq == nullptr) return done(nullptr);
  const Py_ssize_t n_tensors = PySequence_Fast_GET_SIZE(seq);
  PyObject* refs = PyTuple_New(2 * n_tensors);
  if (refs == nullptr) {
    Py_DECREF(seq);
    return done(nullptr);
  }
  auto fail = [&](PyObject* result) {
    Py_DECREF(seq);
    Py_DECREF(refs);
    return done(result);
  };
  for (Py_ssize_t k = 0; k < n_tensors; ++k) {
    PyObject* item = PySequence_Fast_GET_ITEM(seq, k);
    if (!THPVariable_Check(item)) {
      PyErr_SetString(PyExc_TypeError, "record_append: tensors must be tensors");
      return fail(nullptr);
    }
    const at::Tensor& t = THPVariable_Unpack(item);
    const c10::Storage& storage = t.storage();
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    const auto dtype = t.scalar_type();
    Py_ssize_t slot = -1;
    PyObject* key = PyLong_FromVoidPtr(reinterpret_cast<void*>(address));
    if (key == nullptr) return fail(nullptr);
    PyObject* found = PyDict_GetItemWithError(fields.slot_of, key);
    Py_DECREF(key);
    if (found == nullptr && PyErr_Occurred()) return fail(nullptr);
    if (found != nullptr) {
      slot = PyLong_AsSsize_t(found);
      PyObject* held = PyList_GET_ITEM(fields.storages, slot);
      if (is_weak(held) && expired(held)) slot = -1;  // new memory where a dropped result's was
    }
    if (slot < 0) {
      const auto itemsize = static_cast<int64_t>(t.element_size());
      const auto nbytes = static_cast<int64_t>(storage.nbytes());
      if (nbytes % itemsize) return fail(Py_NewRef(api.miss));
      PyObject* storage_obj = THPStorage_Wrap(storage);
      if (storage_obj == nullptr) return fail(nullptr);
      slot = add_slot(storage_obj, address, dtype, nbytes / itemsize, true);
      Py_DECREF(storage_obj);
      if (slot < 0) return fail(nullptr);
    } else {
      PyObject* have = PyList_GET_ITEM(fields.dtypes, slot);
      if (have != reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype))) {
        return fail(Py_NewRef(api.miss));  // one storage seen as two dtypes: the op path takes it
      }
    }
    PyTuple_SET_ITEM(refs, 2 * k, PyLong_FromSsize_t(slot));
    PyTuple_SET_ITEM(refs, 2 * k + 1, PyLong_FromLongLong(t.storage_offset()));
  }

  // Results: new memory, held weakly.
  PyObject* out_specs = get_attr(recipe, names().out_slots);
  if (out_specs == nullptr) return fail(nullptr);
  const Py_ssize_t n_outs = PyTuple_GET_SIZE(out_specs);
  PyObject* outs = PyTuple_New(n_outs);
  PyObject* out_slots = PyList_New(n_outs);
  if (outs == nullptr || out_slots == nullptr) {
    Py_XDECREF(outs);
    Py_XDECREF(out_slots);
    Py_DECREF(out_specs);
    return fail(nullptr);
  }
  auto fail_outs = [&](PyObject* result) {
    Py_DECREF(outs);
    Py_DECREF(out_slots);
    Py_DECREF(out_specs);
    return fail(result);
  };
  std::vector<int64_t> sizes;
  for (Py_ssize_t j = 0; j < n_outs; ++j) {
    PyObject* spec = PyTuple_GET_ITEM(out_specs, j);  // (shape, dtype, numel)
    PyObject* shape = PyTuple_GET_ITEM(spec, 0);
    const auto dtype = reinterpret_cast<THPDtype*>(PyTuple_GET_ITEM(spec, 1))->scalar_type;
    const int64_t numel = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 2));
    sizes.clear();
    const Py_ssize_t dims = PySequence_Size(shape);
    for (Py_ssize_t d = 0; d < dims; ++d) {
      PyObject* size = PySequence_GetItem(shape, d);
      sizes.push_back(PyLong_AsLongLong(size));
      Py_XDECREF(size);
    }
    if (PyErr_Occurred()) return fail_outs(nullptr);
    at::Tensor out;
    try {
      out = empty_device(sizes, dtype, static_cast<int>(index));
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return fail_outs(nullptr);
    }
    const c10::Storage& storage = out.storage();
    PyObject* weak = new_weak(storage);
    if (weak == nullptr) return fail_outs(nullptr);
    const Py_ssize_t slot = add_slot(weak, reinterpret_cast<uintptr_t>(storage.data()), dtype, numel, false);
    Py_DECREF(weak);
    if (slot < 0) return fail_outs(nullptr);
    PyList_SET_ITEM(out_slots, j, PyLong_FromSsize_t(slot));
    PyTuple_SET_ITEM(outs, j, THPVariable_Wrap(std::move(out)));
  }

  // The op.
  PyObject* loc = location;
  if (loc == Py_None) {
    loc = user_location();
    if (loc == nullptr) return fail_outs(nullptr);
  } else {
    Py_INCREF(loc);
  }
  PyObject* record = api.op_record->tp_alloc(api.op_record, 6);
  if (record == nullptr) {
    Py_DECREF(loc);
    return fail_outs(nullptr);
  }
  Py_INCREF(recipe);
  Py_INCREF(refs);
  Py_INCREF(floats);
  Py_INCREF(ints);
  Py_INCREF(out_slots);
  PyTuple_SET_ITEM(record, 0, recipe);
  PyTuple_SET_ITEM(record, 1, refs);
  PyTuple_SET_ITEM(record, 2, floats);
  PyTuple_SET_ITEM(record, 3, ints);
  PyTuple_SET_ITEM(record, 4, out_slots);
  PyTuple_SET_ITEM(record, 5, loc);
  PyObject* id = get_attr(recipe, names().id);
  bool ok = id != nullptr && append_steal(fields.identity, PyTuple_Pack(2, id, refs));
  if (ok) fields.prefix.push_back(hash_step(fields.prefix.back(), PyLong_AsLongLong(id)));
  Py_XDECREF(id);
  ok = ok && PyList_Append(fields.ops, record) == 0;
  Py_DECREF(record);
  for (auto [to, from] : {std::pair<PyObject*, PyObject*>{fields.floats, floats}, {fields.ints, ints}}) {
    const Py_ssize_t end = PyList_GET_SIZE(to);
    if (ok && PySequence_Size(from) > 0) ok = PyList_SetSlice(to, end, end, from) == 0;  // extend
  }
  if (!ok) return fail_outs(nullptr);

  PyObject* returns = get_attr(recipe, names().returns);
  if (returns == nullptr) return fail_outs(nullptr);
  PyObject* result = assemble(returns, seq, outs);
  Py_DECREF(returns);
  if (result == nullptr) return fail_outs(nullptr);

  // Cuts: a loop's next iteration, the size cap, or inputs the program dropped held too long.
  PyObject* ops = fields.ops;
  const Py_ssize_t n = PyList_GET_SIZE(ops);
  PyObject* loop_obj = get_attr(fields.graph, names().loop_start);
  if (loop_obj == nullptr) {
    Py_DECREF(result);
    return fail_outs(nullptr);
  }
  Py_ssize_t loop_start = PyLong_AsSsize_t(loop_obj);
  Py_DECREF(loop_obj);
  auto recipe_at = [&](Py_ssize_t i) { return PyTuple_GET_ITEM(PyList_GET_ITEM(ops, i), 0); };
  PyObject* cut = nullptr;  // what to call, with the graph
  if (loop_start) {
    if (recipe_at(n - 1 - loop_start) != recipe) {
      loop_start = 0;  // not a repeat after all
      PyObject* zero = PyLong_FromLong(0);
      PyObject_SetAttr(fields.graph, names().loop_start, zero);
      Py_XDECREF(zero);
    } else if (n - loop_start >= kLoopConfirm) {
      cut = api.cut_loop;
    }
  }
  if (peak_cuts_on) {
    learn_peak_cut(static_cast<c10::DeviceIndex>(index));
    if (cut == nullptr && !peak_cuts.empty() && peak_cuts.count(fields.prefix[n])) cut = api.cut_peak;
  }
  if (cut == nullptr) {
    if (n >= max_ops) {
      cut = api.cut_size;
    } else if (max_held_bytes >= 0 && held_only_here() > max_held_bytes) {
      cut = api.cut_held;
    } else if (!loop_start && n > kLoopMinOps && recipe_at(0) == recipe && recipe_at(1) != recipe) {
      // (a run of one op, x = x + x ..., is a chain, not a loop body: the cap cuts it)
      PyObject* start = PyLong_FromSsize_t(n - 1);
      PyObject_SetAttr(fields.graph, names().loop_start, start);
      Py_XDECREF(start);
    }
  }
  if (cut != nullptr) {
    PyObject* graph = fields.graph;
    Py_INCREF(graph);
    fields.clear();  // the cut detaches it
    PyObject* rc = PyObject_CallOneArg(cut, graph);
    Py_DECREF(graph);
    if (rc == nullptr) {
      Py_DECREF(result);
      return fail_outs(nullptr);
    }
    Py_DECREF(rc);
  }
  if (PyErr_Occurred()) {
    Py_DECREF(result);
    return fail_outs(nullptr);
  }
  return fail_outs(result);
}

}  // namespace

// The recorder's append of a call the C++ entry learned (recording.cpp).
PyObject* append_learned(PyObject* recipe, PyObject* tensors, PyObject* floats, PyObject* ints) {
  return append(recipe, tensors, floats, ints, Py_None);
}

void set_recorder_api(pybind11::object pending, pybind11::object fresh_graph, pybind11::object cut_loop,
                      pybind11::object cut_size, pybind11::object cut_held, pybind11::object cut_peak,
                      pybind11::object op_record, pybind11::object is_library_file, pybind11::object miss) {
  api.cut_peak = cut_peak.release().ptr();
  api.pending = pending.release().ptr();
  api.fresh_graph = fresh_graph.release().ptr();
  api.cut_loop = cut_loop.release().ptr();
  api.cut_size = cut_size.release().ptr();
  api.cut_held = cut_held.release().ptr();
  api.op_record = reinterpret_cast<PyTypeObject*>(op_record.release().ptr());
  api.is_library_file = is_library_file.release().ptr();
  api.miss = miss.release().ptr();
}

void set_adaptive_max_ops(int64_t n) { max_ops = static_cast<Py_ssize_t>(n); }

void set_adaptive_held_bytes(int64_t n) { max_held_bytes = n; }

void set_adaptive_peak_cuts(bool on) { peak_cuts_on = on; }

// Forget the learned peak cuts and levels (recorder.reset).
void forget_peak_cuts() {
  peak_cuts.clear();
  op_level_peak.fill(0);
}

pybind11::object record_append(pybind11::handle recipe, pybind11::handle tensors, pybind11::handle floats,
                               pybind11::handle ints, pybind11::handle location) {
  PyObject* result = append(recipe.ptr(), tensors.ptr(), floats.ptr(), ints.ptr(), location.ptr());
  if (result == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(result);
}

// Forget the graph whose lists are held (after a cut or a flush).
void forget_pending_lists() { fields.clear(); }

pybind11::object weak_storage(const c10::Storage& storage) {
  PyObject* o = new_weak(storage);
  if (o == nullptr) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(o);
}

pybind11::object weak_get(pybind11::handle weak) {
  auto* impl = weak_impl(weak.ptr());
  if (impl == nullptr) throw pybind11::error_already_set();
  auto strong = c10::weak_intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl).lock();
  if (!strong) return pybind11::none();
  return pybind11::reinterpret_steal<pybind11::object>(THPStorage_Wrap(c10::Storage(std::move(strong))));
}


}  // namespace torchneuron
