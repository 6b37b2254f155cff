"""The model census: every architecture in Hugging Face Transformers, built
offline from a tiny random configuration, classified by its features and run
forward and backward on neuron and on CPU.

Each model runs in its own worker process (`python -m torchneuron.eval.census
--worker TYPE ...`) with a timeout, so a crash or a hang costs one model;
results are appended to a JSON-lines file as they finish, so a census can be
run in parts and resumed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback

from . import census_inputs
from .census_inputs import NotBuildable  # noqa: F401 - raised and caught here, and by the census's callers

# Sizes a tiny configuration gets, wherever the configuration has the attribute.
_TINY = {
    "hidden_size": 32, "d_model": 32, "n_embd": 32, "embed_dim": 32, "dim": 32,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "encoder_layers": 2, "decoder_layers": 2,
    "n_layers": 2, "num_attention_heads": 2, "n_head": 2, "n_heads": 2, "encoder_attention_heads": 2,
    "decoder_attention_heads": 2, "intermediate_size": 64, "ffn_dim": 64, "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64, "d_ff": 64, "n_inner": 64, "vocab_size": 128, "max_position_embeddings": 64,
    "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
    "image_size": 32, "patch_size": 4,
    "max_source_positions": 32,  # audio encoders' position tables: 64 mel frames after a stride-2 conv
    "num_queries": 16,  # two-stage detectors pick this many of a tiny image's few encoder positions
}
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")
MAX_PARAMETERS = 20_000_000  # a "tiny" model above this is skipped (the shrinking missed a sub-module)
BATCH, SEQ = 2, 8

# Head classes tried first, in order: a head gives the model an output head (a feature) and a loss.
_HEAD_MAPPINGS = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    ("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("audio-classification", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES"),
    ("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ("ctc", "MODEL_FOR_CTC_MAPPING_NAMES"),
)




def architectures() -> list:
    """[(model_type, model class name, head)] for every model type with a model class."""
    from transformers.models.auto import modeling_auto as ma

    out = []
    for model_type, base in ma.MODEL_MAPPING_NAMES.items():
        cls_name, head = (base if isinstance(base, str) else base[0]), "base"
        for head_name, mapping in _HEAD_MAPPINGS:
            found = getattr(ma, mapping, {}).get(model_type)
            if found:
                cls_name, head = (found if isinstance(found, str) else found[0]), head_name
                break
        out.append((model_type, cls_name, head))
    return out


def _read(cfg, key):
    try:
        return getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 - per-layer attributes refuse plain reads
        return None


# Deeper tiny variants tried when the default one fails on CPU: hybrid models
# (Mamba/linear attention + attention) put their first attention layer past
# layer 2, multimodal RoPE splits the rotary dims into sections the tiny
# head size must still hold, and some split heads in fixed groups (CodeGen: 4).
_VARIANTS = ({}, {"layers": 8}, {"mrope": True}, {"layers": 8, "mrope": True}, {"mla": True}, {"n_heads": 4})
# Multi-head latent attention (DeepSeek V2/V3 and kin) sizes its heads apart from head_dim.
_TINY_MLA = {"qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
             "q_lora_rank": 16, "qk_head_dim": 16}
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _rotary_sections(cfg):
    """rope_parameters["mrope_section"] that sums to the tiny rotary half-size,
    in the usual 2:3:3 (temporal, height, width) proportion."""
    rope = _read(cfg, "rope_parameters")
    heads = _read(cfg, "num_attention_heads")
    if not isinstance(rope, dict) or not isinstance(heads, int) or not heads:
        return
    head_dim = _read(cfg, "head_dim")
    if not isinstance(head_dim, int):
        hidden = _read(cfg, "hidden_size")
        if not isinstance(hidden, int):
            return
        head_dim = hidden // heads
    partial = rope.get("partial_rotary_factor", 1.0)
    half = int(head_dim * partial) // 2
    if half < 3:  # too few rotary dims for three sections (GLM-4V: 4 heads of 8, half rotary): wider heads
        with contextlib.suppress(Exception):
            cfg.head_dim = head_dim = 16
        half = int(head_dim * partial) // 2
        if half < 3 or _read(cfg, "head_dim") != 16:
            return
    sections = [max(1, round(half * w)) for w in (0.25, 0.375)]
    rope["mrope_section"] = sections + [half - sum(sections)]


_LAYER_TYPE_KEYS = ("layer_types", "layers_block_type", "block_types")
_NOT_ATTENTION = ("linear", "recurrent", "mamba", "ssm", "conv", "rwkv", "moe", "mlp", "dense", "sparse")


def _is_attention(kind) -> bool:
    return isinstance(kind, str) and ("attention" in kind or kind == "hybrid") and not kind.startswith(_NOT_ATTENTION)


def _keep_an_attention_layer(cfg) -> None:
    """Hybrid models (Mamba, linear attention or recurrence with some attention
    layers) list a type per layer, or the attention layers' indices; the tiny
    depth may keep no attention layer, and their cache then fails. The last
    tiny layer becomes an attention layer of the kind the model uses."""
    n = next((v for v in (_read(cfg, k) for k in _LAYER_KEYS) if isinstance(v, int) and not isinstance(v, bool)), None)
    if not n:
        return
    for key in ("attn_layer_indices", "attention_layer_indices", "hybrid_layer_ids"):
        indices = _read(cfg, key)
        if key in vars(cfg) and (indices is None or isinstance(indices, list)):
            if not any(isinstance(i, int) and i < n for i in indices or []):
                with contextlib.suppress(Exception):
                    setattr(cfg, key, [n - 1])
    for key in _LAYER_TYPE_KEYS:
        kinds = _read(cfg, key)
        if not (isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds)):
            continue
        head = (kinds * (n // len(kinds) + 1))[:n]
        if any(_is_attention(k) for k in head):
            continue
        head[-1] = next((k for k in kinds if _is_attention(k)), "full_attention")
        with contextlib.suppress(Exception):
            setattr(cfg, key, head)


_SSM_HEADS = (("mamba_n_heads", "mamba_d_head"), ("n_mamba_heads", "mamba_headdim"), ("num_heads", "head_dim"))


def _ssm_heads(cfg) -> None:
    """Mamba-2 mixers split expand * hidden_size into heads x head size: the
    tiny sizes must multiply out (4 heads of expand * hidden / 4)."""
    expand = _read(cfg, "mamba_expand") or _read(cfg, "expand")
    hidden = _read(cfg, "hidden_size")
    if not (isinstance(expand, int) and isinstance(hidden, int)):
        return
    inner = _read(cfg, "mamba_d_ssm")  # an explicit inner size, where the model has one
    inner = inner if isinstance(inner, int) else expand * hidden
    for heads_key, dim_key in _SSM_HEADS:
        heads, dim = _read(cfg, heads_key), _read(cfg, dim_key)
        if heads_key in vars(cfg) and dim_key in vars(cfg) and isinstance(heads, int):
            if isinstance(dim, int) and heads * dim == inner:
                break
            with contextlib.suppress(Exception):
                setattr(cfg, heads_key, 4)
                setattr(cfg, dim_key, inner // 4)
            for key in ("n_groups", "mamba_n_groups", "mamba_ngroups"):  # groups divide the heads
                groups = _read(cfg, key)
                if isinstance(groups, int) and 4 % groups:
                    with contextlib.suppress(Exception):
                        setattr(cfg, key, 1)
            break


_STAGE_LISTS = ("hidden_sizes", "depths", "num_heads", "embed_dims", "mlp_ratios", "strides", "sr_ratios",
                "patch_sizes", "kernel_sizes", "layer_norms", "window_sizes")


def _stages(cfg) -> None:
    """Hierarchical vision backbones (Swin, ConvNeXt and kin) list sizes per
    stage. Where the tiny depth cut the stages (num_stages, aliased to the
    layer count), the per-stage lists are cut to match; per-stage head
    counts become 2, which divides every stage width of a tiny embed_dim."""
    stages = _read(cfg, "num_stages")
    for key in _STAGE_LISTS:
        value = _read(cfg, key)
        if not (isinstance(value, (list, tuple)) and value):
            continue
        value = list(value)
        if isinstance(stages, int) and not isinstance(stages, bool) and 0 < stages < len(value):
            value = value[:stages]
        if key == "num_heads" and all(isinstance(h, int) for h in value):
            value = [2] * len(value)
        with contextlib.suppress(Exception):
            setattr(cfg, key, value)


def _fixed_stem(cfg) -> bool:
    """A strided convolutional stem (LeViT) sets the patch grid by its own
    stride and kernel; patch_size only restates it."""
    return all(isinstance(_read(cfg, k), int) for k in ("stride", "kernel_size"))


def _windows(cfg) -> None:
    """Windowed hierarchical backbones (Swin and kin) halve the patch grid per
    stage; a stage grid smaller than the window shrinks the window there but
    not its relative position table. A window of 2 and an image whose last
    stage still holds one window keep every stage whole."""
    window, depths = _read(cfg, "window_size"), _read(cfg, "depths")
    size, patch = _read(cfg, "image_size"), _read(cfg, "patch_size")
    if not (isinstance(window, int) and isinstance(depths, (list, tuple)) and depths
            and isinstance(size, int) and isinstance(patch, int)):
        return
    scale = 2 ** (len(depths) - 1)
    if size // patch // scale >= window:
        return
    with contextlib.suppress(Exception):
        cfg.window_size = min(window, 2)
        cfg.image_size = max(size, patch * cfg.window_size * scale)


def _image_with_patch(cfg, default_patch) -> None:
    """An image size given per side (YOLOS: [512, 864]) is not a plain int, so
    the tiny size does not replace it; shrunk by the same factor as the patch,
    it keeps the default's patch grid. Unshrunk, YOLOS's 4-pixel patches made
    16485 tokens and 4.35 GB attention scores a layer."""
    size, patch = _read(cfg, "image_size"), _read(cfg, "patch_size")
    if not (isinstance(size, (list, tuple)) and size and all(isinstance(v, int) and not isinstance(v, bool) for v in size)
            and isinstance(default_patch, int) and isinstance(patch, int) and 0 < patch < default_patch):
        return
    with contextlib.suppress(Exception):
        cfg.image_size = type(size)(max(patch, v * patch // default_patch) for v in size)


def _backbone_outputs(cfg) -> None:
    """ViT backbones (a stage per layer, no per-stage depths) name the layers
    a neck reads; the tiny depth drops them. The neck reads the last tiny
    layers instead, as many as there are (it sizes itself by their count)."""
    indices, names, layers = _read(cfg, "out_indices"), _read(cfg, "stage_names"), _read(cfg, "num_hidden_layers")
    if not (isinstance(indices, (list, tuple)) and indices and isinstance(names, list) and isinstance(layers, int)
            and _read(cfg, "depths") is None and max(indices) > layers
            and hasattr(cfg, "set_output_features_output_indices")):
        return
    keep = min(len(indices), layers)
    with contextlib.suppress(Exception):
        cfg.stage_names = ["stem"] + [f"stage{i}" for i in range(1, layers + 1)]
        cfg.set_output_features_output_indices(None, list(range(layers - keep + 1, layers + 1)))


def _shrink(cfg, depth: int = 0, layers: int = 2, mrope: bool = False, mla: bool = False, n_heads: int = 0):
    import transformers

    heads, kv = _read(cfg, "num_attention_heads"), _read(cfg, "num_key_value_heads")
    channels, patch = _read(cfg, "num_channels") or 3, _read(cfg, "patch_size")
    flat_patch = isinstance(patch, int) and _read(cfg, "patch_dim") == channels * patch * patch
    stages = _read(cfg, "out_features")
    stage_width = (stages[-1] if isinstance(stages, list) and stages and isinstance(stages[-1], int)
                   and stages[-1] == _read(cfg, "hidden_size") else None)
    for key, value in _TINY.items():
        try:
            current = getattr(cfg, key, None)
        except Exception:  # noqa: BLE001 - per-layer attributes refuse plain reads
            continue
        if isinstance(current, int) and not isinstance(current, bool):
            if key == "patch_size" and (current < value or _fixed_stem(cfg)):
                continue  # a patch size of 1 keeps full resolution; a fixed stem implies its own
            with contextlib.suppress(Exception):
                setattr(cfg, key, value)
    _image_with_patch(cfg, patch)
    if stage_width:
        with contextlib.suppress(Exception):  # the last CNN stage's width, checked against it (EfficientLoFTR)
            cfg.hidden_size = stage_width
    # Keep the attention variant: multi-head, multi-query or grouped-query.
    if isinstance(heads, int) and isinstance(kv, int) and not isinstance(kv, bool):
        tiny = {"num_key_value_heads": 2}
        if kv == 1:
            tiny = {"num_key_value_heads": 1}
        elif kv < heads:
            tiny = {"num_attention_heads": 4, "num_key_value_heads": 2}
            if isinstance(_read(cfg, "head_dim"), int):
                tiny["head_dim"] = 8
        for key, value in tiny.items():
            with contextlib.suppress(Exception):
                setattr(cfg, key, value)
    if n_heads:
        for key in ("num_attention_heads", "n_head", "n_heads", "head_dim"):
            value = 8 if key == "head_dim" else n_heads
            if isinstance(_read(cfg, key), int):
                with contextlib.suppress(Exception):
                    setattr(cfg, key, value)
    rope, tiny_heads = _read(cfg, "rope_parameters"), _read(cfg, "num_attention_heads")
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1) > 1 and isinstance(heads, int) \
            and isinstance(tiny_heads, int) and tiny_heads != heads:
        # rotary frequencies over several heads' width (EfficientLoFTR: the whole hidden size)
        rope["partial_rotary_factor"] = rope["partial_rotary_factor"] * tiny_heads / heads
    if layers != 2:
        for key in _LAYER_KEYS:
            current = _read(cfg, key)
            if isinstance(current, int) and not isinstance(current, bool):
                with contextlib.suppress(Exception):
                    setattr(cfg, key, layers)
    _ssm_heads(cfg)
    _stages(cfg)
    context, positions = _read(cfg, "context_size"), _read(cfg, "max_position_embeddings")
    if isinstance(context, int) and isinstance(positions, int) and context > positions:
        with contextlib.suppress(Exception):  # attention blocks whose relative positions index the table
            cfg.context_size = positions
    if flat_patch:
        with contextlib.suppress(Exception):  # a flattened patch's width (RADIO): channels x patch area
            cfg.patch_dim = channels * cfg.patch_size ** 2
    if isinstance(_read(cfg, "dim_bbox_projection"), int) and isinstance(_read(cfg, "num_attention_heads"), int):
        with contextlib.suppress(Exception):  # BROS: box positions projected to the head size
            cfg.dim_bbox_projection = cfg.hidden_size // cfg.num_attention_heads
    if isinstance(_read(cfg, "channel_shrink_ratio"), int) and _read(cfg, "hidden_size") == _TINY["hidden_size"]:
        with contextlib.suppress(Exception):  # LiLT: six box embeddings of hidden // 6 concatenate to hidden
            cfg.hidden_size = 48
    _windows(cfg)
    _backbone_outputs(cfg)
    if _read(cfg, "num_feature_levels") == 0 and _read(cfg, "projector_scale_factors") in ((), []) \
            and isinstance(_read(cfg, "d_model"), int):
        with contextlib.suppress(Exception):  # a default with no feature level (LW-DETR): one, at scale 1
            cfg.projector_scale_factors = [1.0]
            cfg.projector_in_channels = [cfg.d_model]
            cfg.num_feature_levels = 1
    size, patch = _read(cfg, "image_size"), _read(cfg, "patch_size")
    if isinstance(_read(cfg, "image_embedding_size"), int) and isinstance(size, int) and isinstance(patch, int):
        with contextlib.suppress(Exception):  # derived at init (SAM's prompt encoder): the patch grid
            cfg.image_embedding_size = size // patch
    hidden, coordinate = _read(cfg, "hidden_size"), _read(cfg, "coordinate_size")
    if isinstance(hidden, int) and isinstance(coordinate, int) and isinstance(_read(cfg, "shape_size"), int):
        with contextlib.suppress(Exception):  # layout embeddings: 4 coordinates + 2 shapes concatenate to hidden
            cfg.coordinate_size = hidden // 8
            cfg.shape_size = (hidden - 4 * (hidden // 8)) // 2
    if isinstance(_read(cfg, "num_query_tokens"), int) and "image_token_index" in vars(cfg) \
            and _read(cfg, "image_token_index") is None:
        with contextlib.suppress(Exception):  # Q-Former models: an unset image placeholder, in the tiny vocabulary
            cfg.image_token_index = _TINY["vocab_size"] - 1
    experts = next((v for v in (_read(cfg, k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
                    if isinstance(v, int) and not isinstance(v, bool)), None)
    width = _read(cfg, "moe_intermediate_size")
    if isinstance(width, int) and width % 4:
        with contextlib.suppress(Exception):  # grouped expert matmuls need 16-byte strides (DeepSeek-V2: 1407)
            cfg.moe_intermediate_size = width + 4 - width % 4
    if experts and "num_experts_per_tok" in vars(cfg) and _read(cfg, "num_experts_per_tok") is None:
        with contextlib.suppress(Exception):  # routed experts with the per-token count unset (DeepSeek-V2)
            cfg.num_experts_per_tok = _TINY["num_experts_per_tok"]
    for key in ("n_group", "num_expert_group", "num_group", "topk_group"):  # expert groups divide the experts
        groups = _read(cfg, key)
        if isinstance(experts, int) and isinstance(groups, int) and not isinstance(groups, bool) and groups > 1 \
                and (experts % groups or groups >= experts):
            with contextlib.suppress(Exception):
                setattr(cfg, key, 1)
    kinds = _read(cfg, "layer_types")
    if isinstance(kinds, (list, tuple)) and "sliding_attention" in kinds and _read(cfg, "sliding_window") is None:
        with contextlib.suppress(Exception):
            cfg.sliding_window = 4  # sliding-window layers listed, their window unset: a tiny window
    if mrope:
        _rotary_sections(cfg)
    if mla:
        for key, value in _TINY_MLA.items():
            current = _read(cfg, key)
            if isinstance(current, int) and not isinstance(current, bool):
                with contextlib.suppress(Exception):
                    setattr(cfg, key, value)
        if isinstance(_read(cfg, "qk_rope_head_dim"), int):
            rope = _read(cfg, "rope_parameters")
            partial = rope.get("partial_rotary_factor", 1.0) if isinstance(rope, dict) else 1.0
            with contextlib.suppress(Exception):  # what the rotary embedding is sized by (times its share)
                cfg.head_dim = int(cfg.qk_rope_head_dim / partial)
    if isinstance(_read(cfg, "rotary_dim"), int):
        with contextlib.suppress(Exception):
            cfg.rotary_dim = 8
    for key in _TOKEN_IDS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value >= _TINY["vocab_size"]:
            setattr(cfg, key, 1)
    if depth < 3:
        for value in list(vars(cfg).values()):
            if isinstance(value, transformers.PretrainedConfig):
                _shrink(value, depth + 1, layers, mrope, mla, n_heads)
    return cfg


_WIDTH_KEYS = ("hidden_size", "d_model", "n_embd", "embed_dim", "dim")
# Names of attributes that give a width of a layer (the hidden size of another part).
_WIDTH_NAME = ("hidden", "embed", "d_model", "width", "_dim", "channels", "pooler")
_NOT_WIDTH_NAME = ("head", "num", "max", "vocab", "patch", "image", "position", "rope", "rotary", "intermediate",
                   "layers", "kernel", "window", "ffn", "mlp", "lora", "rank", "state", "conv", "feat", "mel")


def _configs(cfg, depth=0):
    import transformers

    yield cfg
    if depth < 3:
        for value in list(vars(cfg).values()):
            if isinstance(value, transformers.PretrainedConfig):
                yield from _configs(value, depth + 1)


def _widths(cfg) -> set:
    """The hidden sizes of a default configuration and its sub-configurations."""
    out = set()
    for c in _configs(cfg):
        for key in _WIDTH_KEYS:
            value = _read(c, key)
            if isinstance(value, int) and not isinstance(value, bool) and value > _TINY["hidden_size"]:
                out.add(value)
    return out


def _joint_width(cfg):
    """The widths of a configuration's sub-models, concatenated (X-Codec's
    codebook_dim: acoustic + semantic hidden sizes), where it has several."""
    import transformers

    subs = [_read(v, "hidden_size") for v in vars(cfg).values() if isinstance(v, transformers.PretrainedConfig)]
    subs = [w for w in subs if isinstance(w, int) and not isinstance(w, bool)]
    return sum(subs) if len(subs) > 1 else None


def _shrink_widths(cfg, widths: set, joint: dict | None = None) -> None:
    """A sub-module sized by another part's hidden size names it in its own
    attribute (a Q-Former's encoder_hidden_size, a decoder's
    cross_attention_hidden_size, a projection_dim equal to the width): any
    such width-named attribute still at a default hidden size (or twice one)
    is shrunk to the tiny hidden size (or twice it) with it."""
    for c in _configs(cfg):
        for key, value in list(vars(c).items()):
            name = key.lower()
            if name.endswith("pos_feats") and isinstance(value, int) and 2 * value in widths:
                with contextlib.suppress(Exception):  # sine and cosine halves of a width (SAM)
                    setattr(c, key, _TINY["hidden_size"] // 2)
                continue
            if not (any(w in name for w in _WIDTH_NAME) and not any(w in name for w in _NOT_WIDTH_NAME)):
                continue
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and v in widths for v in value):
                with contextlib.suppress(Exception):  # one width per level (D-FINE's decoder_in_channels)
                    setattr(c, key, [_TINY["hidden_size"]] * len(value))
                continue
            if not (isinstance(value, int) and not isinstance(value, bool)):
                continue
            stages = _read(c, "out_features")
            if isinstance(stages, list) and stages and value == stages[-1]:
                continue  # the last CNN stage's width (EfficientLoFTR), not shrunk with the rest
            if joint and joint.get(id(c)) == value and _joint_width(c):
                with contextlib.suppress(Exception):
                    setattr(c, key, _joint_width(c))
                continue
            for times in (1, 2):  # a width, or two widths concatenated (Zamba's attention input)
                if value in {w * times for w in widths}:
                    with contextlib.suppress(Exception):
                        setattr(c, key, _TINY["hidden_size"] * times)
                    break


def build(model_type: str, cls_name: str, variant: dict | None = None):
    """(model, config) on CPU, eval mode, seeded; raises NotBuildable."""
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    def construct(attention_layer: bool):
        config = config_cls()
        widths = _widths(config)
        joint = {id(c): _joint_width(c) for c in _configs(config)}
        config = _shrink(config, **(variant or {}))
        _shrink_widths(config, widths, joint)
        if attention_layer:
            for c in _configs(config):
                _keep_an_attention_layer(c)
        torch.manual_seed(0)
        return model_cls(config), config

    try:
        config_cls = getattr(transformers, CONFIG_MAPPING_NAMES[model_type])
        model_cls = getattr(transformers, cls_name)
        try:
            model, config = construct(True)
        except Exception:  # noqa: BLE001 - some hybrids need more attention layers than one: as configured
            model, config = construct(False)
    except Exception as e:  # noqa: BLE001 - every way a build can fail is a reason, not a crash
        raise NotBuildable(f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160] if str(e).strip() else ''}") from None
    _without_sampling_noise(model)
    _without_zero_matrices(model)
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMETERS:
        raise NotBuildable(f"too large for a tiny census model ({n / 1e6:.0f}M parameters)")
    return model.eval(), config


def _without_sampling_noise(model) -> None:
    """Models that sample in eval mode (VITS: noise_scale, noise_scale_duration)
    draw some numbers from CPU tensors and some from the device's generator, so
    device and CPU runs draw different noise, as on CUDA. The census compares
    the deterministic part: every noise scale the model exposes is set to 0."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if name.startswith("noise_scale") and isinstance(value, float):
                setattr(module, name, 0.0)


