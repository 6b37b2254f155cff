"""Runs vLLM scenarios in a process of their own and prints their results as
one JSON line (tests/test_vllm.py starts it: vLLM chooses its platform once
per process, and VLLM_TARGET_DEVICE=cpu gives the CPU reference).

    python tests/vllm_run.py MODEL_DIR SCENARIO [SCENARIO ...]
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MAX_TOKENS = 8


def _tokens(outputs) -> list:
    return [list(o.outputs[0].token_ids) for o in outputs]


def offline(llm, prompts) -> dict:
    """The batch at once, then again (prefix-cache hits the second time)."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = _tokens(llm.generate(prompts, greedy, use_tqdm=False))
    again = _tokens(llm.generate(prompts, greedy, use_tqdm=False))
    return {"greedy": first, "greedy_again": again}


def continuous(llm, prompts) -> dict:
    """Prompts added one or two at a time while earlier ones decode."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    pending = list(enumerate(prompts))
    done, steps = {}, 0
    while pending or engine.has_unfinished_requests():
        for _ in range(2 if steps % 3 == 0 else 0):
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(str(i), prompt, greedy)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = list(out.outputs[0].token_ids)
        steps += 1
    return {"continuous": [done[i] for i in range(len(prompts))], "steps": steps}


def too_long(llm, prompts) -> dict:
    """A prompt past the context is refused; the engine goes on serving."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    words = " ".join(["w7"] * (llm.llm_engine.model_config.max_model_len + 10))
    try:
        llm.generate([words], greedy, use_tqdm=False)
        refused = None
    except Exception as e:  # vLLM's own error for an over-long prompt
        refused = f"{type(e).__name__}: {e}"
    after = _tokens(llm.generate(prompts[:2], greedy, use_tqdm=False))
    return {"refused": refused, "after_refusal": after}


def seeded(llm, prompts) -> dict:
    """Sampling with temperature, top-k and top-p and a seed per request, twice
    (the same seeds draw the same tokens), and once with the seeds of the
    first half only (the others draw from the engine's generator)."""
    from vllm import SamplingParams

    def params(i, seed=True):
        return SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=MAX_TOKENS, ignore_eos=True,
                              seed=1000 + i if seed else None)

    first = _tokens(llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False))
    again = _tokens(llm.generate(prompts, [params(i) for i in range(len(prompts))], use_tqdm=False))
    half = len(prompts) // 2
    mixed = _tokens(llm.generate(prompts, [params(i, i < half) for i in range(len(prompts))], use_tqdm=False))
    return {"seeded": first, "seeded_again": again, "seeded_half": mixed[:half]}


def cancelled(llm, prompts) -> dict:
    """A request aborted while it decodes (what the server does when a client
    drops a stream) gives its KV-cache blocks back; the engine serves on."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    kv = engine.engine_core.engine_core.scheduler.kv_cache_manager  # in-process engine core
    free_before = kv.block_pool.get_num_free_blocks()
    engine.add_request("long", prompts[-1], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    generated = 0
    while generated < 5:
        for out in engine.step():
            generated = len(out.outputs[0].token_ids)
    free_while_decoding = kv.block_pool.get_num_free_blocks()
    engine.abort_request(["long"])
    engine.step()
    after = _tokens(llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                                 use_tqdm=False))
    return {"free_blocks": [free_before, free_while_decoding, kv.block_pool.get_num_free_blocks()],
            "unfinished_after_abort": engine.has_unfinished_requests(), "after_abort": after}


SCENARIOS = {"offline": offline, "continuous": continuous, "too_long": too_long, "seeded": seeded,
             "cancelled": cancelled}


def main(argv) -> None:
    model, scenarios = argv[0], argv[1:]
    from vllm import LLM

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    from torchneuron.vllm import tiny_models

    options = json.loads(os.environ.get("VLLM_RUN_OPTIONS", "{}"))
    options.setdefault("enforce_eager", True)
    options.setdefault("kv_cache_memory_bytes", 8 << 20)
    llm = LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=16, seed=0, **options)
    prompts = tiny_models.prompts(16)
    result = {"platform": type(__import__("vllm.platforms", fromlist=["x"]).current_platform).__name__}
    for name in scenarios:
        result.update(SCENARIOS[name](llm, prompts))
    if result["platform"] == "NeuronPlatform":
        import torchneuron

        torchneuron.wait_for_compiles()
        stats = torchneuron.compile_stats()
        result["host_path_ops"] = sorted(torchneuron.fallback_ops())
        result["compiled_here"] = stats["sources"].get("compiled", 0)
        result["sources"] = stats["sources"]
        result["signatures"] = stats["signatures"]
        result["not_compiled"] = stats["not_compiled"]
        result["dynamo"] = stats.get("dynamo", {})
        # The kernels this process launched (with tensor parallelism, the workers' processes launch them).
        kernels = {name: sys.modules.get(f"torchneuron.kernels.{name}") for name in ("paged_attention", "moe")}
        result["kernels"] = {"paged_attention": getattr(kernels["paged_attention"], "_paged", None),
                             "moe_experts": getattr(kernels["moe"], "_experts", None)}
        result["kernels"] = {name: k.launches if k is not None else 0 for name, k in result["kernels"].items()}
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
