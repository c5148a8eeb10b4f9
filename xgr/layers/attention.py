"""The attention layer of a decoder-only model, on xgr's shared / unshared KV layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from xgr.kernels.decode_attention import decode_attention_reference
from xgr.kernels.prefill_attention import prefill_attention
from xgr.kv import BeamKV, SharedKV
from xgr.layers.linear import concat_linears
from xgr.layers.norm import RMSNorm
from xgr.layers.rotary import apply_rope


@dataclass
class PrefillMetadata:
    """Per-forward metadata of a prefill over packed prompts.

    Attributes:
        shared: where each layer writes the prompt KV (one row per prompt token).
        cu_seqlens: R + 1 host ints, token offsets of each prompt in the packed batch.
        cu_seqlens_device: (R + 1,) int32 copy of cu_seqlens on the model's device, for the
            packed flash-attention path (made per layer from cu_seqlens if None).
        max_seqlen: the longest prompt (tokens); None: computed from cu_seqlens.
        packed: force (True) or forbid (False) the packed flash-attention launch; None: the
            measured choice of ``prefill_attention``.
    """

    shared: SharedKV
    cu_seqlens: list[int]
    cu_seqlens_device: torch.Tensor | None = None
    max_seqlen: int | None = None
    packed: bool | None = None


@dataclass
class DecodeMetadata:
    """Per-step metadata of a decode step over all beams of a batch.

    Attributes:
        shared: the batch's prompt KV (read, never written, during decode).
        beam: the beams' unshared KV; each layer writes slot ``beam.length``.
        cu_seqlens: R + 1 host ints, prompt offsets.
        beam_width: beam rows per request (rows are request-major).
        backend: "torch" (the reference) or "triton" (the GPU kernel), chosen by the engine.
    """

    shared: SharedKV
    beam: BeamKV
    cu_seqlens: list[int]
    beam_width: int
    backend: str = "torch"


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and optional per-head q/k RMSNorm (Qwen3).

    Parameter names follow the Hugging Face checkpoints (q_proj, k_proj, v_proj, o_proj,
    q_norm, k_norm) so their state dicts load as they are.
    """

    def __init__(self, cfg, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.scale = cfg.head_dim**-0.5
        hidden, q_dim, kv_dim = (
            cfg.hidden_size,
            cfg.num_heads * cfg.head_dim,
            cfg.num_kv_heads * cfg.head_dim,
        )
        self.q_proj = nn.Linear(hidden, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.qkv_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace q_proj, k_proj and v_proj by one ``qkv_proj`` (their rows concatenated).

        One GEMM instead of three per layer; done after the checkpoint is loaded (the HF
        names are kept until then). Idempotent.
        """
        if self.qkv_proj is None:
            self.qkv_proj = concat_linears(self.q_proj, self.k_proj, self.v_proj)
            del self.q_proj, self.k_proj, self.v_proj

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: PrefillMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        """x: (T, hidden) tokens (prompt tokens, or one per beam); returns (T, hidden)."""
        tokens = x.shape[0]
        if self.qkv_proj is not None:  # one GEMM; q, k, v are column views of its output
            q_dim = self.num_heads * self.head_dim
            kv_dim = self.num_kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        layer = self.layer_index
        if isinstance(meta, PrefillMetadata):
            # The shared KV may be a larger reused buffer: the batch fills its first tokens.
            meta.shared.k[layer, :tokens].copy_(k)
            meta.shared.v[layer, :tokens].copy_(v)
            out = prefill_attention(
                q, k, v, meta.cu_seqlens, self.scale, meta.cu_seqlens_device, meta.max_seqlen,
                meta.packed,
            )  # fmt: skip
        else:
            slot = meta.beam.length
            meta.beam.k[layer, :, slot] = k
            meta.beam.v[layer, :, slot] = v
            out = self._decode(q, meta, slot + 1)  # the current token attends to itself too
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))

    def _decode(self, q: torch.Tensor, meta: DecodeMetadata, num_tokens: int) -> torch.Tensor:
        """Attention of the beams' queries over the prompt KV and their first num_tokens."""
        layer = self.layer_index
        shared_k, shared_v = meta.shared.k[layer], meta.shared.v[layer]
        if meta.backend == "triton":
            from xgr.kernels.triton_decode_attention import beam_decode_attention

            return beam_decode_attention(
                q,
                shared_k,
                shared_v,
                meta.shared.cu_seqlens,
                meta.beam.k[layer],
                meta.beam.v[layer],
                meta.beam.rows,
                num_tokens,
                meta.beam_width,
                self.scale,
            )
        own_k, own_v = meta.beam.gather(layer, num_tokens)
        return decode_attention_reference(
            q, shared_k, shared_v, meta.cu_seqlens, own_k, own_v, meta.beam_width, self.scale
        )
