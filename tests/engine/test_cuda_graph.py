"""Shape buckets of the CUDA-graph cache (host arithmetic; the replays are in test_engine_cuda)."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
import torch

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from xgr import Engine
from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.decode import runs_first_levels_together
from xgr.engine.generate import _launch
from xgr.engine.graph_cache import GraphCache
from xgr.engine.graph_keys import MAX_ENCODER_MASK_BYTES, encoder_bucket, prefill_bucket
from xgr.engine.inputs import prepare_inputs
from xgr.engine.warm_up import warm_up_batches
from xgr.kernels.prefill_attention import prefill_attention_reference
from xgr.layers import attention as attention_layers
from xgr.models import CausalLM
from xgr.models import t5 as t5_module
from xgr.models.config import DecoderConfig, T5Config
from xgr.models.t5 import T5Seq2SeqLM


def tiny_model(dtype):
    raw = dict(
        model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with torch.device("meta"):
        return CausalLM(DecoderConfig.from_hf(raw)).to(dtype)


@pytest.mark.parametrize(
    ("tokens", "bucket"),
    [(1, 256), (255, 256), (256, 512), (1000, 1024), (2047, 2048), (5000, 5120),
     (9000, 9216), (38_000, 40_960)],
)  # fmt: skip
def test_prefill_bucket_values(tokens, bucket):
    assert prefill_bucket(tokens) == bucket


def test_prefill_buckets_pad_little_and_stay_few():
    buckets = {prefill_bucket(n) for n in range(1, 65_536)}
    assert all(prefill_bucket(n) > n for n in range(1, 65_536, 7))
    # at most an eighth of a long prefill is padding (256 tokens below 2048)
    assert all(prefill_bucket(n) - n <= max(256, n / 8) for n in range(1, 65_536, 7))
    assert len(buckets) <= 64


def test_packed_prefill_keys_do_not_depend_on_the_batch_size():
    graphs = CudaGraphs(tiny_model(torch.bfloat16), max_requests=16)
    keys = {
        graphs.prefill_key(lens) for lens in ([30, 41], [10, 20, 33], [5] * 8 + [40], [2, 60, 1])
    }
    assert keys == {("prefill", 16, 256, 64, False)}
    assert graphs.prefill_key([100]) == ("prefill", 1, 256, 256, False)  # alone: causal
    # A single request whose prefill also runs level 1's forward: a graph of its own.
    assert graphs.prefill_key([100], level_one=True) == ("prefill", 1, 256, 256, True)
    assert graphs.prefill_key([1] * 17) is None  # above max_requests: eager
    assert graphs.prefill_key([40_000, 40_000]) is None  # above max_prefill_tokens
    assert CudaGraphs(tiny_model(torch.float32)).prefill_key([3, 4]) is None  # fp32: eager


def test_a_dropped_cuda_graphs_is_freed_without_the_cyclic_collector():
    # Its graphs, memory pool, prompt-KV pool and capture stream go with it: a reference
    # cycle would keep them until a collection that GPU memory pressure does not trigger.
    gc.disable()
    try:
        graphs = CudaGraphs(tiny_model(torch.bfloat16))
        graphs.reserve(64)
        freed = weakref.ref(graphs)
        del graphs
        assert freed() is None
    finally:
        gc.enable()


def tiny_t5(dtype, num_heads=4):
    raw = dict(
        model_type="t5", vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2,
        num_heads=num_heads, feed_forward_proj="relu", decoder_start_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        return T5Seq2SeqLM(T5Config.from_hf(raw)).to(dtype)


@pytest.mark.parametrize(
    ("max_len", "bucket"), [(1, 64), (64, 64), (65, 128), (300, 320), (1023, 1024), (1200, 1280)]
)
def test_encoder_bucket_values(max_len, bucket):
    assert encoder_bucket(max_len) == bucket


def test_encoder_keys_pad_slots_to_powers_of_two_and_respect_the_mask_limit(monkeypatch):
    monkeypatch.setattr(t5_module, "ENCODER_ATTENTION", "sdpa")  # the one that builds a mask
    graphs = CudaGraphs(tiny_t5(torch.bfloat16), max_requests=16)
    assert graphs.prefill_key([100]) == ("encode", 1, 128, 128)
    # slots: the next power of two; P: the longest prompt's bucket; float32 too
    assert graphs.prefill_key([30, 41, 100]) == ("encode", 4, 512, 128)
    assert graphs.prefill_key([5] * 9) == ("encode", 16, 1024, 64)
    assert CudaGraphs(tiny_t5(torch.float32)).prefill_key([3, 4]) == ("encode", 2, 128, 64)
    assert graphs.prefill_key([1] * 17) is None  # above max_requests: eager
    # The mask, 16 slots x 4 heads x P^2 x 2 bytes, passes 1 GiB between P = 2816 and 3072.
    assert 16 * 4 * 2816**2 * 2 <= MAX_ENCODER_MASK_BYTES < 16 * 4 * 3072**2 * 2
    assert graphs.prefill_key([10] * 9 + [2816]) == ("encode", 16, 16 * 2816, 2816)
    assert graphs.prefill_key([10] * 9 + [2817]) is None
    assert graphs.prefill_key([2817]) == ("encode", 1, 3072, 3072)  # one slot: 1/16 of it


def test_encoder_keys_skip_the_mask_limit_where_no_mask_is_built(monkeypatch):
    """The Triton encoder attention (on a CUDA device) builds no square mask: only the
    token limit sends an encode to eager; under SDPA the mask limit still does."""
    model = tiny_t5(torch.bfloat16)
    monkeypatch.setattr(T5Seq2SeqLM, "_triton_encoder_attention_fits", lambda self, device: True)
    graphs = CudaGraphs(model, max_requests=16)
    assert not model.encoder_builds_mask(torch.device("meta"))
    assert graphs.prefill_key([10] * 9 + [2817]) == ("encode", 16, 16 * 3072, 3072)
    assert graphs.prefill_key([10] * 9 + [4097]) is None  # 16 x 4160 tokens: above 65,536
    monkeypatch.setattr(t5_module, "ENCODER_ATTENTION", "sdpa")
    assert model.encoder_builds_mask(torch.device("meta"))
    assert graphs.prefill_key([10] * 9 + [2817]) is None


def test_warm_up_batches_cover_the_graphs_of_any_such_batch():
    graphs = CudaGraphs(tiny_model(torch.bfloat16), max_requests=16)
    shortest, longest, max_size = 300, 450, 6
    batches, most = warm_up_batches(graphs, shortest, longest, max_size)
    assert {len(b) for b in batches} == set(range(1, max_size + 1))
    assert all(shortest <= n <= longest for b in batches for n in b)
    keys = {graphs.prefill_key(b) for b in batches}
    assert most >= max(k[2] for k in keys) and most >= max(sum(b) for b in batches)
    rng = np.random.default_rng(0)
    for _ in range(300):  # batches a load could form: their prefill graphs were warmed up
        lens = rng.integers(shortest, longest + 1, rng.integers(1, max_size + 1)).tolist()
        assert graphs.prefill_key(lens) in keys, lens


class _ReplayByRerun:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the captured work
    into the same output tensors, reading the same static inputs."""

    def __init__(self, run, outputs):
        self.run, self.outputs = run, outputs

    def replay(self):
        for out, new in zip(self.outputs, self.run(), strict=True):
            out.copy_(new)


