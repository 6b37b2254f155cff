"""The model census, the representative set and the model stages (issue:
evaluation system). Real Hugging Face architectures, built offline."""

import json

import pytest
import torch

from torchneuron.eval import census, census_report, stages


def test_census_enumerates_hundreds_of_architectures_and_builds_them_offline():
    archs = {a[0]: a for a in census.architectures()}
    assert len(archs) >= 500
    assert archs["gpt2"][2] == "causal-lm" and archs["vit"][2] == "image-classification"
    model, config = census.build("llama", archs["llama"][1])
    inputs = census.inputs_for(model, config)
    feats = census.features(model, config, archs["llama"][2], inputs)
    assert feats["structure"] == "decoder" and feats["positional"] == "rotary" and feats["modality"] == "text"
    assert sum(p.numel() for p in model.parameters()) < census.MAX_PARAMETERS


def _run(tmp_path, models, modes=("host",), timeout=600.0, **kw):
    return census.run_census(str(tmp_path / "results.jsonl"), list(modes), models=models, jobs=2,
                             timeout=timeout, **kw)


def test_unbuildable_models_are_counted_with_a_reason_and_hangs_time_out(tmp_path):
    # dinat needs the optional natten package: "not buildable", never a backend failure.
    results = _run(tmp_path, ["dinat"])
    assert results["dinat"]["status"] == "not-buildable" and "natten" in results["dinat"]["reason"]
    # Raised by the input rules in a worker process: not buildable too, not a crash.
    results = _run(tmp_path, ["decision_transformer"])
    assert results["decision_transformer"]["status"] == "not-buildable", results["decision_transformer"]
    # A model that cannot finish in time is killed and recorded; the run goes on.
    results = _run(tmp_path, ["bert"], timeout=1.0)
    assert results["bert"]["status"] == "timeout"
    # Resumable: what is recorded is not run again.
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 3
    _run(tmp_path, ["dinat", "bert"])
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3


def test_representative_stage_runs_models_compiled_against_cpu(tmp_path, monkeypatch):
    """What CI runs: the three quickest models of the committed representative set, forward and
    backward, compiled, against CPU, under guarded memory (no op writes outside its
    memory), several models one after another in each worker process."""
    monkeypatch.setenv("TORCHNEURON_CHECK_MEMORY", "1")
    with open(census_report.REPRESENTATIVE) as f:
        chosen = json.load(f)["ci_models"][:3]
    assert len(chosen) == 3

    class Args:
        stage = ["representative"]
        modes = ["compile"]
        models = chosen
        limit = None
        jobs = 2
        models_per_process = 2
        timeout = 900
        results = str(tmp_path / "rep.jsonl")
        fresh = True
        baseline = None
        keep_going = False
        report = False
        json = str(tmp_path / "stage.json")
        registry = None
        ops = None

    assert stages.run(Args) == 0, (tmp_path / "stage.json").read_text()
    results = census.load_results(Args.results)
    assert set(results) == set(chosen)
    for r in results.values():
        assert r["status"] == "ran" and census_report.model_passes(r, "compile"), r
        assert r["check_memory"] is True
    assert max(len(r.get("models_in_process", [r["model"]])) for r in results.values()) == 2


def test_representative_selection_is_a_greedy_cover_of_features_and_ops():
    def result(ops, **features):
        return {"status": "ran", "features": features, "ops": ops, "parameters": 10}

    results = {
        "a": result(["x", "y"], modality="text"),
        "b": result(["y", "z", "w"], modality="text"),
        "c": result(["x"], modality="vision"),
        "d": result([], modality="text"),
        "e": {"status": "not-buildable", "reason": "no"},
    }
    rep = census_report.select_representative(results)
    assert rep["models"] == ["b", "c"]  # a adds nothing once b and c are in
    assert rep["op_coverage"] == 1.0
    assert census_report.select_representative(results, max_models=1)["op_coverage"] == 0.75


