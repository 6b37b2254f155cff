"""Op-level tests generated from a shape registry.

Each recorded signature becomes one test: random inputs with the recorded
dtypes, sizes, strides and storage offsets (integer inputs drawn from the
recorded value range, so indices stay valid), run on neuron and on CPU from
the same values and seed, and compared: results, arguments the op writes,
arguments it must leave alone (bit for bit) and which results alias arguments.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

from . import argument_checks, exactness, registry, rnn_references

# (rtol, atol) by dtype; reductions over recorded (real) sizes need more than
# elementwise ops, so these are a little wider than PyTorch's defaults.
_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
    torch.complex64: (1e-4, 1e-4),
    torch.complex128: (1e-7, 1e-7),
}


class Unsupported(Exception):
    """The signature cannot be rebuilt (an argument type with no generator)."""


@dataclass
class UnitResult:
    op: str
    sig: str
    status: str  # pass | mismatch | error | invalid (CPU rejects the generated inputs too) | unsupported
    #              | too-large (its inputs, copies and checks would not fit in this host's memory)
    detail: str = ""
    models: tuple = ()


def resolve_op(name: str):
    """"aten.add.Tensor" -> torch.ops.aten.add.Tensor."""
    ns, opname, overload = name.split(".", 2)
    return getattr(getattr(getattr(torch.ops, ns), opname), overload)


def _make_tensor(d: dict, gen: torch.Generator) -> tuple:
    """(cpu tensor, neuron tensor) with the recorded layout and equal values."""
    dtype = getattr(torch, d["T"])
    size, stride, offset = d["size"], d["stride"], d["offset"]
    extent = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0
    numel = offset + extent
    if dtype == torch.bool:
        lo, hi = d.get("range", [0, 1])
        base = torch.randint(lo, hi + 1, (numel,), generator=gen).bool()
    elif not dtype.is_floating_point:
        lo, hi = d.get("range", [0, 9])
        base = torch.randint(lo, hi + 1, (numel,), generator=gen, dtype=torch.int64).to(dtype)
    elif dtype.is_complex:
        base = torch.randn(numel, generator=gen, dtype=dtype)
    else:
        base = torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype)
    cpu = base.as_strided(size, stride, offset)
    other = base.clone() if d.get("dev") != "neuron" else base.to("neuron")
    return cpu, other.as_strided(size, stride, offset)


# Arguments an op needs sorted along their last dim (binary searches: any
# other order gives an undefined answer, on CPU too).
_SORTED_ARGUMENT = {
    "aten.bucketize.Tensor": 1, "aten.bucketize.Scalar": 1,
    "aten.searchsorted.Tensor": 0, "aten.searchsorted.Scalar": 0,
}


# Index arguments an op needs without repeats: index_copy with a repeated
# index leaves whichever copy lands last, "nondeterministic" in PyTorch's
# documentation (CPU and a compiled scatter may pick different ones).
_DISTINCT_INDEX = {"aten.index_copy_.default": 2, "aten.index_copy.default": 2}

# Boolean masks an op needs with exactly as many set elements as the values
# it puts have rows: (position of the index list, position of the values).
_MASK_FITS_VALUES = {"aten._index_put_impl_.default": (1, 2), "aten.index_put_.default": (1, 2),
                     "aten.index_put.default": (1, 2)}

# Group ends an op needs non-decreasing, the last one covering every row:
# rows past the last end are left unwritten (uninitialized, on CPU too).
_GROUP_ENDS = {"aten._grouped_mm.default": 2}


def build_arguments(sig: dict, seed: int = 0, op_name: str | None = None) -> tuple:
    """((cpu args, cpu kwargs), (neuron args, neuron kwargs)) for a signature
    (of op_name: arguments it needs sorted, or without repeats, are)."""
    cpu, dev = _build_arguments(sig, seed)
    position = _SORTED_ARGUMENT.get(op_name)
    if position is not None and position < len(cpu[0]) and isinstance(cpu[0][position], torch.Tensor):
        ordered = cpu[0][position].sort(-1).values
        cpu[0][position].copy_(ordered)
        dev[0][position].copy_(ordered)
    position = _DISTINCT_INDEX.get(op_name)
    if position is not None and position < len(cpu[0]) and isinstance(cpu[0][position], torch.Tensor):
        index = cpu[0][position]
        lo, hi = sig["args"][position].get("range", [0, 9])
        if index.dim() == 1 and index.numel() <= hi - lo + 1:
            gen = torch.Generator().manual_seed(seed)
            distinct = (lo + torch.randperm(hi - lo + 1, generator=gen)[: index.numel()]).to(index.dtype)
            index.copy_(distinct)
            dev[0][position].copy_(distinct)
    positions = _MASK_FITS_VALUES.get(op_name)
    if positions is not None and max(positions) < len(cpu[0]):
        _fit_mask_to_values(cpu[0], dev[0], *positions, seed)
    if op_name == "aten._thnn_fused_lstm_cell_backward_impl.default" and len(cpu[0]) >= 5:
        rnn_references.make_state_consistent(cpu[0], dev[0])
    position = _GROUP_ENDS.get(op_name)
    if position is not None and position < len(cpu[0]) and isinstance(cpu[0][position], torch.Tensor):
        ends = cpu[0][position].sort(-1).values
        ends[..., -1] = sig["args"][position].get("range", [0, 0])[1]
        cpu[0][position].copy_(ends)
        dev[0][position].copy_(ends)
    return cpu, dev


def _fit_mask_to_values(cpu_args, dev_args, at, values_at, seed) -> None:
    indices, values = cpu_args[at], cpu_args[values_at]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], torch.Tensor)
            and indices[0].dtype == torch.bool and isinstance(values, torch.Tensor) and values.dim() >= 1):
        return
    mask, rows = indices[0], values.shape[0]
    if rows <= 1 or rows > mask.numel() or not mask.is_contiguous():
        return  # one row broadcasts to any count; a mask too small cannot fit
    gen = torch.Generator().manual_seed(seed)
    fitted = torch.zeros(mask.numel(), dtype=torch.bool)
    fitted[torch.randperm(mask.numel(), generator=gen)[:rows]] = True
    mask.copy_(fitted.view(mask.shape))
    dev_args[at][0].copy_(mask)


def _make_meta_tensor(d: dict, gen) -> tuple:
    """Layout only, no memory: for sizing a case's results before running it."""
    t = torch.empty_strided(d["size"], d["stride"], dtype=getattr(torch, d["T"]), device="meta")
    return t, t


