"""The tracer: runs a kernel once on proxy tiles and emits its MLIR.

Tiles are SSA tensor values; writing into a tile or an argument (`t[...] =`,
`+=`, `nk.store`) rebinds it to a new value. Loops are `scf.for` at the
program level (a top-level loop of dispatches, which IREE compiles where a
hand-made dispatch region does not), the grid included; whatever a loop body
rebinds is carried through the loop's iter_args. Tile math is linalg
(`linalg.generic`, `linalg.matmul`, `linalg.transpose`), loads and stores
are tensor slices. The module takes the arguments in the runtime's calling
convention (torch value tensors in, written arguments overwritten), so it
launches like every other executable.

Every rule is checked here, at the kernel's line: tile shapes (partition
dimension), slice bounds over every value a program id or loop index takes,
matching shapes and dtypes, and values carried across an affine_range.
"""

from __future__ import annotations

import inspect
import re

from .language import PMAX, KernelError

_ELEMENT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "i32", "bool": "i1"}
_TORCH = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int32": "si32", "bool": "i1"}
_FLOATS = ("float32", "float16", "bfloat16")


def tensor_type(shape, dtype) -> str:
    return f"tensor<{''.join(f'{s}x' for s in shape)}{_ELEMENT[dtype]}>"


def vtensor_type(shape, dtype, value=True) -> str:
    return f"!torch.{'v' if value else ''}tensor<[{','.join(map(str, shape))}],{_TORCH[dtype]}>"


