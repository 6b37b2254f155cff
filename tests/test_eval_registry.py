"""The shape registry and the tests generated from it (issue: evaluation system)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torchneuron

from torchneuron.eval import record_shapes, registry, stages, unit


def _rows_by_op(path):
    out = {}
    for op, sig, count, models in registry.rows(path):
        out.setdefault(op, []).append((json.loads(sig), count, models))
    return out


def test_recording_captures_layouts_ranges_scalars_counts_and_models(tmp_path):
    path = str(tmp_path / "reg.sqlite")
    x = torch.randn(4, 6).neuron()
    idx = torch.tensor([3, 0, 2]).neuron()
    with record_shapes(path, model="first"):
        for _ in range(3):
            y = x.add(1.5)
        x[:, 2:].sum(0)  # a strided view with a storage offset
        x.index_select(0, idx)
    with record_shapes(path, model="second"):
        x.add(1.5)
    rows = _rows_by_op(path)
    (add_sig, add_count, add_models), = rows["aten.add.Tensor"]
    assert add_count == 4 and add_models == ["first", "second"]
    assert add_sig["args"][0] == {"T": "float32", "size": [4, 6], "stride": [6, 1], "offset": 0, "dev": "neuron"}
    assert add_sig["args"][1] == {"f": "1.5"}
    (sum_sig, _, _), = rows["aten.sum.dim_IntList"]
    assert sum_sig["args"][0]["stride"] == [6, 1] and sum_sig["args"][0]["offset"] == 2
    assert sum_sig["args"][0]["size"] == [4, 4]
    (sel_sig, _, _), = rows["aten.index_select.default"]
    assert sel_sig["args"][2]["range"] == [0, 3]  # index values, so generated indices stay valid
    assert y.device.type == "neuron"


def test_recording_from_the_environment_covers_the_process(tmp_path):
    path = tmp_path / "env.sqlite"
    code = "import torch; x = torch.ones(3, 3, device='neuron'); print((x @ x).sum().item())"
    env = dict(os.environ, TORCHNEURON_RECORD_SHAPES=str(path), TORCHNEURON_RECORD_MODEL="tiny",
               TORCHNEURON_DEVICE_COUNT="1")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=240)
    stats = registry.stats(str(path))
    assert stats["models"] == ["tiny"]
    assert "aten.mm.default" in stats["top_ops"] and "aten.sum.default" in stats["top_ops"]


def test_registry_cli_merge_stats_export(tmp_path, capsys):
    from torchneuron import cli

    a, b, merged = (str(tmp_path / n) for n in ("a.sqlite", "b.sqlite", "m.sqlite"))
    x = torch.randn(5).neuron()
    with record_shapes(a, model="a"):
        x.exp()
    with record_shapes(b, model="b"):
        x.exp()
        x.cos()
    assert cli.main(["registry", "merge", merged, a, b]) == 0
    assert cli.main(["registry", "stats", merged, "--json"]) == 0
    out = capsys.readouterr().out
    stats = json.loads(out[out.index("{"):])
    assert stats["signatures"] == 2 and stats["calls"] == 3 and stats["models"] == ["a", "b"]
    out_file = tmp_path / "sigs.jsonl"
    assert cli.main(["registry", "export", merged, str(out_file)]) == 0
    lines = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert {(r["op"], r["count"]) for r in lines} == {("aten.exp.default", 2), ("aten.cos.default", 1)}


def _unit_failures(cases):
    results = unit.run_cases(cases)
    counts = unit.summarize(results)
    return counts, [(r.op, r.status, r.detail) for r in results if r.status in ("error", "mismatch")]


def test_unit_stage_on_the_demo_registry_passes():
    """Every signature the demo model dispatches, regenerated with random
    inputs and compared against CPU."""
    counts, failed = _unit_failures(registry.rows(stages.DEMO_REGISTRY))
    assert counts.get("pass", 0) >= 100, counts
    assert failed == []


def test_unit_stage_on_a_sample_of_the_census_registry_passes():
    """What CI runs of the census's registry (every model's signatures): each
    op's first signature (240 ops); `torchneuron eval --stage unit` runs all.
    (1000 took 25 minutes of a CI worker, cold; 400 about 4; 300 3:12.)"""
    assert stages.DEFAULT_REGISTRY == stages.CENSUS_REGISTRY
    found = registry.rows(stages.CENSUS_REGISTRY)
    assert len({m for _, _, _, models in found for m in models}) >= 300
    ops = {op for op, _, _, _ in found}
    sample = registry.sample(found, len(ops))
    assert len(sample) == len(ops) >= 240 and {op for op, _, _, _ in sample} == ops
    counts, failed = _unit_failures(sample)
    assert counts.get("pass", 0) >= 0.8 * len(sample), counts
    assert failed == []


def test_a_sample_spreads_over_ops_and_is_the_same_every_time():
    found = [("a", f"s{i}", 1, ["m"]) for i in range(5)] + [("b", "s0", 1, ["m"]), ("c", "s0", 1, ["m"])]
    assert registry.sample(found, 4) == [("a", "s0", 1, ["m"]), ("a", "s1", 1, ["m"]),
                                         ("b", "s0", 1, ["m"]), ("c", "s0", 1, ["m"])]
    assert registry.sample(found, 100) == sorted(found)


def test_the_census_records_each_models_signatures_and_a_rerun_replaces_them(tmp_path):
    from torchneuron.eval import census

    results, path = str(tmp_path / "results.jsonl"), str(tmp_path / "census.parquet")
    census.run_census(results, ["host"], models=["bert", "gpt2"], jobs=2, record=path)
    first = registry.rows(path)
    assert {m for _, _, _, models in first for m in models} == {"bert", "gpt2"}
    assert {"aten.addmm.default", "aten.embedding.default"} <= {op for op, _, _, _ in first}
    census.run_census(results, ["host"], models=["bert"], record=path, resume=False)
    assert registry.rows(path) == first  # bert's rows replaced, not counted twice


def test_unit_stage_classifies_failures_and_sets_the_exit_code(tmp_path):
    path = str(tmp_path / "bad.sqlite")
    good = {"args": [{"T": "float32", "size": [3], "stride": [1], "offset": 0, "dev": "neuron"}], "kwargs": {}}
    complex_input = {"args": [{"T": "complex32", "size": [3], "stride": [1], "offset": 0, "dev": "neuron"}],
                     "kwargs": {}}
    bad_shapes = {"args": [{"T": "float32", "size": [2, 3], "stride": [3, 1], "offset": 0, "dev": "neuron"},
                           {"T": "float32", "size": [4, 5], "stride": [5, 1], "offset": 0, "dev": "neuron"}],
                  "kwargs": {}}
    registry.merge_counts(path, {
        ("aten.neg.default", json.dumps(good), "m"): 1,
        ("aten.neg.default", json.dumps(complex_input), "m"): 1,  # no complex32 on neuron
        ("aten.mm.default", json.dumps(bad_shapes), "m"): 1,  # CPU rejects it too
    })
    status = {json.loads(r.sig)["args"][0]["T"] + r.op: r.status for r in unit.run(path)}
    assert status == {"float32aten.neg.default": "pass", "complex32aten.neg.default": "error",
                      "float32aten.mm.default": "invalid"}

    class Args:
        stage = ["unit", "representative"]
        registry = path
        ops = None
        keep_going = False
        json = str(tmp_path / "report.json")

    assert stages.run(Args) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report) == ["unit"]  # stopped at the failing stage
    assert report["unit"]["counts"] == {"pass": 1, "error": 1, "invalid": 1}


def test_comparison_catches_wrong_values_shapes_and_dtypes():
    ref = torch.arange(6.0).reshape(2, 3)
    unit._compare(ref.clone().neuron(), ref)
    with pytest.raises(AssertionError, match="Mismatched elements"):
        unit._compare((ref + 1e-2).neuron(), ref)
    with pytest.raises(AssertionError, match=r"float32\[3, 2\] vs CPU"):
        unit._compare(ref.T.contiguous().neuron(), ref)
    with pytest.raises(AssertionError, match="float64"):
        unit._compare(ref.double().neuron(), ref)


def test_a_float_mismatch_passes_only_as_close_to_the_float64_answer_as_cpu():
    """Long sums differ from CPU's float32 by accumulation order; the float64
    result decides, and a result off by more than CPU's own error still fails."""
    sig = {"args": [{"T": "float32", "size": [4, 20000], "stride": [20000, 1], "offset": 0, "dev": "neuron"},
                    {"L": [1]}], "kwargs": {}}
    op = torch.ops.aten.sum.dim_IntList
    (cpu_args, _), _ = unit.build_arguments(sig, 0)
    expected = op(*cpu_args)
    reordered = cpu_args[0].reshape(4, 100, 200).sum(2).sum(1)  # another accumulation order
    assert unit._as_close_to_exact_as_cpu(op, sig, 0, reordered, expected)
    assert not unit._as_close_to_exact_as_cpu(op, sig, 0, expected + 1e-2, expected)