def _without_zero_matrices(model) -> None:
    """A weight matrix or embedding left at zeros by the model's init (an
    AFMoE router, InstructBLIP's query tokens) is random here, as after
    training: a zero router scores every expert alike, and top-k among equal
    scores picks experts in an order PyTorch leaves unspecified (CPU picks
    2, 3 of 4; another backend may pick 0, 1); zero query tokens reach a
    LayerNorm with no variance, whose gradient is 1/sqrt(eps) times its input's
    rounding. The census compares computations, not ties and rounding noise."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() >= 2 and parameter.is_floating_point() and parameter.numel() > 1 and not parameter.any():
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.02)


def inputs_for(model, config) -> dict:
    """Generic inputs by the model's classes and configuration (rules in
    census_inputs); raises NotBuildable."""
    return census_inputs.inputs_for(model, config)


def features(model, config, head: str, inputs: dict) -> dict:
    """Architectural features, from the configuration and the module tree."""
    import torch

    names = {type(m).__name__.lower() for m in model.modules()}
    text = " ".join(names)

    def cfg(key, default=None):
        for c in (config, getattr(config, "text_config", None)):
            if c is not None:
                with contextlib.suppress(Exception):
                    value = getattr(c, key, None)
                    if value is not None:
                        return value
        return default

    main = next(iter(inputs))
    multimodal = any(hasattr(config, k) for k in ("vision_config", "audio_config")) and hasattr(config, "text_config")
    modality = ("multimodal" if multimodal else {"input_ids": "text", "pixel_values": "vision",
                "input_values": "audio", "input_features": "audio"}.get(main, "other"))
    if cfg("is_encoder_decoder", False):
        structure = "encoder-decoder"
    elif head in ("causal-lm",) or "causallm" in type(model).__name__.lower():
        structure = "decoder"
    else:
        structure = "encoder"
    heads, kv = cfg("num_attention_heads"), cfg("num_key_value_heads")
    attention = []
    if "attention" not in text and "attn" not in text:
        attention.append("none")
    else:
        attention.append("self")
        if structure == "encoder-decoder" or cfg("add_cross_attention", False) or "crossattention" in text:
            attention.append("cross")
        if isinstance(cfg("sliding_window"), int) and cfg("sliding_window"):
            attention.append("sliding-window")
        if isinstance(heads, int) and isinstance(kv, int) and kv < heads:
            attention.append("multi-query" if kv == 1 else "grouped-query")
    n_experts = cfg("num_experts") or cfg("num_local_experts") or cfg("n_routed_experts")
    moe = bool((isinstance(n_experts, int) and n_experts > 1) or "expert" in text or "moe" in text)
    recurrent = any(k in text for k in ("mamba", "ssm", "rwkv", "recurrent", "lstm", "gru", "xlstm"))
    conv = any(isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)) for m in model.modules())
    if "rotary" in text or cfg("rope_theta") is not None or cfg("rope_parameters") is not None:
        positional = "rotary"
    elif "alibi" in text or cfg("alibi", False):
        positional = "alibi"
    elif cfg("relative_attention_num_buckets") is not None or "relative" in text:
        positional = "relative"
    elif (cfg("max_position_embeddings") is not None or "position" in text
          or any("position" in n for n, _ in model.named_parameters())):
        positional = "absolute"
    else:
        positional = "none"
    return {"modality": modality, "structure": structure, "attention": attention, "moe": moe,
            "recurrent": recurrent, "convolution": conv, "positional": positional, "head": head}


def _floats(value) -> list:
    """Floating-point tensors of a model output, in a stable order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    return []