class Index:
    """An index that may depend on program ids and loop indices: a linear
    form sum(coefficient * variable) + constant."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: dict, const: int = 0):
        self.terms = {v: c for v, c in terms.items() if c}
        self.const = const

    @staticmethod
    def of(value) -> Index:
        if isinstance(value, Index):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise KernelError(f"an index must be an int, a program id or a loop index, got {value!r}")
        return Index({}, value)

    def constant(self):
        return None if self.terms else self.const

    def __add__(self, other):
        if not _indexish(other):
            return NotImplemented  # a tile's operator takes it from here
        other = Index.of(other)
        terms = dict(self.terms)
        for v, c in other.terms.items():
            terms[v] = terms.get(v, 0) + c
        return Index(terms, self.const + other.const)

    __radd__ = __add__

    def __neg__(self):
        return Index({v: -c for v, c in self.terms.items()}, -self.const)

    def __sub__(self, other):
        if not _indexish(other):
            return NotImplemented
        return self + (-Index.of(other))

    def __rsub__(self, other):
        if not _indexish(other):
            return NotImplemented
        return Index.of(other) - self

    def __mul__(self, other):
        if isinstance(other, Tile):
            return NotImplemented
        if isinstance(other, Index) and other.constant() is not None:
            other = other.const
        if isinstance(other, bool) or not isinstance(other, int):
            raise KernelError("an index can only be multiplied by an int (indices stay affine)")
        return Index({v: c * other for v, c in self.terms.items()}, self.const * other)

    __rmul__ = __mul__

    def bounds(self, trips: dict) -> tuple:
        lo = hi = self.const
        for v, c in self.terms.items():
            top = c * (trips[v] - 1)
            lo, hi = lo + min(0, top), hi + max(0, top)
        return lo, hi

    def __repr__(self):
        return " + ".join([f"{c}*{v}" for v, c in self.terms.items()] + [str(self.const)])


def _indexish(value) -> bool:
    return isinstance(value, Index) or (isinstance(value, int) and not isinstance(value, bool))


class Ref:
    """A kernel argument (a tensor in device memory)."""

    def __init__(self, tracer, position, name, shape, dtype):
        self.tracer, self.position, self.name = tracer, position, name
        self.shape, self.dtype = tuple(shape), dtype
        self.ssa = f"%a{position}"
        self.written = False

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        gathered = [(dim, k) for dim, k in enumerate(key) if isinstance(k, Tile)]
        if len(gathered) > 1:
            raise self.tracer.error("an argument can be indexed by a tile along one dimension only")
        if gathered:
            dim, index = gathered[0]
            if index.dtype != "int32" or len(index.shape) != 1:
                raise self.tracer.error(f"indexing `{self.name}` by a tile takes a 1-D int32 tile, got {index!r}")
            key = key[:dim] + (slice(None),) + key[dim + 1:]
        view = View(self, *self.tracer.parse_key(key, self.shape, f"argument `{self.name}`"))
        if gathered:
            view.gather = gathered[0]
        return view

    def __repr__(self):
        return f"<nk argument {self.name}: {self.dtype}{list(self.shape)}>"


class View:
    """A slice of an argument, to load from or store to."""

    def __init__(self, ref, offsets, sizes, dropped):
        self.ref, self.offsets, self.sizes, self.dropped = ref, offsets, sizes, dropped
        self.gather = None  # (dimension, 1-D int32 tile): rows picked by the tile's values

    @property
    def shape(self) -> tuple:
        sizes = list(self.sizes)
        if self.gather:
            sizes[self.gather[0]] = self.gather[1].shape[0]
        return tuple(s for s, d in zip(sizes, self.dropped) if not d)


class Tile:
    """A tile: an SSA tensor value the kernel may rebind by writing into it."""

    def __init__(self, tracer, ssa, shape, dtype):
        self.tracer, self.ssa, self.shape, self.dtype = tracer, ssa, tuple(shape), dtype
        tracer.objects.append(self)

    def astype(self, dtype):
        from .language import cast
        return cast(self, dtype)

    def __getitem__(self, key):
        if any(k is None for k in (key if isinstance(key, tuple) else (key,))):
            return self.tracer.expand(self, key if isinstance(key, tuple) else (key,))
        offsets, sizes, dropped = self.tracer.parse_key(key, self.shape, "a tile")
        return self.tracer.extract(self.tracer.use(self), self.shape, self.dtype, offsets, sizes, dropped)

    def __setitem__(self, key, value):
        t = self.tracer
        offsets, sizes, dropped = t.parse_key(key, self.shape, "a tile")
        shape = tuple(s for s, d in zip(sizes, dropped) if not d)
        part = t.broadcast_to(value, shape, self.dtype)
        if part.dtype != self.dtype:
            raise t.error(f"writing a {part.dtype} tile into a {self.dtype} tile: cast it first (nk.cast)")
        if shape == self.shape and not any(dropped) and all(Index.of(o).constant() == 0 for o in offsets):
            self.ssa = t.use(part)
            return
        self.ssa = t.insert(t.use(part), part.shape, t.use(self), self.shape, self.dtype, offsets, sizes, dropped)

    def _inplace(name):  # noqa: N805 - builds methods
        def method(self, other):
            result = self.tracer.binary(name, self, other)
            if result.shape != self.shape or result.dtype != self.dtype:
                raise KernelError(f"in-place {name} would change a {self.dtype}{list(self.shape)} tile into "
                                  f"{result.dtype}{list(result.shape)}")
            self.ssa = self.tracer.use(result)
            return self
        return method

    def _op(name, swap=False):  # noqa: N805
        def method(self, other):
            return self.tracer.binary(name, other, self) if swap else self.tracer.binary(name, self, other)
        return method

    __add__, __radd__ = _op("add"), _op("add", True)
    __sub__, __rsub__ = _op("sub"), _op("sub", True)
    __mul__, __rmul__ = _op("mul"), _op("mul", True)
    __truediv__, __rtruediv__ = _op("div"), _op("div", True)
    __lt__, __le__, __gt__, __ge__ = _op("lt"), _op("le"), _op("gt"), _op("ge")
    __eq__, __ne__ = _op("eq"), _op("ne")  # noqa: PIE794
    __and__, __or__ = _op("and"), _op("or")
    __iadd__, __isub__, __imul__, __itruediv__ = _inplace("add"), _inplace("sub"), _inplace("mul"), _inplace("div")
    __hash__ = object.__hash__
    del _op, _inplace

    def __neg__(self):
        return self.tracer.unary("negative", self)

    def __invert__(self):
        return self.tracer.unary("not", self)

    def __bool__(self):
        raise KernelError("a tile's value is not known when the kernel is traced: use nk.where, not `if`")

    def __repr__(self):
        return f"<nk tile {self.dtype}{list(self.shape)}>"


class _Loop:
    def __init__(self, kind, placeholders):
        self.kind, self.placeholders = kind, set(placeholders)
        self.read_lines: dict = {}  # placeholder -> the kernel line that read it


class Tracer:
    def __init__(self, kernel_code):
        self.code = kernel_code
        self.blocks: list = [[]]
        self.count = 0
        self.objects: list = []  # what a loop body may rebind: arguments and tiles
        self.aliases: dict = {}  # a loop placeholder not carried -> the value it stands for
        self.trips: dict = {}  # index variable -> its trip count
        self.loops: list = []
        self.program_ids: list = []
        self.refs: list = []

    # -- the kernel's frame, for errors ------------------------------------------

    def line(self) -> str:
        for frame in inspect.stack(0):
            if frame.frame.f_code is self.code:
                return f"{frame.filename}:{frame.lineno}"
        return "<kernel>"

    def error(self, message) -> KernelError:
        return KernelError(f"{self.line()}: {message}")

    # -- SSA values ------------------------------------------------------------------

    def fresh(self, prefix="v") -> str:
        self.count += 1
        return f"%{prefix}{self.count}"

    def emit(self, line: str) -> None:
        self.blocks[-1].append(line)

    def use(self, obj) -> str:
        ssa = obj.ssa
        for loop in self.loops:
            if loop.kind == "affine" and isinstance(obj, Tile) and ssa in loop.placeholders:
                loop.read_lines.setdefault(ssa, self.line())
        return ssa

    def tile(self, shape, dtype, ssa=None) -> Tile:
        return Tile(self, ssa or self.fresh(), shape, dtype)

    def index(self, value) -> str:
        """An SSA index (or a static int, as text) for an offset."""
        value = Index.of(value)
        if value.constant() is not None:
            return str(value.const)
        parts = []
        for var, c in value.terms.items():
            if c == 1:
                parts.append(var)
            else:
                k, m = self.fresh("c"), self.fresh()
                self.emit(f"{k} = arith.constant {c} : index")
                self.emit(f"{m} = arith.muli {var}, {k} : index")
                parts.append(m)
        if value.const:
            k = self.fresh("c")
            self.emit(f"{k} = arith.constant {value.const} : index")
            parts.append(k)
        total = parts[0]
        for p in parts[1:]:
            s = self.fresh()
            self.emit(f"{s} = arith.addi {total}, {p} : index")
            total = s
        return total

    # -- programs and loops ------------------------------------------------------------

    def program_id(self, axis):
        if not isinstance(axis, int) or not 0 <= axis < len(self.program_ids):
            raise self.error(f"program_id({axis!r}): the grid has {len(self.program_ids)} axes")
        program = self.program_ids[axis]
        if isinstance(program, (int, Index)):  # the grid is traced program by program
            return program
        return Index({program: 1})

    def loop(self, n, kind):
        var = self.fresh("i")
        if isinstance(n, Index):
            if n.constant() is not None:
                n = n.const
            else:
                lo, hi = n.bounds(self.trips)
                if lo < 0:
                    raise self.error(f"a loop's trip count {n} may be negative ({lo})")
                self.trips[var] = max(hi, 1)  # the index's largest value bounds the slices it takes
        if not isinstance(n, Index):
            self.trips[var] = n
        objects = list(self.objects) + list(self.refs)
        outer = [o.ssa for o in objects]
        placeholders = [self.fresh("p") for _ in objects]
        for o, p in zip(objects, placeholders):
            o.ssa = p
        frame = _Loop(kind, placeholders)
        self.loops.append(frame)
        self.blocks.append([])
        try:
            yield Index({var: 1})
        except GeneratorExit:
            self.loops.pop()
            self.blocks.pop()
            raise
        self.loops.pop()
        body = self.blocks.pop()
        carried = []
        for o, p, before in zip(objects, placeholders, outer):
            if o.ssa == p:  # not rebound in the body: not carried
                self.aliases[p] = before
                o.ssa = before
            else:
                carried.append((o, p, before))
                if kind == "affine" and isinstance(o, Tile) and p in frame.read_lines:
                    raise KernelError(
                        f"{frame.read_lines[p]}: a tile updated in one iteration of affine_range is read in the "
                        f"next (a carried dependency); iterations of affine_range must be independent: use "
                        f"sequential_range for an accumulation")
        if isinstance(n, int) and n == 0:
            for o, p, before in carried:
                o.ssa = before
            return
        lo, one = self.fresh("c"), self.fresh("c")
        self.emit(f"{lo} = arith.constant 0 : index")
        if isinstance(n, Index):
            hi = self.index(n)
        else:
            hi = self.fresh("c")
            self.emit(f"{hi} = arith.constant {n} : index")
        self.emit(f"{one} = arith.constant 1 : index")
        if not carried:
            self.emit(f"scf.for {var} = {lo} to {hi} step {one} {{")
            self.blocks[-1].extend("  " + ln for ln in body)
            self.emit("}")
            return
        result = self.fresh("r")
        types = [tensor_type(o.shape, o.dtype) for o, _, _ in carried]
        args = ", ".join(f"{p} = {before}" for _, p, before in carried)
        self.emit(f"{result}:{len(carried)} = scf.for {var} = {lo} to {hi} step {one} iter_args({args}) "
                  f"-> ({', '.join(types)}) {{")
        self.blocks[-1].extend("  " + ln for ln in body)
        self.emit(f"  scf.yield {', '.join(o.ssa for o, _, _ in carried)} : {', '.join(types)}")
        self.emit("}")
        for k, (o, _, _) in enumerate(carried):
            o.ssa = f"{result}#{k}"

    # -- slices ---------------------------------------------------------------------------

    def parse_key(self, key, shape, what):
        key = key if isinstance(key, tuple) else (key,)
        if Ellipsis in key:
            at = key.index(Ellipsis)
            key = key[:at] + (slice(None),) * (len(shape) - len(key) + 1) + key[at + 1:]
        if len(key) > len(shape):
            raise self.error(f"{len(key)} indices for {what} of rank {len(shape)}")
        key = key + (slice(None),) * (len(shape) - len(key))
        offsets, sizes, dropped = [], [], []
        for dim, (k, extent) in enumerate(zip(key, shape)):
            if isinstance(k, slice):
                if k.step not in (None, 1):
                    raise self.error("slices take step 1")
                start = Index.of(0 if k.start is None else k.start)
                stop = Index.of(extent if k.stop is None else k.stop)
                size = (stop - start).constant()
                if size is None or size <= 0:
                    raise self.error(f"the slice {k.start}:{k.stop} of dimension {dim} of {what} must have a "
                                     f"positive size known when the kernel is traced (use nk.ds(start, size))")
                offsets.append(start), sizes.append(size), dropped.append(False)
            else:
                offsets.append(Index.of(k)), sizes.append(1), dropped.append(True)
            lo, hi = offsets[-1].bounds(self.trips)
            if lo < 0 or hi + sizes[-1] > extent:
                raise self.error(f"dimension {dim} of {what} has {extent} elements, but this slice reaches "
                                 f"[{lo}, {hi + sizes[-1]}) over the program ids and loop indices it takes")
        return offsets, sizes, dropped

    def _slice_text(self, offsets, sizes):
        return (f"[{', '.join(self.index(o) for o in offsets)}] [{', '.join(map(str, sizes))}] "
                f"[{', '.join('1' for _ in sizes)}]")

    def extract(self, source, shape, dtype, offsets, sizes, dropped) -> Tile:
        out = tuple(s for s, d in zip(sizes, dropped) if not d)
        result = self.fresh()
        self.emit(f"{result} = tensor.extract_slice {source}{self._slice_text(offsets, sizes)} : "
                  f"{tensor_type(shape, dtype)} to {tensor_type(out, dtype)}")
        return self.tile(out, dtype, result)

    def insert(self, part, part_shape, dest, shape, dtype, offsets, sizes, dropped) -> str:
        result = self.fresh()
        self.emit(f"{result} = tensor.insert_slice {part} into {dest}{self._slice_text(offsets, sizes)} : "
                  f"{tensor_type(part_shape, dtype)} into {tensor_type(shape, dtype)}")
        return result

    def expand(self, tile, key):
        """t[:, None], t[None, :]: new unit dimensions (every other index a full slice)."""
        if sum(k is not None for k in key) != len(tile.shape) or any(
                k is not None and k != slice(None) for k in key):
            raise self.error("indexing with None takes a full slice (:) for every dimension of the tile")
        shape = tuple(1 if k is None else tile.shape[sum(x is not None for x in key[:j])] for j, k in enumerate(key))
        self._check_tile_shape(shape)
        sources = [j for j, k in enumerate(key) if k is not None]
        groups = [[j] for j in sources]
        for j, k in enumerate(key):
            if k is None:
                after = [g for g in groups if g[0] > j]
                (after[0] if after else groups[-1]).append(j)
        text = "[" + ", ".join("[" + ", ".join(map(str, sorted(g))) + "]" for g in groups) + "]" if groups else "[]"
        r = self.fresh()
        self.emit(f"{r} = tensor.expand_shape {self.use(tile)} {text} output_shape [{', '.join(map(str, shape))}] : "
                  f"{tensor_type(tile.shape, tile.dtype)} into {tensor_type(shape, tile.dtype)}")
        return self.tile(shape, tile.dtype, r)

    # -- memory -----------------------------------------------------------------------------

    def load(self, view):
        if not isinstance(view, View):
            raise self.error(f"nk.load takes a slice of a kernel argument (x[...]), got {view!r}")
        self._check_tile_shape(view.shape)
        if view.gather:
            return self._gather(view)
        return self.extract(self.use(view.ref), view.ref.shape, view.ref.dtype, view.offsets, view.sizes, view.dropped)

    def _gather(self, view) -> Tile:
        """x[rows_tile, ...]: each index clamped into the argument (an index
        out of range reads its nearest row, never memory outside it; the
        simulator raises instead)."""
        ref, (dim, index) = view.ref, view.gather
        out = view.shape
        positions, k = {}, 0  # source dimension -> its dimension in the result
        for j, d in enumerate(view.dropped):
            if not d:
                positions[j] = k
                k += 1
        dims = [f"d{i}" for i in range(len(out))]
        source = self.use(ref)
        lines = []
        saved, self.blocks = self.blocks, [lines]
        value, picked = self.fresh("e"), self.fresh("s")
        self.emit(f"{picked} = arith.index_cast {value} : i32 to index")
        lo, hi = self.fresh("c"), self.fresh("c")
        self.emit(f"{lo} = arith.constant 0 : index")
        self.emit(f"{hi} = arith.constant {ref.shape[dim] - 1} : index")
        low, row = self.fresh("s"), self.fresh("s")
        self.emit(f"{low} = arith.maxsi {picked}, {lo} : index")
        self.emit(f"{row} = arith.minsi {low}, {hi} : index")
        coordinates = []
        for j in range(len(ref.shape)):
            if j == dim:
                coordinates.append(row)
            elif view.dropped[j]:
                coordinates.append(self._index_ssa(view.offsets[j]))
            else:
                at = self.fresh("s")
                self.emit(f"{at} = linalg.index {positions[j]} : index")
                offset = self._index_ssa(view.offsets[j])
                total = self.fresh("s")
                self.emit(f"{total} = arith.addi {at}, {offset} : index")
                coordinates.append(total)
        element = self.fresh("s")
        self.emit(f"{element} = tensor.extract {source}[{', '.join(coordinates)}] : {tensor_type(ref.shape, ref.dtype)}")
        self.blocks = saved
        empty, o = self.fresh(), self.fresh("o")
        self.emit(f"{empty} = tensor.empty() : {tensor_type(out, ref.dtype)}")
        maps = [f"affine_map<({', '.join(dims)}) -> ({dims[positions[dim]]})>",
                f"affine_map<({', '.join(dims)}) -> ({', '.join(dims)})>"]
        result = self._emit_generic(maps, ["parallel"] * len(dims),
                                    f"ins({self.use(index)} : {tensor_type(index.shape, 'int32')}) ",
                                    f"{empty} : {tensor_type(out, ref.dtype)}",
                                    [f"{value}: i32", f"{o}: {_ELEMENT[ref.dtype]}"], lines, element, ref.dtype,
                                    tensor_type(out, ref.dtype))
        return self.tile(out, ref.dtype, result)

    def _emit_generic(self, maps, iterators, ins, outs, region, lines, value, dtype, result_type) -> str:
        """A linalg.generic whose region (block arguments `region`) runs
        `lines` and yields `value`; returns its result's name."""
        result = self.fresh()
        self.emit(f"{result} = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = "
                  f"[{', '.join(f'{chr(34)}{i}{chr(34)}' for i in iterators)}]}} {ins}outs({outs}) {{")
        self.emit(f"^bb0({', '.join(region)}):")
        for ln in lines:
            self.emit("  " + ln)
        self.emit(f"  linalg.yield {value} : {_ELEMENT[dtype]}")
        self.emit(f"}} -> {result_type}")
        return result

    def _index_ssa(self, value) -> str:
        """An index as an SSA value (a constant emitted when static)."""
        text = self.index(value)
        if text.startswith("%"):
            return text
        c = self.fresh("c")
        self.emit(f"{c} = arith.constant {text} : index")
        return c

    def store(self, view, tile):
        if not isinstance(view, View):
            raise self.error(f"nk.store writes to a slice of a kernel argument (out[...]), got {view!r}")
        if view.gather:
            raise self.error("nk.store writes to slices; indexing by a tile (a scatter) is for loads only")
        tile = self.broadcast_to(tile, view.shape, view.ref.dtype)
        if tile.dtype != view.ref.dtype:
            raise self.error(f"storing a {tile.dtype} tile into {view.ref.dtype} argument `{view.ref.name}`: "
                             f"cast it first (nk.cast)")
        ref = view.ref
        ref.ssa = self.insert(self.use(tile), tile.shape, self.use(ref), ref.shape, ref.dtype,
                              view.offsets, view.sizes, view.dropped)
        ref.written = True

    def _check_tile_shape(self, shape):
        if len(shape) >= 2 and shape[0] > PMAX:
            raise self.error(f"a tile's first (partition) dimension holds at most {PMAX} rows, "
                             f"this one would have {shape[0]} (shape {list(shape)})")

    def full(self, shape, value, dtype):
        self._check_tile_shape(shape)
        empty = self.fresh()
        self.emit(f"{empty} = tensor.empty() : {tensor_type(shape, dtype)}")
        if value is None:
            return self.tile(shape, dtype, empty)
        c = self._scalar(value, dtype)
        result = self.fresh()
        self.emit(f"{result} = linalg.fill ins({c} : {_ELEMENT[dtype]}) outs({empty} : {tensor_type(shape, dtype)}) "
                  f"-> {tensor_type(shape, dtype)}")
        return self.tile(shape, dtype, result)

    def _scalar(self, value, dtype) -> str:
        """An SSA constant of `dtype` (emitted in the current block)."""
        c = self.fresh("k")
        if dtype in _FLOATS:
            self.emit(f"{c} = arith.constant {_float(value)} : f32")
            if dtype != "float32":
                t = self.fresh("k")
                self.emit(f"{t} = arith.truncf {c} : f32 to {_ELEMENT[dtype]}")
                return t
            return c
        if dtype == "bool":
            self.emit(f"{c} = arith.constant {'true' if value else 'false'}")
            return c
        if isinstance(value, float) and not float(value).is_integer():
            raise self.error(f"the float {value} used with an {dtype} tile: cast the tile first (nk.cast)")
        self.emit(f"{c} = arith.constant {int(value)} : i32")
        return c

    def _index_value(self, value, dtype) -> str:
        """An index as a number of `dtype` (emitted in the current block)."""
        if value.constant() is not None:
            return self._scalar(value.const, dtype)
        if dtype == "bool":
            raise self.error("an index used with a bool tile")
        return self._as_number(self.index(value), dtype)

    def _as_number(self, index: str, dtype) -> str:
        """An SSA index converted to a number of `dtype`."""
        r = self.fresh("s")
        self.emit(f"{r} = arith.index_cast {index} : index to i32")
        if dtype in _FLOATS:
            f = self.fresh("s")
            self.emit(f"{f} = arith.sitofp {r} : i32 to {_ELEMENT[dtype]}")
            return f
        return r

    def arange(self, n, dtype):
        self._check_tile_shape((n,))

        def body(a):
            i = self.fresh("s")
            self.emit(f"{i} = linalg.index 0 : index")
            return self._as_number(i, dtype)
        return self._generic([], (n,), dtype, body)

    def broadcast_to(self, value, shape, dtype) -> Tile:
        if isinstance(value, Tile):
            if value.shape != tuple(shape):
                value = self.binary("keep", value, None, shape)
            return value
        if isinstance(value, (int, float, bool)):
            return self.full(shape, value, dtype)
        raise self.error(f"expected a tile or a number, got {value!r}")

    # -- math -----------------------------------------------------------------------------

    def _operand(self, x):
        if isinstance(x, Tile):
            return x
        if isinstance(x, (bool, int, float)):
            return x
        if isinstance(x, Index):
            return x  # a program id or loop index as a number in tile math
        raise self.error(f"expected a tile or a number, got {x!r}")

    def _generic(self, operands, out_shape, out_dtype, body, scalar_dtype=None):
        """linalg.generic over `operands` (tiles broadcast to out_shape, and
        numbers); body(args, out_elem) returns (lines, result) in the region."""
        rank = len(out_shape)
        dims = [f"d{i}" for i in range(rank)]
        maps, ins, in_types, args, region = [], [], [], [], []
        for x in operands:
            if isinstance(x, Tile):
                shift = rank - len(x.shape)
                exprs = ["0" if (s == 1 and out_shape[shift + j] != 1) else dims[shift + j] for j, s in enumerate(x.shape)]
                maps.append(f"affine_map<({', '.join(dims)}) -> ({', '.join(exprs)})>")
                ins.append(self.use(x))
                in_types.append(tensor_type(x.shape, x.dtype))
                a = self.fresh("e")
                region.append(f"{a}: {_ELEMENT[x.dtype]}")
                args.append(a)
            else:
                args.append(("index" if isinstance(x, Index) else "const", x))
        maps.append(f"affine_map<({', '.join(dims)}) -> ({', '.join(dims)})>")
        out = self.fresh("o")
        region.append(f"{out}: {_ELEMENT[out_dtype]}")
        empty = self.fresh()
        self.emit(f"{empty} = tensor.empty() : {tensor_type(out_shape, out_dtype)}")
        lines = []
        resolved = []
        for a in args:
            if isinstance(a, tuple):
                saved, self.blocks = self.blocks, [lines]
                resolved.append(self._scalar(a[1], scalar_dtype) if a[0] == "const" else self._index_value(a[1], scalar_dtype))
                self.blocks = saved
            else:
                resolved.append(a)
        saved, self.blocks = self.blocks, [lines]
        value = body(resolved)
        self.blocks = saved
        ins_text = f"ins({', '.join(ins)} : {', '.join(in_types)}) " if ins else ""
        result = self._emit_generic(maps, ["parallel"] * rank, ins_text, f"{empty} : {tensor_type(out_shape, out_dtype)}",
                                    region, lines, value, out_dtype, tensor_type(out_shape, out_dtype))
        return self.tile(out_shape, out_dtype, result)

    def _broadcast_shape(self, shapes):
        rank = max(len(s) for s in shapes)
        out = []
        for j in range(rank):
            sizes = {s[j - rank + len(s)] for s in shapes if j - rank + len(s) >= 0} - {1}
            if len(sizes) > 1:
                raise self.error(f"tiles of shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast")
            out.append(sizes.pop() if sizes else 1)
        return tuple(out)

    def _elem(self, name, dtype, a, b=None):
        """One scalar op in a region: emits and returns its SSA name."""
        t = _ELEMENT[dtype]
        r = self.fresh("s")
        fl = dtype in _FLOATS
        simple = {
            "add": ("arith.addf", "arith.addi"), "sub": ("arith.subf", "arith.subi"),
            "mul": ("arith.mulf", "arith.muli"), "div": ("arith.divf", "arith.divsi"),
            "maximum": ("arith.maximumf", "arith.maxsi"), "minimum": ("arith.minimumf", "arith.minsi"),
            "and": (None, "arith.andi"), "or": (None, "arith.ori"),
        }
        if name in simple:
            op = simple[name][0 if fl else 1]
            if op is None:
                raise self.error(f"`{name}` takes bool or int tiles")
            self.emit(f"{r} = {op} {a}, {b} : {t}")
        elif name in ("lt", "le", "gt", "ge", "eq", "ne"):
            pred = {"lt": ("olt", "slt"), "le": ("ole", "sle"), "gt": ("ogt", "sgt"), "ge": ("oge", "sge"),
                    "eq": ("oeq", "eq"), "ne": ("une", "ne")}[name][0 if fl else 1]
            self.emit(f"{r} = arith.{'cmpf' if fl else 'cmpi'} {pred}, {a}, {b} : {t}")
        elif name in ("exp", "log", "tanh", "sqrt", "rsqrt"):
            if not fl:
                raise self.error(f"nk.{name} takes float tiles; cast first (nk.cast)")
            self.emit(f"{r} = math.{name} {a} : {t}")
        elif name == "abs":
            self.emit(f"{r} = math.{'absf' if fl else 'absi'} {a} : {t}")
        elif name == "negative":
            if fl:
                self.emit(f"{r} = arith.negf {a} : {t}")
            else:
                z = self._scalar(0, dtype)
                self.emit(f"{r} = arith.subi {z}, {a} : {t}")
        elif name == "not":
            one = self._scalar(True, "bool") if dtype == "bool" else self._scalar(-1, dtype)
            self.emit(f"{r} = arith.xori {a}, {one} : {t}")
        elif name == "sigmoid":
            if not fl:
                raise self.error("nk.sigmoid takes float tiles; cast first (nk.cast)")
            one = self._scalar(1.0, dtype)
            n, e, d = self.fresh("s"), self.fresh("s"), self.fresh("s")
            self.emit(f"{n} = arith.negf {a} : {t}")
            self.emit(f"{e} = math.exp {n} : {t}")
            self.emit(f"{d} = arith.addf {e}, {one} : {t}")
            self.emit(f"{r} = arith.divf {one}, {d} : {t}")
        else:
            raise self.error(f"unknown tile operation {name}")
        return r

    def unary(self, name, x):
        x = self._operand(x)
        if not isinstance(x, Tile):
            raise self.error(f"nk.{name} takes a tile, got {x!r}")
        if name == "not" and x.dtype not in ("bool", "int32"):
            raise self.error("~ takes bool or int tiles")
        return self._generic([x], x.shape, x.dtype, lambda a: self._elem(name, x.dtype, a[0]))

    def binary(self, name, x, y, shape=None):
        if name == "keep":  # broadcast x to `shape`
            if self._broadcast_shape([x.shape, shape]) != tuple(shape):
                raise self.error(f"a {list(x.shape)} tile does not broadcast to {list(shape)}")
            return self._generic([x], tuple(shape), x.dtype, lambda a: a[0])
        x, y = self._operand(x), self._operand(y)
        tiles = [v for v in (x, y) if isinstance(v, Tile)]
        if not tiles:
            raise self.error(f"`{name}` needs at least one tile")
        dtypes = {t.dtype for t in tiles}
        if len(dtypes) > 1:
            raise self.error(f"`{name}` of {' and '.join(sorted(dtypes))} tiles: cast one first (nk.cast)")
        dtype = dtypes.pop()
        out_shape = self._broadcast_shape([t.shape for t in tiles])
        compare = name in ("lt", "le", "gt", "ge", "eq", "ne")
        out_dtype = "bool" if compare else dtype
        return self._generic([x, y], out_shape, out_dtype, lambda a: self._elem(name, dtype, a[0], a[1]),
                             scalar_dtype=dtype)

    def where(self, condition, x, y):
        if not isinstance(condition, Tile) or condition.dtype != "bool":
            raise self.error("nk.where's condition must be a bool tile (a comparison)")
        x, y = self._operand(x), self._operand(y)
        tiles = [v for v in (x, y) if isinstance(v, Tile)]
        dtypes = {t.dtype for t in tiles} or {"float32"}
        if len(dtypes) > 1:
            raise self.error(f"nk.where of {' and '.join(sorted(dtypes))} tiles: cast one first (nk.cast)")
        dtype = dtypes.pop()
        shape = self._broadcast_shape([condition.shape] + [t.shape for t in tiles])

        def body(a):
            r = self.fresh("s")
            self.emit(f"{r} = arith.select {a[0]}, {a[1]}, {a[2]} : {_ELEMENT[dtype]}")
            return r
        return self._generic([condition, x, y], shape, dtype, body, scalar_dtype=dtype)

    def cast(self, x, dtype):
        if not isinstance(x, Tile):
            raise self.error(f"nk.cast takes a tile, got {x!r}")
        src = x.dtype
        if src == dtype:
            return x

        def body(a):
            r = self.fresh("s")
            f, t = _ELEMENT[src], _ELEMENT[dtype]
            if src in _FLOATS and dtype in _FLOATS:
                wider = _FLOATS.index(dtype) < _FLOATS.index(src) if "float32" in (src, dtype) else None
                if wider is None:  # float16 <-> bfloat16 through float32
                    m = self.fresh("s")
                    self.emit(f"{m} = arith.extf {a[0]} : {f} to f32")
                    self.emit(f"{r} = arith.truncf {m} : f32 to {t}")
                else:
                    self.emit(f"{r} = arith.{'extf' if wider else 'truncf'} {a[0]} : {f} to {t}")
            elif src in _FLOATS and dtype == "int32":
                self.emit(f"{r} = arith.fptosi {a[0]} : {f} to {t}")
            elif src == "int32" and dtype in _FLOATS:
                self.emit(f"{r} = arith.sitofp {a[0]} : {f} to {t}")
            elif src == "bool" and dtype in _FLOATS:
                self.emit(f"{r} = arith.uitofp {a[0]} : {f} to {t}")
            elif src == "bool" and dtype == "int32":
                self.emit(f"{r} = arith.extui {a[0]} : {f} to {t}")
            elif dtype == "bool":
                z = self._scalar(0, src)
                self.emit(f"{r} = arith.{'cmpf une' if src in _FLOATS else 'cmpi ne'}, {a[0]}, {z} : {f}")
            else:
                raise self.error(f"no cast from {src} to {dtype}")
            return r
        return self._generic([x], x.shape, dtype, body)

    def reduce(self, name, x, axis, keepdims):
        if not isinstance(x, Tile):
            raise self.error(f"nk.{name} takes a tile, got {x!r}")
        rank = len(x.shape)
        if not isinstance(axis, int) or not -rank <= axis < rank:
            raise self.error(f"axis {axis!r} of a rank-{rank} tile")
        axis %= rank
        dtype = x.dtype
        if dtype == "bool":
            raise self.error(f"nk.{name} of a bool tile: cast it first (nk.cast)")
        out = tuple(s for j, s in enumerate(x.shape) if j != axis)
        fl = dtype in _FLOATS
        start = {"sum": 0, "max": float("-inf") if fl else -2**31, "min": float("inf") if fl else 2**31 - 1}[name]
        init = self.full(out, start, dtype)
        dims = [f"d{i}" for i in range(rank)]
        kept = [d for j, d in enumerate(dims) if j != axis]
        a, acc, s = self.fresh("e"), self.fresh("e"), self.fresh("s")
        t = _ELEMENT[dtype]
        op = {"sum": ("arith.addf", "arith.addi"), "max": ("arith.maximumf", "arith.maxsi"),
              "min": ("arith.minimumf", "arith.minsi")}[name][0 if fl else 1]
        maps = [f"affine_map<({', '.join(dims)}) -> ({', '.join(dims)})>",
                f"affine_map<({', '.join(dims)}) -> ({', '.join(kept)})>"]
        r = self._emit_generic(maps, ["reduction" if j == axis else "parallel" for j in range(rank)],
                               f"ins({self.use(x)} : {tensor_type(x.shape, dtype)}) ",
                               f"{self.use(init)} : {tensor_type(out, dtype)}", [f"{a}: {t}", f"{acc}: {t}"],
                               [f"{s} = {op} {a}, {acc} : {t}"], s, dtype, tensor_type(out, dtype))
        if not keepdims:
            return self.tile(out, dtype, r)
        full = tuple(1 if j == axis else s for j, s in enumerate(x.shape))
        if not out:
            groups = "[]"
        else:
            lists = [[j] for j in range(rank) if j != axis]
            if axis > 0:
                lists[axis - 1].append(axis)
            else:
                lists[0].insert(0, 0)
                lists = [[0] + [v for v in lists[0] if v != 0]] + lists[1:]
            groups = "[" + ", ".join("[" + ", ".join(map(str, sorted(g))) + "]" for g in lists) + "]"
        e = self.fresh()
        self.emit(f"{e} = tensor.expand_shape {r} {groups} output_shape [{', '.join(map(str, full))}] : "
                  f"{tensor_type(out, dtype)} into {tensor_type(full, dtype)}")
        return self.tile(full, dtype, e)

    def matmul(self, a, b):
        if not (isinstance(a, Tile) and isinstance(b, Tile)) or len(a.shape) != 2 or len(b.shape) != 2:
            raise self.error("nk.matmul takes two 2-D tiles")
        if a.shape[1] != b.shape[0]:
            raise self.error(f"nk.matmul of {list(a.shape)} and {list(b.shape)} tiles: inner sizes differ")
        if "bool" in (a.dtype, b.dtype) or "int32" in (a.dtype, b.dtype):
            raise self.error("nk.matmul takes float tiles")
        a, b = self.cast(a, "float32"), self.cast(b, "float32")
        out = (a.shape[0], b.shape[1])
        self._check_tile_shape(out)
        init = self.full(out, 0.0, "float32")
        r = self.fresh()
        self.emit(f"{r} = linalg.matmul ins({self.use(a)}, {self.use(b)} : {tensor_type(a.shape, 'float32')}, "
                  f"{tensor_type(b.shape, 'float32')}) outs({self.use(init)} : {tensor_type(out, 'float32')}) "
                  f"-> {tensor_type(out, 'float32')}")
        return self.tile(out, "float32", r)

    def transpose(self, x):
        if not isinstance(x, Tile) or len(x.shape) != 2:
            raise self.error("nk.transpose takes a 2-D tile")
        out = (x.shape[1], x.shape[0])
        self._check_tile_shape(out)
        empty, r = self.fresh(), self.fresh()
        self.emit(f"{empty} = tensor.empty() : {tensor_type(out, x.dtype)}")
        self.emit(f"{r} = linalg.transpose ins({self.use(x)} : {tensor_type(x.shape, x.dtype)}) "
                  f"outs({empty} : {tensor_type(out, x.dtype)}) permutation = [1, 0]")
        return self.tile(out, x.dtype, r)

    def device_print(self, label, x):
        pass  # compiled kernels print nothing (the simulator prints)

    # -- the module ---------------------------------------------------------------------------

    def module(self) -> str:
        args, prelude, epilogue = [], [], []
        for ref in self.refs:
            k = ref.position
            builtin = tensor_type(ref.shape, ref.dtype)
            if ref.written:
                args.append(f"%arg{k}: {vtensor_type(ref.shape, ref.dtype, value=False)}")
                prelude.append(f"%t{k} = torch.copy.to_vtensor %arg{k} : {vtensor_type(ref.shape, ref.dtype)}")
                prelude.append(f"%a{k} = torch_c.to_builtin_tensor %t{k} : {vtensor_type(ref.shape, ref.dtype)} -> {builtin}")
                epilogue.append(f"%w{k} = torch_c.from_builtin_tensor {ref.ssa} : {builtin} -> "
                                f"{vtensor_type(ref.shape, ref.dtype)}")
                epilogue.append(f"torch.overwrite.tensor.contents %w{k} overwrites %arg{k} : "
                                f"{vtensor_type(ref.shape, ref.dtype)}, {vtensor_type(ref.shape, ref.dtype, value=False)}")
            else:
                args.append(f"%arg{k}: {vtensor_type(ref.shape, ref.dtype)}")
                prelude.append(f"%a{k} = torch_c.to_builtin_tensor %arg{k} : {vtensor_type(ref.shape, ref.dtype)} -> {builtin}")
        body = "\n".join("    " + ln for ln in prelude + self.blocks[0] + epilogue + ["return"])
        text = f"module {{\n  func.func @main({', '.join(args)}) {{\n{body}\n  }}\n}}\n"
        return _resolve(text, self.aliases)


def _resolve(text: str, aliases: dict) -> str:
    """Loop placeholders that were not carried, replaced by what they stand for."""
    if not aliases:
        return text

    def final(name):
        while name in aliases:
            name = aliases[name]
        return name
    return re.sub(r"%p\d+\b", lambda m: final(m.group(0)), text)


def _float(value) -> str:
    value = float(value)
    if value == float("inf"):
        return "0x7F800000"
    if value == float("-inf"):
        return "0xFF800000"
    if value != value:
        return "0x7FC00000"
    return f"{value:.9e}"


__all__ = ["Index", "Ref", "Tile", "Tracer", "View", "tensor_type"]
