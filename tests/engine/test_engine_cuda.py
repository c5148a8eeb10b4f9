"""The engine on a GPU (Triton decode attention) agrees with the CPU reference path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import ARCHS, random_catalog, sequential_sid_map
from xgr import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def engines(model_dir, catalog, dtype):
    sid_map = sequential_sid_map(3, 16, 8)
    cpu = Engine.from_pretrained(model_dir, catalog, device="cpu", sid_token_ids=sid_map)
    gpu = Engine.from_pretrained(
        model_dir, catalog, device="cuda", dtype=dtype, sid_token_ids=sid_map
    )
    return cpu, gpu


@pytest.mark.parametrize("arch", ARCHS)
def test_float32_gpu_equals_cpu_reference(model_dirs, arch):
    catalog = random_catalog(600, 3, 16, seed=1)
    cpu, gpu = engines(model_dirs[arch], catalog, "float32")
    assert (cpu.attention_backend, gpu.attention_backend) == ("torch", "triton")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 77, 140)]
    for a, b in zip(
        cpu.recommend(prompts, beam_width=40, top_k=40, num_results=40),
        gpu.recommend(prompts, beam_width=40, top_k=40, num_results=40),
        strict=True,
    ):
        assert [c for c, _ in a.semantic_ids] == [c for c, _ in b.semantic_ids]
        np.testing.assert_allclose(
            [s for _, s in a.semantic_ids], [s for _, s in b.semantic_ids], atol=1e-4
        )


def test_bfloat16_gpu_keeps_the_top_items(model_dirs):
    catalog = random_catalog(600, 3, 16, seed=2)
    cpu, gpu = engines(model_dirs["qwen2"], catalog, "bfloat16")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in range(5, 45, 4)]
    overlaps = []
    for a, b in zip(
        cpu.recommend(prompts, beam_width=32, num_results=10),
        gpu.recommend(prompts, beam_width=32, num_results=10),
        strict=True,
    ):
        overlaps.append(len({c for c, _ in a.semantic_ids} & {c for c, _ in b.semantic_ids}))
    assert np.mean(overlaps) >= 8
