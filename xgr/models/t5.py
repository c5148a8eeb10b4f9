"""T5-family encoder-decoder (T5, T5 v1.1, Flan-T5, TIGER-style) as xgr modules.

The architecture is Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a
Unified Text-to-Text Transformer": pre-norm blocks with an RMS-style layer norm (scale only,
no mean subtraction, no bias), attention logits q . k without the 1 / sqrt(d) scale plus a
learned relative position bias (``xgr.layers.relative_position``), and a ReLU or gated-GELU
feed-forward. Module and parameter names mirror HF ``T5ForConditionalGeneration`` so its
safetensors load without renaming.

On xgr's KV layout:

- ``encode`` runs the encoder once over the packed prompts (bidirectional attention within
  each prompt) and writes every decoder layer's cross-attention K/V of the encoder output
  into the request's ``SharedKV``: (num_decoder_layers, total_prompt_tokens, num_heads, d_kv).
- ``decode`` runs one decoder step for a set of beams: self-attention over each beam's own
  tokens in ``BeamKV`` (the decoder start token at position 0, then one code per level, with
  the causal relative position bias), and cross-attention over its request's shared K/V
  (no mask, no position bias), read once per request for all its beams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from xgr.kernels.beam_self_attention import beam_self_attention_reference
from xgr.kernels.decode_attention import shared_attention_reference
from xgr.kv import BeamKV, SharedKV
from xgr.layers.linear import concat_linears
from xgr.layers.norm import RMSNorm
from xgr.layers.relative_position import relative_position_bias, square_position_bias
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
        q, k, v = self.project_qkv(x)
        beam = meta.beam
        args = (q, k, v, beam.k[layer], beam.v[layer], beam.rows, meta.kv_rows, beam.length, bias)
        if meta.backend == "triton":
            from xgr.kernels.triton_beam_self_attention import beam_self_attention

            return self.project_out(beam_self_attention(*args))
        return self.project_out(beam_self_attention_reference(*args))

    def over_encoder(self, x: torch.Tensor, layer: int, meta: EncDecDecodeMetadata) -> torch.Tensor:
        """Cross-attention of every query row over its request's encoder K/V (no mask, no
        position bias): (N, d_model) -> (N, d_model)."""
        q, k, v = self.heads(self.q, x), meta.shared.k[layer], meta.shared.v[layer]
        scale = 1.0  # T5 folds the 1 / sqrt(d) scale into its initialization
        if meta.backend == "triton":
            from xgr.kernels.triton_decode_attention import shared_decode_attention

            cu = meta.shared.cu_seqlens
            return self.project_out(shared_decode_attention(q, k, v, cu, meta.beam_width, scale))
        out, _ = shared_attention_reference(q, k, v, meta.cu_seqlens, meta.beam_width, scale)
        return self.project_out(out.to(x.dtype))


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
        self.wi_fused: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace a gated feed-forward's wi_0 and wi_1 by one ``wi_fused`` GEMM; idempotent,
        and nothing to do for an ungated one."""
        if self.gated and self.wi_fused is None:
            self.wi_fused = concat_linears(self.wi_0, self.wi_1)
            del self.wi_0, self.wi_1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wi_fused is not None:
            gate, up = self.wi_fused(x).chunk(2, dim=-1)
            if x.is_cuda and self.act is _gelu_tanh:
                from xgr.kernels.triton_elementwise import gelu_tanh_mul

                return self.wo(gelu_tanh_mul(gate, up))  # one pass for act(gate) * up
            return self.wo(self.act(gate) * up)
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


def _residual_stack(x: torch.Tensor, sublayers: list, final_norm: RMSNorm) -> torch.Tensor:
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


