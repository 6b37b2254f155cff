"""Tiny language models for serving tests and benchmarks, built offline.

A Transformers config with random weights (seeded) and a word-level
tokenizer built with `tokenizers`, saved as a model folder that vLLM and
Hugging Face load like any checkpoint: no hub access at any point.
"""

from __future__ import annotations

import pathlib

VOCAB = 256
WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def _config(family: str):
    import transformers

    shared = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**shared)
    if family == "qwen3":
        return transformers.Qwen3Config(**shared, head_dim=32)
    if family == "mistral":
        return transformers.MistralConfig(**shared, sliding_window=None)
    if family == "qwen3_moe":  # 8 SwiGLU experts, 2 per token, in every layer
        return transformers.Qwen3MoeConfig(**shared, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                           moe_intermediate_size=64, decoder_sparse_step=1, norm_topk_prob=True)
    raise ValueError(f"no tiny model for {family!r}: llama, qwen3, qwen3_moe or mistral")


def tokenizer():
    """A word-level tokenizer: "w5 w17" is [8, 20]; decoding joins words with spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(family: str, path, seed: int = 0) -> pathlib.Path:
    """Save a tiny `family` model (random weights from `seed`) and its
    tokenizer under path; returns the folder."""
    import torch
    import transformers

    path = pathlib.Path(path)
    torch.manual_seed(seed)
    config = _config(family)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


def prompts(count: int, seed: int = 0, shortest: int = 3, longest: int = 40) -> list[str]:
    """`count` prompts of different lengths made of the tokenizer's words."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS[3:]) for _ in range(rng.randint(shortest, longest))) for _ in range(count)]