# Execution modes a model runs in: the eager execution settings, and
# torch.compile(backend="neuron") over compile-first eager.
MODES = ("compile", "host", "torch_compile")


def _run(model, inputs: dict, device: str, backward: bool, compiled: bool = False) -> tuple:
    """(output tensors on CPU, gradients on CPU or None); `compiled`: the
    model runs under torch.compile(backend="neuron")."""
    import torch

    model = model.to(device)
    # Modules that cache values derived from their parameters in eval mode (LeViT's attention
    # biases, per device) drop them when switched to training: a run without grad must not leave
    # the next run cached values that carry no gradient.
    model.train()
    model.eval()
    args = {k: v.to(device) for k, v in inputs.items()}
    model.zero_grad(set_to_none=True)
    call = torch.compile(model, backend="neuron") if compiled else model
    torch.manual_seed(0)  # models that draw random numbers (masking, noise) draw the same on both
    with torch.set_grad_enabled(backward):
        outs = _floats(call(**args))
    grads = None
    if backward and outs:
        loss = sum(o.float().mean() for o in outs if o.requires_grad)
        if isinstance(loss, torch.Tensor):
            loss.backward()
            grads = [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]
    return [o.detach().cpu() for o in outs], grads


def _compare(got: list, expected: list, what: str) -> str | None:
    import torch

    if len(got) != len(expected):
        return f"{what}: {len(got)} tensors vs CPU {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        # The absolute tolerance scales with the tensor's largest value: an untrained tiny model's
        # gradients reach 1e12 (BLIP-2), where float32 sums in another order differ by far more than 1e-3.
        finite = e[e.isfinite()] if e.is_floating_point() or e.is_complex() else e[:0]
        scale = max(1.0, finite.abs().max().item()) if finite.numel() else 1.0
        try:
            torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-3 * scale, equal_nan=True)
        except AssertionError as err:
            return f"{what}[{i}]: " + str(err).strip().splitlines()[0][:200]
    return None