def _build_arguments(sig: dict, seed: int, make_tensor=_make_tensor) -> tuple:
    gen = torch.Generator().manual_seed(seed)

    def both(v):
        if isinstance(v, dict):
            if "T" in v:
                return make_tensor(v, gen)
            if "f" in v:
                x = float(v["f"])
                return x, x
            if "s" in v:
                return v["s"], v["s"]
            if "L" in v or "U" in v:
                pairs = [both(x) for x in v.get("L", v.get("U"))]
                kind = list if "L" in v else tuple
                return kind(p[0] for p in pairs), kind(p[1] for p in pairs)
            if "dtype" in v:
                d = getattr(torch, v["dtype"])
                return d, d
            if "device" in v:
                if make_tensor is _make_meta_tensor:
                    return torch.device("meta"), torch.device("meta")
                return torch.device("cpu"), torch.device(v["device"])
            if "layout" in v:
                layout = getattr(torch, v["layout"])
                return layout, layout
            if "mf" in v:
                mf = getattr(torch, v["mf"])
                return mf, mf
            raise Unsupported(f"an argument of type {v.get('other', '?')}")
        return v, v

    args = [both(a) for a in sig["args"]]
    kwargs = {k: both(v) for k, v in sig["kwargs"].items()}
    return (
        ([a[0] for a in args], {k: v[0] for k, v in kwargs.items()}),
        ([a[1] for a in args], {k: v[1] for k, v in kwargs.items()}),
    )


