"""Generic inputs for the model census, by rules that cover families.

`inputs_for(model, config)` reads what a model takes from its class (its
`main_input_name`, the parameter names of its `forward`) and from its
configuration (vocabulary, image, patch and grid sizes, mel bins, frames,
whether it has a decoder) and builds a small batch of random inputs:

- the main input: token ids, images (videos where the configuration counts
  frames), flattened patch sequences with their grid (Qwen-VL style vision
  towers), mel features in the layout the first layer reads, raw audio;
- what the main input needs beside it: the other modality of a dual encoder,
  decoder inputs of an encoder-decoder, layout boxes, masks and grids that
  `forward` requires.

Every size is read from the configuration the census has shrunk, so the
inputs agree with the tiny model. Raises `NotBuildable` when a model
takes something that is not a tensor a rule can make (a video-tracking
session object, say).
"""

from __future__ import annotations

import inspect

BATCH, SEQ = 2, 8
FRAMES = 64  # audio feature frames (a multiple of every subsampling factor seen: 4, 8)
SAMPLES = 1600  # raw audio samples

# Sub-configurations searched, in order, for a size, by what the size is for.
_VISION = ("vision_config", "image_config", "backbone_config", "vision_encoder_config", "encoder_config")
_TEXT = ("text_config", "decoder_config", "language_config", "llm_config")
_AUDIO = ("audio_config", "encoder_config", "audio_encoder_config", "acoustic_config", "asr_config")


class NotBuildable(Exception):
    """The architecture cannot be built here: a missing optional dependency, a
    configuration the generic tiny sizes break. Never a backend failure."""


def _get(cfg, key):
    try:
        value = getattr(cfg, key, None)
    except Exception:  # noqa: BLE001 - per-layer attributes refuse plain reads
        return None
    return None if isinstance(value, bool) else value


