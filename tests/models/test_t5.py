"""T5 modules reproduce HF's encoder and decoder; T5 folders load or are refused clearly."""

from __future__ import annotations

import json
import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton cross-attention test runs interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
from safetensors.torch import load_file, save_file
from transformers import T5ForConditionalGeneration

from tests.conftest import write_random_t5
from xgr import XgrError
from xgr.engine.generate import allocate_shared_kv
from xgr.engine.inputs import prepare_inputs
from xgr.kv import SharedKV
from xgr.layers.relative_position import (
    relative_position_bias,
    relative_position_bucket,
    square_position_bias,
)
from xgr.models import CausalLM, T5Config, T5Seq2SeqLM, load_causal_lm, load_model, load_t5
from xgr.models import t5 as t5_module
from xgr.models.t5 import EncDecDecodeMetadata

# (feed_forward_proj, tied head)
VARIANTS = [("relu", True), ("relu", False), ("gated-gelu", True), ("gated-gelu", False)]


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory):
    dirs = {}
    for i, (proj, tied) in enumerate(VARIANTS):
        path = tmp_path_factory.mktemp(f"t5-{proj}-{tied}")
        write_random_t5(path, proj, tied, seed=i)
        dirs[proj, tied] = path
    return dirs


def test_relative_position_buckets():
    offsets = torch.tensor([0, -1, 1, -7, -8, -12, -20, -127, -500, 7, 8, 12, 500])
    # Bidirectional: 16 buckets per direction, 8 exact; keys after the query from 16 on.
    assert relative_position_bucket(offsets, True, 32, 128).tolist() == [
        0, 1, 17, 7, 8, 9, 10, 15, 15, 23, 24, 25, 31,
    ]  # fmt: skip
    # Causal: all 32 buckets look back, 16 exact; later keys share bucket 0.
    assert relative_position_bucket(offsets, False, 32, 128).tolist() == [
        0, 1, 0, 7, 8, 12, 17, 31, 31, 0, 0, 0, 0,
    ]  # fmt: skip


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("buckets", "max_distance"), [(32, 128), (16, 24), (8, 5)])
def test_relative_position_buckets_match_hf(bidirectional, buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    offsets = torch.arange(-300, 301)
    expected = T5Attention._relative_position_bucket(
        offsets, bidirectional=bidirectional, num_buckets=buckets, max_distance=max_distance
    )
    got = relative_position_bucket(offsets, bidirectional, buckets, max_distance)
    assert torch.equal(got, expected)


def encode(model: T5Seq2SeqLM, prompts: list[list[int]]):
    cu = [0]
    for p in prompts:
        cu.append(cu[-1] + len(p))
    inputs = prepare_inputs(prompts, model.shared.weight.device)
    shared = allocate_shared_kv(model, inputs)
    encoded = model.encode(inputs.tokens, cu, shared)
    return encoded, shared, cu


@pytest.mark.parametrize("length", [1, 2, 7, 40])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_square_position_bias_equals_the_general_one(length, bidirectional):
    table = torch.randn(16, 3, generator=torch.Generator().manual_seed(length))
    pos = torch.arange(length)
    want = relative_position_bias(table, pos, pos, bidirectional, 24)
    got = square_position_bias(table, length, bidirectional, 24)
    assert got.is_contiguous() and got.shape == (3, length, length)
    assert torch.equal(got, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_hf(t5_dirs, variant):
    ours = load_t5(t5_dirs[variant], "cpu", "float32")
    hf = T5ForConditionalGeneration.from_pretrained(t5_dirs[variant], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    # Lengths below, inside and beyond the buckets' max distance (24), in one packed batch.
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    decoder_ids = torch.randint(0, 96, (len(prompts), 4), generator=gen)
    decoder_ids[:, 0] = ours.config.decoder_start_token_id
    with torch.inference_mode():
        encoded, shared, cu = encode(ours, prompts)
        # One row per request: decoder token t sits at slot t of the request's row.
        rows = len(prompts)
        beam = ours.allocate_beam_kv(rows, decoder_ids.shape[1])
        meta = EncDecDecodeMetadata(shared, beam, cu, 1, torch.arange(rows))
        steps = []
        for t in range(decoder_ids.shape[1]):
            steps.append(ours.log_probs(ours.decode(decoder_ids[:, t], meta)))
            beam.length += 1
        for r, prompt in enumerate(prompts):
            out = hf(input_ids=torch.tensor([prompt]), decoder_input_ids=decoder_ids[r : r + 1])
            expected = torch.log_softmax(out.logits[0].float(), -1)
            torch.testing.assert_close(
                encoded[cu[r] : cu[r + 1]], out.encoder_last_hidden_state[0], atol=1e-4, rtol=1e-5
            )
            got = torch.stack([step[r] for step in steps])
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("variant", [("relu", True), ("gated-gelu", False)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "triton"])
def test_padded_encoder_equals_the_packed_one(monkeypatch, t5_dirs, variant, fused, attention):
    """The CUDA graphs' encoder (prompts padded to one length, masked; fused projections;
    SDPA with the square mask or the Triton kernel, on the GPU or interpreted on the CPU)
    against the packed per-prompt reference: same encoder output and K/V."""
    device = "cpu"
    if attention == "triton":
        pytest.importorskip("triton")
        device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled or interpreted
    monkeypatch.setattr(t5_module, "ENCODER_ATTENTION", attention)
    model = load_t5(t5_dirs[variant], device, "float32")
    assert attention == "sdpa" or model._triton_encoder_attention_fits(torch.device(device))
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (7, 1, 30, 12)]
    with torch.inference_mode():
        encoded, shared, cu = encode(model, prompts)
        if fused:
            model.fuse_projections()
            model.fuse_projections()  # idempotent
        total, slots, length = cu[-1], 8, 32  # 4 absent requests stand in, one token each
        tokens = torch.randint(0, 96, (slots * length,), generator=gen)
        tokens[:total] = torch.tensor([t for p in prompts for t in p])
        lengths = torch.ones(slots, dtype=torch.int64)
        lengths[: len(prompts)] = torch.tensor([len(p) for p in prompts])
        layers, heads, d_kv = model.shared_kv_layout
        # Fused: one GEMM writes every layer's K/V into a token-major buffer; unfused: a
        # GEMM a layer into separate K and V (the reference wrote token-major views).
        kv = SharedKV.allocate(
            layers, [slots * length], heads, d_kv, torch.float32, device, token_major=fused
        )
        assert (kv.token_major is not None) == fused
        if fused:  # each layer's kv projection views the all-layer weight: no second copy
            kv_weight = model.decoder.block[-1].layer[1].EncDecAttention.kv.weight
            assert kv_weight.untyped_storage().data_ptr() == (
                model.cross_kv.weight.untyped_storage().data_ptr()
            )
        padded = model.encode_padded(tokens.to(device), lengths.to(device), length, kv)
    assert padded.shape == (slots * length, model.config.d_model)
    torch.testing.assert_close(padded[:total], encoded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.k[:, :total], shared.k[:, :total], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.v[:, :total], shared.v[:, :total], atol=1e-5, rtol=1e-5)


def test_triton_encoder_on_long_prompts_takes_one_bias_beyond_max_distance(monkeypatch, t5_dirs):
    """Prompts of 150 and 100 tokens (max_distance 24, 64-key tiles): most key tiles lie
    beyond the distance, where the kernel adds one bias; output as the packed reference."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(t5_module, "ENCODER_ATTENTION", "triton")
    model = load_t5(t5_dirs[("gated-gelu", False)], device, "float32")
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (150, 100)]
    with torch.inference_mode():
        encoded, shared, cu = encode(model, prompts)
        length = 192
        tokens = torch.zeros(2 * length, dtype=torch.int64)
        tokens[: cu[-1]] = torch.tensor([t for p in prompts for t in p])
        lengths = torch.tensor([150, 100])
        layers, heads, d_kv = model.shared_kv_layout
        kv = SharedKV.allocate(layers, [2 * length], heads, d_kv, torch.float32, device)
        padded = model.encode_padded(tokens.to(device), lengths.to(device), length, kv)
    torch.testing.assert_close(padded[: cu[-1]], encoded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.k[:, : cu[-1]], shared.k[:, : cu[-1]], atol=1e-5, rtol=1e-5)


def test_triton_encoder_attention_keeps_sdpa_for_head_sizes_it_lacks(monkeypatch, tmp_path):
    """d_kv 24 is not a Triton kernel size: encode_padded falls back to SDPA, same output."""
    pytest.importorskip("triton")
    write_random_t5(tmp_path, "relu", True, d_kv=24)
    monkeypatch.setattr(t5_module, "ENCODER_ATTENTION", "triton")
    model = load_t5(tmp_path, "cpu", "float32")
    assert not model._triton_encoder_attention_fits(torch.device("cpu"))
    prompts = [[5, 9, 11], [7]]
    with torch.inference_mode():
        encoded, _, cu = encode(model, prompts)
        tokens = torch.tensor([5, 9, 11, 7, 7, 7, 7, 7])
        lengths = torch.tensor([3, 1])
        layers, heads, d_kv = model.shared_kv_layout
        kv = SharedKV.allocate(layers, [8], heads, d_kv, torch.float32, "cpu")
        padded = model.encode_padded(tokens, lengths, 4, kv)
    torch.testing.assert_close(padded[: cu[-1]], encoded, atol=1e-5, rtol=1e-5)


def test_triton_encoder_attention_needs_cuda_or_the_interpreter(monkeypatch, t5_dirs):
    """Compiled Triton cannot read host tensors: a CPU model keeps SDPA unless interpreted
    (as Triton decided when the kernel module was imported, whatever the environment says
    later)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from xgr.kernels import triton_encoder_attention as kernels

    model = load_t5(t5_dirs["relu", True], "cpu", "float32")
    interpreted = isinstance(kernels._padded_biased_attention_kernel, InterpretedFunction)
    assert model._triton_encoder_attention_fits(torch.device("cpu")) == interpreted
    assert model._triton_encoder_attention_fits(torch.device("cuda"))
    # Compiled (as on a machine with a GPU): the CPU keeps SDPA.
    monkeypatch.setattr(kernels, "_padded_biased_attention_kernel", object())
    assert not model._triton_encoder_attention_fits(torch.device("cpu"))


def test_triton_decoder_attention_equals_the_reference(t5_dirs):
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: interpreted
    model = load_t5(t5_dirs["gated-gelu", False], device, "float32")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (3, 17)]
    beam_width, rows = 2, 4
    ids = torch.randint(0, 96, (rows,), generator=gen).to(device)
    outputs = {}
    with torch.inference_mode():
        _, shared, cu = encode(model, prompts)
        for backend in ("torch", "triton"):
            beam = model.allocate_beam_kv(rows, 1)
            rows_index = torch.arange(rows, device=device)
            meta = EncDecDecodeMetadata(shared, beam, cu, beam_width, rows_index, backend)
            outputs[backend] = model.decode(ids, meta)
    torch.testing.assert_close(outputs["triton"], outputs["torch"], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_small_rows_decode_equals_the_cublas_path(monkeypatch, t5_dirs, variant):
    """The first decode steps of a batch (at most 16 rows) run norm, activation and residual
    inside their projections (``triton_small_rows_linear``): two steps give the results of
    the op-by-op path (float32; under Triton's interpreter on the CPU)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_t5(t5_dirs[variant], device, "float32")
    model.fuse_projections()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 12)]
    beam_width, rows = 3, 6
    steps = [torch.randint(0, 96, (rows,), generator=gen).to(device) for _ in range(2)]
    outputs = {}
    with torch.inference_mode():
        _, shared, cu = encode(model, prompts)
        for small in (False, True):
            monkeypatch.setattr(t5_module, "small_rows_kernels", lambda x, s=small: s)
            beam = model.allocate_beam_kv(rows, 2)
            kv_rows = torch.arange(rows, device=device)
            outs = []
            for ids in steps:
                meta = EncDecDecodeMetadata(shared, beam, cu, beam_width, kv_rows)
                outs.append(model.decode(ids, meta))
                beam.length += 1
            outputs[small] = outs
    for got, expected in zip(outputs[True], outputs[False], strict=True):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_small_rows_path_needs_fused_projections_and_few_rows_on_cuda(t5_dirs):
    model = load_t5(t5_dirs["gated-gelu", False], "cpu", "float32")
    assert not model._projections_fused()
    model.fuse_projections()
    assert model._projections_fused()
    assert not t5_module.small_rows_kernels(torch.zeros(4, 8))  # the CPU: cuBLAS-free path
    if torch.cuda.is_available():
        assert t5_module.small_rows_kernels(torch.zeros(16, 8, device="cuda"))
        assert not t5_module.small_rows_kernels(torch.zeros(17, 8, device="cuda"))


def test_head_tying_and_scaling(t5_dirs):
    tied = load_t5(t5_dirs["relu", True], "cpu", "float32")
    assert tied.lm_head.weight.data_ptr() == tied.shared.weight.data_ptr()
    assert tied.config.scale_decoder_outputs
    untied = load_t5(t5_dirs["gated-gelu", False], "cpu", "float32")
    assert not torch.equal(untied.lm_head.weight, untied.shared.weight)
    assert not untied.config.scale_decoder_outputs
    assert untied.config.is_gated_act and untied.config.dense_act_fn == "gelu_new"
    assert (untied.config.num_layers, untied.config.num_decoder_layers) == (2, 3)


def test_position_biases_are_kept_once_the_projections_are_fused(t5_dirs):
    model = load_t5(t5_dirs["relu", False], "cpu", "float32")
    table = model.decoder.position_bias_table
    first = model._decoder_bias(2, table.device)
    expected = relative_position_bias(
        table, torch.tensor([2]), torch.arange(3), False,
        model.config.relative_attention_max_distance,
    )[:, 0]  # fmt: skip
    torch.testing.assert_close(first, expected)
    assert not first.requires_grad  # no autograd graph kept with it
    assert model._decoder_bias(2, table.device) is not first  # unfused: computed each time
    model.fuse_projections()
    kept = model._decoder_bias(2, table.device)
    assert model._decoder_bias(2, table.device) is kept
    model.double()  # a cast empties the cache: the bias follows the table's dtype
    again = model._decoder_bias(2, table.device)
    assert again.dtype == torch.float64 and again is not kept
    torch.testing.assert_close(again, expected.double())
    with torch.inference_mode():  # inference tensors have no version counter: not read
        model._encoder_bias(4)
        model._decoder_bias(3, table.device)


def test_load_model_picks_the_architecture(t5_dirs, model_dirs):
    assert isinstance(load_model(t5_dirs["relu", True], "cpu", "float32"), T5Seq2SeqLM)
    assert isinstance(load_model(model_dirs["qwen2"], "cpu", "float32"), CausalLM)
    with pytest.raises(XgrError, match="not a decoder-only"):
        load_causal_lm(t5_dirs["relu", True], "cpu", "float32")
    with pytest.raises(XgrError, match="not a T5"):
        load_t5(model_dirs["qwen2"], "cpu", "float32")


def test_older_checkpoint_layouts_load(tmp_path, t5_dirs):
    """transformers 4 files: embedding aliases saved, scaling read from tie_word_embeddings."""
    source = t5_dirs["gated-gelu", False]
    state = load_file(source / "model.safetensors")
    state["encoder.embed_tokens.weight"] = state["shared.weight"].clone()
    state["decoder.embed_tokens.weight"] = state["shared.weight"].clone()
    save_file(state, tmp_path / "model.safetensors")
    raw = json.loads((source / "config.json").read_text())
    del raw["scale_decoder_outputs"]
    raw["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_t5(tmp_path, "cpu", "float32")
    assert not model.config.scale_decoder_outputs
    torch.testing.assert_close(model.lm_head.weight, state["lm_head.weight"], atol=0, rtol=0)


def rewrite_config(src, dst, **changes):
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    (dst / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"feed_forward_proj": "gated-silu"}, "feed_forward_proj 'gated-silu'"),
        ({"decoder_start_token_id": None}, "decoder_start_token_id"),
        ({"decoder_start_token_id": 96}, "decoder_start_token_id 96"),
        ({"relative_attention_max_distance": 8}, "max_distance 8"),
        ({"d_ff": 64}, "do not match config.json"),
        # Values of the wrong type are refused, not truncated or coerced.
        ({"num_layers": 2.5}, "num_layers must be an integer >= 1, got 2.5"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
        ({"decoder_start_token_id": True}, "decoder_start_token_id True"),
    ],
)
def test_bad_t5_configs_are_refused(tmp_path, t5_dirs, changes, message):
    rewrite_config(t5_dirs["relu", True], tmp_path, **changes)
    with pytest.raises(XgrError, match=message):
        load_t5(tmp_path, "cpu", "float32")


def test_missing_t5_weight_is_named(tmp_path, t5_dirs):
    rewrite_config(t5_dirs["relu", True], tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["decoder.block.1.layer.1.EncDecAttention.k.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(XgrError, match="EncDecAttention.k.weight"):
        load_t5(tmp_path, "cpu", "float32")


def test_config_defaults_follow_hf():
    cfg = T5Config.from_hf({"model_type": "t5", "decoder_start_token_id": 0, "n_positions": 512})
    assert (cfg.d_model, cfg.d_kv, cfg.d_ff, cfg.num_heads) == (512, 64, 2048, 8)
    assert cfg.num_decoder_layers == cfg.num_layers == 6
    assert (cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance) == (32, 128)
    assert cfg.dense_act_fn == "relu" and not cfg.is_gated_act
    assert cfg.scale_decoder_outputs and cfg.max_prompt_tokens == 512
