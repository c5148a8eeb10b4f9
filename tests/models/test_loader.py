"""Our modules reproduce HF's forward; folders load in every supported layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from tests.conftest import ARCHS, write_random_model
from xgr import XgrError
from xgr.kv import SharedKV
from xgr.layers.attention import PrefillMetadata
from xgr.models import load_causal_lm, resolve_dtype
from xgr.models.loader import read_config


def prefill_log_probs(model, prompts):
    cfg = model.config
    lens = [len(p) for p in prompts]
    shared = SharedKV.allocate(
        cfg.num_layers, lens, cfg.num_kv_heads, cfg.head_dim, torch.float32, torch.device("cpu")
    )
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    tokens = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        return model.log_probs(model(tokens, positions, PrefillMetadata(shared, cu)))


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_hf_logits(model_dirs, arch):
    ours = load_causal_lm(model_dirs[arch], "cpu", "float32")
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (1, 7, 33)]
    got = prefill_log_probs(ours, prompts)
    start = 0
    for prompt in prompts:
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
        torch.testing.assert_close(got[start : start + len(prompt)], expected, atol=2e-5, rtol=0)
        start += len(prompt)


def test_sharded_checkpoint_loads_the_same(tmp_path, model_dirs):
    state = load_file(model_dirs["llama"] / "model.safetensors")
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for shard, keys in halves.items():
        save_file({k: state[k].contiguous() for k in keys}, tmp_path / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((model_dirs["llama"] / "config.json").read_text())
    single = load_causal_lm(model_dirs["llama"], "cpu", "float32").state_dict()
    sharded = load_causal_lm(tmp_path, "cpu", "float32").state_dict()
    assert single.keys() == sharded.keys()
    for key in single:
        torch.testing.assert_close(single[key], sharded[key], atol=0, rtol=0)


def test_tied_and_untied_embeddings(model_dirs):
    tied = load_causal_lm(model_dirs["qwen2"], "cpu", "float32")
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    untied = load_causal_lm(model_dirs["llama"], "cpu", "float32")
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_weights(model_dirs, dtype):
    model = load_causal_lm(model_dirs["qwen3"], "cpu", dtype)
    assert {p.dtype for p in model.parameters()} == {resolve_dtype(dtype)}


def test_rope_theta_and_qk_norm_from_config(model_dirs):
    cfg, _ = read_config(model_dirs["qwen3"])
    assert cfg.rope_theta == 1000000.0 and cfg.qk_norm and cfg.head_dim == 32
    cfg, _ = read_config(model_dirs["llama"])
    assert cfg.rope_theta == 500000.0 and not cfg.qk_norm and cfg.num_kv_heads == 4


def test_broken_folders_are_reported(tmp_path):
    with pytest.raises(XgrError, match="config.json"):
        load_causal_lm(tmp_path, "cpu", "float32")
    write_random_model(tmp_path, "qwen2")
    with pytest.raises(XgrError, match="dtype"):
        load_causal_lm(tmp_path, "cpu", "float64")
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(XgrError, match="missing"):
        load_causal_lm(tmp_path, "cpu", "float32")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(XgrError, match="neither"):
        load_causal_lm(tmp_path, "cpu", "float32")


def test_unsupported_rope_scaling_is_refused(tmp_path):
    write_random_model(tmp_path, "llama")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(XgrError, match="yarn"):
        load_causal_lm(tmp_path, "cpu", "float32")
