"""FP8 on load: quantize_fp8, FP8 checkpoints (block-wise and per-tensor), refusals, and the
FP8 engine against bf16 on the CPU reference path."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import random_catalog, sequential_sid_map, write_random_model
from xgr import Engine
from xgr.core import XgrError
from xgr.layers.fp8 import Fp8GatedMLP, Fp8Linear, Fp8RMSNorm
from xgr.models import load_model
from xgr.models.quantize import dequantize_fp8_checkpoint, quantize_fp8

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8-qwen3")
    write_random_model(path, "qwen3", seed=3, initializer_range=0.05)
    return path


def write_fp8_checkpoint(source, target, block: list[int] | None) -> dict:
    """``source``'s projections stored as e4m3 with ``weight_scale_inv`` scales (blocks of
    ``block`` or one per tensor), as Hugging Face FP8 checkpoints hold them."""
    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    out = {}
    for name, tensor in state.items():
        if not any(f"{p}.weight" in name for p in PROJECTIONS):
            out[name] = tensor
            continue
        if block is None:
            scale = tensor.abs().amax() / 448.0
            full = scale
        else:
            rows, cols = tensor.shape
            blocks = tensor.reshape(rows // block[0], block[0], cols // block[1], block[1])
            scale = blocks.abs().amax((1, 3)) / 448.0
            full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        out[name] = (tensor / full).to(torch.float8_e4m3fn)
        out[name + "_scale_inv"] = scale.float()
    save_file(out, target / "model.safetensors")
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": block,
    }  # fmt: skip
    (target / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("quantization", ["fp8", "fp8-tensorwise"])
def test_quantize_fp8_replaces_the_layer_projections(qwen3_dir, quantization):
    model = quantize_fp8(load_model(qwen3_dir, "cpu", "bfloat16"), quantization)
    assert model.quantization == quantization
    per_tensor = quantization == "fp8-tensorwise"
    for layer in model.model.layers:
        projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj)  # fmt: skip
        assert all(isinstance(p, Fp8Linear) for p in projections)
        assert all(p.per_tensor == per_tensor for p in projections)
        hidden = layer.self_attn.o_proj.out_features
        assert layer.self_attn.o_proj.weight_scale.shape == ((1,) if per_tensor else (hidden,))
        assert isinstance(layer.mlp, Fp8GatedMLP)
        assert isinstance(layer.input_layernorm, Fp8RMSNorm)
        assert layer.input_layernorm.per_tensor == per_tensor
    assert model.lm_head.weight.dtype == torch.bfloat16  # scores stay in the model dtype
    assert quantize_fp8(model, quantization) is model  # idempotent
    other = "fp8" if per_tensor else "fp8-tensorwise"
    with pytest.raises(XgrError, match="quantized already"):
        quantize_fp8(model, other)


@pytest.mark.parametrize("block", [[16, 32], None])
def test_fp8_checkpoint_loads_dequantized(qwen3_dir, tmp_path, block):
    stored = write_fp8_checkpoint(qwen3_dir, tmp_path / "fp8", block)
    model = load_model(tmp_path / "fp8", "cpu", "float32")
    name = "model.layers.0.mlp.down_proj.weight"
    scale = stored[name + "_scale_inv"]
    if block is not None:
        scale = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    expected = stored[name].float() * scale
    torch.testing.assert_close(model.model.layers[0].mlp.down_proj.weight, expected)
    original = load_file(qwen3_dir / "model.safetensors")[name]
    assert (expected - original).norm() / original.norm() < 0.05
    quantized = load_model(tmp_path / "fp8", "cpu", "bfloat16", quantization="fp8")
    assert isinstance(quantized.model.layers[0].mlp.down_proj, Fp8Linear)


def test_fp8_checkpoint_errors_name_the_problem(qwen3_dir, tmp_path):
    stored = write_fp8_checkpoint(qwen3_dir, tmp_path / "fp8", [16, 32])
    name = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(XgrError, match="has no .*_scale_inv"):
        dequantize_fp8_checkpoint({name: stored[name]}, (16, 32), "ckpt")
    with pytest.raises(XgrError, match="block scales of shape"):
        dequantize_fp8_checkpoint(
            {name: stored[name], name + "_scale_inv": stored[name + "_scale_inv"][:1]},
            (16, 32), "ckpt",
        )  # fmt: skip
    with pytest.raises(XgrError, match="scales no weight"):
        dequantize_fp8_checkpoint({"x.weight_scale_inv": torch.ones(1)}, None, "ckpt")


@pytest.mark.parametrize(
    "quantization_config,message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "only e4m3"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive ints"),
    ],
)
def test_other_checkpoint_quantizations_are_refused(qwen3_dir, tmp_path, quantization_config,
                                                    message):  # fmt: skip
    target = tmp_path / "other"
    shutil.copytree(qwen3_dir, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(XgrError, match=message):
        load_model(target, "cpu", "bfloat16")


def test_quantization_option_is_checked(qwen3_dir, tmp_path):
    with pytest.raises(XgrError, match="one of"):
        load_model(qwen3_dir, "cpu", "bfloat16", quantization="int4")
    with pytest.raises(XgrError, match="use dtype 'bfloat16'"):
        load_model(qwen3_dir, "cpu", "float32", quantization="fp8")
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"model_type": "t5", "vocab_size": 64,
                                                "d_model": 32, "d_kv": 8, "d_ff": 64,
                                                "num_layers": 1, "num_heads": 4,
                                                "decoder_start_token_id": 0}))  # fmt: skip
    with pytest.raises(XgrError, match="not T5"):
        load_model(t5, "cpu", "bfloat16", quantization="fp8")


@pytest.mark.parametrize("quantization", ["fp8", "fp8-tensorwise"])
def test_fp8_engine_agrees_with_bf16(qwen3_dir, quantization):
    catalog = random_catalog(300, 3, 16, seed=1)
    sid = sequential_sid_map(3, 16, 96 - 48)
    prompts = [np.random.default_rng(i).integers(0, 48, 30).tolist() for i in range(12)]
    top = {}
    for name, options in (("bf16", {}), ("fp8", {"quantization": quantization})):
        engine = Engine.from_pretrained(qwen3_dir, catalog=catalog, sid_token_ids=sid,
                                        dtype="bfloat16", **options)  # fmt: skip
        results = engine.recommend(prompts, beam_width=16, top_k=10)
        top[name] = [{c for c, _ in r.semantic_ids[:10]} for r in results]
        if name == "fp8":  # still normalized log-probabilities: every score below 0
            assert all(s < 0 for r in results for _, s in r.semantic_ids)
    overlap = np.mean([len(a & b) / 10 for a, b in zip(top["fp8"], top["bf16"], strict=True)])
    assert overlap >= 0.8, overlap