def test_arbitration_judges_only_the_results_that_mismatch():
    """A result within the usual tolerance of CPU's passes as it is, even where its distance from
    float64 is more than twice CPU's (vits's convolution_backward: the weight gradient was
    arbitrated, the bias gradient, within tolerance, failed the float64 rule)."""
    sig = {"args": [{"T": "float32", "size": [4, 20000], "stride": [20000, 1], "offset": 0, "dev": "neuron"},
                    {"L": [1]}], "kwargs": {}}
    op = torch.ops.aten.var_mean.correction
    (cpu_args, _), _ = unit.build_arguments(sig, 0)
    expected = op(*cpu_args)
    exact = op(cpu_args[0].double(), [1])
    within_tolerance = expected[0] * (1 + 5e-6)  # passes unit._compare, 50x CPU's own error
    unit._compare(within_tolerance, expected[0])
    assert (within_tolerance.double() - exact[0]).abs().max() > 2 * (expected[0].double() - exact[0]).abs().max()
    assert unit._as_close_to_exact_as_cpu(op, sig, 0, (within_tolerance, exact[1].float()), expected)
    assert not unit._as_close_to_exact_as_cpu(op, sig, 0, (expected[0] + 1e-2, exact[1].float()), expected)


def test_index_copy_cases_draw_distinct_indices():
    """A repeated index leaves whichever copy lands last (nondeterministic in
    PyTorch's documentation, and a race between IREE's workers): the unit
    stage gives index_copy distinct indices within the recorded range."""
    found = [r for r in registry.rows(stages.CENSUS_REGISTRY) if r[0].startswith("aten.index_copy")]
    assert found
    for op, sig, _, _ in found:
        for seed in range(3):
            (cpu_args, _), (dev_args, _) = unit.build_arguments(json.loads(sig), seed, op)
            index = cpu_args[2]
            lo, hi = json.loads(sig)["args"][2]["range"]
            assert len(set(index.tolist())) == index.numel() and lo <= index.min() and index.max() <= hi
            assert torch.equal(dev_args[2].cpu(), index)


