"""Restricted LM-head scoring equals the full-vocabulary log-softmax at each level's codes."""

from __future__ import annotations

import pytest
import torch

import xgr.beam.logits as logits_module
from xgr.beam import BeamState, constrained_beam_step
from xgr.beam.logits import (
    code_log_probs,
    distinct_code_mask,
    full_vocab_logsumexp,
    full_vocab_partials,
    level_head_weights,
)
from xgr.catalog.trie import build_prefix_trie


def random_head(vocab=300, hidden=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=gen)
    hidden_states = torch.randn(7, hidden, generator=gen) * 3
    return weight, hidden_states


# 7 rows of float32 logits (plus their float32 copy on the CPU path): 1024-column chunks.
@pytest.mark.parametrize("chunk_bytes", [384 << 20, 7 * 1024 * 8], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_full_vocab_logsumexp_matches_torch(monkeypatch, chunk_bytes, device):
    monkeypatch.setattr(logits_module, "LSE_CHUNK_BYTES", chunk_bytes)
    weight, h = (t.to(device) for t in random_head(vocab=5000))
    expected = torch.logsumexp(h @ weight.T, dim=-1)
    torch.testing.assert_close(full_vocab_logsumexp(h, weight), expected, rtol=1e-6, atol=1e-5)


def test_code_log_probs_equal_log_softmax_at_the_codes():
    weight, h = random_head()
    sid_token_ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(1))
    levels = level_head_weights(weight, sid_token_ids)
    assert levels.shape == (3, 16, 32)
    full = torch.log_softmax(h @ weight.T, dim=-1)
    for level in range(3):
        got = code_log_probs(h, levels[level], weight)
        assert got.dtype == torch.float32 and got.shape == (7, 16)
        torch.testing.assert_close(got, full[:, sid_token_ids[level]], rtol=1e-6, atol=1e-5)


def test_code_only_normalization_is_a_softmax_over_the_level():
    weight, h = random_head()
    sid_token_ids = torch.arange(48).view(3, 16) + 100
    levels = level_head_weights(weight, sid_token_ids)
    got = code_log_probs(h, levels[1], None)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(7))
    expected = torch.log_softmax(h @ weight[sid_token_ids[1]].T, dim=-1)
    torch.testing.assert_close(got, expected)


def test_out_of_vocab_ids_are_clamped_not_read_out_of_bounds():
    weight, _ = random_head(vocab=10)
    levels = level_head_weights(weight, torch.tensor([[0, 9, 25]]))
    torch.testing.assert_close(levels[0, 2], weight[9])


def test_beam_step_on_code_log_probs_equals_the_vocab_path():
    gen = torch.Generator().manual_seed(3)
    sids = torch.unique(torch.randint(0, 6, (40, 2), generator=gen), dim=0).numpy()
    trie = build_prefix_trie(sids, 6)
    token_ids = torch.tensor([9, 4, 7, 1, 8, 2])
    vocab_lp = torch.log_softmax(torch.randn(2, 1, 12, generator=gen), dim=-1)
    code_lp = vocab_lp[:, :, token_ids]
    root = BeamState.root(2, torch.device("cpu"))
    for top_k in (2, 6):
        a = constrained_beam_step(root, vocab_lp, trie.levels[0], token_ids, 5, top_k)
        b = constrained_beam_step(root, code_lp, trie.levels[0], None, 5, top_k)
        for field in ("scores", "nodes", "codes", "parents"):
            torch.testing.assert_close(getattr(a, field), getattr(b, field))


def test_distinct_code_mask_drops_unused_out_of_vocab_and_repeated_tokens():
    ids = torch.tensor([[3, -1, 3, 9, 12], [0, 1, 2, 3, 4]])
    mask = distinct_code_mask(ids, vocab_size=10)
    assert mask.tolist() == [[True, False, False, True, False], [True] * 5]


def test_masked_codes_get_minus_infinity_and_the_rest_sum_to_one():
    weight, h = random_head()
    levels = level_head_weights(weight, torch.tensor([[4, 5, 6, 7]]))
    mask = torch.tensor([True, False, True, True])
    got = code_log_probs(h, levels[0], None, mask)
    assert torch.isinf(got[:, 1]).all()
    torch.testing.assert_close(got[:, mask].exp().sum(-1), torch.ones(7))


def test_bfloat16_code_log_probs_stay_below_zero_when_one_code_dominates():
    weight, h = random_head(vocab=300, hidden=32)
    weight[10] = h[0] * 3  # token 10 dominates row 0's distribution
    levels = level_head_weights(weight.bfloat16(), torch.tensor([[10, 11, 12]]))
    got = code_log_probs(
        h.bfloat16(), levels[0], weight.bfloat16(), torch.ones(3, dtype=torch.bool)
    )
    assert (got <= 0).all()
    exact = torch.log_softmax(h.bfloat16().float() @ weight.bfloat16().float().T, -1)[:, 10:13]
    torch.testing.assert_close(got, exact, atol=0.1, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the model-dtype weight path is CUDA's")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("full_vocab", [True, False])
def test_model_dtype_level_weights_give_the_float32_path_scores(dtype, full_vocab):
    weight, h = (t.cuda() for t in random_head(vocab=3000, hidden=256))
    weight, h = weight.to(dtype), (h * 0.3).to(dtype)
    sid_token_ids = torch.randint(0, 3000, (1, 256), generator=torch.Generator().manual_seed(4))
    levels32 = level_head_weights(weight, sid_token_ids.cuda())
    full = weight if full_vocab else None
    expected = code_log_probs(h, levels32[0], full)
    got = code_log_probs(h, levels32[0].to(dtype), full)
    assert got.dtype == torch.float32
    # Same bf16/fp16 products, float32 sums in another order.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="precomputed partials are CUDA's")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partials_of_several_levels_in_one_pass_give_each_level_its_scores(dtype):
    weight, h = (t.cuda().to(dtype) for t in random_head(vocab=3000, hidden=256))
    first_row, rows = h[:1] * 0.5, h[1:]
    sid_token_ids = torch.randint(0, 3000, (2, 64), generator=torch.Generator().manual_seed(5))
    levels = level_head_weights(weight, sid_token_ids.cuda())
    together = full_vocab_partials(torch.cat([first_row, rows]), weight)
    for hidden, level, part in ((first_row, 0, together[:1]), (rows, 1, together[1:])):
        alone = code_log_probs(hidden, levels[level], weight)
        got = code_log_probs(hidden, levels[level], weight, partials=part)
        # The same logits in another GEMM shape: summation order only.
        torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-4)
