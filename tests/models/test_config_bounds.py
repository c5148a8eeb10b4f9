"""config.json is bounded and checked against the weights' headers before anything is built;
RoPE settings that would not be applied, and shards outside the folder, are refused."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from tests.conftest import random_catalog
from xgr import Engine, XgrError
from xgr.models import (
    CausalLM,
    DecoderConfig,
    T5Config,
    T5Seq2SeqLM,
    config_checks,
    decoder,
    load_causal_lm,
    load_model,
    load_t5,
    loader,
    t5_blocks,
)
from xgr.models.config import MAX_LAYERS, MAX_POSITIONS
from xgr.models.loader import read_config

DROP = object()  # a value of ``changes`` that removes the key from config.json

DECODER_CONFIGS = {
    arch: {
        "model_type": arch,
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
    }
    for arch in ("qwen2", "qwen3", "llama")
}
DECODER_CONFIGS["qwen3"]["head_dim"] = 32
DECODER_CONFIGS["llama"]["head_dim"] = 16
T5_CONFIG = {
    "model_type": "t5",
    "vocab_size": 96,
    "d_model": 64,
    "d_kv": 16,
    "d_ff": 128,
    "num_layers": 2,
    "num_decoder_layers": 3,
    "num_heads": 4,
    "relative_attention_num_buckets": 16,
    "relative_attention_max_distance": 24,
    "feed_forward_proj": "relu",
    "decoder_start_token_id": 0,
}


def write_folder(path, arch="qwen2", **changes):
    """A model folder of zero weights shaped by the base config of ``arch``, whose
    config.json then gets ``changes``; returns the folder."""
    raw = json.loads(json.dumps(T5_CONFIG if arch == "t5" else DECODER_CONFIGS[arch]))
    cfg_cls, model_cls = (T5Config, T5Seq2SeqLM) if arch == "t5" else (DecoderConfig, CausalLM)
    with torch.device("meta"):
        model = model_cls(cfg_cls.from_hf(raw))
    save_file(
        {name: torch.zeros(t.shape) for name, t in model.state_dict().items()},
        path / "model.safetensors",
    )
    raw.update(changes)
    raw = {key: value for key, value in raw.items() if value is not DROP}
    (path / "config.json").write_text(json.dumps(raw))
    return path


@contextlib.contextmanager
def nothing_allocated():
    """Fail the test (with an AssertionError, which ``pytest.raises(XgrError)`` lets through)
    if a layer is built or weight data is read while the context is open."""

    def refuse(*args, **kwargs):
        raise AssertionError("a layer was built or weights read before the config was refused")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder.DecoderLayer, "__init__", refuse)
        patch.setattr(t5_blocks.T5Block, "__init__", refuse)
        patch.setattr(loader, "load_file", refuse)
        yield


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "t5"])
def test_matching_folders_load(tmp_path, arch):
    model = load_model(write_folder(tmp_path, arch), "cpu", "float32")
    assert isinstance(model, T5Seq2SeqLM if arch == "t5" else CausalLM)


# --- layer counts and sizes against the weights' headers ---------------------------------


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("qwen2", {"num_hidden_layers": 3}, "num_hidden_layers = 3, but the weights hold 2"),
        ("llama", {"num_hidden_layers": 1}, "num_hidden_layers = 1, but the weights hold 2"),
        ("qwen3", {"num_hidden_layers": MAX_LAYERS}, f"num_hidden_layers = {MAX_LAYERS}, but"),
        ("t5", {"num_layers": 5}, "num_layers = 5, but the weights hold 2 .encoder.block"),
        ("t5", {"num_decoder_layers": 2}, "num_decoder_layers = 2, but the weights hold 3"),
        (
            "qwen2",
            {"hidden_size": 128},
            r"hidden_size = 128, but the weights have 64: model.embed_tokens.weight has "
            r"shape \[96, 64\]",
        ),
        ("llama", {"vocab_size": 100}, "vocab_size = 100, but the weights have 96"),
        ("qwen3", {"intermediate_size": 256}, "intermediate_size = 256, but the weights have 128"),
        (
            "llama",
            {"num_attention_heads": 8, "num_key_value_heads": 4},
            r"num_attention_heads x head_dim = 8 x 16 = 128, but the weights have 64: "
            r"model.layers.0.self_attn.q_proj.weight",
        ),
        (
            "qwen2",
            {"num_key_value_heads": 4},
            r"num_key_value_heads x head_dim = 4 x 16 = 64, but the weights have 32: "
            r"model.layers.0.self_attn.k_proj",
        ),
        ("qwen3", {"head_dim": 16}, "num_attention_heads x head_dim = 4 x 16 = 64, but the"),
        ("t5", {"d_model": 32}, "d_model = 32, but the weights have 64: shared.weight"),
        ("t5", {"num_heads": 8}, "num_heads x d_kv = 8 x 16 = 128, but the weights have 64"),
        ("t5", {"d_ff": 256}, "d_ff = 256, but the weights have 128"),
        (
            "t5",
            {"relative_attention_num_buckets": 32, "relative_attention_max_distance": 64},
            "relative_attention_num_buckets = 32, but the weights have 16",
        ),
    ],
)
def test_configs_that_disagree_with_the_weights_name_the_field(tmp_path, arch, changes, message):
    write_folder(tmp_path, arch, **changes)
    with (
        nothing_allocated(),
        pytest.raises(
            XgrError, match=f"weights do not match config.json: config.json has {message}"
        ),
    ):
        load_model(tmp_path, "cpu", "float32")


def test_100000_layers_fail_before_any_layer_is_built(tmp_path):
    write_folder(tmp_path, "qwen2", num_hidden_layers=100000)
    with nothing_allocated(), pytest.raises(XgrError, match="num_hidden_layers 100000 is above"):
        load_causal_lm(tmp_path, "cpu", "float32")
    write_folder(tmp_path, "t5", num_layers=100000)
    with nothing_allocated(), pytest.raises(XgrError, match="num_layers 100000 is above"):
        load_t5(tmp_path, "cpu", "float32")


def test_a_million_heads_fail_before_any_layer_is_built(tmp_path):
    # Without head_dim the heads must divide the hidden size (64 // 10^6 would be 0).
    write_folder(tmp_path, "qwen2", num_attention_heads=10**6, num_key_value_heads=DROP)
    with nothing_allocated(), pytest.raises(XgrError, match="hidden_size 64 is not a multiple"):
        load_causal_lm(tmp_path, "cpu", "float32")
    # With it, the q projection of the weights has 4 x 16 rows, not 10^6 x 16.
    write_folder(tmp_path, "llama", num_attention_heads=10**6, num_key_value_heads=2)
    with nothing_allocated(), pytest.raises(XgrError, match="heads x head_dim = 1000000 x 16"):
        load_causal_lm(tmp_path, "cpu", "float32")


def test_a_million_layers_of_billion_sizes_fail_before_any_layer_is_built(tmp_path):
    big = 10**9
    write_folder(
        tmp_path, "qwen2", num_hidden_layers=10**6, hidden_size=big, intermediate_size=big,
        vocab_size=big,
    )  # fmt: skip
    with nothing_allocated(), pytest.raises(XgrError, match="hidden_size 1000000000 is above"):
        load_causal_lm(tmp_path, "cpu", "float32")
    write_folder(tmp_path, "t5", d_model=big, d_ff=big, num_layers=10**6)
    with nothing_allocated(), pytest.raises(XgrError, match="is above the largest supported"):
        load_t5(tmp_path, "cpu", "float32")
    # Sizes within the bounds but not the weights' are the headers' to refuse.
    write_folder(tmp_path, "qwen2", num_hidden_layers=MAX_LAYERS, intermediate_size=2**24)
    with nothing_allocated(), pytest.raises(XgrError, match="weights do not match config.json"):
        load_causal_lm(tmp_path, "cpu", "float32")


def test_the_engine_reports_it_as_the_folders_error(tmp_path):
    write_folder(tmp_path, "qwen2", num_hidden_layers=500)
    with nothing_allocated(), pytest.raises(XgrError, match="num_hidden_layers = 500, but"):
        Engine.from_pretrained(tmp_path, random_catalog(20, 3, 16, seed=1))


# --- bounds of the config alone ----------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "changes", "message"),
    [
        ("qwen2", {"max_position_embeddings": 10**12}, "max_position_embeddings 1000000000000 is"),
        ("t5", {"n_positions": 10**12}, "n_positions 1000000000000 is above"),
        ("qwen2", {"vocab_size": 0}, "vocab_size must be an integer >= 1, got 0"),
        ("llama", {"intermediate_size": -1}, "intermediate_size must be an integer >= 1"),
        ("llama", {"head_dim": 16.0}, "head_dim must be an integer >= 1, got 16.0"),
        ("qwen3", {"head_dim": 15}, "head_dim 15 must be even"),
        ("qwen2", {"num_key_value_heads": 3}, "4 is not a multiple of num_key_value_heads 3"),
        ("qwen2", {"num_key_value_heads": 8}, "4 is not a multiple of num_key_value_heads 8"),
        ("qwen2", {"hidden_size": 66}, "hidden_size 66 is not a multiple of num_attention_heads"),
        ("qwen2", {"rms_norm_eps": -1e-6}, "rms_norm_eps must be a finite number >= 0"),
        ("qwen2", {"rms_norm_eps": math.nan}, "rms_norm_eps must be a finite number >= 0"),
        ("t5", {"layer_norm_epsilon": "1e-6"}, "layer_norm_epsilon must be a finite number"),
        ("t5", {"relative_attention_max_distance": 10**400}, "max_distance .* is above"),
        ("qwen2", {"layer_types": ["full_attention"]}, "num_hidden_layers is 2, layer_types has 1"),
        ("qwen3", {"layer_types": ["sliding_attention", "full_attention"]}, "'sliding_attention'"),
        ("llama", {"layer_types": "full_attention"}, "layer_types has str"),
    ],
)
def test_sizes_out_of_range_are_refused(tmp_path, arch, changes, message):
    write_folder(tmp_path, arch, **changes)
    with pytest.raises(XgrError, match=message):
        read_config(tmp_path)


def test_the_largest_bounds_are_accepted(tmp_path):
    write_folder(tmp_path, "qwen2", max_position_embeddings=MAX_POSITIONS)
    assert read_config(tmp_path)[0].max_position_embeddings == MAX_POSITIONS


# --- RoPE settings -----------------------------------------------------------------------


def rope_config(tmp_path, **changes):
    write_folder(tmp_path, "llama", **changes)
    return read_config(tmp_path)[0]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            r"rope_scaling and rope_parameters disagree on factor \(2.0 in rope_scaling, unset "
            r"in rope_parameters\); rope_theta .*; rope_type \('linear' in rope_scaling, "
            r"'default' in rope_parameters\)",
        ),
        (
            {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},
            r"disagree on rope_theta \(500000.0 in rope_scaling, 10000.0 in rope_parameters\)",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_parameters": DROP},
            "RoPE type 'linear' .rope_scaling. is not supported",
        ),
        (
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            "RoPE type 'dynamic' .rope_parameters. is not supported",
        ),
        ({"rope_theta": 5e5}, "rope_theta 500000.0 disagrees with the rope_theta 10000.0 in"),
        ({"rope_parameters": {"rope_type": "default", "type": "linear"}}, "but type 'linear'"),
        ({"rope_parameters": [10000.0]}, "rope_parameters must be a JSON object"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "sets RoPE per layer type .full_attention, sliding_attention. differently",
        ),
        ({"rope_parameters": {"rope_theta": 0}}, r"rope_theta must be a finite number in \(0, "),
        ({"rope_parameters": {"rope_theta": -1e4}}, "got -10000.0"),
        ({"rope_parameters": {"rope_theta": math.inf}}, "got inf"),
        ({"rope_parameters": {"rope_theta": math.nan}}, "got nan"),
        ({"rope_parameters": {"rope_theta": 1e39}}, "got 1e[+]39"),
        ({"rope_parameters": {"rope_theta": "1e4"}}, "got '1e4'"),
    ],
)
def test_rope_settings_that_would_not_be_applied_are_refused(tmp_path, changes, message):
    with pytest.raises(XgrError, match=message):
        rope_config(tmp_path, **changes)


@pytest.mark.parametrize(
    ("changes", "theta"),
    [
        ({}, 10000.0),
        ({"rope_parameters": DROP}, 10000.0),
        ({"rope_parameters": DROP, "rope_theta": 5e5}, 5e5),
        ({"rope_parameters": DROP, "rope_scaling": None, "rope_theta": 5e5}, 5e5),
        ({"rope_parameters": {}, "rope_theta": 5e5}, 5e5),
        ({"rope_parameters": {"rope_theta": 1e6}, "rope_theta": 1e6}, 1e6),
        # Both names saying the same thing (the older one with "type") are one setting.
        (
            {
                "rope_scaling": {"type": "default", "rope_theta": 1e6},
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            },
            1e6,
        ),
        ({"rope_scaling": {"type": "default"}, "rope_parameters": DROP, "rope_theta": 7.0}, 7.0),
        (
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 2e5}}},
            2e5,
        ),
    ],
)
def test_accepted_rope_settings_give_the_applied_theta(tmp_path, changes, theta):
    assert rope_config(tmp_path, **changes).rope_theta == theta


# --- sharded checkpoints -----------------------------------------------------------------


def write_sharded(path, names, saved=None):
    """``write_folder``'s qwen2 weights split over the shards ``names`` in an index; only
    the shards in ``saved`` (default: all) are written, always inside ``path``."""
    from safetensors.torch import load_file

    write_folder(path, "qwen2")
    state = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    tensors = sorted(state)
    weight_map = {}
    for i, shard in enumerate(names):
        part = tensors[i :: len(names)]
        weight_map.update(dict.fromkeys(part, shard))
        if shard in (names if saved is None else saved):
            save_file({k: state[k] for k in part}, path / os.path.basename(shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


@pytest.fixture
def nothing_opened(monkeypatch):
    """The safetensors files opened (headers or data), in order."""
    opened = []
    real_safe_open, real_load_file = config_checks.safe_open, loader.load_file

    def safe_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_safe_open(path, *args, **kwargs)

    def load_file(path, *args, **kwargs):
        opened.append(str(path))
        return real_load_file(path, *args, **kwargs)

    monkeypatch.setattr(config_checks, "safe_open", safe_open)
    monkeypatch.setattr(loader, "load_file", load_file)
    return opened


def test_sharded_folder_loads(tmp_path, nothing_opened):
    write_sharded(tmp_path, ["a.safetensors", "b.safetensors"])
    assert isinstance(load_causal_lm(tmp_path, "cpu", "float32"), CausalLM)
    assert sorted(os.path.basename(p) for p in nothing_opened) == [
        "a.safetensors", "a.safetensors", "b.safetensors", "b.safetensors",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../../../../etc/passwd", "is not a relative name inside"),
        ("/proc/self/environ", "is not a relative name inside"),
        ("sub/../../x.safetensors", "is not a relative name inside"),
        ("C:/x.safetensors", "is not a relative name inside"),
        ("..\\x.safetensors", "has a backslash"),
        ("missing.safetensors", "does not exist in"),
    ],
)
def test_shards_outside_the_folder_are_refused_unopened(tmp_path, nothing_opened, shard, message):
    folder = tmp_path / "model"
    folder.mkdir()
    tensors = write_sharded(folder, ["a.safetensors", shard], saved=["a.safetensors"])
    entry = f"the shard of {tensors[1]!r}, {shard!r}, {message}"
    with pytest.raises(XgrError, match=re.escape(entry)):
        load_causal_lm(folder, "cpu", "float32")
    assert nothing_opened == []


def test_a_shard_folder_linked_outside_is_refused_unopened(tmp_path, nothing_opened):
    folder, outside = tmp_path / "model", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    write_sharded(folder, ["a.safetensors", "sub/b.safetensors"], saved=["a.safetensors"])
    (outside / "b.safetensors").write_bytes((folder / "a.safetensors").read_bytes())
    (folder / "sub").symlink_to(outside)
    with pytest.raises(XgrError, match="'sub/b.safetensors', resolves outside"):
        load_causal_lm(folder, "cpu", "float32")
    assert nothing_opened == []


def test_shard_files_linked_as_in_a_hub_cache_load(tmp_path):
    """A hub cache snapshot holds links to ../../blobs; the index names them inside."""
    snapshot, blobs = tmp_path / "snapshots" / "abc", tmp_path / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    write_sharded(snapshot, ["a.safetensors", "b.safetensors"])
    for name in ("a.safetensors", "b.safetensors"):
        (snapshot / name).rename(blobs / name)
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", name))
    assert isinstance(load_causal_lm(snapshot, "cpu", "float32"), CausalLM)


@pytest.mark.parametrize(
    ("index", "message"),
    [
        ({"weight_map": {"model.norm.weight": ["a.safetensors"]}}, "is not a file name"),
        ({"weight_map": {"model.norm.weight": ""}}, "is not a file name"),
        ({"weight_map": {}}, "has no weight_map object"),
        ({}, "has no weight_map object"),
        ([], "cannot read"),
    ],
)
def test_malformed_indexes_are_refused(tmp_path, nothing_opened, index, message):
    write_sharded(tmp_path, ["a.safetensors"])
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(XgrError, match=message):
        load_causal_lm(tmp_path, "cpu", "float32")
    assert nothing_opened == []