def test_report_says_what_newly_passes_and_what_regressed(tmp_path):
    def ran(ok):
        return {"status": "ran", "features": {"modality": "text"},
                "modes": {"compile": {"forward": "pass" if ok else "error", "error": "RuntimeError: boom"}}}

    previous = {"m1": ran(False), "m2": ran(True)}
    now = {"m1": ran(True), "m2": ran(False), "m3": {"status": "not-buildable", "reason": "ImportError: x"}}
    summary = census_report.summarize(now, previous)
    assert summary["changes"]["compile"] == {"newly_passing": ["m1"], "regressed": ["m2"]}
    assert summary["built"] == 2 and summary["status"]["not-buildable"] == 1
    assert summary["modes"]["compile"]["top_causes"][0][:2] == ["error: RuntimeError: boom", 1]
    md = tmp_path / "c.md"
    census_report.write_markdown(str(md), summary, census_report.select_representative(now), "cmd")
    text = md.read_text()
    assert "regressed 1 (m2)" in text and "modality=text" in text


@pytest.mark.parametrize("model", ["gpt2"])
def test_one_model_matches_cpu_on_the_host_fallback_too(model):
    arch = {a[0]: a for a in census.architectures()}[model]
    result = census.run_one(*arch, ["host"])
    assert result["status"] == "ran" and census_report.model_passes(result, "host"), result
    assert "aten.embedding.default" in result["ops"]


def test_models_the_default_tiny_config_breaks_on_cpu_get_a_deeper_or_rope_fixed_variant():
    # Multimodal RoPE splits the rotary dims into sections the tiny head must hold;
    # the default tiny config fails on CPU, the mrope variant runs and matches.
    archs = {a[0]: a for a in census.architectures()}
    result = census.run_one(*archs["qwen2_vl_text"], ["host"])
    assert result["status"] == "ran" and result["variant"] == {"mrope": True}
    assert result["modes"]["host"]["forward"] == "pass"


def test_guarded_runs_merge_into_the_census_and_are_reported(tmp_path):
    """A guarded compiled run (one model per process, then several per process)
    merges into a host census; the report counts runs, violations and crashes."""
    base = tmp_path / "base.jsonl"
    run1 = tmp_path / "one.jsonl"
    run2 = tmp_path / "batch.jsonl"
    host = {"forward": "pass", "backward": "pass"}
    base.write_text("\n".join(json.dumps(r) for r in [
        {"model": "a", "status": "ran", "modes": {"host": host}, "features": {}},
        {"model": "b", "status": "ran", "modes": {"host": host}, "features": {}},
    ]) + "\n")
    run1.write_text("\n".join(json.dumps(r) for r in [
        {"model": "a", "status": "ran", "check_memory": True, "modes": {"compile": dict(host)}},
        {"model": "b", "status": "crash", "reason": "the worker exited with -6"},
    ]) + "\n")
    run2.write_text(json.dumps({"model": "a", "status": "ran", "check_memory": True, "models_in_process": ["a", "b"],
                                "modes": {"compile": {"forward": "error",
                                                      "error": "NeuronMemoryError: ... wrote outside"}}}) + "\n")
    merged = tmp_path / "merged.jsonl"
    assert census_report.merge_mode_results(str(base), str(run1), str(merged), guarded=True) == 2
    assert census_report.merge_mode_results(str(merged), str(run2), str(merged), guarded=True) == 1
    summary = census_report.summarize(census.load_results(str(merged)))
    g = summary["guarded"]["compile"]
    assert g["models"] == 2 and g["several_per_process"] == 1 and g["runs"] == 3 and g["passing"] == 1
    assert g["violations"] == ["a"] and g["crashes"] == ["b"]
    md = tmp_path / "census.md"
    census_report.write_markdown(str(md), summary, census_report.select_representative(census.load_results(str(merged))),
                                 "test")
    assert "Guard violations: 1 (a); crashed or hung workers: 1 (b)." in md.read_text()


