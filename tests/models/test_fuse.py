"""Fusing q/k/v and gate/up projections leaves a model's outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ARCHS
from xgr.kv import SharedKV
from xgr.layers.attention import PrefillMetadata
from xgr.models import load_causal_lm


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_projections_compute_the_same_forward(model_dirs, arch):
    model = load_causal_lm(model_dirs[arch], "cpu", "float32")
    cfg = model.config
    lengths = [5, 9]
    tokens = torch.randint(
        0, cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.cat([torch.arange(n) for n in lengths])

    def forward():
        shared = SharedKV.allocate(
            cfg.num_layers,
            lengths,
            cfg.num_kv_heads,
            cfg.head_dim,
            torch.float32,
            torch.device("cpu"),
        )
        with torch.inference_mode():
            hidden = model(tokens, positions, PrefillMetadata(shared, [0, 5, 14]))
        return hidden, shared.k.clone(), shared.v.clone()

    before = forward()
    params = sum(p.numel() for p in model.parameters())
    model.fuse_projections()
    model.fuse_projections()  # idempotent
    assert sum(p.numel() for p in model.parameters()) == params
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj is not None and not hasattr(attn, "q_proj")
    for a, b in zip(before, forward(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
