"""Row-wise log-sum-exp of a logits matrix in one pass over it (Triton).

The full-vocabulary normalizer of a decode step (``xgr.beam.logits.full_vocab_logsumexp``)
reduces an (N, V) block of LM-head logits per row. ``torch.logsumexp`` on the model-dtype
product runs as a float32 copy, a max, a subtraction, an exp, a sum and a log: five passes over
N x V float32 elements, over a third of a batch's decode-level kernel time
(``benchmarks/profile_request.py``; docs/performance.md). Here each program streams its share of
a row once, in the logits' own dtype, and keeps a running maximum and a rescaled running sum per
group of adjacent columns (the online softmax of Milakov & Gimelshein, "Online normalizer
calculation for softmax", 2018); the partial results of a row's programs are merged by one small
``torch.logsumexp``. A running maximum per element took two exps per element, which bounded the
pass on the GPU's exp rate rather than its memory; per group of a thread's 16-byte load it takes
one, plus one per group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgr.kernels.device import multiprocessor_count

BLOCK = 2048  # elements a program loads per iteration
# Programs per streaming multiprocessor the split over columns aims for: enough to hide
# memory latency when there are few rows (the first level's one row per request).
PROGRAMS_PER_SM = 4


@triton.jit
def _accumulate(row_ptr, c, end, run_max, run_sum, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Fold the columns [c, min(c + BLOCK, end)) into the running max and sum of each group
    of GROUP adjacent columns (a thread's vector load): one exp per element for the sum,
    one per group for the rescale, where a running max per element costs two."""
    idx = c + tl.arange(0, BLOCK // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    x = tl.load(row_ptr + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
    new_max = tl.maximum(run_max, tl.max(x, 1))
    # Shift by 0 where the max is infinite, as torch.logsumexp does: a group that has seen
    # only -inf keeps sum 0 (no -inf - -inf = nan), one that has seen +inf sums to +inf.
    shift = tl.where(tl.abs(new_max) == float("inf"), 0.0, new_max)
    total = tl.sum(tl.exp(x - shift[:, None]), 1)
    return new_max, run_sum * tl.exp(run_max - shift) + total


@triton.jit
def _row_logsumexp_kernel(
    X, OUT, cols, stride_x, stride_o, cols_per_program, BLOCK: tl.constexpr,
    GROUP: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    start = part * cols_per_program
    end = tl.minimum(start + cols_per_program, cols)
    run_max = tl.full([BLOCK // GROUP], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK // GROUP], tl.float32)
    if FOR_LOOP:  # compiled: a for loop is software-pipelined
        for c in range(start, end, BLOCK):
            run_max, run_sum = _accumulate(
                X + row * stride_x, c, end, run_max, run_sum, BLOCK, GROUP
            )
    else:  # Triton's interpreter takes no tensor bounds in range()
        c = start
        while c < end:
            run_max, run_sum = _accumulate(
                X + row * stride_x, c, end, run_max, run_sum, BLOCK, GROUP
            )
            c += BLOCK
    row_max = tl.max(run_max, 0)
    shift = tl.where(tl.abs(row_max) == float("inf"), 0.0, row_max)
    total = tl.sum(run_sum * tl.exp(run_max - shift), 0)
    tl.store(OUT + row * stride_o + part, shift + tl.log(total))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return multiprocessor_count(device)
    return 8  # the CPU interpreter: any small split exercises the merge


def row_logsumexp_partials(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row log-sum-exp of column blocks of ``logits``; merge them with ``torch.logsumexp``.

    Args:
        logits: (N, V) float32/bf16/fp16, last dimension contiguous.
        out: optional (N, P) float32 buffer to write into, P = ``num_partials(N, V)``
            (a column slice of a larger buffer is fine).

    Returns:
        (N, P) float32: entry (n, p) is log(sum(exp(logits[n, cols_p]))) over the p-th block
        of columns, -inf for an empty or all -inf block.

    Raises:
        ValueError: a non-2-D input, a non-contiguous last dimension or a misshapen ``out``.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (N, V) with contiguous rows, got {tuple(logits.shape)}")
    rows, cols = logits.shape
    parts = num_partials(rows, cols, logits.device)
    if out is None:
        out = torch.empty(rows, parts, dtype=torch.float32, device=logits.device)
    elif out.shape != (rows, parts) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"out must be ({rows}, {parts}) float32, got {tuple(out.shape)}")
    if rows and parts:
        per_program = triton.cdiv(triton.cdiv(cols, parts), BLOCK) * BLOCK
        _row_logsumexp_kernel[(rows, parts)](
            logits, out, cols, logits.stride(0), out.stride(0), per_program, BLOCK=BLOCK,
            # One 16-byte load of the logits' dtype a group.
            GROUP=16 // logits.element_size(), FOR_LOOP=logits.is_cuda, num_warps=8,
        )  # fmt: skip
    return out


def num_partials(rows: int, cols: int, device: torch.device) -> int:
    """Column blocks per row: enough programs to fill the device, no block under BLOCK."""
    if cols == 0:
        return 0
    wanted = triton.cdiv(PROGRAMS_PER_SM * _num_sms(device), max(rows, 1))
    return max(1, min(wanted, triton.cdiv(cols, BLOCK)))


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(logits), dim=-1)) of an (N, V) matrix, computed in float32.

    Equals ``torch.logsumexp(logits.float(), dim=-1)`` up to float32 summation order.

    Returns:
        (N,) float32; -inf for a row of only -inf (or V = 0), +inf for a row holding +inf
        and no NaN, NaN for a row holding NaN.
    """
    # V = 0 gives (N, 0) partials, whose log-sum-exp is -inf.
    return torch.logsumexp(row_logsumexp_partials(logits), dim=1)
