"""The one-pass code log-probabilities kernel against its torch reference
(``xgr.beam.logits.code_log_probs_reference``).

On the CPU under Triton's interpreter; on a GPU compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.beam.logits import code_log_probs_reference  # noqa: E402
from xgr.kernels.triton_code_log_probs import code_log_probs_from_logits  # noqa: E402
from xgr.kernels.triton_logsumexp import row_logsumexp_partials  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's interpreter truncates float32 to bfloat16 (the compiled kernel rounds to nearest
# even, as torch): bf16 rounding is checked on a GPU only; fp16 rounds alike in both.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def case(rows, codes, vocab, dtype, seed):
    """Code logits and the (model-dtype rounded) full-vocabulary logits they sit in."""
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype).float()
    ids = torch.randperm(vocab, generator=gen)[:codes]
    # The codes' float32 logits: near their rounded values, as a float32 head computes them.
    logits = full[:, ids] + torch.randn(rows, codes, generator=gen) * 1e-2
    mask = torch.rand(codes, generator=gen) > 0.2
    return logits.to(DEVICE), full.to(DEVICE), mask.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "codes", "vocab"), [(5, 16, 3000), (33, 256, 5000), (1, 7, 9)])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
def test_full_vocabulary_normalization_matches_the_reference(rows, codes, vocab, dtype, masked):
    logits, full, mask = case(rows, codes, vocab, dtype, seed=rows + codes)
    mask = mask if masked else None
    partials = row_logsumexp_partials(full)
    got = code_log_probs_from_logits(logits, partials, mask, dtype)
    expected = code_log_probs_reference(logits, torch.logsumexp(full, -1), mask, dtype)
    assert got.shape == (rows, codes) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    if masked:
        assert torch.isinf(got[:, ~mask]).all() and (got[:, ~mask] < 0).all()
    if dtype != torch.float32:  # the rounded codes are swapped out: no probability above 1
        assert (got[finite] <= 1e-6).all()


@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
def test_code_only_normalization_is_a_log_softmax(masked):
    logits, _, mask = case(9, 40, 100, torch.float32, seed=3)
    mask = mask if masked else None
    got = code_log_probs_from_logits(logits, None, mask, torch.bfloat16)
    expected = code_log_probs_reference(logits, None, mask, torch.bfloat16)
    finite = torch.isfinite(expected)
    assert torch.equal(finite, torch.isfinite(got))
    torch.testing.assert_close(got[finite], expected[finite], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(9, device=DEVICE))


def test_a_row_of_masked_codes_gives_the_reference_values():
    logits = torch.randn(2, 4, device=DEVICE)
    mask = torch.zeros(4, dtype=torch.bool, device=DEVICE)
    full = torch.randn(2, 50, device=DEVICE)
    got = code_log_probs_from_logits(logits, row_logsumexp_partials(full), mask, torch.float32)
    assert torch.isneginf(got).all()  # -inf - finite normalizer


def test_empty_and_misshapen_inputs():
    empty = torch.empty(0, 8, device=DEVICE)
    assert code_log_probs_from_logits(empty, None, None, torch.float32).shape == (0, 8)
    logits = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="float32"):
        code_log_probs_from_logits(logits.double(), None, None, torch.float32)
    with pytest.raises(ValueError, match="partials"):
        code_log_probs_from_logits(logits, torch.zeros(2, 4, device=DEVICE), None, torch.float32)
    with pytest.raises(ValueError, match="code_mask"):
        code_log_probs_from_logits(logits, None, torch.ones(7, dtype=torch.bool), torch.float32)
    strided = torch.ones(8, 2, dtype=torch.bool, device=DEVICE)[:, 1]
    with pytest.raises(ValueError, match="code_mask"):
        code_log_probs_from_logits(logits, None, strided, torch.float32)
    with pytest.raises(ValueError, match="model_dtype"):
        code_log_probs_from_logits(logits, None, None, torch.int32)