def _compare(got, expected, path: str = "result") -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"{path}: expected a tensor, got {type(got).__name__}")
        got = got.cpu()
        if got.shape != expected.shape or got.dtype != expected.dtype:
            raise AssertionError(f"{path}: {got.dtype}{list(got.shape)} vs CPU {expected.dtype}{list(expected.shape)}")
        rtol, atol = _TOLERANCE.get(expected.dtype, (0, 0))
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{path}: {m}")
    elif isinstance(expected, (list, tuple)):
        if len(got) != len(expected):
            raise AssertionError(f"{path}: {len(got)} items vs CPU {len(expected)}")
        for i, (g, e) in enumerate(zip(got, expected)):
            _compare(g, e, f"{path}[{i}]")
    elif isinstance(expected, float) and isinstance(got, float):
        if not (math.isclose(got, expected, rel_tol=1e-4, abs_tol=1e-4) or (math.isnan(got) and math.isnan(expected))):
            raise AssertionError(f"{path}: {got} vs CPU {expected}")
    elif got != expected:
        raise AssertionError(f"{path}: {got!r} vs CPU {expected!r}")


_OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)


def run_case(op_name: str, sig_text: str, seed: int = 0) -> UnitResult:
    sig = json.loads(sig_text)
    try:
        op = resolve_op(op_name)
    except (AttributeError, ValueError) as e:
        return UnitResult(op_name, sig_text, "unsupported", f"no such op: {e}")
    needed = working_set_bytes(sig) + _COPIES_OF_RESULTS * result_bytes(op, sig)
    available = _available_bytes()
    if needed > available // 2:
        return UnitResult(op_name, sig_text, "too-large",
                          f"needs about {needed / 2**30:.1f} GiB, {available / 2**30:.1f} GiB available")
    try:
        return _run_case(op, op_name, sig, sig_text, seed)
    except _OUT_OF_MEMORY as e:
        # The estimate missed (an op whose results meta cannot size):
        # reported like one it caught, and the run goes on.
        return UnitResult(op_name, sig_text, "too-large", f"ran out of memory: {str(e)[:200]}")


def _run_case(op, op_name: str, sig: dict, sig_text: str, seed: int) -> UnitResult:
    try:
        (cpu_args, cpu_kwargs), (dev_args, dev_kwargs) = build_arguments(sig, seed, op_name)
    except Unsupported as e:
        return UnitResult(op_name, sig_text, "unsupported", str(e))
    except _OUT_OF_MEMORY:
        raise
    except Exception as e:  # noqa: BLE001 - neuron refused the inputs themselves
        return UnitResult(op_name, sig_text, "error", f"creating the inputs: {type(e).__name__}: {str(e)[:300]}")
    cpu_in = argument_checks.tensor_leaves([cpu_args, cpu_kwargs])
    dev_in = argument_checks.tensor_leaves([dev_args, dev_kwargs])
    cpu_before, dev_before = argument_checks.snapshot(cpu_in), argument_checks.snapshot(dev_in)
    torch.manual_seed(seed)
    try:
        expected = _CPU_REFERENCE.get(op_name, op)(*cpu_args, **cpu_kwargs)
    except _OUT_OF_MEMORY:
        raise
    except Exception as e:  # noqa: BLE001 - random inputs PyTorch itself rejects
        return UnitResult(op_name, sig_text, "invalid", f"CPU: {type(e).__name__}: {str(e)[:200]}")
    torch.manual_seed(seed)
    try:
        got = op(*dev_args, **dev_kwargs)
        torch.neuron.synchronize()
    except _OUT_OF_MEMORY:
        raise
    except Exception as e:  # noqa: BLE001 - a backend failure, reported as such
        return UnitResult(op_name, sig_text, "error", f"{type(e).__name__}: {str(e)[:300]}")
    try:
        # Only memory the op owns: arguments CPU leaves alone stay bit for bit,
        # results alias arguments exactly where CPU's do.
        argument_checks.check_unchanged(dev_in, dev_before, cpu_in, cpu_before)
        argument_checks.check_aliasing(argument_checks.tensor_leaves(got), dev_in,
                                       argument_checks.tensor_leaves(expected), cpu_in)
        _compare(got, expected)
        # What in-place and out= ops wrote into their arguments.
        for i, (g, e) in enumerate(zip(argument_checks.tensor_leaves(dev_args), argument_checks.tensor_leaves(cpu_args))):
            _compare(g, e, f"tensor argument {i}")
        for i, (g, e) in enumerate(zip(argument_checks.tensor_leaves(dev_kwargs), argument_checks.tensor_leaves(cpu_kwargs))):
            _compare(g, e, f"tensor keyword argument {i}")
    except AssertionError as e:
        if not _as_close_to_exact_as_cpu(op, sig, seed, got, expected, op_name):
            return UnitResult(op_name, sig_text, "mismatch", str(e)[:500])
    return UnitResult(op_name, sig_text, "pass")