class _Spec:
    """What one model takes: its forward parameters and its configuration."""

    def __init__(self, model, config):
        import torch

        self.model, self.config = model, config
        self.g = torch.Generator().manual_seed(1)
        sig = inspect.signature(model.forward)
        self.params = {n: p for n, p in sig.parameters.items()
                       if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        self.required = [n for n, p in self.params.items() if p.default is inspect.Parameter.empty]

    def find(self, keys, subs=(), types=(int,)):
        """The first value of `keys` in the sub-configurations `subs`, then the
        configuration itself, then any nested configuration."""
        import transformers

        configs = [_get(self.config, s) for s in subs] + [self.config]
        configs += [v for v in vars(self.config).values() if isinstance(v, transformers.PretrainedConfig)]
        for key in (keys if isinstance(keys, (list, tuple)) else (keys,)):
            for cfg in configs:
                if cfg is None:
                    continue
                value = _get(cfg, key)
                if isinstance(value, types) and not isinstance(value, bool):
                    return value
        return None

    def modules(self, kind):
        return [m for m in self.model.modules() if isinstance(m, kind)]

    # -- random tensors ---------------------------------------------------

    def ids(self, shape=(BATCH, SEQ), subs=_TEXT):
        import torch

        vocab = self.find("vocab_size", subs) or 100
        return torch.randint(3, max(4, min(int(vocab), 100)), shape, generator=self.g)

    def randn(self, *shape):
        import torch

        return torch.randn(*shape, generator=self.g)


# -- text ----------------------------------------------------------------------

def _text(spec: _Spec, name: str = "input_ids") -> dict:
    return {name: spec.ids()}


def _encoder_audio(spec: _Spec, out: dict) -> dict:
    """An encoder-decoder whose decoder reads text and whose encoder reads
    audio (its forward takes input_features beside input_ids, and encoder
    inputs or is_encoder_decoder says there is an encoder) needs both."""
    if "input_features" in out or "input_features" not in spec.params or "input_ids" not in out:
        return {}
    if not (_get(spec.config, "is_encoder_decoder") or any(n.startswith("encoder_") for n in spec.params)):
        return {}
    return _audio_features(spec)


def _decoder(spec: _Spec, out: dict) -> dict:
    """Decoder inputs of an encoder-decoder (or a transducer's prediction
    network): whenever forward takes them, the first tokens, as teacher forcing."""
    if "decoder_input_ids" not in spec.params or "decoder_input_ids" in out:
        return {}
    ids = out.get("input_ids")
    channels = _get(_get(spec.config, "decoder_config"), "num_channels")
    if isinstance(channels, int):  # a decoder of parallel codebook streams (Dia): (batch, steps, channels)
        return {"decoder_input_ids": spec.ids((BATCH, 4, channels), ("decoder_config",))}
    return {"decoder_input_ids": ids[:, :4].clone() if ids is not None else spec.ids((BATCH, 4))}


# -- images and videos -----------------------------------------------------------

def _size(value):
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        return tuple(value[-2:]) if len(value) >= 2 else (value[0], value[0])
    if isinstance(value, dict):
        h, w = value.get("height"), value.get("width")
        if isinstance(h, int) and isinstance(w, int):
            return h, w
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    return None


_MAX_PIXELS = 512 * 512


def _image_size(spec: _Spec):
    for key in ("image_size", "img_size", "input_size", "resolution"):
        for cfg in [_get(spec.config, s) for s in _VISION] + [spec.config]:
            if cfg is not None and (size := _size(_get(cfg, key))):
                if size[0] * size[1] > _MAX_PIXELS:
                    # A large non-square detector size (YOLOS: 512x864 took 24 GB on the
                    # host): its smaller side, square, as models that interpolate accept.
                    side = min(size)
                    return side, side
                return size
    # No size configured: a convolutional backbone that downsamples by fixed
    # strides (OCR recognisers pool 32 pixels away); 64 keeps a few pixels.
    return 64, 64


def _channels(spec: _Spec) -> int:
    return spec.find(("num_channels", "in_channels", "input_channels", "in_chans", "channels"), _VISION) or 3


def _frames(spec: _Spec):
    """Frames of a video model: the configuration counts them."""
    for key in ("num_frames", "frames", "video_size"):
        value = spec.find(key, _VISION, types=(int, list, tuple))
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and value > 0:
            return value
    return None


def _matches_pairs(spec: _Spec) -> bool:
    """Keypoint matchers (LightGlue, EfficientLoFTR) take images in pairs."""
    from transformers.models.auto import modeling_auto

    return _get(spec.config, "model_type") in getattr(modeling_auto, "MODEL_FOR_KEYPOINT_MATCHING_MAPPING_NAMES", {})


def _pixels(spec: _Spec, name: str = "pixel_values") -> dict:
    channels, (h, w) = _channels(spec), _image_size(spec)
    frames = 2 if _matches_pairs(spec) else _frames(spec)
    if frames:
        return {name: spec.randn(BATCH, frames, channels, h, w)}
    return {name: spec.randn(BATCH, channels, h, w)}


def _grid_param(spec: _Spec):
    for name in spec.params:
        if name.endswith("grid_thw") or name == "grid_thw":
            return name
    return None


def _patch_sequence(spec: _Spec, pixel_name: str, grid_name: str) -> dict:
    """Vision towers fed flattened patches and their (t, h, w) grid (Qwen-VL and
    kin): BATCH images of a 2x2 grid of merged patches each."""
    import torch

    merge = spec.find(("spatial_merge_size", "merge_size"), _VISION)
    if merge is None:
        kernel = spec.find("merge_kernel_size", _VISION, types=(list, tuple))
        merge = kernel[0] if kernel else 1
    patch = spec.find("patch_size", _VISION) or 14
    temporal = spec.find(("temporal_patch_size", "patch_temporal"), _VISION) or 1
    channels = _channels(spec)
    side = 2 * merge
    grid = torch.tensor([[1, side, side]] * BATCH)
    n = int(grid.prod(-1).sum())
    out = {pixel_name: spec.randn(n, channels * temporal * patch * patch), grid_name: grid}
    if "merge_sizes" in spec.params:
        out["merge_sizes"] = torch.tensor([merge] * BATCH)
    return out


def _patch_grid(spec: _Spec, name: str) -> dict:
    """Vision towers fed a padded sequence of flattened patches with its
    layout (SigLIP 2: spatial_shapes and a patch mask; Gemma 4: each patch's
    (x, y)): a side x side grid per image, side a multiple of the pooling
    kernel where the tower pools patches."""
    import torch

    patch = spec.find("patch_size", _VISION) or 16
    pool = spec.find("pooling_kernel_size", _VISION) or 2
    side = 2 * pool
    n = side * side
    out = {name: spec.randn(BATCH, n, _channels(spec) * patch * patch)}
    if "spatial_shapes" in spec.params:
        out["spatial_shapes"] = torch.tensor([[side, side]] * BATCH)
    if "pixel_attention_mask" in spec.params:
        out["pixel_attention_mask"] = torch.ones(BATCH, n, dtype=torch.long)
    if "pixel_position_ids" in spec.params:
        y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        out["pixel_position_ids"] = torch.stack([x.flatten(), y.flatten()], -1).expand(BATCH, n, 2).clone()
    return out


# -- audio -----------------------------------------------------------------------

def _mel_bins(spec: _Spec) -> int:
    # Per-frame feature width: what a feature extractor stacks or projects comes first.
    stacked = spec.find("feature_projection_input_dim", _AUDIO)
    if stacked:
        return stacked
    bins = spec.find(("num_mel_bins", "input_feat_per_channel", "feature_size", "n_mels", "mel_bins"), _AUDIO)
    bins = bins or _bins_from_subsampling(spec) or 80
    frames = spec.find("num_stacked_frames", _AUDIO)
    return bins * frames if frames else bins * _stacked(spec, bins)


def _stacked(spec: _Spec, bins: int) -> int:
    """Frames stacked into one input vector (Granite Speech 5): nothing reads
    the bins themselves, the first linear layer reads a multiple of them."""
    import torch

    layers = spec.modules((torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d))
    if not layers or any(getattr(m, "in_features", getattr(m, "in_channels", None)) in (bins, 1) for m in layers):
        return 1  # read as they are, or as a one-channel (frames, bins) image
    first = layers[0]
    if isinstance(first, torch.nn.Linear) and first.in_features % bins == 0:
        if spec.find("subsampling_factor", _AUDIO) == first.in_features // bins:
            return 1  # the model stacks them itself (Nemotron 3 audio)
        return first.in_features // bins
    return 1


def _bins_from_subsampling(spec: _Spec):
    """No mel-bin count configured (Gemma 4 audio): 2-D convolutions from one
    channel subsample (frames, bins) as an image, and a linear layer reads
    the flattened channels x bins; undo the frequency strides."""
    import torch

    convs = spec.modules(torch.nn.Conv2d)
    if not convs or convs[0].in_channels != 1:
        return None
    chain = [convs[0]]
    for conv in convs[1:]:
        if conv.in_channels != chain[-1].out_channels:
            break
        chain.append(conv)
    linear = next(iter(spec.modules(torch.nn.Linear)), None)
    if linear is None or linear.in_features % chain[-1].out_channels:
        return None
    bins = linear.in_features // chain[-1].out_channels
    for conv in chain:
        bins *= conv.stride[1]
    return bins


def _channels_first(spec: _Spec, bins: int) -> bool:
    """Whisper-style encoders read (batch, bins, frames) straight into a Conv1d
    over the bins; the rest read (batch, frames, bins), some transposing
    before a Conv1d of their own: Speech2Text (which names its bins
    input_feat_per_channel) and GAN vocoders (which take a noise_sequence)."""
    import torch

    if spec.find("input_feat_per_channel", _AUDIO) or "noise_sequence" in spec.params:
        return False
    return any(m.in_channels == bins for m in spec.modules(torch.nn.Conv1d))


def _audio_features(spec: _Spec, name: str = "input_features") -> dict:
    bins = _mel_bins(spec)
    if _channels_first(spec, bins):
        # Whisper-style encoders want exactly their position table's frames,
        # before a stride-2 convolution.
        positions = spec.find("max_source_positions", _AUDIO)
        return {name: spec.randn(BATCH, bins, 2 * positions if positions else FRAMES)}
    return {name: spec.randn(BATCH, _audio_frames(spec), bins)}


def _audio_frames(spec: _Spec) -> int:
    """Chunked encoders (n_window frames a chunk, chunks of two windows) want
    whole chunks."""
    window = spec.find("n_window", _AUDIO)
    return 2 * window if window else FRAMES


def _audio_values(spec: _Spec, name: str = "input_values") -> dict:
    bins = spec.find("num_mel_bins", _AUDIO)
    length = spec.find("max_length", _AUDIO)
    if bins and length:  # a spectrogram under the name input_values (AST)
        return {name: spec.randn(BATCH, length, bins)}
    if spec.find("upsampling_ratios", _AUDIO, types=(list, tuple)):  # a neural codec: (batch, channels, samples)
        channels = spec.find(("audio_channels", "channels"), _AUDIO) or 1
        return {name: spec.randn(BATCH, channels, SAMPLES)}
    return {name: spec.randn(BATCH, SAMPLES)}


# -- the rules -------------------------------------------------------------------

def _main(spec: _Spec) -> str:
    """The main input: the model's own, unless its forward does not take it
    (sub-models that inherit a generic main_input_name): then forward's first."""
    name = getattr(spec.model, "main_input_name", "input_ids")
    if name in spec.params:
        return name
    if spec.required:
        return spec.required[0]
    return next(iter(spec.params), name)


_IMAGE_NAMES = ("pixel_values", "images", "image")
_AUDIO_FEATURE_NAMES = ("input_features", "audio_features", "input_audio_features")


def _build_main(spec: _Spec, name: str) -> dict:
    grid = _grid_param(spec)
    if grid and name in ("hidden_states", "pixel_values"):
        return _patch_sequence(spec, name, grid)
    if name == "pixel_values" and ("spatial_shapes" in spec.params or "pixel_position_ids" in spec.params):
        return _patch_grid(spec, name)
    if name == "input_ids" or name.endswith("input_ids"):
        return _text(spec, name)
    if name in _IMAGE_NAMES:
        return _pixels(spec, name)
    width = spec.find("encoder_hidden_size")
    if name.endswith("_embeds") and "encoder_hidden_states" in spec.params and width:
        # A cross-attending stack built alone (BLIP-2's Q-Former): its queries and what they attend to.
        hidden = spec.find("hidden_size", _TEXT) or 32
        return {name: spec.randn(BATCH, SEQ, hidden), "encoder_hidden_states": spec.randn(BATCH, SEQ, width)}
    if name == "input_values":
        return _audio_values(spec, name)
    if name in _AUDIO_FEATURE_NAMES:
        return _audio_features(spec, name)
    raise NotBuildable(f"no generic input for main input {name!r}")


def _placeholder_key(key: str) -> bool:
    """A configuration key naming an image placeholder token (image_token_id,
    image_patch_id, image_start_token_id, image_seq_length...)."""
    return (any(w in key for w in ("image", "img", "vision", "video"))
            and (key.endswith(("_id", "_index")) or "token" in key or "image_seq" in key))


def _dual(spec: _Spec, out: dict) -> dict:
    """Dual encoders (CLIP and kin: a contrastive forward over text and images)
    need both; so do models that take text beside images without placeholder
    image tokens in the text (ViLT, Grounding DINO, BLIP-2's Q-Former...)."""
    has_text, has_pixels = "input_ids" in spec.params, "pixel_values" in spec.params
    if not (has_text and has_pixels):
        return {}
    contrastive = "return_loss" in spec.params or (
        hasattr(spec.model, "get_text_features") and hasattr(spec.model, "get_image_features"))
    # Without image placeholder tokens the text cannot carry the image: a
    # model that fuses the two (ViLT, LayoutLMv3) reads both.
    placeholders = any(_placeholder_key(k) for c in [spec.config] + [_get(spec.config, s) for s in _TEXT]
                       if c is not None for k in c.to_dict())
    needed = ("input_ids" in spec.required) or ("pixel_values" in spec.required) or contrastive or not placeholders
    if not needed:
        return {}
    extra = {}
    if "input_ids" not in out:
        extra.update(_text(spec))
    if "pixel_values" not in out:
        extra.update(_pixels(spec))
    return extra


def _boxes(spec: _Spec, shape) -> "object":
    """Layout boxes (x0, y0, x1, y1) in 0..1000 with x0 <= x1, y0 <= y1."""
    import torch

    a = torch.randint(0, 500, (*shape, 2), generator=spec.g)
    b = a + torch.randint(0, 500, (*shape, 2), generator=spec.g)
    return torch.cat([a, b], -1)


def _companions(spec: _Spec, out: dict) -> dict:
    """Inputs the main one needs beside it, by forward parameter name."""
    import torch

    extra = {}
    ids = out.get("input_ids")
    if "bbox" in spec.params and ids is not None:
        extra["bbox"] = _boxes(spec, ids.shape)
        annotation = str(spec.params["bbox"].annotation)
        if "Long" not in annotation and "Tensor" not in annotation:  # boxes as floats in [0, 1] (UDOP)
            extra["bbox"] = extra["bbox"].float() / 1000
    feat_dim, pos_dim = spec.find("visual_feat_dim"), spec.find("visual_pos_dim")
    if "visual_feats" in spec.params and feat_dim and pos_dim:  # detector region features (LXMERT)
        extra["visual_feats"] = spec.randn(BATCH, 4, feat_dim)
        extra["visual_pos"] = torch.rand(BATCH, 4, pos_dim, generator=spec.g)
    if "lang_ids" in spec.params and ids is not None:  # per-language adapters (X-MOD): the first language
        extra["lang_ids"] = torch.zeros(ids.shape[0], dtype=torch.long)
    feats = out.get("input_features")
    if "input_features_mask" in spec.params and feats is not None:  # audio encoders that count valid frames
        frames = feats.shape[-1] if _channels_first(spec, _mel_bins(spec)) else feats.shape[1]
        extra["input_features_mask"] = torch.ones(BATCH, frames, dtype=torch.long)
    for name in spec.required:
        if name in out or name in extra:
            continue
        if name.endswith("input_ids"):  # qformer_input_ids, decoder ids, ...
            extra[name] = spec.ids()
        elif name == "pixel_values" or name.endswith("pixel_values"):
            extra.update(_pixels(spec, name))
        elif name in _AUDIO_FEATURE_NAMES:
            extra.update(_audio_features(spec, name))
        elif name.endswith("_mask") and "input_features" in out:
            feats = out["input_features"]
            frames = feats.shape[-1] if _channels_first(spec, _mel_bins(spec)) else feats.shape[1]
            extra[name] = torch.ones(BATCH, frames, dtype=torch.long)
        elif name.endswith("_mask") and ids is not None:
            extra[name] = torch.ones_like(ids)
    return extra


def _placeholders(spec: _Spec, out: dict) -> dict:
    """Models that take both images and text with image placeholder tokens
    for a fixed count of query embeddings (BLIP-2, InstructBLIP) need the
    placeholders in the text: they lead it."""
    import torch

    token = spec.find(("image_token_id", "image_token_index"))
    count = spec.find(("num_query_tokens", "image_seq_length"))
    ids = out.get("input_ids")
    if ids is None or "pixel_values" not in out or token is None or not count:
        return {}
    return {"input_ids": torch.cat([torch.full((ids.shape[0], count), token, dtype=ids.dtype), ids], 1)}


def inputs_for(model, config) -> dict:
    import torch

    if type(model).forward is torch.nn.Module.forward:
        raise NotBuildable("the model class has no forward of its own (a container of sub-models)")
    spec = _Spec(model, config)
    out = _build_main(spec, _main(spec))
    out.update(_dual(spec, out))
    out.update(_encoder_audio(spec, out))
    out.update(_decoder(spec, out))
    out.update(_placeholders(spec, out))
    out.update(_companions(spec, out))
    missing = [n for n in spec.required if n not in out]
    if missing:
        raise NotBuildable(f"forward requires {', '.join(missing)}: no generic input")
    return out
