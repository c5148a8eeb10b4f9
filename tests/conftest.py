"""Shared fixtures: small random HF models and catalogs written as real HF folders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from xgr import ItemCatalog

ARCHS = ("qwen2", "qwen3", "llama")


def random_catalog(num_items: int, num_levels: int, codebook: int, seed: int) -> ItemCatalog:
    """A catalog of random semantic IDs (collisions possible), item ids "item<i>"."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, codebook, size=(num_items, num_levels))
    return ItemCatalog.from_codes([f"item{i}" for i in range(num_items)], codes, codebook)


def sequential_sid_map(num_levels: int, codebook: int, offset: int) -> np.ndarray:
    """Codes of level l at vocabulary ids offset + l * codebook + code."""
    return offset + np.arange(num_levels * codebook).reshape(num_levels, codebook)


def write_random_model(
    path: Path, arch: str, vocab_size: int = 96, seed: int = 0, **overrides
) -> torch.nn.Module:
    """Save a random-weight HF model of ``arch`` to ``path``; returns the HF model (float32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads={"qwen2": 2, "qwen3": 2, "llama": 4}[arch],
        max_position_embeddings=256,
        rope_theta={"qwen2": 10000.0, "qwen3": 1000000.0, "llama": 500000.0}[arch],
        tie_word_embeddings=arch != "llama",
        # Wide weights give peaked next-token distributions, so beam orders are well separated.
        initializer_range=0.2,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    kwargs.update(overrides)
    config = AutoConfig.for_model(arch, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """One saved random model per architecture."""
    dirs = {}
    for i, arch in enumerate(ARCHS):
        path = tmp_path_factory.mktemp(arch)
        write_random_model(path, arch, seed=i)
        dirs[arch] = path
    return dirs