# A case holds each input on both devices and a bit snapshot of each, a
# result per device, and float64 copies when it judges a mismatch.
_COPIES_OF_INPUTS = 8
# A result per device and a float64 copy of each (twice a float32's bytes).
_COPIES_OF_RESULTS = 6


def working_set_bytes(sig: dict) -> int:
    """About the host memory a case of this signature uses at its peak (the
    device's memory is the host's on the CPU target): yolos's attention
    scores, 1.1e9 floats, would need some 35 GiB."""
    total = 0

    def walk(v):
        nonlocal total
        if isinstance(v, dict):
            if "T" in v and all(v["size"]):
                extent = 1 + sum((n - 1) * s for n, s in zip(v["size"], v["stride"]))
                total += (v["offset"] + extent) * getattr(torch, v["T"]).itemsize
            for x in v.get("L", v.get("U", ())):
                walk(x)

    for a in list(sig["args"]) + list(sig["kwargs"].values()):
        walk(a)
    return total * _COPIES_OF_INPUTS


def result_bytes(op, sig: dict) -> int:
    """The bytes of the op's results for this signature, from its meta kernel
    (0 when it has none): a yolos bmm of 2 MB inputs returns 4.1 GB."""
    try:
        (args, kwargs), _ = _build_arguments(sig, 0, _make_meta_tensor)
        out = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, data-dependent shapes
        return 0
    return sum(t.numel() * t.element_size() for t in argument_checks.tensor_leaves(out))


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # not Linux: no estimate


def _grouped_mm_float64(a, b, offs=None, bias=None, out_dtype=None):
    """_grouped_mm by groups, for the float64 answer CPU's kernel (float32,
    bfloat16, float16 only) cannot give: a 2d left operand's rows (3d right:
    one matrix a group) or its columns (2d right: the shared dimension cut
    into groups) end at `offs`."""
    if offs is None or bias is not None or a.dim() != 2 or b.dim() not in (2, 3):
        raise NotImplementedError("only the grouped layouts of the census")
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for g, (start, end) in enumerate(zip(starts, ends)):
            out[start:end] = a[start:end] @ b[g]
        return out
    return torch.stack([a[:, start:end] @ b[start:end] for start, end in zip(starts, ends)])


# Ops with no CPU kernel at all, and what computes CPU's answer: _copy_from
# is the copy between backends that copy_ hands a new backend.
def _convolution_backward_overrideable(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups,
                                       output_mask):
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    return torch.ops.aten.convolution_backward.default(grad, x, weight, bias_sizes, stride, padding, dilation,
                                                       transposed, output_padding, groups, output_mask)


