"""OpInfo conformance: run each OpInfo's sample inputs on neuron and on CPU and
compare. Per op and dtype the result is compiled-pass (every sample matched
and ran compiled), fallback-pass (matched, some of it on the host fallback)
or fail (a mismatch or an error, with the first one recorded).

    torchneuron conformance [--ops add mul ...] [--dtypes float32 ...]
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._pytree import tree_leaves, tree_map

import torchneuron
from torchneuron import config
from torchneuron.dispatch import stats as dispatch_stats

from . import argument_checks, exactness

# Ops models use most: the fixed subset CI runs.
CI_OPS = (
    "add sub mul div neg abs exp log sqrt rsqrt pow tanh sigmoid sin cos clamp where "
    "maximum minimum eq ne lt gt ge le logical_not masked_fill sum mean amax amin max min argmax "
    "softmax log_softmax nn.functional.gelu nn.functional.relu nn.functional.silu "
    "nn.functional.layer_norm nn.functional.embedding nn.functional.linear nn.functional.dropout "
    "nn.functional.cross_entropy matmul mm bmm addmm cat stack reshape view transpose permute "
    "expand squeeze unsqueeze flatten contiguous clone zeros_like ones_like full_like tril triu "
    "cumsum index_select gather topk sort norm var erf floor lerp addcmul addcdiv"
).split()

# Failure messages that mean an op touched memory it does not own.
_OWNERSHIP = ("which it only reads on CPU", "shares memory with argument", "wrote outside the memory it owns")

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    # (PyTorch's op database has float8 samples for _scaled_mm, _scaled_mm_v2 and eye: compared exactly)
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

# Device-vs-CPU (rtol, atol). float16/bfloat16: the larger of assert_close's
# defaults for the dtype and PyTorch's own device-vs-CPU test
# (TestCommon.test_compare_cpu: atol=rtol=1e-3): a device may compute in float32
# and round once where CPU's kernel also rounds intermediates (log_softmax's
# sum). float32: 1e-4, stricter than that test; the device kernels (erf, exp,
# tanh approximations) are not CPU's.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.complex64: (1e-4, 1e-4),  # on the real and imaginary parts, as float32
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-3),
}


@dataclass
class OpResult:
    op: str
    dtype: str
    status: str  # compiled-pass | fallback-pass | fail | skipped
    samples: int = 0
    compiled_ops: int = 0
    fallback_ops: dict = field(default_factory=dict)
    error: str = ""
    seconds: float = 0.0
    float64_judged: int = 0  # samples that differ from CPU's answer but are as close to float64's


def _op_db():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def _to_neuron(x, memo: dict):
    """A neuron copy; the same CPU tensor twice in a call gives the same neuron tensor."""
    if isinstance(x, torch.Tensor):
        if id(x) not in memo:
            memo[id(x)] = x.detach().to("neuron")
        return memo[id(x)]
    return x


def _to_cpu(x):
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return x


def _tolerance(opinfo, dtype):
    rtol, atol = TOLERANCES.get(dtype, (0.0, 0.0))
    for decorator in getattr(opinfo, "decorators", ()) or ():
        # toleranceOverride decorators registered for the CPU comparison test.
        test_name = getattr(decorator, "test_name", None)
        if test_name not in ("test_compare_cpu", None):
            continue
        for dec in getattr(decorator, "decorators", ()) or ():
            overrides = getattr(dec, "d", None)
            if isinstance(overrides, dict) and dtype in overrides:
                tol = overrides[dtype]
                rtol, atol = max(rtol, tol.rtol), max(atol, tol.atol)
    return rtol, atol


def _not_compared_by_pytorch(opinfo, dtype) -> str:
    """Why PyTorch's own device-vs-CPU test (TestCommon.test_compare_cpu)
    skips this OpInfo or expects it to fail (empty*: uninitialized memory), or ''."""
    for info in tuple(opinfo.skips or ()) + tuple(opinfo.decorators or ()):
        if getattr(info, "test_name", None) != "test_compare_cpu" or not getattr(info, "active_if", True):
            continue
        if info.device_type is not None:  # a verdict about one device (cuda, mps...), not ours
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        for dec in info.decorators:
            qualname = getattr(dec, "__qualname__", "")
            if qualname.startswith("skip") or qualname == "expectedFailure":
                return f"PyTorch's test_compare_cpu {'skips' if qualname.startswith('skip') else 'expects a failure for'} it"
    return ""


# OpInfos whose indices may order equal values either way: torch.sort and
# torch.argsort (unless stable=True) and torch.topk leave the order of ties
# unspecified, and CPU's std::sort / partial_sort pick one that no other sort
# reproduces (float16 and bfloat16 samples meant to hold distinct values round
# many of them equal). op -> position of dim in the sample's args.
_TIES_UNORDERED = {"sort": 0, "argsort": 0, "topk": 1}


# Reductions to one element of the row and its index: PyTorch documents the
# index among equal values as device-specific (CPU's is where its quickselect
# or nth_element stopped). op -> position of dim in the sample's args.
_TIE_INDEX_UNSPECIFIED = {"kthvalue": 1, "median": 0}


def _picked_tie_as_cpu(opinfo, sample, actual, expected):
    """(values, indices) with CPU's indices where its own pick another element
    equal to the same value; otherwise `actual`, unchanged."""
    at = _TIE_INDEX_UNSPECIFIED[opinfo.name]
    if not (isinstance(actual, (tuple, list)) and len(actual) == 2 and isinstance(expected, (tuple, list))):
        return actual
    (values, indices), (cpu_values, cpu_indices) = actual, expected
    x = sample.input
    if x.dim() == 0 or indices.shape != cpu_indices.shape or torch.equal(indices, cpu_indices):
        return actual
    dim = sample.args[at] if len(sample.args) > at else sample.kwargs.get("dim", -1)
    dim = dim % x.dim()
    kept = indices.dim() == x.dim()
    if not bool(((indices >= 0) & (indices < x.shape[dim])).all()):
        return actual
    picked = x.gather(dim, indices if kept else indices.unsqueeze(dim))
    picked = picked if kept else picked.squeeze(dim)
    if not bool(((picked == cpu_values) | (picked.isnan() & cpu_values.isnan())).all()):
        return actual
    return type(actual)((values, cpu_indices))


def _with_ties_as_cpu(opinfo, sample, actual, expected):
    """`actual` with CPU's indices where its own differ only in the order of
    equal values: its values (if returned) match CPU's, and its indices are
    distinct along the dimension and pick from the input the values CPU's
    pick. Otherwise `actual`, unchanged."""
    if opinfo.name in _TIE_INDEX_UNSPECIFIED:
        return _picked_tie_as_cpu(opinfo, sample, actual, expected)
    at = _TIES_UNORDERED.get(opinfo.name)
    if at is None or sample.kwargs.get("stable"):
        return actual
    pair = isinstance(actual, (tuple, list)) and len(actual) == 2
    indices, cpu_indices = (actual[1], expected[1]) if pair else (actual, expected)
    x = sample.input
    if not (isinstance(indices, torch.Tensor) and isinstance(cpu_indices, torch.Tensor)) or x.dim() == 0 \
            or indices.shape != cpu_indices.shape or torch.equal(indices, cpu_indices):
        return actual
    dim = sample.args[at] if len(sample.args) > at else sample.kwargs.get("dim", -1)

    def same(a, b):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())

    if not bool(((indices >= 0) & (indices < x.shape[dim])).all()):
        return actual
    picked = x.gather(dim, cpu_indices)
    if not same(x.gather(dim, indices), picked) or (pair and not same(actual[0], expected[0])):
        return actual
    ordered = indices.sort(dim).values
    if ordered.shape[dim] > 1 and not bool((ordered.diff(dim=dim) > 0).all()):
        return actual  # an index twice
    return type(actual)((actual[0], cpu_indices)) if pair else cpu_indices


def _as_close_to_exact_as_cpu(opinfo, cpu_call, got, expected, rtol, atol) -> bool:
    """A mismatch judged by the float64 answer, as the unit stage and the
    census judge theirs: CPU's half-precision grid_sample rounds its sampling
    coordinates and picks other pixels (0.13-0.2 from float64 in bfloat16,
    neuron 0.005), so a device closer to the exact answer than CPU is not
    wrong. Only for samples CPU left unchanged (the call is its inputs)."""
    try:
        torch.manual_seed(0)
        exact = opinfo.op(*exactness.in_float64((cpu_call[0], *cpu_call[1])), **exactness.in_float64(cpu_call[2]))
    except Exception:  # noqa: BLE001 - no float64 kernel: no arbitration
        return False

    def close(g, e):
        torch.testing.assert_close(g, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False)

    # Every leaf, not only tensors: a mismatching Python number is no rounding of a tensor.
    return exactness.mismatches_as_close_as_cpu(tree_leaves(got), tree_leaves(expected), tree_leaves(exact), close)


def run_op(opinfo, dtype, max_samples: int) -> OpResult:
    name = opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")
    result = OpResult(name, str(dtype).replace("torch.", ""), "skipped")
    result.error = _not_compared_by_pytorch(opinfo, dtype)
    if result.error:
        return result
    start = time.perf_counter()
    rtol, atol = _tolerance(opinfo, dtype)
    try:
        samples = list(opinfo.sample_inputs("cpu", dtype, requires_grad=False))[:max_samples]
    except Exception as e:  # noqa: BLE001 - a broken sample generator is the OpInfo's problem
        result.error = f"sample_inputs: {type(e).__name__}: {e}"[:500]
        return result
    fallback_before = dict(dispatch_stats.host_fallback)
    compiled_before = sum(dispatch_stats.compiled.values())
    failure = ""
    for sample in samples:
        cpu_call = (sample.input, sample.args, sample.kwargs)
        # Neuron copies first: a CPU call may write its arguments (inplace=True).
        memo: dict = {}
        dev_call = tree_map(lambda x: _to_neuron(x, memo), cpu_call)
        cpu_in, dev_in = argument_checks.tensor_leaves(cpu_call), argument_checks.tensor_leaves(dev_call)
        cpu_before = argument_checks.snapshot(cpu_in)
        try:
            torch.manual_seed(0)
            expected = opinfo.op(cpu_call[0], *cpu_call[1], **cpu_call[2])
        except Exception:  # noqa: BLE001 - the sample is invalid on CPU too: not ours to judge
            continue
        result.samples += 1
        try:
            dev_before = argument_checks.snapshot(dev_in)
            torch.manual_seed(0)
            actual = opinfo.op(dev_call[0], *dev_call[1], **dev_call[2])
            torch.neuron.synchronize()
            argument_checks.check_unchanged(dev_in, dev_before, cpu_in, cpu_before)
            argument_checks.check_aliasing(argument_checks.tensor_leaves(actual), dev_in,
                                           argument_checks.tensor_leaves(expected), cpu_in)
            got = _with_ties_as_cpu(opinfo, sample, tree_map(_to_cpu, actual), expected)
            try:
                torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, equal_nan=True, check_device=False)
            except AssertionError:
                if argument_checks.changed(cpu_in, cpu_before) or not _as_close_to_exact_as_cpu(
                        opinfo, cpu_call, got, expected, rtol, atol):
                    raise
                result.float64_judged += 1
            # Arguments CPU wrote (inplace=True samples) hold what CPU wrote.
            for i in set(argument_checks.changed(cpu_in, cpu_before)):
                torch.testing.assert_close(dev_in[i].cpu(), cpu_in[i], rtol=rtol, atol=atol, equal_nan=True,
                                           msg=lambda m, i=i: f"argument {i} after the call: {m}")
        except Exception as e:  # noqa: BLE001 - recorded as this op's failure
            failure = f"{type(e).__name__}: {str(e).strip()}"[:800]
            break
    result.seconds = round(time.perf_counter() - start, 2)
    result.compiled_ops = sum(dispatch_stats.compiled.values()) - compiled_before
    result.fallback_ops = {
        k: v - fallback_before.get(k, 0)
        for k, v in dispatch_stats.host_fallback.items()
        if v - fallback_before.get(k, 0) > 0
    }
    if result.samples == 0:
        result.status = "skipped"
        result.error = result.error or "no sample input runs on CPU"
    elif failure:
        result.status = "fail"
        result.error = failure
    elif result.fallback_ops:
        result.status = "fallback-pass"
    else:
        result.status = "compiled-pass"
    return result


def run(ops=None, dtypes=("float32",), max_samples: int = 3, json_path=None, resume=False, progress=True):
    """Run the OpInfos (all, or those named in ops) for each dtype they declare."""
    wanted = set(ops) if ops else None
    done: dict = {}
    if resume and json_path and os.path.exists(json_path):
        with open(json_path) as f:
            for r in json.load(f).get("results", []):
                done[(r["op"], r["dtype"])] = r
    marker = json_path + ".current" if json_path else None
    if resume and marker and os.path.exists(marker):
        # The previous run died inside this op: record it, do not run it again.
        with open(marker) as f:
            op_name, dtype_name = f.read().split("\t")
        if (op_name, dtype_name) not in done:
            crashed = OpResult(op_name, dtype_name, "fail", error="the op crashed the process")
            done[(op_name, dtype_name)] = asdict(crashed)
    results = list(done.values())
    db = [o for o in _op_db() if wanted is None or o.name in wanted]
    total = sum(1 for _ in db) * len(dtypes)
    count = 0
    for opinfo in db:
        supported = opinfo.supported_dtypes("cpu")
        for dtype_name in dtypes:
            count += 1
            dtype = DTYPES[dtype_name]
            name = opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")
            if dtype not in supported or (name, dtype_name) in done:
                continue
            if marker:
                with open(marker, "w") as f:
                    f.write(f"{name}\t{dtype_name}")
            try:
                r = run_op(opinfo, dtype, max_samples)
            except Exception as e:  # noqa: BLE001 - never stop the run
                r = OpResult(name, dtype_name, "fail", error=f"runner: {e}\n{traceback.format_exc()[-500:]}")
            results.append(asdict(r))
            if progress:
                print(f"[{count}/{total}] {name} {dtype_name}: {r.status} ({r.seconds}s)", flush=True)
            if json_path:
                _write_json(json_path, results, dtypes, max_samples)
    if marker and os.path.exists(marker):
        os.remove(marker)
    return results


def _write_json(path, results, dtypes, max_samples):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"dtypes": list(dtypes), "max_samples": max_samples, "results": results}, f, indent=1)
    os.replace(tmp, path)


def summarize(results) -> dict:
    by_dtype: dict = {}
    for r in results:
        d = by_dtype.setdefault(r["dtype"], {"compiled-pass": 0, "fallback-pass": 0, "fail": 0, "skipped": 0})
        d[r["status"]] += 1
    return by_dtype


def write_markdown(path, results, command: str, max_samples: int) -> None:
    summary = summarize(results)
    lines = [
        "# OpInfo conformance",
        "",
        "Each OpInfo of PyTorch's `op_db` runs its sample inputs on neuron and on CPU and the",
        "results are compared (float32 rtol/atol 1e-4; float16 rtol/atol 1e-3 and bfloat16 rtol",
        "1.6e-2, atol 1e-3, as PyTorch's own device-vs-CPU test at least; more where the OpInfo",
        "overrides it for the CPU comparison test; the indices of sort, argsort and topk may",
        "order equal values otherwise unless a stable sort is asked for, if they pick the same",
        "values). **compiled-pass**: every sample matched and ran as compiled",
        "executables; **fallback-pass**: matched, with some ops on the host fallback; **fail**:",
        "a mismatch or an error; **skipped**: no sample runs on CPU either, or PyTorch's own",
        "device-vs-CPU test (`TestCommon.test_compare_cpu`) skips the OpInfo or expects it to fail",
        "on every device (uninitialized memory, random streams, LAPACK sign choices); those are",
        "listed at the end.",
        "",
        "Every sample also checks that the op touched only memory it owns: each argument that",
        "CPU leaves unchanged must be bit-for-bit unchanged on neuron, and a result must share",
        "memory with an argument exactly when CPU's does; a violation fails the OpInfo.",
        "",
        f"Command: `{command}` (at most {max_samples} samples per op)  ",
        f"torchneuron {torchneuron.__version__}, torch {torch.__version__}",
        "",
        "| dtype | OpInfos | pass | compiled-pass | fallback-pass | fail | skipped | pass rate | compiled rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for dtype, d in sorted(summary.items()):
        judged = d["compiled-pass"] + d["fallback-pass"] + d["fail"]
        passed = d["compiled-pass"] + d["fallback-pass"]
        rate = f"{100 * passed / judged:.1f}%" if judged else "-"
        crate = f"{100 * d['compiled-pass'] / judged:.1f}%" if judged else "-"
        lines.append(
            f"| {dtype} | {judged + d['skipped']} | {passed} | {d['compiled-pass']} | {d['fallback-pass']} "
            f"| {d['fail']} | {d['skipped']} | {rate} | {crate} |"
        )
    judged = sorted(f"`{r['op']}` ({r['dtype']})" for r in results if r.get("float64_judged"))
    if judged:
        lines += ["", f"Passing by the float64 answer ({len(judged)}): a sample whose result differs from CPU's "
                  "beyond the tolerance passes when each differing result is within twice CPU's own error "
                  "of the answer computed in float64 (as the unit stage and the census judge): "
                  + ", ".join(judged) + "."]
    lines += ["", "## Memory ownership", ""]
    guards = "with guarded memory (`TORCHNEURON_CHECK_MEMORY=1`: guard bytes around every allocation, " \
             "checked after every launch)" if config.settings.check_memory else "without guarded memory"
    owners = [r for r in results if r["status"] == "fail" and any(m in r.get("error", "") for m in _OWNERSHIP)]
    crashed = [r for r in results if "crashed the process" in r.get("error", "")]
    lines.append(f"Run {guards}. OpInfos that wrote memory they do not own (an argument, memory past a "
                 f"tensor, a freed block) or returned an alias CPU does not: {len(owners)}"
                 + (": " + ", ".join(f"`{r['op']}`" for r in owners) if owners else " (none).")
                 + f" OpInfos that crashed the process: {len(crashed)}"
                 + (": " + ", ".join(f"`{r['op']}`" for r in crashed) if crashed else " (none)."))
    not_compared = [r for r in results if r["status"] == "skipped" and "test_compare_cpu" in r.get("error", "")]
    fallback_counts: dict = {}
    for r in results:
        for op in r.get("fallback_ops", {}):
            fallback_counts[op] = fallback_counts.get(op, 0) + 1
    if fallback_counts:
        lines += ["", "## Ops most often on the host fallback", "", "| aten op | OpInfos |", "|---|---:|"]
        for op, n in sorted(fallback_counts.items(), key=lambda kv: -kv[1])[:25]:
            lines.append(f"| `{op}` | {n} |")
    fails = [r for r in results if r["status"] == "fail"]
    if fails:
        lines += ["", "## Failures", "", "| OpInfo | dtype | first error |", "|---|---|---|"]
        for r in sorted(fails, key=lambda r: (r["op"], r["dtype"])):
            err = r["error"].replace("|", "\\|").replace("\n", " ")[:160]
            lines.append(f"| {r['op']} | {r['dtype']} | {err} |")
    if not_compared:
        lines += [
            "",
            "## Not compared, as in PyTorch's own suite",
            "",
            f"{len(not_compared)} OpInfos: " + ", ".join(sorted(f"`{r['op']}`" for r in not_compared)) + ".",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
