"""The prefill's last-layer shortcut: only each prompt's last token attends."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ARCHS
from xgr.kernels.prefill_attention import prefill_attention_reference
from xgr.kv import SharedKV
from xgr.layers.attention import LAST_TOKEN_CHUNK, PrefillMetadata, last_token_attention
from xgr.models import load_causal_lm


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_last_token_attention_is_the_causal_row_of_each_last_token(heads, kv_heads):
    gen = torch.Generator().manual_seed(torch.seed())
    lengths = [1, 7, 13, 4]
    cu = [0, 1, 8, 21, 25]
    q, k, v = (
        torch.randn(25, n, 16, generator=gen, dtype=torch.float64)
        for n in (heads, kv_heads, kv_heads)
    )
    full = prefill_attention_reference(q, k, v, cu, 0.3)
    last = torch.tensor(cu[1:]) - 1
    # A longer offset tensor (as a padded CUDA graph holds) reads only its first R + 1.
    cu_device = torch.tensor([*cu, 30, 40], dtype=torch.int32)
    out = last_token_attention(q[last], k, v, cu_device, 0.3)
    assert out.shape == (len(lengths), heads, 16)
    torch.testing.assert_close(out, full[last], rtol=1e-12, atol=1e-12)


def test_many_prompts_with_host_offsets_go_in_groups_with_the_same_result():
    gen = torch.Generator().manual_seed(torch.seed())
    lengths = torch.randint(1, 30, (LAST_TOKEN_CHUNK * 3 + 5,), generator=gen).tolist()
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q, k, v = (torch.randn(cu[-1], n, 8, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    last = torch.tensor(cu[1:]) - 1
    want = prefill_attention_reference(q, k, v, cu, 0.5)[last]
    device_cu = torch.tensor(cu, dtype=torch.int32)
    grouped = last_token_attention(q[last], k, v, device_cu, 0.5, cu)
    torch.testing.assert_close(grouped, want, rtol=1e-12, atol=1e-12)
    # Without host offsets (a CUDA graph's case): one masked product, the same values.
    torch.testing.assert_close(last_token_attention(q[last], k, v, device_cu, 0.5), want)


def test_padding_after_the_prompts_is_not_attended():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(12, 2, 8, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 5, 9, 12], dtype=torch.int32)  # the last "prompt" is padding
    out = last_token_attention(q[[4, 8]], k, v, cu, 1.0)
    k2, v2 = k.clone(), v.clone()
    k2[9:], v2[9:] = 1e4, -1e4
    torch.testing.assert_close(last_token_attention(q[[4, 8]], k2, v2, cu, 1.0), out)


@pytest.mark.parametrize("arch", ARCHS)
def test_output_rows_give_the_full_forward_rows_and_the_same_kv(model_dirs, arch):
    model = load_causal_lm(model_dirs[arch], "cpu", "float32")
    cfg = model.config
    lengths = [5, 9, 2]
    cu = [0, 5, 14, 16]
    tokens = torch.randint(0, cfg.vocab_size, (16,), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])
    last = torch.tensor(cu[1:]) - 1

    def forward(rows):
        shared = SharedKV.allocate(
            cfg.num_layers, lengths, cfg.num_kv_heads, cfg.head_dim, torch.float32,
            torch.device("cpu"),
        )  # fmt: skip
        with torch.inference_mode():
            hidden = model(tokens, positions, PrefillMetadata(shared, cu, output_rows=rows))
        return hidden, shared.k.clone(), shared.v.clone()

    full, full_k, full_v = forward(None)
    rows, k, v = forward(last)
    assert rows.shape == (3, cfg.hidden_size)
    torch.testing.assert_close(rows, full[last], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, full_k, rtol=0, atol=0)
    torch.testing.assert_close(v, full_v, rtol=0, atol=0)
