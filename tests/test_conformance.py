"""The OpInfo conformance runner on the fixed CI subset (ops models use most)."""

import json
import os
import subprocess
import sys

import pytest

import torchneuron

from torchneuron.eval import conformance


def test_ci_subset_passes_under_guarded_memory(tmp_path):
    """The ops models use most: results, untouched arguments, aliasing, and no
    write outside any op's memory (TORCHNEURON_CHECK_MEMORY=1, set before the
    first allocation: a process of its own). Guards poke host memory around
    allocations: under the discrete model (which has none to poke) the
    subset runs with its result, argument and aliasing checks only."""
    assert len(set(conformance.CI_OPS)) >= 60
    report = tmp_path / "conformance.json"
    md = tmp_path / "conformance.md"
    guarded = not torchneuron._C.discrete_memory()
    env = dict(os.environ, TORCHNEURON_DEVICE_COUNT="1")
    if guarded:
        env["TORCHNEURON_CHECK_MEMORY"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torchneuron.cli", "conformance", "--ci", "--max-samples", "2",
                           "--json", str(report), "--markdown", str(md)], env=env, capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(report.read_text())["results"]
    by_status = {}
    for r in results:
        by_status.setdefault(r["status"], []).append(r["op"])
    assert not by_status.get("fail"), [r for r in results if r["status"] == "fail"]
    judged = len(results) - len(by_status.get("skipped", []))
    assert judged >= 60
    assert len(by_status.get("compiled-pass", [])) >= 0.9 * judged
    # The Markdown report renders and says the run was guarded and clean.
    text = md.read_text()
    assert "| float32 |" in text
    assert not guarded or "Run with guarded memory" in text and "own (an argument, memory past a tensor, a freed block) " \
        "or returned an alias CPU does not: 0 (none)." in text


def test_resume_skips_done_ops_and_records_a_crash(tmp_path):
    report = tmp_path / "c.json"
    first = conformance.run(ops=["abs"], max_samples=1, json_path=str(report), progress=False)
    assert [r["status"] for r in first] == ["compiled-pass"]
    # A run that died inside "neg" left its marker behind.
    (tmp_path / "c.json.current").write_text("neg\tfloat32")
    again = conformance.run(ops=["abs", "neg"], max_samples=1, json_path=str(report), resume=True, progress=False)
    status = {r["op"]: r for r in again}
    assert status["abs"]["seconds"] == first[0]["seconds"]  # kept, not rerun
    assert status["neg"]["status"] == "fail" and "crashed" in status["neg"]["error"]


@pytest.mark.op_mode  # compiled at once (adaptive eager's first run is the host path: CPU's own answer)
def test_half_precision_grid_sample_passes_by_the_float64_answer(tmp_path):
    # CPU's bfloat16/float16 grid_sample rounds its sampling coordinates and picks other
    # pixels; neuron's result is closer to the float64 answer, and passes on that account.
    results = conformance.run(ops=["grid_sampler_2d"], dtypes=("bfloat16",), max_samples=2, progress=False)
    assert [(r["status"], r["float64_judged"] > 0) for r in results] == [("compiled-pass", True)]


def test_the_float64_judgment_fails_a_result_further_from_it_than_cpus():
    import torch

    class Op:  # the part of an OpInfo the judgment calls
        op = staticmethod(torch.sin)

    x = torch.linspace(-3, 3, 50, dtype=torch.bfloat16)
    expected, exact = torch.sin(x), torch.sin(x.double())
    tolerance = conformance.TOLERANCES[torch.bfloat16]
    assert conformance._as_close_to_exact_as_cpu(Op, (x, (), {}), exact.to(torch.bfloat16), expected, *tolerance)
    wrong = exact.to(torch.bfloat16) + 0.05
    assert not conformance._as_close_to_exact_as_cpu(Op, (x, (), {}), wrong, expected, *tolerance)


def test_the_float64_judgment_does_not_excuse_another_dtype():
    import torch

    class Op:
        op = staticmethod(torch.sin)

    x = torch.linspace(-3, 3, 50, dtype=torch.bfloat16)
    expected, exact = torch.sin(x), torch.sin(x.double())
    assert not conformance._as_close_to_exact_as_cpu(Op, (x, (), {}), exact.float(), expected,
                                                      *conformance.TOLERANCES[torch.bfloat16])


def test_the_float64_judgment_does_not_excuse_a_mismatching_number():
    import torch

    class Op:  # a result with a tensor that matches and a number that does not
        op = staticmethod(lambda x: (torch.sin(x), float(x.sum())))

    x = torch.linspace(-3, 3, 50)
    expected = Op.op(x)
    got = (expected[0].clone(), expected[1] + 1.0)
    assert not conformance._as_close_to_exact_as_cpu(Op, (x, (), {}), got, expected, 1e-4, 1e-4)
