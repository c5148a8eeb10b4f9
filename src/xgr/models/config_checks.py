"""config.json checked against the weights' safetensors headers, before any module is built.

The headers give every tensor's name and shape without reading its data, so a config whose
layer count or sizes differ from the checkpoint's fails here in milliseconds, instead of
after a model of the config's size has been created and the weights read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from safetensors import SafetensorError, safe_open

from xgr.core import XgrError
from xgr.models.config import DecoderConfig, T5Config

_LAYER = r"model\.layers\.\d+\."
_BLOCK = r"(?:encoder|decoder)\.block\.\d+\.layer\.\d+\."


def read_weight_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``files``, from their safetensors headers alone.

    Raises:
        XgrError: a file that cannot be opened or is not safetensors (the message names the
            file and the ``SafetensorError`` or ``OSError``).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except (SafetensorError, OSError) as exc:
            raise XgrError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    return shapes


def check_weight_shapes(
    cfg: DecoderConfig | T5Config, shapes: dict[str, tuple[int, ...]], model_dir: Path | str
) -> None:
    """Refuse a config whose layer counts or sizes differ from its weights' headers.

    Checked: the layer count (the highest layer index in the tensor names + 1, per stack for
    T5), and the shape of every embedding, norm, attention projection (heads x head size),
    position bias and feed-forward tensor present. Tensors that are missing or unexpected are
    left to the loader, which names them once the (then correctly sized) model is built.

    Raises:
        XgrError: "weights do not match config.json", naming the config field(s), their
            values, and the tensor and shape the weights have.
    """
    # Layer indices of at most 9 digits: a longer one is no layer of a servable model (the
    # loader reports it as unexpected), and int() of a huge digit string would raise.
    if isinstance(cfg, T5Config):
        layers = [
            (r"encoder\.block\.(\d{1,9})\.", "num_layers", cfg.num_layers, "encoder.block"),
            (
                r"decoder\.block\.(\d{1,9})\.",
                "num_decoder_layers",
                cfg.num_decoder_layers,
                "decoder.block",
            ),
        ]
        rules = _t5_rules(cfg)
    else:
        layers = [
            (r"model\.layers\.(\d{1,9})\.", "num_hidden_layers", cfg.num_layers, "model.layers")
        ]
        rules = _decoder_rules(cfg)
    names = sorted(shapes, key=_natural)
    problem = _layer_count_problem(names, layers) or _shape_problem(names, shapes, rules)
    if problem:
        raise XgrError(f"{model_dir}: weights do not match config.json: {problem}")


@dataclass(frozen=True)
class _Dim:
    """One expected tensor dimension: the product of config fields (name, value)."""

    fields: tuple[tuple[str, int], ...]

    @property
    def value(self) -> int:
        return math.prod(value for _, value in self.fields)

    def __str__(self) -> str:
        names = " x ".join(name for name, _ in self.fields)
        values = " x ".join(str(value) for _, value in self.fields)
        product = f" = {self.value}" if len(self.fields) > 1 else ""
        return f"{names} = {values}{product}"


def _dim(*fields: tuple[str, int]) -> _Dim:
    return _Dim(fields)


def _decoder_rules(cfg: DecoderConfig) -> list[tuple[str, tuple[_Dim, ...]]]:
    """(tensor name pattern, expected shape) of a Qwen2 / Qwen3 / Llama checkpoint."""
    hidden = _dim(("hidden_size", cfg.hidden_size))
    vocab = _dim(("vocab_size", cfg.vocab_size))
    inter = _dim(("intermediate_size", cfg.intermediate_size))
    head = ("head_dim", cfg.head_dim)
    q = _dim(("num_attention_heads", cfg.num_heads), head)
    kv = _dim(("num_key_value_heads", cfg.num_kv_heads), head)
    return [
        (r"model\.embed_tokens\.weight", (vocab, hidden)),
        (r"lm_head\.weight", (vocab, hidden)),
        (
            r"model\.norm\.weight|" + _LAYER + r"(?:input|post_attention)_layernorm\.weight",
            (hidden,),
        ),
        (_LAYER + r"self_attn\.q_proj\.weight", (q, hidden)),
        (_LAYER + r"self_attn\.q_proj\.bias", (q,)),
        (_LAYER + r"self_attn\.[kv]_proj\.weight", (kv, hidden)),
        (_LAYER + r"self_attn\.[kv]_proj\.bias", (kv,)),
        (_LAYER + r"self_attn\.o_proj\.weight", (hidden, q)),
        (_LAYER + r"self_attn\.o_proj\.bias", (hidden,)),
        (_LAYER + r"self_attn\.[qk]_norm\.weight", (_dim(head),)),
        (_LAYER + r"mlp\.(?:gate|up)_proj\.weight", (inter, hidden)),
        (_LAYER + r"mlp\.(?:gate|up)_proj\.bias", (inter,)),
        (_LAYER + r"mlp\.down_proj\.weight", (hidden, inter)),
        (_LAYER + r"mlp\.down_proj\.bias", (hidden,)),
    ]


def _t5_rules(cfg: T5Config) -> list[tuple[str, tuple[_Dim, ...]]]:
    """(tensor name pattern, expected shape) of a T5 checkpoint."""
    model = _dim(("d_model", cfg.d_model))
    vocab = _dim(("vocab_size", cfg.vocab_size))
    ff = _dim(("d_ff", cfg.d_ff))
    heads = ("num_heads", cfg.num_heads)
    inner = _dim(heads, ("d_kv", cfg.d_kv))
    attention = _BLOCK + r"(?:SelfAttention|EncDecAttention)\."
    return [
        (r"shared\.weight", (vocab, model)),
        (r"lm_head\.weight", (vocab, model)),
        (
            r"(?:encoder|decoder)\.final_layer_norm\.weight|" + _BLOCK + r"layer_norm\.weight",
            (model,),
        ),
        (attention + r"[qkv]\.weight", (inner, model)),
        (attention + r"o\.weight", (model, inner)),
        # Only the self-attention's table is read (some files carry an unused cross one).
        (
            _BLOCK + r"SelfAttention\.relative_attention_bias\.weight",
            (
                _dim(("relative_attention_num_buckets", cfg.relative_attention_num_buckets)),
                _dim(heads),
            ),
        ),
        (_BLOCK + r"DenseReluDense\.wi(?:_0|_1)?\.weight", (ff, model)),
        (_BLOCK + r"DenseReluDense\.wo\.weight", (model, ff)),
    ]


def _layer_count_problem(names: list[str], layers) -> str | None:
    """What differs between each stack's layer count and its highest layer index + 1."""
    for pattern, field, expected, prefix in layers:
        indices = [int(m.group(1)) for m in map(re.compile(pattern).match, names) if m]
        held = max(indices) + 1 if indices else 0
        if held != expected:
            where = f"{prefix}.0 to {prefix}.{held - 1}" if held else f"no {prefix}.* tensors"
            return f"config.json has {field} = {expected}, but the weights hold {held} ({where})"
    return None


def _shape_problem(names: list[str], shapes, rules) -> str | None:
    """The first tensor, in the order of ``rules``, whose shape differs from the config's."""
    for pattern, expected in rules:
        regex = re.compile(pattern)
        for name in filter(regex.fullmatch, names):
            shape = shapes[name]
            if len(shape) != len(expected):
                want = ", ".join(str(dim) for dim in expected)
                return f"{name} has shape {list(shape)}, where config.json gives ({want})"
            for dim, size in zip(expected, shape, strict=True):
                if dim.value != size:
                    return (
                        f"config.json has {dim}, but the weights have {size}: {name} has shape "
                        f"{list(shape)}"
                    )
    return None


def _natural(name: str) -> list:
    """Sort key putting layer 2 before layer 10, so the first mismatch found is the lowest."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]