# -- the input rules (census_inputs): CPU only, one tiny model each --------------

def _reference_runs(model_type):
    """The census's CPU reference for one model: (inputs, outputs)."""
    arch = {a[0]: a for a in census.architectures()}[model_type]
    model, config = census.build(model_type, arch[1])
    inputs = census.inputs_for(model, config)
    trains = any(p.requires_grad for p in model.parameters())
    outs, _ = census._run(model, inputs, "cpu", trains)
    assert outs
    return inputs, config


def test_a_dual_text_and_vision_encoder_gets_both_inputs():
    inputs, config = _reference_runs("clipseg")
    assert inputs["input_ids"].shape == (census.BATCH, census.SEQ)
    size = config.vision_config.image_size
    assert inputs["pixel_values"].shape == (census.BATCH, 3, size, size)


def test_audio_models_get_mel_features_of_their_bin_count_in_their_layout():
    # A Whisper-style encoder reads (batch, bins, frames), frames from its position table.
    inputs, config = _reference_runs("qwen2_audio_encoder")
    assert inputs["input_features"].shape == (census.BATCH, config.num_mel_bins, 2 * config.max_source_positions)
    # A conformer with a Conv2d subsampler reads (batch, frames, bins), bins from its encoder config;
    # an encoder-decoder gets decoder inputs.
    inputs, config = _reference_runs("canary")
    assert inputs["input_features"].shape[-1] == config.encoder_config.num_mel_bins != 80
    assert inputs["decoder_input_ids"].shape == (census.BATCH, 4)


def test_an_encoder_decoder_on_raw_audio_gets_decoder_inputs():
    inputs, _ = _reference_runs("moonshine")
    assert set(inputs) == {"input_values", "decoder_input_ids"}


def test_a_patch_sequence_vision_tower_gets_patches_and_their_grid():
    inputs, config = _reference_runs("qwen2_5_vl_vision")
    grid = inputs["grid_thw"]
    assert grid.shape == (census.BATCH, 3) and (grid[:, 1:] % config.spatial_merge_size == 0).all()
    c, t, p = config.in_channels, config.temporal_patch_size, config.patch_size
    assert inputs["hidden_states"].shape == (int(grid.prod(-1).sum()), c * t * p * p)


def test_a_hybrid_keeps_an_attention_layer_and_its_mamba_heads_fit():
    _, config = _reference_runs("bamba")
    assert "full_attention" in config.layers_block_type
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size


def test_a_windowed_backbone_gets_windows_every_stage_holds():
    _, config = _reference_runs("swin")
    last_grid = config.image_size // config.patch_size // 2 ** (len(config.depths) - 1)
    assert last_grid >= config.window_size


