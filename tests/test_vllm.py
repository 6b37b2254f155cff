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


def _vllm(model, *scenarios, cpu=False, timeout=900, **options) -> dict:
    # A server's default: an op whose executable is still compiling runs on
    # the host meanwhile (the suite's conftest waits for each compile).
    env = dict(os.environ, VLLM_RUN_OPTIONS=json.dumps(options), TORCHNEURON_COMPILE_WAIT="0")
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
    with vLLM's error and the engine goes on serving. No op on the host path."""
    path, expected = llama
    got = _vllm(path, "offline", "continuous", "too_long")
    assert got["platform"] == "NeuronPlatform"
    assert got["greedy"] == expected
    assert got["greedy_again"] == expected
    assert got["continuous"] == expected and got["steps"] > 8 + 1
    assert "maximum context length" in got["refused"]
    assert got["after_refusal"] == expected[:2]
    assert got["host_path_ops"] == [], got["not_compiled"]
    cpu = _vllm(path, "offline", cpu=True)
    assert cpu["platform"] == "CpuPlatform" and cpu["greedy"] == expected


def test_a_kv_cache_too_small_for_the_batch_preempts_and_finishes_every_request(llama):
    # 2 layers x 2 KV heads x (K, V) x 32 x 4 bytes = 1 KiB a token: 24
    # blocks of 16 tokens; the 16 requests need more than that at once.
    path, expected = llama
    prompts = tiny_models.prompts(16)
    blocks_needed = sum(-(-(len(p.split()) + 8) // 16) for p in prompts)
    assert blocks_needed > 24
    got = _vllm(path, "offline", kv_cache_memory_bytes=24 * 16 * 1024)
    assert got["greedy"] == expected and got["greedy_again"] == expected


def test_qwen3_without_prefix_caching_matches_huggingface(tmp_path):
    path = tiny_models.build("qwen3", tmp_path / "tiny_qwen3")
    expected = _huggingface(path, tiny_models.prompts(16))
    got = _vllm(path, "offline", enable_prefix_caching=False)
    assert got["platform"] == "NeuronPlatform"
    assert got["greedy"] == expected and got["greedy_again"] == expected
    assert got["host_path_ops"] == [], got["not_compiled"]