def _capture_by_rerun(self, key, run, inputs):
    outputs = tuple(run())
    return self.add(key, _ReplayByRerun(run, outputs), inputs, outputs)


@pytest.mark.parametrize("arch", ["t5", "qwen2"])
def test_graph_buffers_give_the_eager_results_on_the_cpu(arch, model_dirs, tmp_path, monkeypatch):
    """The graphs' static buffers, keys and refills (a graph reused by batches of other
    prompt lengths, absent requests standing in) against eager runs, with capture replaced
    by re-running the captured work; the kernels read offsets from the device (Triton,
    interpreted), as in a real graph."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without a GPU
        pytest.skip("Triton reads CPU tensors only interpreted; the GPU tests replay real graphs")
    monkeypatch.setattr(GraphCache, "capture", _capture_by_rerun)
    if arch == "t5":
        write_random_t5(tmp_path, "gated-gelu", False)
        folder, offset, batches = tmp_path, 2, [[5, 30, 12], [40], [7, 60, 3], [33]]
    else:  # one request a batch: several need packed flash attention (CUDA)
        folder, offset, batches = model_dirs["qwen2"], 40, [[30], [12], [61]]
    catalog = random_catalog(300, 3, 16, seed=3)
    sid_map = sequential_sid_map(3, 16, offset)
    engine = Engine.from_pretrained(folder, catalog=catalog, sid_token_ids=sid_map)
    engine.decode_spec.attention_backend = "triton"
    graphs = CudaGraphs(engine.model, max_requests=4)
    gen = torch.Generator().manual_seed(0)
    for lens in batches:
        prompts = [torch.randint(2, 40, (n,), generator=gen).tolist() for n in lens]
        want = _launch(engine.decode_spec, prompts, 8, 8, None).wait()
        got = _launch(engine.decode_spec, prompts, 8, 8, graphs).wait()
        assert torch.equal(got.sid_index, want.sid_index), lens
        torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=1e-5)
    # Fewer graphs than batches: later batches replayed earlier captures.
    assert graphs.captures < 2 * len(batches)


def test_single_requests_with_level_one_mixing_graphed_and_eager_prefills_on_the_cpu(
    model_dirs, monkeypatch
):
    """A single request whose beam holds every first-level code runs level 1 within its
    prefill, graphed or (too long for the graph limit) eager; its decode replays one graph,
    which must read that prefill's level-1 K/V whichever ran (capture re-runs the work)."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without a GPU
        pytest.skip("Triton reads CPU tensors only interpreted; the GPU tests replay real graphs")
    monkeypatch.setattr(GraphCache, "capture", _capture_by_rerun)
    catalog = random_catalog(300, 3, 16, seed=3)
    sid_map = sequential_sid_map(3, 16, 40)
    engine = Engine.from_pretrained(model_dirs["qwen2"], catalog=catalog, sid_token_ids=sid_map)
    spec = engine.decode_spec
    spec.attention_backend = "triton"
    assert runs_first_levels_together(spec, 1, 16)
    graphs = CudaGraphs(engine.model, max_requests=4, max_prefill_tokens=256)
    gen = torch.Generator().manual_seed(1)
    for n in (300, 30, 280, 40):  # above 256 padded tokens: eager prefills
        prompt = torch.randint(2, 40, (n,), generator=gen).tolist()
        assert (graphs.prefill_key([n], True) is None) == (n > 200)
        want = _launch(spec, [prompt], 16, 16, None).wait()
        got = _launch(spec, [prompt], 16, 16, graphs).wait()
        assert torch.equal(got.sid_index, want.sid_index), n
        torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=1e-5)
    assert graphs.captures == 2  # one decode graph, one prefill bucket (30 and 40 tokens)


