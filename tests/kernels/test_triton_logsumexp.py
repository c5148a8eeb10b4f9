"""The row-wise log-sum-exp Triton kernel against ``torch.logsumexp``.

On the CPU it runs under Triton's interpreter (float32 only); on a GPU compiled, bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels import triton_logsumexp as kernels  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def expected(logits):
    return torch.logsumexp(logits.float(), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 5000), (2, 3 * 2048 + 7), (40, 300)])
def test_row_logsumexp_matches_torch(rows, cols, dtype):
    logits = (torch.randn(rows, cols) * 8).to(dtype=dtype, device=DEVICE)
    got = kernels.row_logsumexp(logits)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    torch.testing.assert_close(got, expected(logits), rtol=1e-6, atol=2e-5)


def test_one_row_is_split_over_several_programs_and_merged():
    # One row is the first level's case: the work must still spread over the device.
    logits = torch.randn(1, 9 * 2048, device=DEVICE) * 4
    parts = kernels.row_logsumexp_partials(logits)
    assert parts.shape == (1, kernels.num_partials(1, 9 * 2048, logits.device))
    assert parts.shape[1] > 1
    torch.testing.assert_close(torch.logsumexp(parts, 1), expected(logits), rtol=1e-6, atol=2e-5)


def test_minus_infinity_entries_and_rows():
    logits = torch.randn(3, 4100, device=DEVICE)
    logits[0, ::3] = float("-inf")
    logits[1] = float("-inf")  # a row with nothing in it: -inf, not nan
    logits[2, :2048] = float("-inf")  # a whole block of one program
    got = kernels.row_logsumexp(logits)
    assert got[1].item() == float("-inf")
    torch.testing.assert_close(got, expected(logits), rtol=1e-6, atol=2e-5)


def test_infinite_and_nan_entries_give_what_torch_gives():
    logits = torch.randn(3, 4100, device=DEVICE)
    logits[0, 7] = float("inf")  # an overflowed logit: +inf, as torch.logsumexp
    logits[1, 3000] = float("nan")
    logits[2, 100] = float("inf")
    logits[2, 101] = float("-inf")
    got = kernels.row_logsumexp(logits)
    assert got[0].item() == float("inf") and got[2].item() == float("inf")
    assert torch.isnan(got[1])
    torch.testing.assert_close(got, expected(logits), equal_nan=True)


def test_strided_rows_and_writing_into_a_slice_of_a_wider_buffer():
    wide = torch.randn(5, 3000, device=DEVICE) * 3
    logits = wide[:, 100:2600]  # rows 3000 apart
    parts = kernels.num_partials(5, 2500, logits.device)
    buffer = torch.full((5, parts + 4), float("nan"), device=DEVICE)
    kernels.row_logsumexp_partials(logits, buffer[:, 2 : 2 + parts])
    assert torch.isnan(buffer[:, :2]).all() and torch.isnan(buffer[:, 2 + parts :]).all()
    merged = torch.logsumexp(buffer[:, 2 : 2 + parts], 1)
    torch.testing.assert_close(merged, expected(logits), rtol=1e-6, atol=2e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.row_logsumexp_partials(torch.randn(4, 6, device=DEVICE).T)
    with pytest.raises(ValueError, match="out must be"):
        kernels.row_logsumexp_partials(
            torch.randn(2, 10, device=DEVICE), torch.empty(3, 1, device=DEVICE)
        )


def test_zero_columns_give_minus_infinity():
    got = kernels.row_logsumexp(torch.empty(2, 0, device=DEVICE))
    assert got.tolist() == [float("-inf")] * 2
