"""The attention layer of a decoder-only model, on xgr's shared / unshared KV layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xgr.kernels.decode_attention import decode_attention_reference
from xgr.kernels.prefill_attention import prefill_attention
from xgr.kv import BeamKV, SharedKV
from xgr.layers.linear import concat_linears
from xgr.layers.norm import RMSNorm, rms_norm_reference
from xgr.layers.rotary import apply_rope_reference


@dataclass
class PrefillMetadata:
    """Per-forward metadata of a prefill over packed prompts.

    Attributes:
        shared: where each layer writes the prompt KV (one row per prompt token).
        cu_seqlens: R + 1 host ints, token offsets of each prompt in the packed batch.
        cu_seqlens_device: (R + 1,) int32 copy of cu_seqlens on the model's device, for the
            packed attention launch (made per layer from cu_seqlens if None).
        max_seqlen: the longest prompt (tokens); None: computed from cu_seqlens.
        packed: force (True) or forbid (False) the packed attention launch; None: the
            measured choice of ``prefill_attention``.
        output_rows: (R,) int64 packed index of each prompt's last token on the model's
            device, or None. When given, the model's forward returns (R, hidden) states of
            these rows only, and its last layer runs attention, the output projection and
            the MLP for them alone (it still writes the KV of every token): the other rows'
            last-layer outputs are never read.
        first_codes: None, or the decode metadata of rows that follow the prompt tokens in
            the same pass: each request's candidate first codes, one position after its
            prompt (level 1's forward, ``xgr.runner.DecoderRunner.first_levels_together``). They
            write their K/V into slot 0 of ``first_codes.beam`` (row r * W + j for code j of
            request r, W = ``first_codes.beam_width``) and attend over their request's
            prompt and themselves; the forward returns their hidden states after the
            ``output_rows`` ones.
    """

    shared: SharedKV
    cu_seqlens: list[int]
    cu_seqlens_device: torch.Tensor | None = None
    max_seqlen: int | None = None
    packed: bool | None = None
    output_rows: torch.Tensor | None = None
    first_codes: DecodeMetadata | None = None

    @property
    def num_code_rows(self) -> int:
        """Rows of ``first_codes`` at the end of the pass (0 without them)."""
        return 0 if self.first_codes is None else self.first_codes.beam.rows.shape[0]


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
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: (T, hidden) tokens (prompt tokens, or one per beam); returns (T, hidden).

        With ``rows`` (prefill only: (R,) int64 index of each prompt's last token, then the
        index of each ``meta.first_codes`` row), every token's K/V is still written but only
        these rows attend, and (len(rows), hidden) is returned.
        """
        tokens, layer = x.shape[0], self.layer_index
        if self.qkv_proj is not None:  # one GEMM
            qkv = self.qkv_proj(x)
        else:  # the HF-named projections, before fuse_projections
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=1)
        if isinstance(meta, DecodeMetadata):
            slot = meta.beam.length
            q = self._heads(qkv, cos, sin, meta.beam.k[layer, :tokens, slot],
                            meta.beam.v[layer, :tokens, slot])  # fmt: skip
            out = self._decode(q, meta, slot + 1)  # the current token attends to itself too
            return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        codes = meta.num_code_rows
        prompt = tokens - codes
        # The prompt KV may be a larger reused buffer whose first tokens the batch fills.
        k, v = meta.shared.k[layer, :prompt], meta.shared.v[layer, :prompt]
        q = self._heads(qkv[:prompt], cos[:prompt], sin[:prompt], k, v)
        if rows is not None:
            cu = meta.cu_seqlens_device
            if cu is None:
                cu = torch.tensor(meta.cu_seqlens, dtype=torch.int32, device=q.device)
            last = rows[: rows.shape[0] - codes]
            out = last_token_attention(q[last], k, v, cu, self.scale, meta.cu_seqlens)
        else:
            out = prefill_attention(
                q, k, v, meta.cu_seqlens, self.scale, meta.cu_seqlens_device, meta.max_seqlen,
                meta.packed,
            )  # fmt: skip
        if codes:
            beam = meta.first_codes.beam
            q = self._heads(qkv[prompt:], cos[prompt:], sin[prompt:], beam.k[layer, :, 0],
                            beam.v[layer, :, 0])  # fmt: skip
            out = torch.cat((out, self._decode(q, meta.first_codes, 1)))
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))

    def _heads(self, qkv, cos, sin, k_out, v_out) -> torch.Tensor:
        """``qkv_heads`` with this layer's head counts and q/k norms: q of the rows of qkv,
        their k and v written into k_out / v_out."""
        norms = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        eps = self.q_norm.eps if self.qk_norm else 0.0
        return qkv_heads(
            qkv, self.num_heads, self.num_kv_heads, cos, sin, k_out, v_out, *norms, eps
        )

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


