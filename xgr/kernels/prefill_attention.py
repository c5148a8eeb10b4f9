"""Causal attention over a batch of packed prompts of different lengths (prefill).

Two implementations of one function:

- ``prefill_attention_reference``: PyTorch SDPA once per prompt (any device and dtype);
- ``prefill_attention``: picks between the reference and one launch of PyTorch's packed
  variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``) by measurement.
  On an H200 (benchmarks/attention.py --prefill, bf16, per layer) the packed launch won only
  for several short prompts (8 x 1000 tokens: 179 vs 184 us for the Qwen3-1.7B shape, 115 vs
  134 us for Qwen2.5-0.5B), where each per-prompt grid is small; SDPA per prompt won for
  single prompts (1000 tokens: 22 vs 39 us) and for long ones (8 x 3000: 791 vs 997 us).

A third, ``xgr.kernels.triton_prefill_attention.packed_causal_attention`` (one Triton launch
over the packed prompts), is tested against the reference and timed by
``benchmarks/attention.py --prefill``; it is not chosen here until it has been measured
faster on the GPU.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


@functools.cache
def _varlen():
    """PyTorch's packed flash attention and its keyword names, or (None, {}) if absent.

    Imported on first use: the module imports Triton, which must not happen before a test
    process selects Triton's CPU interpreter.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # an older PyTorch: the reference path only
        return None, set()
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


# The packed launch is used for batches of prompts at most this long (tokens).
PACKED_MAX_SEQLEN = 1024


def prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal self-attention within each prompt of a packed batch.

    Args:
        q: (total_tokens, num_heads, head_dim).
        k, v: (total_tokens, num_kv_heads, head_dim); num_heads % num_kv_heads == 0 (GQA).
        cu_seqlens: R + 1 host ints, token offsets of each prompt.
        scale: softmax scale.

    Returns:
        (total_tokens, num_heads, head_dim) in q's dtype.
    """
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        # SDPA wants [batch, heads, seq, dim].
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out


def varlen_available(q: torch.Tensor) -> bool:
    """Whether PyTorch's packed flash attention can run on q (CUDA, fp16/bf16)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _varlen()[0] is not None


def prefer_packed(q: torch.Tensor, num_prompts: int, max_seqlen: int) -> bool:
    """The measured choice: packed flash attention for several short prompts, else SDPA."""
    return varlen_available(q) and num_prompts > 1 and max_seqlen <= PACKED_MAX_SEQLEN


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    scale: float,
    cu_seqlens_device: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    packed: bool | None = None,
) -> torch.Tensor:
    """Causal self-attention within each prompt of a packed batch, by the faster kernel.

    Args:
        q, k, v, cu_seqlens, scale: as in ``prefill_attention_reference``.
        cu_seqlens_device: (R + 1,) int32 copy of cu_seqlens on q's device; made here if None
            (a host-to-device copy, which callers on the graph path avoid by passing it).
        max_seqlen: the longest prompt (tokens); computed from cu_seqlens if None.
        packed: force (True) or forbid (False) the packed launch; None: ``prefer_packed``.

    Returns:
        (total_tokens, num_heads, head_dim) in q's dtype.

    Raises:
        ValueError: packed=True where packed flash attention cannot run.
    """
    if max_seqlen is None:
        max_seqlen = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    if packed is None:
        packed = prefer_packed(q, len(cu_seqlens) - 1, max_seqlen)
    elif packed and not varlen_available(q):
        raise ValueError(f"packed flash attention needs CUDA fp16/bf16, got {q.device} {q.dtype}")
    if not packed:
        return prefill_attention_reference(q, k, v, cu_seqlens, scale)
    if cu_seqlens_device is None:
        cu_seqlens_device = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
    varlen_attn, params = _varlen()
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(
        q, k, v, cu_seqlens_device, cu_seqlens_device, max_seqlen, max_seqlen, **kwargs
    )
