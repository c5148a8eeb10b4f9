"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xgr.core import XgrError

# model_type -> whether q/k/v projections carry a bias by default, and whether q/k are RMS-normed.
_ARCHITECTURES = {
    "qwen2": {"attention_bias": True, "qk_norm": False},
    "qwen3": {"attention_bias": False, "qk_norm": True},
    "llama": {"attention_bias": False, "qk_norm": False},
}
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


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
            XgrError: unsupported architecture, RoPE scaling, sliding window or activation.
        """
        model_type = raw.get("model_type")
        if model_type not in _ARCHITECTURES:
            raise XgrError(
                f"unsupported model_type {model_type!r}; xgr serves {sorted(_ARCHITECTURES)}"
            )
        defaults = _ARCHITECTURES[model_type]
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise XgrError(f"RoPE type {rope_type!r} is not supported (only 'default')")
        rope_theta = raw.get("rope_theta", rope.get("rope_theta", 10000.0))
        if raw.get("use_sliding_window"):
            raise XgrError("sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise XgrError(
                f"activation {act!r} is not supported; use one of {SUPPORTED_ACTIVATIONS}"
            )
        num_heads = int(raw["num_attention_heads"])
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise XgrError(f"num_attention_heads {num_heads} not a multiple of {num_kv_heads}")
        attention_bias = bool(raw.get("attention_bias", defaults["attention_bias"]))
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            attention_bias=attention_bias,
            # Qwen2 always biases q/k/v only; Qwen3 and Llama use attention_bias for o_proj too.
            o_proj_bias=attention_bias and model_type != "qwen2",
            mlp_bias=model_type == "llama" and bool(raw.get("mlp_bias", False)),
            qk_norm=defaults["qk_norm"],
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            hidden_act=act,
        )
