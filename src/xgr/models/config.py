"""Model configurations read from a Hugging Face ``config.json``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from xgr.core import XgrError
from xgr.models.rope_config import rope_theta_from_hf

# model_type -> whether q/k/v projections carry a bias by default, and whether q/k are RMS-normed.
_ARCHITECTURES = {
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
    "llama": {"attention_bias": False, "qk_norm": False},
}
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")

T5_MODEL_TYPE = "t5"
# feed_forward_proj -> (gated, activation): original T5 uses "relu"; T5 v1.1 and Flan-T5 use
# "gated-gelu", whose GELU is the tanh approximation ("gelu_new" in HF's naming).
T5_FEED_FORWARD = {"relu": (False, "relu"), "gated-gelu": (True, "gelu_new")}
# Prompt limit of a T5 config without ``n_positions``: relative positions set no limit, but the
# encoder's (heads, P, P) attention bias grows with the square of the prompt.
T5_DEFAULT_MAX_PROMPT_TOKENS = 4096

# Upper bounds of config.json's sizes, checked before anything is built. No checkpoint comes
# near them (vocabularies reach ~2^18 rows, hidden and feed-forward sizes ~2^16, the deepest
# Llama or Qwen has 126 layers); they turn a mistyped value into a clear error instead of
# minutes spent creating a module per layer, or a weight whose element count overflows int64.
MAX_SIZE = 2**24
MAX_LAYERS = 1024
# Positions (decoder max_position_embeddings, T5 n_positions): 2^20 covers the longest
# contexts of served checkpoints (Qwen2.5-1M: 1,010,000); beyond it float32 rotary angles
# (position x frequency, as transformers computes them too) are rounded by up to 1/16 rad
# and more, and T5's (heads, P, P) bias of one such prompt would fit no device.
MAX_POSITIONS = 2**20
# RoPE tables are computed in float32: a base frequency beyond its range becomes inf.
_FLOAT32_MAX = 3.4028234663852886e38
_DEFAULT_ROPE_THETA = 10000.0


_MISSING = object()


def _size(
    raw: dict[str, Any],
    key: str,
    default: Any = _MISSING,
    minimum: int = 1,
    maximum: int = MAX_SIZE,
) -> int:
    """config.json's ``key`` as an integer in [``minimum``, ``maximum``] (``default`` when
    absent or null).

    Raises:
        KeyError: absent with no default. XgrError: not an integer (a float, bool or string
            would otherwise be truncated or coerced silently), below ``minimum`` or above
            ``maximum``.
    """
    value = raw.get(key)
    if value is None:
        if default is _MISSING:
            raise KeyError(key)
        return default
    if type(value) is not int or value < minimum:
        raise XgrError(f"{key} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise XgrError(f"{key} {value} is above the largest supported, {maximum}")
    return value


def _epsilon(raw: dict[str, Any], key: str, default: float) -> float:
    """config.json's ``key`` (a norm's epsilon) as a finite number >= 0.

    Raises:
        XgrError: not a JSON number (a string or bool), negative, infinite or NaN (each
            would turn every normed activation into NaN).
    """
    value = raw.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise XgrError(f"{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _flag(raw: dict[str, Any], key: str, default: bool) -> bool:
    """config.json's ``key`` as a JSON boolean (``default`` when absent or null).

    Raises:
        XgrError: not a boolean ("false" as a string would read as true).
    """
    value = raw.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise XgrError(f"{key} must be true or false, got {value!r}")
    return value


@dataclass(frozen=True)
class DecoderConfig:
    """Shape and numerics of a decoder-only transformer (Qwen2, Qwen3 or Llama).

    Attributes:
        model_type: "qwen2", "qwen3" or "llama".
        vocab_size, hidden_size, intermediate_size, num_layers: the usual sizes.
        num_heads, num_kv_heads, head_dim: attention heads; num_heads % num_kv_heads == 0.
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base frequency.
        max_position_embeddings: positions the model accepts (prompt + generated tokens).
        attention_bias: q/k/v projections have a bias.
        o_proj_bias: the output projection has a bias.
        mlp_bias: gate/up/down projections have a bias.
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        tie_word_embeddings: the LM head shares the input embedding matrix.
        hidden_act: activation of the gated MLP.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    hidden_act: str

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> DecoderConfig:
        """Read a Hugging Face config dict.

        Raises:
            XgrError: unsupported architecture, RoPE scaling, sliding window or activation;
                conflicting RoPE settings (``xgr.models.rope_config``); sizes that are not
                integers or out of range (``MAX_SIZE``, ``MAX_LAYERS``, ``MAX_POSITIONS``);
                heads that do not divide the hidden size (without head_dim) or each other;
                an odd head_dim.
        """
        model_type = raw.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise XgrError(
                f"unsupported model_type {model_type!r}; xgr serves "
                f"{sorted([*_ARCHITECTURES, T5_MODEL_TYPE])}"
            )
        defaults = _ARCHITECTURES[model_type]
        rope_theta = rope_theta_from_hf(raw, _DEFAULT_ROPE_THETA, _FLOAT32_MAX)
        if raw.get("use_sliding_window"):
            raise XgrError("sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise XgrError(
                f"activation {act!r} is not supported; use one of {SUPPORTED_ACTIVATIONS}"
            )
        num_heads = _size(raw, "num_attention_heads")
        num_kv_heads = _size(raw, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise XgrError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads} (each KV head serves a whole group of query heads)"
            )
        hidden_size = _size(raw, "hidden_size")
        if raw.get("head_dim") is None and hidden_size % num_heads:
            raise XgrError(
                f"hidden_size {hidden_size} is not a multiple of num_attention_heads "
                f"{num_heads}, and config.json gives no head_dim"
            )
        head_dim = _size(raw, "head_dim", hidden_size // num_heads)
        if head_dim % 2:  # RoPE rotates the two halves of each head against each other
            raise XgrError(f"head_dim {head_dim} must be even for rotary position embeddings")
        attention_bias = _flag(raw, "attention_bias", defaults["attention_bias"])
        config = cls(
            model_type=model_type,
            vocab_size=_size(raw, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_size(raw, "intermediate_size"),
            num_layers=_size(raw, "num_hidden_layers", maximum=MAX_LAYERS),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_epsilon(raw, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=_size(
                raw, "max_position_embeddings", 32768, maximum=MAX_POSITIONS
            ),
            attention_bias=attention_bias,
            # Qwen2 always biases q/k/v only; Qwen3 and Llama use attention_bias for o_proj too.
            o_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=model_type == "llama" and _flag(raw, "mlp_bias", False),
            qk_norm=defaults["qk_norm"],
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", False),
            hidden_act=act,
        )
        _check_layer_types(raw.get("layer_types"), config.num_layers)
        return config


@dataclass(frozen=True)
class T5Config:
    """Shape and numerics of a T5-family encoder-decoder (T5, T5 v1.1, Flan-T5, TIGER).

    Architecture of Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a
    Unified Text-to-Text Transformer" (JMLR 21(140)).

    Attributes:
        vocab_size, d_model, d_ff: vocabulary, hidden and feed-forward sizes.
        num_heads, d_kv: attention heads and the size of each (num_heads * d_kv may differ
            from d_model).
        num_layers, num_decoder_layers: encoder and decoder blocks.
        relative_attention_num_buckets, relative_attention_max_distance: the relative
            position buckets (``xgr.layers.relative_position``).
        layer_norm_epsilon: epsilon of every (RMS-style) layer norm.
        is_gated_act: the feed-forward is act(wi_0 x) * wi_1 x, else act(wi x).
        dense_act_fn: "relu" or "gelu_new" (GELU, tanh approximation).
        scale_decoder_outputs: multiply the decoder output by d_model ** -0.5 before the LM
            head (original T5, whose head is the tied embedding).
        decoder_start_token_id: the decoder's first input token.
        max_prompt_tokens: longest prompt served (``n_positions``, else
            ``T5_DEFAULT_MAX_PROMPT_TOKENS``).
    """

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    layer_norm_epsilon: float
    is_gated_act: bool
    dense_act_fn: str
    scale_decoder_outputs: bool
    decoder_start_token_id: int
    max_prompt_tokens: int
    model_type: str = T5_MODEL_TYPE

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> T5Config:
        """Read a Hugging Face T5 config dict (defaults are HF ``T5Config``'s).

        The output scaling follows ``scale_decoder_outputs`` when the file has it
        (transformers 5 writes it), else ``tie_word_embeddings`` (default True), which
        older files use to tell T5 (tied, scaled) from T5 v1.1 (untied, unscaled).

        Raises:
            XgrError: another model_type, an unsupported feed_forward_proj, no
                decoder_start_token_id, or sizes out of range (``MAX_SIZE``, ``MAX_LAYERS``,
                ``MAX_POSITIONS``).
        """
        if raw.get("model_type") != T5_MODEL_TYPE:
            raise XgrError(f"not a T5 config: model_type {raw.get('model_type')!r}")
        proj = raw.get("feed_forward_proj", "relu")
        if proj not in T5_FEED_FORWARD:
            raise XgrError(
                f"T5 feed_forward_proj {proj!r} is not supported; use one of "
                f"{sorted(T5_FEED_FORWARD)}"
            )
        gated, act = T5_FEED_FORWARD[proj]
        tied = _flag(raw, "tie_word_embeddings", True)
        scale = _flag(raw, "scale_decoder_outputs", tied)
        vocab_size = _size(raw, "vocab_size", 32128)
        start = raw.get("decoder_start_token_id")
        if type(start) is not int or not 0 <= start < vocab_size:
            raise XgrError(
                f"T5 decoder_start_token_id {start!r} is missing or outside the vocabulary "
                f"of {vocab_size}"
            )
        num_layers = _size(raw, "num_layers", 6, maximum=MAX_LAYERS)
        buckets = _size(raw, "relative_attention_num_buckets", 32)
        max_distance = _size(raw, "relative_attention_max_distance", 128)
        # Each direction needs an exact bucket, and the log-spaced buckets a range to span:
        # the bucket formula divides by log(max_distance / exact), exact <= buckets // 2.
        if buckets < 4 or max_distance <= buckets // 2:
            raise XgrError(
                f"T5 relative_attention_num_buckets {buckets} and max_distance {max_distance} "
                "are out of range (need buckets >= 4 and max_distance > buckets // 2)"
            )
        max_prompt = _size(raw, "n_positions", T5_DEFAULT_MAX_PROMPT_TOKENS, maximum=MAX_POSITIONS)
        return cls(
            vocab_size=vocab_size,
            d_model=_size(raw, "d_model", 512),
            d_kv=_size(raw, "d_kv", 64),
            d_ff=_size(raw, "d_ff", 2048),
            num_layers=num_layers,
            num_decoder_layers=_size(raw, "num_decoder_layers", num_layers, maximum=MAX_LAYERS),
            num_heads=_size(raw, "num_heads", 8),
            relative_attention_num_buckets=buckets,
            relative_attention_max_distance=max_distance,
            layer_norm_epsilon=_epsilon(raw, "layer_norm_epsilon", 1e-6),
            is_gated_act=gated,
            dense_act_fn=act,
            scale_decoder_outputs=scale,
            decoder_start_token_id=int(start),
            max_prompt_tokens=max_prompt,
        )


def _check_layer_types(layer_types: Any, layers: int) -> None:
    """Refuse a ``layer_types`` list (transformers 5) that is not one full-attention entry per
    layer of the ``layers``: every layer here runs full causal attention."""
    if layer_types is None:
        return
    if not isinstance(layer_types, list) or len(layer_types) != layers:
        count = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
        raise XgrError(
            f"layer_types must list one type per layer: num_hidden_layers is {layers}, "
            f"layer_types has {count}"
        )
    other = sorted({str(t) for t in layer_types} - {"full_attention"})
    if other:
        raise XgrError(f"layer_types {other} are not supported: only full_attention")
