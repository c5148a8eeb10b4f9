"""A decode level's code log-probabilities from its code logits, in one Triton pass.

``xgr.beam.logits.code_log_probs`` turns the (N, C) float32 logits of a level's C codes into
log-probabilities: the codes outside the level's mask get -inf, and each row is normalized
either over its codes (a log-softmax) or over the whole vocabulary, whose log-sum-exp comes
as float32 partial results per block of vocabulary columns
(``triton_logsumexp.row_logsumexp_partials``). In bf16/fp16 the full-vocabulary sum holds the
codes' logits rounded to the model dtype; they are swapped for their float32 values (the
torch reference, ``xgr.beam.logits.code_log_probs_reference``, gives the formula). In
PyTorch that is about 35 small kernels a level (masked fill, three log-sum-exps, the swap,
the subtraction), each a few microseconds in a CUDA graph; here one program a row does it
all.

Log-sum-exp by the online normalizer of Milakov & Gimelshein, "Online normalizer calculation
for softmax", 2018 (a row's maximum as the shift).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Model dtypes whose rounded code logits the full-vocabulary normalizer holds.
_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _logsumexp(x, axis: tl.constexpr):
    """torch.logsumexp's conventions: -inf for a row of only -inf (shift 0 where the maximum
    is infinite, so no -inf - -inf)."""
    top = tl.max(x, axis)
    shift = tl.where(tl.abs(top) == float("inf"), 0.0, top)
    return shift + tl.log(tl.sum(tl.exp(x - shift), axis))


@triton.jit
def _logaddexp(a, b):
    top = tl.maximum(a, b)
    shift = tl.where(tl.abs(top) == float("inf"), 0.0, top)
    return shift + tl.log(tl.exp(a - shift) + tl.exp(b - shift))


@triton.jit
def _code_log_probs_kernel(
    LOGITS, PARTIALS, MASK, OUT, codes, parts, stride_l, stride_p, stride_o,
    FULL: tl.constexpr, ROUNDING: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Grid: (rows,)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    x = tl.load(LOGITS + row * stride_l + c, mask=c < codes, other=float("-inf"))
    if HAS_MASK:
        keep = tl.load(MASK + c, mask=c < codes, other=0) != 0
        x = tl.where(keep, x, float("-inf"))
    if FULL:
        p = tl.arange(0, BLOCK_P)
        part = tl.load(PARTIALS + row * stride_p + p, mask=p < parts, other=float("-inf"))
        total = _logsumexp(part, 0)
        if ROUNDING != 0:
            if ROUNDING == 1:
                rounded = x.to(tl.bfloat16).to(tl.float32)
            else:
                rounded = x.to(tl.float16).to(tl.float32)
            rest = tl.log(tl.maximum(1.0 - tl.exp(_logsumexp(rounded, 0) - total), 0.0)) + total
            total = _logaddexp(rest, _logsumexp(x, 0))
    else:
        total = _logsumexp(x, 0)
    tl.store(OUT + row * stride_o + c, x - total, mask=c < codes)


def code_log_probs_from_logits(
    logits: torch.Tensor,
    partials: torch.Tensor | None,
    code_mask: torch.Tensor | None,
    model_dtype: torch.dtype,
) -> torch.Tensor:
    """``xgr.beam.logits.code_log_probs_reference`` in one Triton launch.

    Args:
        logits: (N, C) float32 code logits, last dimension contiguous.
        partials: (N, P) float32 log-sum-exps of blocks of the full vocabulary's logits
            (rounded to ``model_dtype``), or None to normalize over the codes only.
        code_mask: (C,) contiguous bool, the codes to keep (the rest get -inf), or None: all.
            All tensors on one device.
        model_dtype: float32, bfloat16 or float16: the dtype the partials' logits were
            rounded to (half types: the codes' rounded logits are swapped for ``logits``).

    Returns:
        (N, C) float32 log-probabilities.

    Raises:
        ValueError: misshapen or non-float32 inputs, or an unknown model dtype.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(f"logits must be (N, C) float32 with contiguous rows, got "
                         f"{tuple(logits.shape)} {logits.dtype}")  # fmt: skip
    rows, codes = logits.shape
    if partials is not None and (
        partials.dim() != 2 or partials.shape[0] != rows or partials.dtype != torch.float32
        or partials.stride(1) != 1 or partials.device != logits.device
    ):  # fmt: skip
        raise ValueError(f"partials must be ({rows}, P) float32 with contiguous rows on "
                         f"{logits.device}, got {tuple(partials.shape)} {partials.dtype} on "
                         f"{partials.device}")  # fmt: skip
    if code_mask is not None and (
        code_mask.shape != (codes,) or code_mask.dtype != torch.bool
        or code_mask.stride(0) != 1 or code_mask.device != logits.device
    ):  # fmt: skip
        raise ValueError(f"code_mask must be ({codes},) contiguous bool on {logits.device}, "
                         f"got {tuple(code_mask.shape)} {code_mask.dtype} on "
                         f"{code_mask.device}")  # fmt: skip
    if model_dtype not in _ROUNDING:
        raise ValueError(f"model_dtype must be one of {list(_ROUNDING)}, got {model_dtype}")
    out = torch.empty_like(logits)
    if not rows or not codes:
        return out
    parts = partials.shape[1] if partials is not None else 0
    _code_log_probs_kernel[(rows,)](
        logits, partials if partials is not None else logits,
        code_mask if code_mask is not None else logits, out, codes, parts,
        logits.stride(0), partials.stride(0) if partials is not None else 0, out.stride(0),
        FULL=partials is not None, ROUNDING=_ROUNDING[model_dtype],
        HAS_MASK=code_mask is not None, BLOCK_C=triton.next_power_of_2(codes),
        BLOCK_P=triton.next_power_of_2(max(parts, 1)), num_warps=4 if codes <= 1024 else 8,
    )  # fmt: skip
    return out
