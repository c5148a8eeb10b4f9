"""Shared fixtures: small random HF models and catalogs written as real HF folders."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

# Triton kernels run under its interpreter on a machine without a GPU. Set before any test
# module is imported: the flag must precede Triton's own import, which importing
# transformers can already trigger.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


def write_code_tokenizer(path: Path, num_levels: int, codebook: int, offset: int) -> None:
    """A word-level tokenizer: ``<t0>``..``<t{offset-1}>`` then ``<a_0>``.. at sequential ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(offset)}
    letters = "abcdefgh"
    for level in range(num_levels):
        for code in range(codebook):
            vocab[f"<{letters[level]}_{code}>"] = offset + level * codebook + code
    tok = Tokenizer(WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)


@pytest.fixture(scope="session")
def served_model_dir(tmp_path_factory) -> Path:
    """A qwen2 folder with tokenizer, catalog (300 items, 3 x 16) and prompt format."""
    import json

    path = tmp_path_factory.mktemp("served")
    write_random_model(path, "qwen2", seed=7)
    write_code_tokenizer(path, 3, 16, 8)
    catalog = random_catalog(300, 3, 16, seed=21)
    catalog.to_index_json(path / "catalog.index.json")
    catalog.write_model_metadata(path)
    (path / "xgr_prompt.json").write_text(
        json.dumps({"prefix_tokens": ["<t1>"], "max_history_items": 20})
    )
    (path / "items.json").write_text(json.dumps({i: f"Title of {i}" for i in catalog.item_ids}))
    return path


def wait_until_ready(base_url: str, timeout: float) -> bool:
    """Poll ``/ready`` until it answers 200 (True) or ``timeout`` seconds pass (False)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{base_url}/ready", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


@contextlib.contextmanager
def live_server(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    import socket
    import threading

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", backlog=512)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    if not wait_until_ready(base, 60):
        server.should_exit = True
        raise RuntimeError("the test server did not become ready")
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def write_random_t5(
    path: Path,
    feed_forward_proj: str,
    tied: bool,
    vocab_size: int = 96,
    seed: int = 0,
    **overrides,
) -> torch.nn.Module:
    """Save a random-weight HF ``T5ForConditionalGeneration`` to ``path``; returns it (float32).

    ``tied=False`` gives the T5 v1.1 layout: its own LM head (saved as ``lm_head.weight``) and
    no output rescaling; ``tied=True`` the original T5's tied, rescaled head.
    """
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    kwargs = dict(
        vocab_size=vocab_size,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=3,
        num_heads=4,
        # Few buckets and a short max distance put the prompts' offsets in every kind of
        # bucket: exact, logarithmic and the shared last one.
        relative_attention_num_buckets=16,
        relative_attention_max_distance=24,
        feed_forward_proj=feed_forward_proj,
        tie_word_embeddings=tied,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        # HF's own scale: T5's unscaled attention logits make wider weights lose float32
        # agreement with HF quickly (1e-3 at twice the scale), while these beams are still
        # separated by far more than the 1e-6 to 3e-5 the two implementations differ by.
        initializer_factor=1.0,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(**kwargs)).eval()
    if not tied:
        # transformers 5 always ties T5's head to ``shared``; a head of its own (as T5 v1.1
        # checkpoints hold) is kept when the file has different values.
        model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab_size, kwargs["d_model"]))
    model.save_pretrained(path, safe_serialization=True)
    if not tied:
        state = load_file(path / "model.safetensors")
        state["lm_head.weight"] = model.lm_head.weight.detach().clone()
        save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    return model
