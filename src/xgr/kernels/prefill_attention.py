"""Causal attention over a batch of packed prompts of different lengths (prefill).

Two implementations of one function:

- ``prefill_attention_reference``: PyTorch SDPA once per prompt (any device and dtype);
- ``prefill_attention``: picks between the reference and one launch of xgr's packed Triton
  kernel (``xgr.kernels.triton_prefill_attention.packed_causal_attention``) by measurement.

The Triton kernel beats PyTorch's packed variable-length flash attention at every size
measured (``benchmarks/attention.py --prefill``; docs/performance.md), so that is not used.
SDPA per prompt (cuDNN) still wins for one prompt and for several long ones, so the packed
launch is preferred for several prompts of at most ``PACKED_MAX_SEQLEN`` tokens. The CUDA
graphs of several requests always take the packed launch: their prompt lengths are device
tensors.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

# The packed launch is preferred for batches of prompts at most this long (tokens).
PACKED_MAX_SEQLEN = 1024
# Head sizes the packed launch takes (its 128 x 64 tiles spill registers at 256).
PACKED_HEAD_DIMS = (16, 32, 64, 128)


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
        (total_tokens, num_heads, head_dim) in q's dtype; for one prompt SDPA's own output
        seen as (tokens, heads, dim), which may be a strided view.
    """
    if len(cu_seqlens) == 2 and cu_seqlens[0] == 0 and cu_seqlens[1] == q.shape[0]:
        # One prompt: no copy into a packed output. cuDNN writes its output token-major,
        # as q is laid out, so the view is contiguous on the GPU and the output projection
        # reads it in place (a 20 MB copy a layer at 5000 tokens of the Qwen3-1.7B shape).
        return _causal_sdpa(q, k, v, scale)
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        out[start:end] = _causal_sdpa(q[start:end], k[start:end], v[start:end], scale)
    return out


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA of one prompt's (tokens, heads, dim) q, k, v; SDPA wants
    (batch, heads, tokens, dim), so this passes and returns transposed views."""
    qs, ks, vs = (t.transpose(0, 1)[None] for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def packed_available(q: torch.Tensor) -> bool:
    """Whether the packed Triton launch is used for q: CUDA, fp16/bf16, a head_dim in
    ``PACKED_HEAD_DIMS`` and Triton installed."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] in PACKED_HEAD_DIMS
        and _triton_installed()
    )


@functools.cache
def _triton_installed() -> bool:
    # Asked per layer of an eager prefill: look the package up once.
    return importlib.util.find_spec("triton") is not None


def prefer_packed(q: torch.Tensor, num_prompts: int, max_seqlen: int) -> bool:
    """The measured choice: the packed launch for several short prompts, else SDPA."""
    return packed_available(q) and num_prompts > 1 and max_seqlen <= PACKED_MAX_SEQLEN


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
        max_seqlen: a bound on the longest prompt (tokens), at least the longest; computed
            from cu_seqlens if None.
        packed: force (True) or forbid (False) the packed launch; None: ``prefer_packed``.

    Returns:
        (total_tokens, num_heads, head_dim) in q's dtype.

    Raises:
        ValueError: packed=True where the packed launch is not used (see ``packed_available``).
    """
    if max_seqlen is None:
        max_seqlen = max(b - a for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))
    if packed is None:
        packed = prefer_packed(q, len(cu_seqlens) - 1, max_seqlen)
    elif packed and not packed_available(q):
        raise ValueError(
            "packed prefill attention needs CUDA fp16/bf16, head_dim in "
            f"{PACKED_HEAD_DIMS} and Triton; got {q.device} {q.dtype} head_dim {q.shape[-1]}"
        )
    if not packed:
        return prefill_attention_reference(q, k, v, cu_seqlens, scale)
    if cu_seqlens_device is None:
        cu_seqlens_device = torch.tensor(cu_seqlens, dtype=torch.int32, device=q.device)
    # Imported on first use: Triton must not load before a test selects its interpreter.
    from xgr.kernels.triton_prefill_attention import packed_causal_attention

    return packed_causal_attention(q, k, v, cu_seqlens_device, max_seqlen, scale)