def _flushed_reference(model, inputs: dict, state: dict, backward: bool) -> tuple:
    """CPU's answer with float32 denormals flushed to zero, as the device computes: IREE's CPU
    runtime sets flush-to-zero on its worker threads (iree/task/worker.c), PyTorch's CPU kernels
    keep denormals. One thread, since the setting is per thread."""
    import torch

    model.to("cpu")
    model.load_state_dict(state)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        return _run(model, inputs, "cpu", backward)
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def _float64_reference(model, inputs: dict, state: dict, backward: bool) -> tuple:
    """CPU's answer in float64: a copy of the model and its float inputs in double."""
    import copy

    import torch

    model.to("cpu")  # copied on CPU: neuron copies would be recorded as the model's ops
    exact = copy.deepcopy(model)
    exact.load_state_dict(state)
    exact.double()
    doubles = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    return _run(exact, doubles, "cpu", backward)


def _closer_to_float64(got: list, expected: list, exact: list, what: str) -> str | None:
    """Where neuron's tensors differ from CPU's, whether each matches the float64 answer within
    the census's tolerance and is as close to it as CPU's own (exactness.as_close_as_cpu): a
    description of the largest errors if so, else None. (Both far from it, as where top-k ties
    pick other elements, is not a rounding difference: no pass.)"""
    from .exactness import as_close_as_cpu

    if not (len(got) == len(expected) == len(exact)):
        return None
    worst = None
    for i, (g, e, x) in enumerate(zip(got, expected, exact)):
        if _compare([g], [e], what) is None:
            continue
        if _compare([g], [x.to(g.dtype)], what) is not None or not as_close_as_cpu(g, e, x):
            return None
        finite = x.isfinite()
        errors = [(t.double() - x)[finite].abs().max().item() if finite.any() else 0.0 for t in (g, e)]
        if worst is None or errors[1] > worst[2]:
            worst = (i, *errors)
    if worst is None:
        return None
    i, device, cpu = worst
    return f"{what}[{i}]: neuron {device:.2e} from float64, CPU's float32 {cpu:.2e}"