def test_unit_stage_writes_each_result_as_it_lands_and_resumes(tmp_path):
    """The whole registry takes hours cold: a run writes each signature's
    result as it lands, and a rerun with the same file runs only what is
    missing (a line a stopped run cut short counts as missing)."""
    path, results = str(tmp_path / "r.sqlite"), tmp_path / "unit.jsonl"
    sizes = ([3], [4, 2], [5])
    registry.merge_counts(path, {
        ("aten.neg.default", json.dumps({"args": [{"T": "float32", "size": s, "stride": [1] if len(s) == 1 else [2, 1],
                                                  "offset": 0, "dev": "neuron"}], "kwargs": {}}), "m"): 1
        for s in sizes})

    class Args:
        stage = ["unit"]
        registry = path
        ops = None
        keep_going = False
        json = str(tmp_path / "report.json")

    Args.results = str(results)
    assert stages.run(Args) == 0
    lines = results.read_text().splitlines()
    assert len(lines) == 3 and {json.loads(x)["status"] for x in lines} == {"pass"}
    assert {json.loads(x)["sig"] for x in lines} == {sig for _, sig, _, _ in registry.rows(path)}

    assert stages.run(Args) == 0  # all three already there: nothing runs, nothing is appended
    assert results.read_text().splitlines() == lines
    assert json.loads((tmp_path / "report.json").read_text())["unit"]["counts"] == {"pass": 3}

    results.write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])  # stopped mid-line
    assert stages.run(Args) == 0
    again = [x for x in results.read_text().splitlines() if x.startswith("{") and x.endswith("}")]
    assert sorted(again) == sorted(lines)
    assert json.loads((tmp_path / "report.json").read_text())["unit"]["counts"] == {"pass": 3}