def _interpreted_engine(folder, offset, monkeypatch):
    """An engine whose graphs are captured by re-running (``_capture_by_rerun``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it without a GPU
        pytest.skip("Triton reads CPU tensors only interpreted; the GPU tests replay real graphs")
    monkeypatch.setattr(GraphCache, "capture", _capture_by_rerun)
    catalog = random_catalog(300, 3, 16, seed=3)
    engine = Engine.from_pretrained(
        folder, catalog=catalog, sid_token_ids=sequential_sid_map(3, 16, offset)
    )
    engine.decode_spec.attention_backend = "triton"
    return engine


def _offsets_from_the_device(q, k, v, cu, scale, cu_device=None, max_seqlen=None, packed=None):
    """The packed prefill attention as a graph runs it: the prompts' bounds come from the
    device offsets (the batch's, then the stand-ins' padding sequences), not from ``cu``."""
    if not packed:
        return prefill_attention_reference(q, k, v, cu, scale)
    offsets = cu_device.tolist()
    assert offsets[0] == 0 and offsets[-1] == q.shape[0]
    lengths = np.diff(offsets)
    assert (lengths > 0).all() and lengths.max() <= max_seqlen
    return prefill_attention_reference(q, k, v, offsets, scale)


def test_packed_prefill_graphs_read_their_staged_offsets_on_the_cpu(model_dirs, monkeypatch):
    """Batches of 1-4 prompts in random order through the packed prefill graphs (absent
    requests standing in as padding sequences; too long and too many prompts eager),
    against eager runs."""
    engine = _interpreted_engine(model_dirs["qwen2"], 40, monkeypatch)
    # float32 batches of several prompts replay the packed graph here, as bf16 ones do.
    monkeypatch.setattr(CudaGraphs, "_eager_kind", lambda self, num: False)
    monkeypatch.setattr(attention_layers, "prefill_attention", _offsets_from_the_device)
    graphs = CudaGraphs(engine.model, max_requests=4, max_prefill_tokens=512)
    rng = np.random.default_rng(0)
    for _ in range(8):
        lens = rng.integers(1, 160, rng.integers(1, 6)).tolist()
        prompts = [rng.integers(2, 40, n).tolist() for n in lens]
        want = _launch(engine.decode_spec, prompts, 8, 8, None).wait()
        got = _launch(engine.decode_spec, prompts, 8, 8, graphs).wait()
        assert torch.equal(got.sid_index, want.sid_index), lens
        torch.testing.assert_close(got.scores, want.scores, atol=1e-4, rtol=1e-4)
    assert any(key[0] == "prefill" and key[1] == 4 for key in graphs.cache.keys())


def test_a_limit_change_rebuilds_the_staging_once_even_for_eager_prefills(model_dirs, monkeypatch):
    """float32 batches of two prompts prefill eagerly and replay a decode graph; after a
    limit changes the next batch rebuilds the staging buffer (dropping the graphs), as
    ``needs_capture`` said it would, and later ones capture nothing."""
    engine = _interpreted_engine(model_dirs["qwen2"], 40, monkeypatch)
    graphs = CudaGraphs(engine.model, max_requests=4)
    prompts = [[3, 4, 5], [6, 7]]
    want = _launch(engine.decode_spec, prompts, 8, 8, None).wait()
    assert graphs.stage(prompts) is None  # eager prefill
    for change in (None, 1024, None, None):
        if change:
            graphs.max_prefill_tokens = change
            assert graphs.needs_capture([3, 2], 8, 8)
        got = _launch(engine.decode_spec, prompts, 8, 8, graphs).wait()
        assert torch.equal(got.sid_index, want.sid_index)
        assert not graphs.needs_capture([3, 2], 8, 8)
    assert graphs.captures == 2  # the decode graph, then again after the rebuild


def test_replay_prefill_refuses_inputs_staged_elsewhere():
    model = tiny_model(torch.bfloat16)
    first, second = CudaGraphs(model), CudaGraphs(model)
    staged = first.stage([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match="stage"):
        second.replay_prefill(staged)  # another CudaGraphs (another lane)
    with pytest.raises(ValueError, match="stage"):
        first.replay_prefill(prepare_inputs([[5, 6, 7, 8]], torch.device("cpu")))
