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

import functools

import torch
from torch import nn

from xgr.kernels.encoder_attention import square_mask
from xgr.kv import BeamKV, SharedKV
from xgr.layers.linear import concat_linears
from xgr.layers.relative_position import (
    offset_position_bias,
    relative_position_bias,
    square_position_bias,
)
from xgr.models.config import T5Config
from xgr.models.embeds import PromptEmbeds
from xgr.models.t5_blocks import EncDecDecodeMetadata, T5Stack, residual_stack
from xgr.models.t5_small_rows import decode_small_rows, small_rows_kernels

# The attention of ``encode_padded`` (the encoder's CUDA graph): "triton" (the default), xgr's
# kernel reading the bias per key - query offset, one value for the key tiles beyond the
# config's max_distance (head sizes it lacks keep SDPA), or "sdpa", PyTorch SDPA with the
# square (S, heads, P, P) bias + padding mask. The kernel was faster per layer and needs no
# mask, which SDPA builds per encode (docs/performance.md). Set it before an engine captures
# its graphs (captured graphs keep what they ran). Under SDPA, encodes whose square mask
# would be too large for a graph run eagerly (``engine.graph_keys.MAX_GRAPH_WORKSPACE_BYTES``).
ENCODER_ATTENTION = "triton"

__all__ = ["EncDecDecodeMetadata", "T5Seq2SeqLM"]