def test_a_signature_too_large_for_this_host_is_reported_not_run():
    """yolos's attention scores (1.1e9 floats) would take the unit stage
    past the host's memory: such a case says so instead of being killed."""
    huge = {"args": [{"T": "float32", "size": [1 << 20, 1 << 20], "stride": [1 << 20, 1], "offset": 0,
                      "dev": "neuron"}], "kwargs": {}}
    result = unit.run_case("aten.neg.default", json.dumps(huge))
    assert result.status == "too-large" and "GiB" in result.detail
    small = dict(huge, args=[dict(huge["args"][0], size=[4, 4], stride=[4, 1])])
    assert unit.run_case("aten.neg.default", json.dumps(small)).status == "pass"


def test_a_signature_whose_results_would_not_fit_is_reported_not_run():
    """A yolos bmm with 2 MB of inputs returns 4.1 GB: the estimate counts
    results (from the op's meta kernel), not only inputs."""
    def bmm_sig(n):
        return {"args": [{"T": "float32", "size": [1, n, 1], "stride": [n, 1, 1], "offset": 0, "dev": "neuron"},
                         {"T": "float32", "size": [1, 1, n], "stride": [n, n, 1], "offset": 0, "dev": "neuron"}],
                "kwargs": {}}
    op = torch.ops.aten.bmm.default
    assert unit.result_bytes(op, bmm_sig(1 << 18)) == 4 << 36
    assert unit.working_set_bytes(bmm_sig(1 << 18)) <= 1 << 24
    result = unit.run_case("aten.bmm.default", json.dumps(bmm_sig(1 << 18)))
    assert result.status == "too-large" and "GiB" in result.detail
    assert unit.run_case("aten.bmm.default", json.dumps(bmm_sig(8))).status == "pass"


def test_running_out_of_device_memory_in_a_case_is_too_large_and_the_run_goes_on():
    """What the estimate misses (here a device capped far below the host) is
    caught in the case: the batch goes on to the next signature."""
    def neg_sig(n):
        return json.dumps({"args": [{"T": "float32", "size": [n], "stride": [1], "offset": 0, "dev": "neuron"}],
                           "kwargs": {}})
    torchneuron.set_memory_limit(torchneuron.memory_allocated() + (1 << 20))
    try:
        results = unit.run_cases([("aten.neg.default", neg_sig(1 << 20), 1, ["m"]),
                                  ("aten.neg.default", neg_sig(16), 1, ["m"])])
    finally:
        torchneuron.set_memory_limit(0)
    assert [r.status for r in results] == ["too-large", "pass"]
    assert "out of memory" in results[0].detail


