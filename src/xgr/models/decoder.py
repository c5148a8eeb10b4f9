"""Decoder-only causal LM (Qwen2, Qwen3, Llama) as xgr modules.

Module and parameter names mirror the Hugging Face implementations so checkpoints load
without renaming; attention runs on xgr's shared / unshared KV layout instead of HF's cache.
"""

from __future__ import annotations

import torch
from torch import nn

from xgr.layers.attention import Attention, DecodeMetadata, PrefillMetadata
from xgr.layers.mlp import GatedMLP
from xgr.layers.norm import RMSNorm
from xgr.layers.rotary import rope_cos_sin
from xgr.models.config import DecoderConfig
from xgr.models.embeds import PromptEmbeds


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The last residual add is left to the next norm (which adds in the same pass): the layer
    returns the residual stream and its MLP output separately.
    """

    def __init__(self, cfg: DecoderConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias)

    def forward(
        self, x: torch.Tensor, cos, sin, meta, delta: torch.Tensor | None = None, rows=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, hidden) residual stream; delta: the previous layer's MLP output, not yet
        added to x (None for the first layer). Returns (residual stream, this MLP's output).

        rows: (R,) int64 token rows whose outputs are wanted (prefill's last layer): every
        token's K/V is written, the rest runs on these rows and returns R rows."""
        if delta is None:
            h = self.input_layernorm(x)
        else:
            x, h = self.input_layernorm(delta, residual=x)
        attn = self.self_attn(h, cos, sin, meta, rows)
        if rows is not None:
            x = x[rows]
        x, h = self.post_attention_layernorm(attn, residual=x)
        return x, self.mlp(h)


class DecoderStack(nn.Module):
    """Embedding, layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A decoder-only LM whose forward fills xgr's KV layout.

    Args:
        cfg: the model's shape and numerics.
    """

    is_encoder_decoder = False
    # The prompt KV is written layer by layer during prefill: a contiguous block per layer.
    token_major_shared_kv = False
    # Set by ``xgr.models.quantize.quantize_fp8`` ("fp8", "fp8-tensorwise") once it has
    # quantized the projections.
    quantization: str | None = None

    @property
    def shared_kv_layout(self) -> tuple[int, int, int]:
        """(layers, KV heads, head_dim) of the prompt KV this model reads while decoding."""
        cfg = self.config
        return cfg.num_layers, cfg.num_kv_heads, cfg.head_dim

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderStack(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: PrefillMetadata | DecodeMetadata,
        embeds: PromptEmbeds | None = None,
    ) -> torch.Tensor:
        """Run the layers over a packed set of tokens.

        Args:
            input_ids: (T,) int64 token ids (all prompt tokens, or one token per beam; a
                prefill's ``meta.first_codes`` rows last).
            positions: (T,) int64 position of each token in its sequence.
            meta: prefill (writes the shared KV) or decode (writes the beams' KV) metadata.
            embeds: a prefill's given input embeddings (``PromptEmbeds``); None: tokens only.

        Returns:
            (T, hidden_size) final hidden states in the model dtype; (R + C, hidden_size),
            those of ``meta.output_rows`` and then of the C ``meta.first_codes`` rows, when a
            prefill's metadata sets them.
        """
        x = self.model.embed_tokens(input_ids)
        if embeds is not None:
            x = embeds.splice(x)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        delta = None
        rows = meta.output_rows if isinstance(meta, PrefillMetadata) else None
        if rows is not None and meta.num_code_rows:
            total = len(input_ids)
            codes = torch.arange(total - meta.num_code_rows, total, device=x.device)
            rows = torch.cat((rows, codes))
        last = len(self.model.layers) - 1
        for index, layer in enumerate(self.model.layers):
            x, delta = layer(x, cos, sin, meta, delta, rows if index == last else None)
        if delta is None:  # no layers
            return self.model.norm(x if rows is None else x[rows])
        return self.model.norm(delta, residual=x)[1]

    def fuse_projections(self) -> None:
        """Fuse each layer's q/k/v and gate/up projections into one GEMM each (idempotent).

        Call after loading weights: the fused modules replace the HF-named ones, so a state
        dict saved afterwards no longer has HF names. Peak memory grows by one layer's
        projections while fusing.
        """
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32 log-softmax over the full vocabulary."""
        return torch.log_softmax(self.lm_head(hidden).float(), dim=-1)