class T5Seq2SeqLM(nn.Module):
    """A T5 encoder-decoder whose forward passes fill xgr's KV layout.

    ``shared`` embeds both the encoder's and the decoder's tokens; ``lm_head`` is the
    checkpoint's own head or, when it has none, the loader ties it to ``shared``.

    Args:
        cfg: the model's shape and numerics.
    """

    is_encoder_decoder = True

    @property
    def shared_kv_layout(self) -> tuple[int, int, int]:
        """(layers, heads, d_kv) of the cross-attention K/V each decoder layer reads."""
        cfg = self.config
        return cfg.num_decoder_layers, cfg.num_heads, cfg.d_kv

    def __init__(self, cfg: T5Config) -> None:
        super().__init__()
        self.config = cfg
        self.shared = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.encoder = T5Stack(cfg, cfg.num_layers, decoder=False)
        self.decoder = T5Stack(cfg, cfg.num_decoder_layers, decoder=True)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def fuse_projections(self) -> None:
        """One GEMM for each self-attention's q/k/v, each cross-attention's k/v and each
        gated feed-forward's wi_0/wi_1 (``xgr.layers.linear.concat_linears``); done after
        loading, as ``CausalLM.fuse_projections``. Idempotent."""
        for stack in (self.encoder, self.decoder):
            for block in stack.block:
                block.layer[0].SelfAttention.fuse_projections()
                block.layer[-1].DenseReluDense.fuse_projections()
        for block in self.decoder.block:
            block.layer[1].EncDecAttention.fuse_kv()

    def allocate_beam_kv(self, num_rows: int, capacity: int) -> BeamKV:
        """Self-attention K/V of ``num_rows`` beams, ``capacity`` decoder tokens each."""
        cfg, weight = self.config, self.lm_head.weight
        return BeamKV.allocate(
            cfg.num_decoder_layers, num_rows, capacity, cfg.num_heads, cfg.d_kv,
            weight.dtype, weight.device,
        )  # fmt: skip

    def encode(
        self, input_ids: torch.Tensor, cu_seqlens: list[int], cross_kv: SharedKV
    ) -> torch.Tensor:
        """Run the encoder over packed prompts and fill every decoder layer's cross K/V.

        Args:
            input_ids: (T,) int64 tokens of all prompts, packed in request order.
            cu_seqlens: R + 1 host ints, prompt offsets.
            cross_kv: receives, per decoder layer, k/v of the encoder output at tokens [0, T).

        Returns:
            (T, d_model) encoder output (after the final layer norm), model dtype.
        """
        x = self.shared(input_ids)
        biases = self._encoder_biases(cu_seqlens)
        sublayers = []
        for block in self.encoder.block:
            attn, ff = block.layer
            sublayers += [
                (attn.layer_norm,
                 lambda h, a=attn: a.SelfAttention.bidirectional(h, cu_seqlens, biases)),
                (ff.layer_norm, ff.DenseReluDense),
            ]  # fmt: skip
        encoded = _residual_stack(x, sublayers, self.encoder.final_layer_norm)
        self._write_cross_kv(encoded, cross_kv)
        return encoded

    def encode_padded(
        self, tokens: torch.Tensor, lengths: torch.Tensor, padded_len: int, cross_kv: SharedKV
    ) -> torch.Tensor:
        """``encode`` for a CUDA graph: S prompts padded to one length P, with every shape
        fixed by (S, P) and the prompts' lengths read from the device.

        Each prompt attends over its own P slots with -inf at its padding keys, so its
        tokens' results equal ``encode``'s; one batched attention replaces the per-prompt
        loop (and its host offsets). The output returns to ``encode``'s packed order
        before the cross-attention K/V are written.

        Args:
            tokens: (S * P,) int64; the prompts packed from index 0 (``lengths.sum()``
                tokens); the rest must hold valid token ids and is ignored.
            lengths: (S,) int64 prompt lengths on the device, each in [1, P].
            padded_len: P (host int).
            cross_kv: receives, per decoder layer, k/v at packed tokens [0, S * P); those
                from ``lengths.sum()`` on are padding, never read by the decoder.

        Returns:
            (S * P, d_model) encoder output in packed order; rows from ``lengths.sum()``
            on are padding.
        """
        slots, device = lengths.shape[0], tokens.device
        pos = torch.arange(padded_len, device=device)
        starts = torch.cumsum(lengths, 0) - lengths
        # Padding slots repeat their prompt's last token: a valid id; masked as keys.
        gather = starts[:, None] + torch.minimum(pos[None, :], lengths[:, None] - 1)
        x = self.shared(tokens[gather.reshape(-1)])
        bias = self._encoder_bias(padded_len)
        keep = pos[None, :] < lengths[:, None]  # (S, P)
        padding = torch.zeros(keep.shape, dtype=x.dtype, device=device).masked_fill_(
            ~keep, float("-inf")
        )
        mask = bias[None] + padding[:, None, None, :]  # (S, H, P, P)
        sublayers = []
        for block in self.encoder.block:
            attn, ff = block.layer
            sublayers += [
                (attn.layer_norm, lambda h, a=attn: a.SelfAttention.bidirectional_padded(h, mask)),
                (ff.layer_norm, ff.DenseReluDense),
            ]  # fmt: skip
        encoded = _residual_stack(x, sublayers, self.encoder.final_layer_norm)
        # Packed token t of prompt r sits at padded row r * P + (t - starts[r]).
        flat = torch.arange(slots * padded_len, device=device)
        slot = torch.searchsorted(starts, flat, right=True) - 1
        offset = (flat - starts[slot]).clamp(max=padded_len - 1)
        packed = encoded[slot * padded_len + offset]
        self._write_cross_kv(packed, cross_kv)
        return packed

    def _write_cross_kv(self, encoded: torch.Tensor, cross_kv: SharedKV) -> None:
        tokens = encoded.shape[0]
        for layer, block in enumerate(self.decoder.block):
            k, v = block.layer[1].EncDecAttention.project_kv(encoded)
            cross_kv.k[layer, :tokens] = k
            cross_kv.v[layer, :tokens] = v

    def decode(self, input_ids: torch.Tensor, meta: EncDecDecodeMetadata) -> torch.Tensor:
        """One decoder step: each query row's newest token through every decoder block.

        Args:
            input_ids: (N,) int64 newest token of each row (the decoder start token at
                ``meta.beam.length`` 0, else the code chosen at the previous level).
            meta: the step's metadata; the token sits at position ``meta.beam.length``.

        Returns:
            (N, d_model) input of the LM head, model dtype: the final layer norm's output,
            times d_model ** -0.5 when ``scale_decoder_outputs``.
        """
        x = self.shared(input_ids)
        bias = self._decoder_bias(meta.beam.length, x.device)
        sublayers = []
        for layer, block in enumerate(self.decoder.block):
            attn, cross, ff = block.layer
            sublayers += [
                (attn.layer_norm,
                 lambda h, a=attn, i=layer: a.SelfAttention.over_beam(h, i, meta, bias)),
                (cross.layer_norm,
                 lambda h, c=cross, i=layer: c.EncDecAttention.over_encoder(h, i, meta)),
                (ff.layer_norm, ff.DenseReluDense),
            ]  # fmt: skip
        x = _residual_stack(x, sublayers, self.decoder.final_layer_norm)
        if self.config.scale_decoder_outputs:
            # Original T5 ties the head to the embedding and rescales its input to match.
            x = x * self.config.d_model**-0.5
        return x

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, d_model) ``decode`` output -> (N, vocab_size) float32 log-softmax."""
        return torch.log_softmax(self.lm_head(hidden).float(), dim=-1)

    def _encoder_biases(self, cu_seqlens: list[int]) -> list[torch.Tensor]:
        """(num_heads, P, P) bidirectional position bias of each prompt of P tokens.

        The bias depends on key - query alone, so every prompt's is the top-left block of
        the longest prompt's: one tensor serves the batch (views, no copies), where one per
        length grew with the number of distinct lengths.
        """
        lengths = [end - start for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
        full = self._encoder_bias(max(lengths))
        return [full[:, :n, :n] for n in lengths]

    def _encoder_bias(self, length: int) -> torch.Tensor:
        """(num_heads, length, length) bidirectional position bias of positions 0..length-1."""
        return square_position_bias(
            self.encoder.position_bias_table, length, True,
            self.config.relative_attention_max_distance,
        )  # fmt: skip

    def _decoder_bias(self, position: int, device: torch.device) -> torch.Tensor:
        """(num_heads, position + 1) causal bias of a query at ``position`` over 0..position."""
        keys = torch.arange(position + 1, device=device)
        query = keys[-1:]
        bias = relative_position_bias(
            self.decoder.position_bias_table,
            query,
            keys,
            False,
            self.config.relative_attention_max_distance,
        )
        return bias[:, 0]