def test_grouped_mm_has_a_float64_answer_for_arbitration():
    """CPU's _grouped_mm has no float64 kernel; the unit stage's float64
    answer (by groups) agrees with CPU's float32 kernel on both of the
    census's layouts, and the generated group ends cover every row."""
    a, b3, b2 = torch.randn(32, 64), torch.randn(4, 64, 32), torch.randn(64, 16)
    rows, cols = torch.tensor([8, 13, 20, 32], dtype=torch.int32), torch.tensor([10, 30, 50, 64], dtype=torch.int32)
    for right, ends in ((b3, rows), (b2, cols)):
        exact = unit._grouped_mm_float64(a.double(), right.double(), ends)
        torch.testing.assert_close(exact.float(), torch._grouped_mm(a, right, ends), rtol=1e-4, atol=1e-4)
    sig = {"args": [{"T": "float32", "size": [32, 64], "stride": [64, 1], "offset": 0, "dev": "neuron"},
                    {"T": "float32", "size": [4, 64, 32], "stride": [2048, 32, 1], "offset": 0, "dev": "neuron"},
                    {"T": "int32", "size": [4], "stride": [1], "offset": 0, "dev": "neuron", "range": [3, 32]}],
           "kwargs": {}}
    (cpu_args, _), _ = unit.build_arguments(sig, 0, "aten._grouped_mm.default")
    ends = cpu_args[2].tolist()
    assert ends == sorted(ends) and ends[-1] == 32


def test_copy_from_and_masked_index_put_get_a_cpu_answer():
    """_copy_from has no CPU kernel (copy_ hands it a new backend): its CPU
    answer is copy_'s. A boolean mask putting values gets exactly as many set
    elements as the values have rows (a random mask: CPU rejects the inputs)."""
    copy = {"args": [{"T": "int32", "dev": "neuron", "offset": 0, "range": [1, 5], "size": [75], "stride": [0]},
                     {"T": "int32", "dev": "neuron", "offset": 7, "range": [0, 0], "size": [75], "stride": [1]}],
            "kwargs": {}}
    assert unit.run_case("aten._copy_from.default", json.dumps(copy)).status == "pass"
    put = {"args": [{"T": "float32", "dev": "neuron", "offset": 0, "size": [64, 32], "stride": [32, 1]},
                    {"L": [{"T": "bool", "dev": "neuron", "offset": 0, "range": [0, 1], "size": [64], "stride": [1]}]},
                    {"T": "float32", "dev": "neuron", "offset": 0, "size": [57, 32], "stride": [32, 1]}, True, True],
           "kwargs": {}}
    (cpu_args, _), (dev_args, _) = unit.build_arguments(put, 0, "aten._index_put_impl_.default")
    assert int(cpu_args[1][0].sum()) == 57 and torch.equal(dev_args[1][0].cpu(), cpu_args[1][0])
    assert unit.run_case("aten._index_put_impl_.default", json.dumps(put)).status == "pass"


def test_fused_lstm_cell_signatures_get_a_cpu_answer():
    """_thnn_fused_lstm_cell and its backward have CUDA kernels only: their
    CPU answers come from CPU's lstm_cell and its autograd (12 of encodec's
    signatures were invalid). The answers agree with the formulas of CUDA's
    kernels the lowering uses, and a backward's state is made consistent."""
    from torchneuron.eval import rnn_references
    from torchneuron.lowering.rules import rnn_cells

    gen = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=gen)

    ig, hg, cx, b1, b2 = r(3, 64), r(3, 64), r(3, 16), r(64), r(64)
    forward = rnn_references.fused_lstm_cell(ig, hg, cx, b1, b2)
    for mine, kernels in zip(forward, rnn_cells.fused_lstm_cell(ig, hg, cx, b1, b2)):
        torch.testing.assert_close(mine, kernels)
    grads = (r(3, 16), r(3, 16), cx, forward[1], forward[2], True)
    for mine, kernels in zip(rnn_references.fused_lstm_cell_backward(*grads), rnn_cells.fused_lstm_cell_backward(*grads)):
        torch.testing.assert_close(mine, kernels, rtol=1e-4, atol=1e-5)

    def t(size, offset=0):
        return {"T": "float32", "dev": "neuron", "offset": offset, "size": size, "stride": [size[-1], 1][-len(size):]}

    cases = [
        ("aten._thnn_fused_lstm_cell.default", {"args": [t([2, 64]), t([2, 64]), t([2, 16], 32), t([64]), t([64])], "kwargs": {}}),
        ("aten._thnn_fused_lstm_cell_backward_impl.default",
         {"args": [t([2, 16]), t([2, 16]), t([2, 16], 32), t([2, 16]), t([2, 64]), True], "kwargs": {}}),
    ]
    results = unit.run_cases([(op, json.dumps(sig), 1, ["encodec"]) for op, sig in cases])
    assert [r.status for r in results] == ["pass", "pass"], [r.detail for r in results]