class T5Seq2SeqLM(nn.Module):
    """A T5 encoder-decoder whose forward passes fill xgr's KV layout.

    ``shared`` embeds both the encoder's and the decoder's tokens; ``lm_head`` is the
    checkpoint's own head or, when it has none, the loader ties it to ``shared``.

    Args:
        cfg: the model's shape and numerics.
    """

    is_encoder_decoder = True
    # Every decoder layer's cross K/V come from the same encoder output: one token-major
    # buffer lets one GEMM (``cross_kv``) write all of them (``SharedKV.token_major``).
    token_major_shared_kv = True
    quantization: str | None = None  # not quantizable (``xgr.models.quantize``)

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
        self.cross_kv: nn.Linear | None = None
        self._bias_cache: dict[tuple, torch.Tensor] = {}

    def fuse_projections(self) -> None:
        """One GEMM for each self-attention's q/k/v and each gated feed-forward's
        wi_0/wi_1, and one for the cross-attention k/v of all decoder layers
        (``xgr.layers.linear.concat_linears``); done after loading, as
        ``CausalLM.fuse_projections``. Idempotent.

        ``cross_kv`` computes every decoder layer's cross K and V of the encoder output at
        once: its output columns are (layer, k or v, head, d_kv), the layout of a row of
        ``SharedKV.token_major``. Each layer's own ``kv`` projection stays, as a view of
        its rows (no second copy of the weights).

        From here on the position biases are kept once computed (``_position_bias``): like
        the fused weights, they are copies that later weight edits do not reach.
        """
        for stack in (self.encoder, self.decoder):
            for block in stack.block:
                block.layer[0].SelfAttention.fuse_projections()
                block.layer[-1].DenseReluDense.fuse_projections()
        if self.cross_kv is not None:
            return
        attentions = [block.layer[1].EncDecAttention for block in self.decoder.block]
        for attn in attentions:
            attn.fuse_kv()
        if attentions:
            self.cross_kv = concat_linears(*(attn.kv for attn in attentions))
            for attn, weight in zip(
                attentions, self.cross_kv.weight.chunk(len(attentions)), strict=True
            ):
                attn.kv.weight = nn.Parameter(weight, requires_grad=False)

    def allocate_beam_kv(self, num_rows: int, capacity: int) -> BeamKV:
        """Self-attention K/V of ``num_rows`` beams, ``capacity`` decoder tokens each."""
        cfg, weight = self.config, self.lm_head.weight
        return BeamKV.allocate(
            cfg.num_decoder_layers, num_rows, capacity, cfg.num_heads, cfg.d_kv,
            weight.dtype, weight.device,
        )  # fmt: skip

    def encode(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: list[int],
        cross_kv: SharedKV,
        embeds: PromptEmbeds | None = None,
    ) -> torch.Tensor:
        """Run the encoder over packed prompts and fill every decoder layer's cross K/V.

        Args:
            input_ids: (T,) int64 tokens of all prompts, packed in request order.
            cu_seqlens: R + 1 host ints, prompt offsets.
            cross_kv: receives, per decoder layer, k/v of the encoder output at tokens [0, T).
            embeds: given input embeddings of some packed tokens; None: tokens only.

        Returns:
            (T, d_model) encoder output (after the final layer norm), model dtype.
        """
        biases = self._encoder_biases(cu_seqlens)
        x = self.shared(input_ids)
        if embeds is not None:
            x = embeds.splice(x)
        encoded = self._run_encoder(x, lambda attn, h: attn.bidirectional(h, cu_seqlens, biases))
        self._write_cross_kv(encoded, cross_kv)
        return encoded

    def encode_padded(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        padded_len: int,
        cross_kv: SharedKV,
        embeds: PromptEmbeds | None = None,
    ) -> torch.Tensor:
        """``encode`` for a CUDA graph: S prompts padded to one length P, with every shape
        fixed by (S, P) and the prompts' lengths read from the device.

        Each prompt attends over its own P slots with -inf at its padding keys, so its
        tokens' results equal ``encode``'s; one batched attention (``ENCODER_ATTENTION``)
        replaces the per-prompt loop (and its host offsets). The output returns to
        ``encode``'s packed order before the cross-attention K/V are written.

        Args:
            tokens: (S * P,) int64; the prompts packed from index 0 (``lengths.sum()``
                tokens); the rest must hold valid token ids and is ignored.
            lengths: (S,) int64 prompt lengths on the device, each in [1, P].
            padded_len: P (host int).
            cross_kv: receives, per decoder layer, k/v at packed tokens [0, S * P); those
                from ``lengths.sum()`` on are padding, never read by the decoder.
            embeds: given input embeddings of some packed tokens (``source`` over the
                S * P packed positions); None: tokens only.

        Returns:
            (S * P, d_model) encoder output in packed order; rows from ``lengths.sum()``
            on are padding.

        Raises:
            ValueError: ``ENCODER_ATTENTION`` is not "sdpa" or "triton".
        """
        if ENCODER_ATTENTION not in ("sdpa", "triton"):
            raise ValueError(f"ENCODER_ATTENTION must be 'sdpa' or 'triton': {ENCODER_ATTENTION!r}")
        slots, device = lengths.shape[0], tokens.device
        pos = torch.arange(padded_len, device=device)
        starts = torch.cumsum(lengths, 0) - lengths
        # Padding slots repeat their prompt's last token: a valid id; masked as keys.
        gather = starts[:, None] + torch.minimum(pos[None, :], lengths[:, None] - 1)
        if embeds is None:
            x = self.shared(tokens[gather.reshape(-1)])
        else:  # spliced in packed order, then laid out in the slots
            x = embeds.splice(self.shared(tokens))[gather.reshape(-1)]
        max_distance = self.config.relative_attention_max_distance
        bias = self._position_bias(
            ("encoder", padded_len),
            self.encoder.position_bias_table,
            lambda table: offset_position_bias(table, padded_len, True, max_distance),
        )
        if not self.encoder_builds_mask(device):
            encoded = self._run_encoder(
                x,
                lambda attn, h: attn.bidirectional_by_offset(
                    h, lengths, bias, padded_len, max_distance
                ),
            )
        else:
            build_mask = square_mask
            if x.is_cuda:  # one pass instead of torch's flip and add
                from xgr.kernels.triton_encoder_attention import square_mask as build_mask
            mask = build_mask(lengths, bias, padded_len, x.dtype)  # (S, H, P, P)
            encoded = self._run_encoder(x, lambda attn, h: attn.bidirectional_padded(h, mask))
        # Packed token t of prompt r sits at padded row r * P + (t - starts[r]).
        flat = torch.arange(slots * padded_len, device=device)
        slot = torch.searchsorted(starts, flat, right=True) - 1
        offset = (flat - starts[slot]).clamp(max=padded_len - 1)
        packed = encoded[slot * padded_len + offset]
        self._write_cross_kv(packed, cross_kv)
        return packed

    def encoder_builds_mask(self, device: torch.device) -> bool:
        """Whether ``encode_padded`` on ``device`` builds the (S, heads, P, P) square mask of
        SDPA (``ENCODER_ATTENTION`` "sdpa", or a head size the Triton kernel lacks) rather
        than running the Triton kernel, which needs none."""
        return ENCODER_ATTENTION != "triton" or not self._triton_encoder_attention_fits(device)

    def _triton_encoder_attention_fits(self, device: torch.device) -> bool:
        """Whether the Triton encoder kernel runs here (else SDPA): this model's head size,
        on a CUDA device or under Triton's interpreter (compiled Triton cannot read host
        tensors, so a CPU model on a machine with a GPU keeps SDPA)."""
        from xgr.kernels.triton_encoder_attention import SUPPORTED_HEAD_DIMS, runs_on

        return self.config.d_kv in SUPPORTED_HEAD_DIMS and runs_on(device)

    def _run_encoder(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The encoder blocks and final norm over embedded tokens x; each block's
        self-attention is ``attend(T5Attention, normed x)``."""
        sublayers = []
        for block in self.encoder.block:
            attn, ff = block.layer
            sublayers += [
                (attn.layer_norm, functools.partial(attend, attn.SelfAttention)),
                (ff.layer_norm, ff.DenseReluDense),
            ]
        return residual_stack(x, sublayers, self.encoder.final_layer_norm)

    def _write_cross_kv(self, encoded: torch.Tensor, cross_kv: SharedKV) -> None:
        tokens = encoded.shape[0]
        if self.cross_kv is not None and cross_kv.token_major is not None:
            # One GEMM over all layers, straight into the buffer: where 12 per-layer GEMMs
            # and 24 copies into per-layer K and V took ~0.3 ms of a 1024-token encode.
            rows = cross_kv.token_major[:tokens].view(tokens, -1)
            with torch.no_grad():  # a KV cache is never differentiated (out= refuses autograd)
                torch.mm(encoded, self.cross_kv.weight.t(), out=rows)
            return
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
        if self._projections_fused() and small_rows_kernels(x):
            x = decode_small_rows(self.decoder, self.config.dense_act_fn, x, meta, bias)
        else:
            x = self._run_decoder(x, meta, lambda attn, h, i: attn.over_beam(h, i, meta, bias))
        return self._head_input(x)

    def decode_start_and_codes(
        self, input_ids: torch.Tensor, meta: EncDecDecodeMetadata
    ) -> torch.Tensor:
        """The decoder start step and the next step of every candidate first code, in one
        pass: ``decode`` of the start token, then ``decode`` of each code after it, without
        a selection between them (all of them are kept).

        Rows are request-major, P = ``meta.beam_width`` a request: row r * P is request r's
        start token, the next P - 1 rows its candidate codes (position 1). Row n writes its
        self-attention K/V into beam row n whatever ``meta.kv_rows`` and
        ``meta.beam.length`` say: slot 0 for the start token, slot 1 for a code. Later steps
        that read slot 0 of a code's row through the ancestry index need that entry set to
        the request's start row first. Every row also attends over its request's encoder
        K/V.

        Args:
            input_ids: (N,) int64, the decoder start token at rows r * P, codes elsewhere.
            meta: the pass's metadata.

        Returns:
            (N, d_model) input of the LM head, model dtype, as ``decode``.
        """
        x = self.shared(input_ids)
        bias = self._decoder_bias(1, x.device)
        return self._head_input(
            self._run_decoder(
                x, meta, lambda attn, h, i: attn.over_start_and_codes(h, i, meta, bias)
            )
        )

    def _run_decoder(self, x: torch.Tensor, meta: EncDecDecodeMetadata, attend) -> torch.Tensor:
        """The decoder blocks and final norm over embedded tokens x (cuBLAS projections);
        each block's self-attention is ``attend(T5Attention, normed x, layer)``."""
        sublayers = []
        for layer, block in enumerate(self.decoder.block):
            attn, cross, ff = block.layer
            sublayers += [
                (attn.layer_norm, lambda h, a=attn, i=layer: attend(a.SelfAttention, h, i)),
                (cross.layer_norm,
                 lambda h, c=cross, i=layer: c.EncDecAttention.over_encoder(h, i, meta)),
                (ff.layer_norm, ff.DenseReluDense),
            ]  # fmt: skip
        return residual_stack(x, sublayers, self.decoder.final_layer_norm)

    def _head_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.scale_decoder_outputs:
            # Original T5 ties the head to the embedding and rescales its input to match.
            x = x * self.config.d_model**-0.5
        return x

    def _projections_fused(self) -> bool:
        """Whether ``fuse_projections`` ran (the small-rows path reads the fused weights)."""
        if not len(self.decoder.block):
            return False
        attn, *_, ff = self.decoder.block[0].layer
        dense = ff.DenseReluDense
        gate_up_fused = not dense.gated or dense.wi_fused is not None
        return attn.SelfAttention.qkv is not None and gate_up_fused

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

        def compute(table: torch.Tensor) -> torch.Tensor:
            keys = torch.arange(position + 1, device=device)
            bias = relative_position_bias(
                table, keys[-1:], keys, False, self.config.relative_attention_max_distance
            )
            return bias[:, 0]

        return self._position_bias(("decoder", position), self.decoder.position_bias_table, compute)

    def _position_bias(self, key: tuple, table: torch.Tensor, compute) -> torch.Tensor:
        """``compute(table)``, kept for later calls with the same key once the projections
        are fused (the engine's models; see ``fuse_projections``).

        The bucket arithmetic is a few dozen small kernels a decode level, for values that
        depend on the weights and the position only.
        Nothing is kept while a CUDA graph captures: the tensor would live in the graph's
        memory pool, which a later pool growth frees (the engine runs each graph's work
        eagerly once before capturing it, which fills the cache). Moving or casting the
        model (``_apply``) empties the cache.
        """
        full_key = (*key, table.device, table.dtype)
        bias = self._bias_cache.get(full_key)
        if bias is None:
            with torch.no_grad():  # a kept tensor must not hold an autograd graph
                bias = compute(table)
            capturing = bias.is_cuda and torch.cuda.is_current_stream_capturing()
            if self._projections_fused() and not capturing:
                self._bias_cache[full_key] = bias
        return bias

    def _apply(self, fn, recurse=True):
        self._bias_cache.clear()
        return super()._apply(fn, recurse)