# A mismatch whose neuron result matches CPU's answer with denormals flushed.
DENORMALS = "float32 denormals: matches CPU with denormals flushed to zero, as IREE's CPU runtime computes"


def _error_class(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:160]}"


def run_one(model_type: str, cls_name: str, head: str, modes: list, record: str | None = None) -> dict:
    """Build, classify and run one architecture in this process."""
    import torch

    import torchneuron
    from torchneuron.eval import registry

    result = {"model": model_type, "class": cls_name, "head": head, "modes": {},
              "driver": torchneuron.config.settings.driver}
    first_error = None
    for variant in _VARIANTS:
        try:
            model, config = build(model_type, cls_name, variant)
            inputs = inputs_for(model, config)
        except NotBuildable as e:
            if not variant:
                result.update(status="not-buildable", reason=str(e))
                return result
            continue
        trains = any(p.requires_grad for p in model.parameters())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            ref_out, ref_grads = _run(model, inputs, "cpu", trains)
            break
        except Exception as e:  # noqa: BLE001 - the reference itself fails: not a backend result
            first_error = first_error or _error_class(e)
    else:
        result.update(status="reference-error", reason=first_error)
        return result
    if variant:
        result["variant"] = variant
    model.load_state_dict(state)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    result["features"] = features(model, config, head, inputs)
    result["status"] = "ran"
    ops: set = set()
    for mode in modes:
        compiled = mode == "torch_compile"
        torchneuron.config.set(execution="compile" if compiled else mode)
        model.load_state_dict(state)
        entry = {}
        if compiled:
            torch._dynamo.reset()
        recorder = registry.Recorder(record or os.devnull, model_type)
        registry.set_active(recorder)
        references: dict = {}  # CPU's answers in float64 and with denormals flushed, at the first mismatch

        def reference(make) -> tuple:
            """(outputs, gradients) of a second CPU reference, once; (None, None) where the model
            cannot give it (one that does not run in float64): the mismatch stays as it is."""
            if make not in references:
                try:
                    references[make] = make(model, inputs, state, trains and ref_grads is not None)
                except Exception:  # noqa: BLE001 - no second reference, no judgment
                    references[make] = (None, None)
            return references[make]

        def judge(phase: str, problem, got: list, index: int) -> None:
            entry[phase] = "pass" if problem is None else "mismatch"
            if problem is None:
                return
            entry[f"{phase}_detail"] = problem
            exact = reference(_float64_reference)[index]
            what = "output" if index == 0 else "gradient"
            closer = _closer_to_float64(got, (ref_out, ref_grads)[index], exact, what) if exact is not None else None
            if closer:
                # as the unit stage judges ops: CPU's float32 is the less accurate of the two
                entry[phase] = "pass"
                entry[f"{phase}_arbitrated"] = closer
                return
            flushed = reference(_flushed_reference)[index]
            if flushed is not None and _compare(got, flushed, phase) is None:
                entry[f"{phase}_cause"] = DENORMALS

        try:
            out, grads = _run(model, inputs, "neuron", False, compiled)
            judge("forward", _compare(out, ref_out, "output"), out, 0)
            if trains and ref_grads is not None:
                model.load_state_dict(state)
                _, grads = _run(model, inputs, "neuron", True, compiled)
                judge("backward", _compare(grads or [], ref_grads, "gradient"), grads or [], 1)
            torch.neuron.synchronize()
        except Exception as e:  # noqa: BLE001 - a backend failure, classified
            entry.setdefault("forward", "error")
            if entry["forward"] != "error":
                entry["backward"] = "error"
            entry["error"] = _error_class(e)
        finally:
            registry.set_active(None)
            model.to("cpu")
        ops.update(op for op, _, _ in recorder.counts)
        entry["signatures"] = len(recorder.counts)
        if record:
            recorder.flush()
        if mode == "compile":
            entry["host_fallback_ops"] = sorted(torchneuron.fallback_ops())
            # what ran as the target's executables (a host-path result proves nothing about the target)
            entry["ops_compiled"] = torchneuron.execution_stats()["ops_compiled"]
        if compiled:
            dynamo = torchneuron.compile_stats()["dynamo"]
            entry["graphs_compiled"] = dynamo.get("graphs_compiled", 0)
            entry["graphs_eager"] = dynamo.get("graphs_fallback", 0)  # fell back to neuron eager
        result["modes"][mode] = entry
        torchneuron.reset_stats()
    result["ops"] = sorted(ops)
    return result