def test_generic_convolution_slots_and_integer_histc_get_a_cpu_answer():
    """convolution_overrideable and convolution_backward_overrideable (what
    PyTorch calls on a backend without a kernel of its own; recorded from
    xcodec) have no CPU kernel: their answers are the convolution's. An
    integer histc's is the float histc's, as on the device."""

    def t(size):
        stride = [1] * len(size)
        for i in range(len(size) - 2, -1, -1):
            stride[i] = stride[i + 1] * size[i + 1]
        return {"T": "float32", "dev": "neuron", "offset": 0, "size": size, "stride": stride}

    cases = [
        # and histc of integers (deepseek_v4's router), which CUDA counts and CPU does not
        ("aten.histc.default", {"args": [{"T": "int32", "dev": "neuron", "offset": 0, "range": [0, 3], "size": [32],
                                          "stride": [1]}, 4, 0, 3], "kwargs": {}}),
        ("aten.convolution_backward_overrideable.default",
         {"args": [t([2, 8, 1, 200]), t([2, 16, 1, 40]), t([16, 8, 1, 10]), {"L": [1, 5]}, {"L": [0, 3]},
                   {"L": [1, 1]}, True, {"L": [0, 1]}, 1, {"L": [True, True, True]}], "kwargs": {}}),
        ("aten.convolution_overrideable.default",
         {"args": [t([2, 3, 8, 8]), t([4, 3, 3, 3]), t([4]), {"L": [2, 2]}, {"L": [1, 1]}, {"L": [1, 1]}, False,
                   {"L": [0, 0]}, 1], "kwargs": {}}),
    ]
    results = unit.run_cases([(op, json.dumps(sig), 1, ["xcodec"]) for op, sig in cases])
    assert [r.status for r in results] == ["pass", "pass", "pass"], [r.detail for r in results]


def test_argument_snapshots_take_one_element_tensors_of_any_stride():
    """A one-element tensor counts as contiguous whatever its stride (a
    registry signature's int64 [1] with stride 3 ended the whole-registry run
    when its bytes were viewed); a change to it is still found."""
    from torchneuron.eval import argument_checks

    t = torch.empty_strided((1,), (3,), dtype=torch.int64).fill_(7)
    before = argument_checks.snapshot([t])
    assert argument_checks.changed([t], before) == []
    t.fill_(8)
    assert argument_checks.changed([t], before) == [0]


def test_float8_signatures_are_recorded_and_pass_the_unit_stage(tmp_path):
    """The registry records float8 calls (casts, _scaled_mm) like any other,
    and the unit stage regenerates and compares them."""
    path = str(tmp_path / "float8.sqlite")
    x, w = torch.randn(32, 64).neuron(), torch.randn(48, 64).neuron()
    with record_shapes(path, model="float8"):
        q, qw = x.to(torch.float8_e4m3fn), w.to(torch.float8_e5m2)
        one = torch.ones((), device="neuron")
        torch._scaled_mm(q, qw.t(), one, one, out_dtype=torch.bfloat16)
        q.to(torch.bfloat16)
    rows = registry.rows(path)
    assert {"aten._to_copy.default", "aten._scaled_mm.default"} <= {op for op, *_ in rows}
    counts, failed = _unit_failures(rows)
    assert failed == [] and counts.get("pass", 0) == len(rows), counts