# Prompts per masked product when their offsets are known on the host: one product over a
# whole batch costs prompts x batch tokens, which grows with the square of a large batch.
LAST_TOKEN_CHUNK = 16


def last_token_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    cu_seqlens_host: list[int] | None = None,
) -> torch.Tensor:
    """Attention of each prompt's last token over its whole prompt (the one row of causal
    prefill attention that a prompt's final hidden state needs).

    Args:
        q: (R, num_heads, head_dim) query of the last token of each of R prompts.
        k, v: (T, num_kv_heads, head_dim) packed prompt K/V; num_heads % num_kv_heads == 0.
        cu_seqlens: (R + 1 or more,) int tensor on q's device; prompt r is rows
            cu_seqlens[r] to cu_seqlens[r + 1] - 1 of k and v (later entries are ignored).
        scale: softmax scale.
        cu_seqlens_host: the same R + 1 offsets as host ints, if known (not inside a CUDA
            graph, whose offsets are device values): then the prompts are taken
            ``LAST_TOKEN_CHUNK`` at a time, each group over its own keys only.

    Returns:
        (R, num_heads, head_dim) in q's dtype: SDPA with a mask that keeps each query within
        its prompt, the query heads of one KV head stacked as rows (no K/V copy per head).
    """
    num = q.shape[0]
    if num <= LAST_TOKEN_CHUNK or cu_seqlens_host is None or len(cu_seqlens_host) != num + 1:
        return _masked_last_token_attention(q, k, v, cu_seqlens, scale)
    parts = []
    for first in range(0, num, LAST_TOKEN_CHUNK):
        end = min(first + LAST_TOKEN_CHUNK, num)
        lo, hi = cu_seqlens_host[first], cu_seqlens_host[end]
        offsets = cu_seqlens[first : end + 1] - lo
        parts.append(_masked_last_token_attention(q[first:end], k[lo:hi], v[lo:hi], offsets, scale))
    return torch.cat(parts)


def _masked_last_token_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    num, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    position = torch.arange(k.shape[0], device=q.device)
    mask = (position >= cu_seqlens[:num, None]) & (position < cu_seqlens[1 : num + 1, None])
    mask = mask.repeat_interleave(group, dim=0)  # (R * group, T), row = r * group + g
    grouped = q.view(num, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads, -1, dim)
    out = F.scaled_dot_product_attention(
        grouped[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask,
        scale=scale,
    )  # fmt: skip
    return out[0].view(kv_heads, num, group, dim).transpose(0, 1).reshape(num, heads, dim)


def qkv_heads(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Split a fused q/k/v projection into heads: norm q and k (if weights are given), rotate
    them, write k and v into ``k_out`` / ``v_out`` and return q.

    On CUDA one Triton pass (``xgr.kernels.triton_elementwise.qkv_heads``, where its
    arguments, shapes and errors are described), else ``qkv_heads_reference``.
    """
    heads = num_heads + 2 * num_kv_heads
    if qkv.is_cuda and qkv.dim() == 2 and qkv.shape[1] // heads in (16, 32, 64, 128, 256):
        from xgr.kernels import triton_elementwise

        return triton_elementwise.qkv_heads(
            qkv, num_heads, num_kv_heads, cos, sin, k_out, v_out, q_norm_weight, k_norm_weight,
            eps,
        )  # fmt: skip
    return qkv_heads_reference(
        qkv, num_heads, num_kv_heads, cos, sin, k_out, v_out, q_norm_weight, k_norm_weight, eps
    )


def qkv_heads_reference(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The torch reference of ``qkv_heads``: split, RMSNorm, RoPE and copy, op by op.

    Returns:
        q: (T, num_heads, head_dim) in qkv's dtype.
    """
    tokens = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=1)  # fmt: skip
    q = q.reshape(tokens, num_heads, head_dim)
    k = k.reshape(tokens, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = rms_norm_reference(q, q_norm_weight, eps), rms_norm_reference(k, k_norm_weight, eps)
    k_out.copy_(apply_rope_reference(k, cos, sin))
    v_out.copy_(v.view(tokens, num_kv_heads, head_dim))
    return apply_rope_reference(q, cos, sin)
