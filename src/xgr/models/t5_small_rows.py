"""A T5 decoder step over a few rows with each projection fused with its sublayer's
elementwise work (``xgr.kernels.triton_small_rows_linear``): the CUDA path of
``T5Seq2SeqLM.decode`` for any step of at most that kernel's ``MAX_ROWS`` rows (the decoder
start step when it runs alone, one row a request, or a later level of a small beam).
"""

from __future__ import annotations

import torch

from xgr.models.t5_blocks import EncDecDecodeMetadata, T5Stack

# The small-rows kernel's name of each feed-forward activation (``T5Config.dense_act_fn``).
_ACTIVATIONS = {"relu": "relu", "gelu_new": "gelu_tanh"}


def small_rows_kernels(x: torch.Tensor) -> bool:
    """Whether a decoder step over the rows of x runs its projections through
    ``xgr.kernels.triton_small_rows_linear`` (a CUDA step of at most its ``MAX_ROWS`` rows),
    else through cuBLAS with the separate norm, activation and residual passes."""
    if not x.is_cuda:  # the CPU path never imports Triton
        return False
    from xgr.kernels.triton_small_rows_linear import MAX_ROWS

    return x.shape[0] <= MAX_ROWS


def decode_small_rows(
    decoder: T5Stack,
    dense_act_fn: str,
    x: torch.Tensor,
    meta: EncDecDecodeMetadata,
    bias: torch.Tensor,
) -> torch.Tensor:
    """``T5Seq2SeqLM.decode``'s blocks and final norm with each sublayer's norm, activation
    and residual add inside its projections (``small_rows_linear``): 6 launches of those a
    block, where the cuBLAS path takes 6 GEMMs (some split in two) and 4 passes.

    Args:
        decoder: the model's decoder stack, its projections fused (``fuse_projections``).
        dense_act_fn: the config's feed-forward activation, "relu" or "gelu_new".
        x: (N, d_model) embedded tokens, N <= ``MAX_ROWS``, model dtype, on CUDA.
        meta, bias: as ``T5Seq2SeqLM.decode``.

    Returns:
        (N, d_model) final layer norm's output, model dtype.
    """
    from xgr.kernels.triton_small_rows_linear import small_rows_linear as linear

    act = _ACTIVATIONS[dense_act_fn]
    rows = x.shape[0]
    for layer, block in enumerate(decoder.block):
        attn, cross, ff = block.layer
        own, other, dense = attn.SelfAttention, cross.EncDecAttention, ff.DenseReluDense
        heads, inner = own.num_heads, own.num_heads * own.d_kv
        qkv = linear(x, own.qkv.weight, attn.layer_norm.weight, attn.layer_norm.eps)
        q, k, v = qkv.view(rows, 3, heads, own.d_kv).unbind(1)
        out = own.beam_attention(q, k, v, layer, meta, bias).reshape(rows, inner)
        x = linear(out, own.o.weight, residual=x)
        q = linear(x, other.q.weight, cross.layer_norm.weight, cross.layer_norm.eps)
        out = other.encoder_attention(q.view(rows, heads, own.d_kv), layer, meta)
        x = linear(out.reshape(rows, inner), other.o.weight, residual=x)
        wi = dense.wi_fused if dense.gated else dense.wi
        norm = ff.layer_norm
        hidden = linear(x, wi.weight, norm.weight, norm.eps, activation=act, gated=dense.gated)
        x = linear(hidden, dense.wo.weight, residual=x)
    return decoder.final_layer_norm(x)