def _histc(x, bins=100, min=0, max=0):  # noqa: A002 - the op's argument names
    # CPU has no integer histc, CUDA has (MoE routers count experts with it)
    if x.dtype.is_floating_point:
        return torch.histc(x, bins, min, max)
    return torch.histc(x.to(torch.float32), bins, min, max).to(x.dtype)


_CPU_REFERENCE = {
    "aten._copy_from.default": lambda self, dst, non_blocking=False: dst.copy_(self),
    "aten.histc.default": _histc,
    # The generic slots a backend fills when it has no kernel of its own (CPU
    # has none there): answered by the convolution they stand for.
    "aten.convolution_overrideable.default": torch.ops.aten.convolution.default,
    "aten.convolution_backward_overrideable.default": _convolution_backward_overrideable,
    # CUDA-only kernels: answered by CPU's lstm_cell and its autograd.
    "aten._thnn_fused_lstm_cell.default": rnn_references.fused_lstm_cell,
    "aten._thnn_fused_lstm_cell_backward_impl.default": rnn_references.fused_lstm_cell_backward,
}

# Ops with no float64 kernel on CPU, and how their float64 answer is computed.
_FLOAT64_REFERENCE = {"aten._grouped_mm.default": _grouped_mm_float64}


def _as_close_to_exact_as_cpu(op, sig, seed, got, expected, op_name=None) -> bool:
    """Arbitration of a float mismatch by the float64 result: long sums
    (a convolution's weight gradient over 20480 positions) differ from CPU's
    float32 by their accumulation order alone. Neuron passes when each of its
    results is within twice CPU's own largest error of the float64 answer
    (plus float32 rounding of its magnitude); results within the usual
    tolerance of CPU's pass as they are (a convolution's bias gradient need
    not beat CPU's sum when its weight gradient is the one judged). Results
    that are not floats must have matched already."""
    (cpu_args, cpu_kwargs), _ = build_arguments(sig, seed, op_name)
    torch.manual_seed(seed)
    try:
        exact = _FLOAT64_REFERENCE.get(op_name, op)(*exactness.in_float64(cpu_args), **exactness.in_float64(cpu_kwargs))
    except Exception:  # noqa: BLE001 - no float64 kernel: no arbitration
        return False
    return exactness.mismatches_as_close_as_cpu(
        argument_checks.tensor_leaves(got), argument_checks.tensor_leaves(expected),
        argument_checks.tensor_leaves(exact), _compare)


def run(registry_path: str, ops=None, on_result=None) -> list:
    return run_cases(registry.rows(registry_path, ops), on_result)


def run_cases(cases, on_result=None, batch: int | None = None) -> list:
    """Run registry rows (op, signature, count, models), each compiled and
    compared against CPU, `batch` rows at a time (all at once by default).
    A batch's executables are built first, all in the background builders
    at once (each case runs once on the host path meanwhile, its result not
    kept): cold, 120 census signatures took 51 s so against 83 s building
    each in turn. Batches bound how long a result waits for its report and
    how many executables a run holds before it compares any."""
    cases = list(cases)
    step = batch or max(1, len(cases))
    results = []
    for start in range(0, len(cases), step):
        results += _run_batch(cases[start:start + step], on_result)
    return results


def _run_batch(cases, on_result) -> list:
    from .. import config, wait_for_compiles

    waited = config.settings.compile_wait
    config.set(compile_wait=False)
    try:
        for op, sig, _, _ in cases:
            run_case(op, sig)
        wait_for_compiles()
    finally:
        config.set(compile_wait=True)
    results = []
    try:
        for op, sig, _, models in cases:
            result = run_case(op, sig)
            result.models = tuple(models)
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        config.set(compile_wait=waited)
    return results


def summarize(results: list) -> dict:
    out: dict = {}
    for r in results:
        out[r.status] = out.get(r.status, 0) + 1
    return out
