"""The blocks of a T5-family encoder-decoder (``xgr.models.t5``): attention with T5's
relative position bias, the ReLU or gated-GELU feed-forward, and HF's sublayer, block and
stack containers (their names mirror HF ``T5ForConditionalGeneration``, so checkpoints load
without renaming).

Every sublayer is pre-norm with a residual: x + f(layer_norm(x)). ``residual_stack`` runs a
stack of them with each residual add fused into the next norm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xgr.kernels.beam_self_attention import (
    beam_self_attention_reference,
    start_and_codes_attention_reference,
)
from xgr.kernels.decode_attention import shared_attention_reference
from xgr.kv import BeamKV, SharedKV
from xgr.layers.linear import concat_linears, fuse_gate_up
from xgr.layers.mlp import KERNEL_ACTIVATIONS, gated_projection
from xgr.layers.norm import RMSNorm
from xgr.models.config import T5Config


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS = {"relu": F.relu, "gelu_new": _gelu_tanh}


@dataclass
class EncDecDecodeMetadata:
    """Per-step metadata of a decoder step over a batch's beams.

    Attributes:
        shared: the batch's cross-attention K/V (written by ``encode``, read here).
        beam: the beams' self-attention K/V; each layer writes slot ``beam.length``.
        cu_seqlens: R + 1 host ints, prompt offsets in ``shared``.
        beam_width: query rows per request (rows are request-major).
        kv_rows: (N,) int64 ``beam`` row each query row writes and reads through.
        backend: attention by "torch" (the references) or "triton": cross-attention by the
            shared-KV decode kernel (reading ``shared.cu_seqlens`` on the device), decoder
            self-attention by ``triton_beam_self_attention``.
    """

    shared: SharedKV
    beam: BeamKV
    cu_seqlens: list[int]
    beam_width: int
    kv_rows: torch.Tensor
    backend: str = "torch"


class T5Attention(nn.Module):
    """q, k, v, o projections (no biases) of one attention, and, on the first block of a
    stack, the relative position bias table that every block of the stack uses."""

    def __init__(self, cfg: T5Config, has_relative_bias: bool) -> None:
        super().__init__()
        self.num_heads, self.d_kv = cfg.num_heads, cfg.d_kv
        inner = cfg.num_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        if has_relative_bias:
            self.relative_attention_bias = nn.Embedding(
                cfg.relative_attention_num_buckets, cfg.num_heads
            )
        self.qkv: nn.Linear | None = None
        self.kv: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace q, k and v by one ``qkv`` (their rows concatenated): one GEMM instead of
        three for a self-attention. Done after loading (the HF names load); idempotent."""
        if self.qkv is None:
            self.qkv = concat_linears(self.q, self.k, self.v)
            del self.q, self.k, self.v

    def fuse_kv(self) -> None:
        """Replace k and v by one ``kv`` GEMM (a cross-attention's, over the encoder output,
        whose q reads the decoder instead); idempotent."""
        if self.kv is None:
            self.kv = concat_linears(self.k, self.v)
            del self.k, self.v

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, d_model) -> k, v, each (T, num_heads, d_kv) (views of one GEMM if fused)."""
        if self.kv is None:
            return self.heads(self.k, x), self.heads(self.v, x)
        k, v = self.kv(x).view(x.shape[0], 2, self.num_heads, self.d_kv).unbind(1)
        return k, v

    def heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """(T, d_model) -> (T, num_heads, d_kv) through one projection."""
        return proj(x).view(x.shape[0], self.num_heads, self.d_kv)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, d_model) -> q, k, v, each (T, num_heads, d_kv) (views of one GEMM if fused)."""
        if self.qkv is None:
            return self.heads(self.q, x), self.heads(self.k, x), self.heads(self.v, x)
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.d_kv).unbind(1)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """(T, num_heads, d_kv) -> (T, d_model)."""
        return self.o(out.reshape(out.shape[0], self.num_heads * self.d_kv))

    def bidirectional(
        self, x: torch.Tensor, cu_seqlens: list[int], biases: list[torch.Tensor]
    ) -> torch.Tensor:
        """Encoder self-attention within each packed prompt.

        Args:
            x: (T, d_model) normed hidden states of all prompts, model dtype.
            cu_seqlens: R + 1 host ints, prompt offsets.
            biases: per prompt, (num_heads, P, P) position bias, model dtype.

        Returns:
            (T, d_model) attention output (before the residual add).
        """
        q, k, v = self.project_qkv(x)
        out = torch.empty_like(q)
        for r, bias in enumerate(biases):
            span = slice(cu_seqlens[r], cu_seqlens[r + 1])
            qs, ks, vs = (t[span].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, P, D]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias[None], scale=1.0)
            out[span] = o[0].transpose(0, 1)
        return self.project_out(out)

    def bidirectional_padded(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Encoder self-attention over S prompts padded to one length P.

        Args:
            x: (S * P, d_model) normed hidden states, prompt-major, model dtype.
            mask: (S, num_heads, P, P) additive mask, model dtype: the position bias, and
                -inf at each prompt's padding keys (``T5Seq2SeqLM.encode_padded``).

        Returns:
            (S * P, d_model); rows of padding queries hold values never read.
        """
        slots, _, length, _ = mask.shape
        q, k, v = (t.view(slots, length, self.num_heads, self.d_kv).transpose(1, 2)
                   for t in self.project_qkv(x))  # fmt: skip
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return self.project_out(out.transpose(1, 2).reshape(x.shape[0], self.num_heads, -1))

    def bidirectional_by_offset(
        self,
        x: torch.Tensor,
        lengths: torch.Tensor,
        bias_by_offset: torch.Tensor,
        length: int,
        max_distance: int | None = None,
    ) -> torch.Tensor:
        """``bidirectional_padded`` by xgr's Triton kernel, which reads the position bias per
        key - query offset and masks each prompt's padding keys itself (no square mask).

        Args:
            x: (S * P, d_model) normed hidden states, prompt-major, model dtype.
            lengths: (S,) int64 prompt lengths on the device, each in [1, P].
            bias_by_offset: (num_heads, 2 * P - 1) position bias (``offset_position_bias``).
            length: P.
            max_distance: the config's ``relative_attention_max_distance`` when the bias
                came from T5's buckets (offsets that far share one bias: the kernel's
                ``constant_beyond``), else None.

        Returns:
            (S * P, d_model); rows of padding queries hold values never read.
        """
        from xgr.kernels.triton_encoder_attention import padded_biased_attention

        q, k, v = self.project_qkv(x)
        out = padded_biased_attention(
            q, k, v, lengths, bias_by_offset, length, constant_beyond=max_distance
        )
        return self.project_out(out)

    def over_beam(
        self, x: torch.Tensor, layer: int, meta: EncDecDecodeMetadata, bias: torch.Tensor
    ) -> torch.Tensor:
        """Decoder self-attention of each beam's newest token over the beam's own tokens.

        Writes the token's K/V into slot ``meta.beam.length`` of its ``kv_rows`` row, then
        attends over slots 0..length through the beam's ancestry index.

        Args:
            x: (N, d_model) normed hidden states, one per query row.
            layer: decoder layer index.
            meta: this step's metadata.
            bias: (num_heads, length + 1) position bias of the newest token over the slots.

        Returns:
            (N, d_model).
        """
        return self.project_out(self.beam_attention(*self.project_qkv(x), layer, meta, bias))

    def beam_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        meta: EncDecDecodeMetadata,
        bias: torch.Tensor,
    ) -> torch.Tensor:
        """``over_beam`` between its projections: q, k, v (N, num_heads, d_kv) of the
        newest tokens -> (N, num_heads, d_kv) attention output (k, v written to the beam)."""
        beam = meta.beam
        args = (q, k, v, beam.k[layer], beam.v[layer], beam.rows, meta.kv_rows, beam.length, bias)
        if meta.backend == "triton":
            from xgr.kernels.triton_beam_self_attention import beam_self_attention

            return beam_self_attention(*args)
        return beam_self_attention_reference(*args)

    def over_start_and_codes(
        self, x: torch.Tensor, layer: int, meta: EncDecDecodeMetadata, bias: torch.Tensor
    ) -> torch.Tensor:
        """Decoder self-attention of ``T5Seq2SeqLM.decode_start_and_codes``'s pass: each
        request's start token over itself, each of its codes over the start token and
        itself (``start_and_codes_attention_reference``), K/V written at slots 0 and 1.

        Args:
            x: (N, d_model) normed hidden states, ``meta.beam_width`` rows a request.
            layer: decoder layer index.
            meta: the pass's metadata.
            bias: (num_heads, 2) position bias of position 1 over positions 0 and 1.

        Returns:
            (N, d_model).
        """
        q, k, v = self.project_qkv(x)
        beam = meta.beam
        args = (q, k, v, beam.k[layer], beam.v[layer], meta.beam_width, bias)
        if meta.backend == "triton":
            from xgr.kernels.triton_beam_self_attention import start_and_codes_attention

            return self.project_out(start_and_codes_attention(*args))
        return self.project_out(start_and_codes_attention_reference(*args))

    def over_encoder(self, x: torch.Tensor, layer: int, meta: EncDecDecodeMetadata) -> torch.Tensor:
        """Cross-attention of every query row over its request's encoder K/V (no mask, no
        position bias): (N, d_model) -> (N, d_model)."""
        return self.project_out(self.encoder_attention(self.heads(self.q, x), layer, meta))

    def encoder_attention(
        self, q: torch.Tensor, layer: int, meta: EncDecDecodeMetadata
    ) -> torch.Tensor:
        """``over_encoder`` between its projections: (N, num_heads, d_kv) queries ->
        (N, num_heads, d_kv) attention output, in q's dtype."""
        k, v = meta.shared.k[layer], meta.shared.v[layer]
        scale = 1.0  # T5 folds the 1 / sqrt(d) scale into its initialization
        if meta.backend == "triton":
            from xgr.kernels.triton_decode_attention import shared_decode_attention

            return shared_decode_attention(q, k, v, meta.shared.cu_seqlens, meta.beam_width, scale)
        out, _ = shared_attention_reference(q, k, v, meta.cu_seqlens, meta.beam_width, scale)
        return out.to(q.dtype)