# -- the parallel, resumable runner -------------------------------------------

def load_results(path: str) -> dict:
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    r = json.loads(line)
                    out[r["model"]] = r
    return out


def run_census(out_path: str, modes: list, models=None, jobs: int = 1, timeout: float = 600.0,
               resume: bool = True, on_result=None, per_process: int = 1, record: str | None = None) -> dict:
    """Run every architecture (or `models`) in worker processes, `per_process`
    models one after another in each (a model's leftovers then meet the next
    one, as in a program that builds several); append each result to
    out_path as it finishes. `record`: a shape registry (.sqlite or .parquet)
    that every model's op signatures go into (each worker records into a file
    of its own, merged as it finishes; a model run again replaces its rows).
    Returns {model: result}."""
    import tempfile

    from torchneuron import config

    from . import registry

    record_path = record
    parts = tempfile.mkdtemp(prefix="torchneuron-census-registry-") if record_path else None

    done = load_results(out_path) if resume else {}
    todo = [a for a in architectures() if (models is None or a[0] in models) and a[0] not in done]
    batches = [todo[i:i + per_process] for i in range(0, len(todo), max(1, per_process))]
    running: list = []
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "a") as sink:
        def keep(result, started):
            result["seconds"] = round(time.monotonic() - started, 1)
            sink.write(json.dumps(result) + "\n")
            sink.flush()
            done[result["model"]] = result
            if on_result is not None:
                on_result(result)

        while batches or running:
            while batches and len(running) < jobs:
                batch = batches.pop(0)
                cmd = [sys.executable, "-m", "torchneuron.eval.census", "--worker",
                       *[x for arch in batch for x in arch], "--modes", *modes]
                part = os.path.join(parts, f"{batch[0][0]}.sqlite") if record_path else None
                if part:
                    cmd += ["--record", part]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        env=dict(os.environ, TORCHNEURON_DEVICE_COUNT="1", PYTHONWARNINGS="ignore"))
                running.append((proc, batch, time.monotonic(), part))
            time.sleep(0.1)
            for item in list(running):
                proc, batch, started, part = item
                if proc.poll() is None and time.monotonic() - started < timeout * len(batch):
                    continue
                running.remove(item)
                timed_out = proc.poll() is None
                if timed_out:
                    proc.kill()
                    proc.wait()
                out = proc.stdout.read()
                finished = {}
                for line in out.splitlines():
                    if line.startswith("CENSUS "):
                        r = json.loads(line[7:])
                        finished[r["model"]] = r
                for model_type, cls_name, head in batch:
                    result = finished.get(model_type)
                    if result is None:
                        result = {"model": model_type, "class": cls_name, "head": head,
                                  "status": "timeout" if timed_out else "crash",
                                  "reason": f"no result within {timeout * len(batch):.0f} s" if timed_out
                                  else f"the worker exited with {proc.returncode}"}
                        if len(batch) > 1:
                            result["models_in_process"] = [a[0] for a in batch]
                        result["check_memory"] = config.settings.check_memory
                    keep(result, started)
                if part and os.path.exists(part):
                    registry.replace_models(record_path, [part])
                    os.remove(part)
    if parts:
        shutil.rmtree(parts, ignore_errors=True)
    return done