def test_an_image_size_per_side_keeps_the_default_patch_grid():
    # YOLOS's [512, 864] at a 4-pixel patch made 16485 tokens (4.35 GB of attention scores a layer).
    import transformers

    default = transformers.YolosConfig()
    inputs, config = _reference_runs("yolos")
    grid = [s // config.patch_size for s in inputs["pixel_values"].shape[-2:]]
    assert config.patch_size < default.patch_size
    assert grid == [s // default.patch_size for s in default.image_size]


def test_keypoint_matchers_get_image_pairs_and_patch_grid_towers_their_layout():
    inputs, _ = _reference_runs("lightglue")
    assert inputs["pixel_values"].shape[:2] == (census.BATCH, 2)
    inputs, _ = _reference_runs("siglip2_vision_model")
    n = inputs["pixel_values"].shape[1]
    assert inputs["pixel_attention_mask"].shape == (census.BATCH, n)
    assert (inputs["spatial_shapes"].prod(-1) == n).all()


def test_a_router_initialized_to_zeros_gets_random_weights():
    """Equal scores would let top-k pick experts in an order PyTorch leaves open."""
    arch = {a[0]: a for a in census.architectures()}["afmoe"]
    model, config = census.build("afmoe", arch[1])
    routers = [m for n, m in model.named_modules() if n.endswith("router.gate")]
    assert routers and all(r.weight.abs().min() > 0 for r in routers)


def test_zero_matrices_get_random_values_and_zero_vectors_stay():
    """InstructBLIP's query tokens start as zeros (a LayerNorm with no variance
    follows); biases initialized to zeros are as a trained model could have them."""
    arch = {a[0]: a for a in census.architectures()}["instructblip"]
    model, config = census.build("instructblip", arch[1])
    assert model.query_tokens.abs().min() > 0
    biases = [p for n, p in model.named_parameters() if n.endswith("bias") and p.dim() == 1]
    assert any(not b.any() for b in biases)


def test_the_comparison_tolerance_scales_with_the_tensor():
    import torch

    big = torch.randn(64) * 1e12
    assert census._compare([big * (1 + 1e-6)], [big], "gradient") is None  # float32 summation order
    wrong = big.clone()
    wrong[3] = -wrong[3]
    assert census._compare([wrong], [big], "gradient").startswith("gradient[0]")
    small = torch.linspace(-1, 1, 64)
    assert census._compare([small + 3e-3], [small], "output") is not None  # unit scale: 1e-3 as before


def test_a_crashed_or_hung_worker_is_a_failure_of_every_mode_it_was_to_run():
    """`eval` said "0 new failures" of a census whose yolos worker the kernel
    killed: only models that ran were counted."""
    ok = {"status": "ran", "modes": {"compile": {"forward": "pass", "backward": "pass"}}}
    bad = {"status": "ran", "modes": {"compile": {"forward": "mismatch"}}}
    results = {
        "crashed": {"status": "crash", "reason": "the worker exited with -9"},
        "hung": {"status": "timeout", "reason": "no result within 900 s"},
        "fine": ok,
        "wrong": bad,
        "cpu-fails": {"status": "reference-error", "reason": "RuntimeError"},
        "absent": {"status": "not-buildable", "reason": "ImportError"},
    }
    new, known = stages.classify_failures(results, ["compile"], {})
    assert [(m, mode) for m, mode, _ in new] == [("crashed", "compile"), ("hung", "compile"), ("wrong", "compile")]
    assert new[0][2] == {"status": "crash", "reason": "the worker exited with -9"} and known == []
    # Known where the baseline failed there too (or lost its worker); new where it passed.
    baseline = {"crashed": {"status": "crash"}, "hung": ok, "wrong": bad}
    new, known = stages.classify_failures(results, ["compile"], baseline)
    assert [m for m, _, _ in new] == ["hung"] and [m for m, _, _ in known] == ["crashed", "wrong"]


class _ThroughDenormals(torch.nn.Module):
    """Its output and gradients pass through float32 denormals (1e-39)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return (self.linear(x) * 1e-39 * 1e38,)


def test_a_mismatch_from_flushed_denormals_is_given_that_cause(monkeypatch):
    """IREE's CPU runtime flushes float32 denormals to zero; PyTorch's CPU kernels keep them.
    A model whose values pass through denormals differs from CPU, and the census says why
    (by CPU's answer with denormals flushed), without calling it a pass."""
    torch.manual_seed(0)
    model = _ThroughDenormals()
    monkeypatch.setattr(census, "build", lambda *a: (model, None))
    monkeypatch.setattr(census, "inputs_for", lambda m, c: {"x": torch.randn(4, 8)})
    monkeypatch.setattr(census, "features", lambda *a: {})
    threads = torch.get_num_threads()
    result = census.run_one("through_denormals", "X", "base", ["compile"])
    entry = result["modes"]["compile"]
    assert entry["forward"] == "mismatch" and entry["forward_cause"] == census.DENORMALS, entry
    assert entry["backward"] == "mismatch" and entry["backward_cause"] == census.DENORMALS, entry
    # CPU's own settings are back: its thread count, and denormals kept
    assert torch.get_num_threads() == threads and (torch.full((1,), 1e-39) * 1.0).item() != 0
    summary = census_report.summarize({"through_denormals": result})
    assert summary["modes"]["compile"]["top_causes"][0][0] == "mismatch: " + census.DENORMALS[:110]


def _census_with_an_error(monkeypatch, model, input_name, device_off):
    """The census of `model` (one [4, 8] input) with 0.01 added to the float32 outputs
    `device_off` computes: a less accurate side, simulated."""
    monkeypatch.setattr(census, "build", lambda *a: (model, None))
    monkeypatch.setattr(census, "inputs_for", lambda m, c: {input_name: torch.randn(4, 8)})
    monkeypatch.setattr(census, "features", lambda *a: {})
    run = census._run

    def run_with_an_error(model, inputs, device, backward, compiled=False):
        outs, grads = run(model, inputs, device, backward, compiled)
        if device == device_off and outs[0].dtype == torch.float32:
            outs = [o + 0.01 for o in outs]
        return outs, grads

    monkeypatch.setattr(census, "_run", run_with_an_error)


@pytest.mark.parametrize("less_accurate", ["cpu", "neuron"])
def test_a_mismatch_is_judged_by_the_float64_answer(monkeypatch, less_accurate):
    """Where neuron and CPU differ, the float64 answer decides, as in the unit stage: a neuron
    result as close to it as CPU's float32 passes (and says so), a less accurate one stays a
    mismatch. The less accurate side is simulated by an error on its outputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    _census_with_an_error(monkeypatch, model, "input", less_accurate)
    entry = census.run_one("linear", "X", "base", ["compile"])["modes"]["compile"]
    if less_accurate == "cpu":
        assert entry["forward"] == "pass" and "from float64" in entry["forward_arbitrated"], entry
        result = {"model": "linear", "status": "ran", "modes": {"compile": entry}, "features": {}}
        assert census_report.summarize({"linear": result})["modes"]["compile"]["arbitrated"] == ["linear"]
    else:
        assert entry["forward"] == "mismatch" and "forward_arbitrated" not in entry, entry
    assert entry["backward"] == "pass", entry


def test_float64_rule_passes_only_results_as_close_as_cpus():
    exact = torch.linspace(-1, 1, 50, dtype=torch.float64)
    cpu = exact.float() + 1e-2  # past the census's tolerance
    assert census._closer_to_float64([exact.float()], [cpu], [exact], "output")
    assert census._closer_to_float64([cpu + 3e-2], [cpu], [exact], "output") is None  # over twice CPU's error
    # both far from float64 (top-k ties picking other elements): not a rounding difference
    assert census._closer_to_float64([exact.float() + 5], [exact.float() - 5], [exact], "output") is None
    inf = exact.clone()
    inf[3] = float("inf")
    assert census._closer_to_float64([exact.float()], [cpu], [inf], "output") is None  # inf where float64 has one


def test_a_model_that_does_not_run_in_float64_keeps_its_mismatch(monkeypatch):
    """No float64 answer (the model builds a float32 tensor of its own): the mismatch is reported
    as it is, not as an error and not as a pass."""

    class Float32Only(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            return (self.linear(x) @ torch.ones(8, 8, device=x.device),)

    torch.manual_seed(0)
    model = Float32Only()
    _census_with_an_error(monkeypatch, model, "x", "neuron")
    with pytest.raises(RuntimeError):  # what the census meets
        census._float64_reference(model, {"x": torch.randn(4, 8)}, model.state_dict(), False)
    entry = census.run_one("float32_only", "X", "base", ["compile"])["modes"]["compile"]
    assert entry["forward"] == "mismatch" and "error" not in entry, entry
    assert "forward_arbitrated" not in entry and "forward_cause" not in entry, entry
    assert entry["backward"] == "pass", entry