class T5FeedForward(nn.Module):
    """wo(act(wi x)), or wo(act(wi_0 x) * wi_1 x) when gated; (T, d_model) -> (T, d_model)."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.gated = cfg.is_gated_act
        if self.gated:
            self.wi_0 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
            self.wi_1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        else:
            self.wi = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.act = _ACTIVATIONS[cfg.dense_act_fn]
        self.kernel_act = KERNEL_ACTIVATIONS.get(cfg.dense_act_fn)
        self.wi_fused: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace a gated feed-forward's wi_0 and wi_1 by one ``wi_fused`` GEMM, their rows
        interleaved (``xgr.layers.linear.fuse_gate_up``); idempotent, and nothing to do for
        an ungated one."""
        if self.gated and self.wi_fused is None:
            self.wi_fused = fuse_gate_up(self.wi_0, self.wi_1)
            del self.wi_0, self.wi_1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wi_fused is not None:
            return self.wo(gated_projection(x, self.wi_fused, self.act, self.kernel_act))
        if self.gated:
            return self.wo(self.act(self.wi_0(x)) * self.wi_1(x))
        return self.wo(self.act(self.wi(x)))


class SelfAttentionSublayer(nn.Module):
    """HF's ``layer.0``: self-attention and its pre-norm; ``T5Seq2SeqLM`` applies them as
    x + attention(layer_norm(x)), bidirectional in the encoder, over the beam in the decoder."""

    def __init__(self, cfg: T5Config, has_relative_bias: bool) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(cfg, has_relative_bias)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class CrossAttentionSublayer(nn.Module):
    """HF's decoder ``layer.1``: cross-attention and its pre-norm, applied as
    x + cross_attention(layer_norm(x))."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.EncDecAttention = T5Attention(cfg, has_relative_bias=False)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


class FeedForwardSublayer(nn.Module):
    """HF's last sublayer of a block: the feed-forward and its pre-norm, applied as
    x + feed_forward(layer_norm(x))."""

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.DenseReluDense = T5FeedForward(cfg)
        self.layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)


def residual_stack(x: torch.Tensor, sublayers: list, final_norm: RMSNorm) -> torch.Tensor:
    """x + f(norm(x)) for each (norm, f) in order, then ``final_norm``; returns its output.

    Each residual add runs inside the next norm (``RMSNorm(delta, residual)``: one pass on
    CUDA), which rounds x + delta to the model dtype as the separate add did.
    """
    h = sublayers[0][0](x)
    norms = [norm for norm, _ in sublayers[1:]] + [final_norm]
    for (_, f), norm in zip(sublayers, norms, strict=True):
        x, h = norm(f(h), x)
    return h


class T5Block(nn.Module):
    """Encoder block (self-attention, feed-forward) or decoder block (self-attention,
    cross-attention, feed-forward), as HF's ``block.{i}.layer`` list."""

    def __init__(self, cfg: T5Config, first: bool, decoder: bool) -> None:
        super().__init__()
        layers: list[nn.Module] = [SelfAttentionSublayer(cfg, has_relative_bias=first)]
        if decoder:
            layers.append(CrossAttentionSublayer(cfg))
        layers.append(FeedForwardSublayer(cfg))
        self.layer = nn.ModuleList(layers)


class T5Stack(nn.Module):
    """The encoder's or decoder's blocks and final layer norm."""

    def __init__(self, cfg: T5Config, num_blocks: int, decoder: bool) -> None:
        super().__init__()
        self.block = nn.ModuleList(T5Block(cfg, i == 0, decoder) for i in range(num_blocks))
        self.final_layer_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon)

    @property
    def position_bias_table(self) -> torch.Tensor:
        """(num_buckets, num_heads) bias table of the first block, used by every block."""
        return self.block[0].layer[0].SelfAttention.relative_attention_bias.weight