def _worker(argv) -> int:
    import warnings

    warnings.simplefilter("ignore")
    with contextlib.suppress(Exception):
        import transformers

        transformers.logging.set_verbosity_error()
    from torchneuron import config

    batch = [argv.worker[i:i + 3] for i in range(0, len(argv.worker), 3)]
    for model_type, cls_name, head in batch:
        try:
            result = run_one(model_type, cls_name, head, argv.modes, argv.record)
        except Exception as e:  # noqa: BLE001 - reported, never fatal to the census
            result = {"model": model_type, "class": cls_name, "head": head, "status": "crash",
                      "reason": _error_class(e), "trace": traceback.format_exc()[-1500:]}
        result["check_memory"] = config.settings.check_memory
        if len(batch) > 1:
            result["models_in_process"] = [b[0] for b in batch]
        sys.stdout.write("CENSUS " + json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", nargs="+", metavar="TYPE CLASS HEAD", help="one or more model triples")
    parser.add_argument("--modes", nargs="+", default=["compile"], choices=MODES)
    parser.add_argument("--record", default=None, help="a shape registry this worker records into")
    # Run in the imported module, not in __main__: its classes (NotBuildable) are
    # the ones census_inputs raises.
    from torchneuron.eval import census as _imported

    raise SystemExit(_imported._worker(parser.parse_args()))
