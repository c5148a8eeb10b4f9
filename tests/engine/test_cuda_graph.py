"""Shape buckets of the CUDA-graph cache (host arithmetic; the replays are in test_engine_cuda)."""

from __future__ import annotations

import functools
import gc
import os
import weakref

import numpy as np
import pytest
import torch

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from xgr import Engine
from xgr.catalog.rules import ItemRules
from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.generate import launch_semantic_ids
from xgr.engine.graph_cache import GraphCache
from xgr.engine.graph_keys import MAX_GRAPH_WORKSPACE_BYTES, DecodeGraphKey
from xgr.engine.inputs import prepare_inputs
from xgr.engine.lanes import Lane, Lanes
from xgr.engine.warm_up import capture_ahead, warm_up_batches
from xgr.kernels.prefill_attention import prefill_attention_reference
from xgr.layers import attention as attention_layers
from xgr.models import CausalLM
from xgr.models import t5 as t5_module
from xgr.models.config import DecoderConfig, T5Config
from xgr.models.t5 import T5Seq2SeqLM
from xgr.runner import PrefillShape, runner_for
from xgr.runner import decoder as decoder_runner
from xgr.runner.shapes import encoder_bucket, prefill_bucket


def graphs_of(model, first_codes=16, **limits):
    """``CudaGraphs`` of a model's runner over a 3-level catalog of ``first_codes`` codes."""
    return CudaGraphs(runner_for(model, 3, torch.arange(first_codes)), **limits)


def shape(graphs, lens, together=False):
    """The prefill graph a batch replays (None: eager), planned without a log line."""
    return graphs.plan(lens, 16, 16, together, log=False).prefill


def run(engine, prompts, graphs=None):
    """One batch (beam 8, top-k 8), eager or through ``graphs``, waited for."""
    return launch_semantic_ids(engine.decode_spec, prompts, 8, 8, graphs).wait()


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
    graphs = graphs_of(tiny_model(torch.bfloat16), max_requests=16)
    keys = {shape(graphs, lens) for lens in ([30, 41], [10, 20, 33], [5] * 8 + [40], [2, 60, 1])}
    assert keys == {PrefillShape(16, 256, 64)}
    assert shape(graphs, [100]) == PrefillShape(1, 256, 256)  # alone: causal
    # A single request whose prefill also runs level 1's forward: a graph of its own.
    assert shape(graphs, [100], together=True) == PrefillShape(1, 256, 256, code_rows=16)
    assert shape(graphs, [1] * 17) is None  # above max_requests: eager
    assert graphs.plan([1] * 17, 16, 16, False).decode is None  # the search too
    assert shape(graphs, [40_000, 40_000]) is None  # above max_prefill_tokens
    assert graphs.plan([40_000, 40_000], 16, 16, False).decode == DecodeGraphKey(2, 16, 16, False)
    assert shape(graphs_of(tiny_model(torch.float32)), [3, 4]) is None  # fp32: eager


def test_a_dropped_cuda_graphs_is_freed_without_the_cyclic_collector():
    # Its graphs, memory pool, prompt-KV pool and capture stream go with it: a reference
    # cycle would keep them until a collection that GPU memory pressure does not trigger.
    gc.disable()
    try:
        graphs = graphs_of(tiny_model(torch.bfloat16))
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
    graphs = graphs_of(tiny_t5(torch.bfloat16), max_requests=16)

    def encode(slots, length):
        mask = slots * 4 * length**2 * 2
        return (slots, slots * length, length, length, mask)

    def fields(key):
        return None if key is None else (key.slots, key.padded_tokens, key.max_seqlen,
                                         key.slot_tokens, key.workspace_bytes)  # fmt: skip

    assert fields(shape(graphs, [100])) == encode(1, 128)
    assert not shape(graphs, [100]).reads_positions
    # Level 1 never joins the encoder: the same graph either way.
    assert shape(graphs, [100], together=True) == shape(graphs, [100])
    # slots: the next power of two; P: the longest prompt's bucket; float32 too
    assert fields(shape(graphs, [30, 41, 100])) == encode(4, 128)
    assert fields(shape(graphs, [5] * 9)) == encode(16, 64)
    t5_fp32 = fields(shape(graphs_of(tiny_t5(torch.float32)), [3, 4]))
    assert t5_fp32 == (2, 128, 64, 64, 2 * 4 * 64**2 * 4)
    assert shape(graphs, [1] * 17) is None  # above max_requests: eager
    # The mask, 16 slots x 4 heads x P^2 x 2 bytes, passes 1 GiB between P = 2816 and 3072.
    assert 16 * 4 * 2816**2 * 2 <= MAX_GRAPH_WORKSPACE_BYTES < 16 * 4 * 3072**2 * 2
    assert fields(shape(graphs, [10] * 9 + [2816])) == encode(16, 2816)
    assert shape(graphs, [10] * 9 + [2817]) is None
    assert fields(shape(graphs, [2817])) == encode(1, 3072)  # one slot: 1/16 of it


def test_encoder_keys_skip_the_mask_limit_where_no_mask_is_built(monkeypatch):
    """The Triton encoder attention (on a CUDA device) builds no square mask: only the
    token limit sends an encode to eager; under SDPA the mask limit still does."""
    model = tiny_t5(torch.bfloat16)
    monkeypatch.setattr(T5Seq2SeqLM, "_triton_encoder_attention_fits", lambda self, device: True)
    graphs = graphs_of(model, max_requests=16)
    assert not model.encoder_builds_mask(torch.device("meta"))
    key = shape(graphs, [10] * 9 + [2817])
    assert (key.slots, key.padded_tokens, key.workspace_bytes) == (16, 16 * 3072, 0)
    assert shape(graphs, [10] * 9 + [4097]) is None  # 16 x 4160 tokens: above 65,536
    monkeypatch.setattr(t5_module, "ENCODER_ATTENTION", "sdpa")
    assert model.encoder_builds_mask(torch.device("meta"))
    assert shape(graphs, [10] * 9 + [2817]) is None


def test_warm_up_batches_cover_the_graphs_of_any_such_batch():
    graphs = graphs_of(tiny_model(torch.bfloat16), max_requests=16)
    shortest, longest, max_size = 300, 450, 6
    batches, most = warm_up_batches(graphs, shortest, longest, max_size, 16, 16)
    assert {len(b) for b in batches} == set(range(1, max_size + 1))
    assert all(shortest <= n <= longest for b in batches for n in b)

    def key(lens):  # a single request runs level 1 in its prefill (16 codes, beam 16)
        return shape(graphs, lens, together=len(lens) == 1)

    keys = {key(b) for b in batches}
    assert any(k.code_rows for k in keys) and any(not k.code_rows for k in keys)
    assert most >= max(k.padded_tokens for k in keys) and most >= max(sum(b) for b in batches)
    rng = np.random.default_rng(0)
    for _ in range(300):  # batches a load could form: their prefill graphs were warmed up
        lens = rng.integers(shortest, longest + 1, rng.integers(1, max_size + 1)).tolist()
        assert key(lens) in keys, lens


class _ReplayByRerun:
    """Stands in for a captured CUDA graph on the CPU: a replay re-runs the captured work
    into the same output tensors, reading the same static inputs."""

    def __init__(self, run, outputs):
        self.run, self.outputs = run, outputs

    def replay(self):
        for out, new in zip(_tensors(self.outputs), _tensors(self.run()), strict=True):
            out.copy_(new)


def _tensors(outputs):
    """A graph's outputs as tensors: a search's (nodes, scores), a prefill's ``Prefilled``."""
    return outputs if isinstance(outputs, tuple) else outputs.tensors()


def _capture_by_rerun(self, key, run, inputs):
    outputs = run()
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
    engine.runner.attention_backend = "triton"
    graphs = CudaGraphs(engine.runner, max_requests=4)
    gen = torch.Generator().manual_seed(0)
    for lens in batches:
        prompts = [torch.randint(2, 40, (n,), generator=gen).tolist() for n in lens]
        want = run(engine, prompts)
        got = run(engine, prompts, graphs)
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
    engine.runner.attention_backend = "triton"
    assert engine.runner.first_levels_together(1, 16)
    graphs = CudaGraphs(engine.runner, max_requests=4, max_prefill_tokens=256)
    gen = torch.Generator().manual_seed(1)
    for n in (300, 30, 280, 40):  # above 256 padded tokens: eager prefills
        prompt = torch.randint(2, 40, (n,), generator=gen).tolist()
        assert (shape(graphs, [n], True) is None) == (n > 200)
        want = launch_semantic_ids(spec, [prompt], 16, 16, None).wait()
        got = launch_semantic_ids(spec, [prompt], 16, 16, graphs).wait()
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
    engine.runner.attention_backend = "triton"
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
    packed = decoder_runner.packed_shape
    monkeypatch.setattr(
        decoder_runner.DecoderRunner,
        "prefill_shape",
        lambda self, lens, slots, together: packed(lens, slots, 16 if together else 0),
    )
    monkeypatch.setattr(attention_layers, "prefill_attention", _offsets_from_the_device)
    graphs = CudaGraphs(engine.runner, max_requests=4, max_prefill_tokens=512)
    rng = np.random.default_rng(0)
    for _ in range(8):
        lens = rng.integers(1, 160, rng.integers(1, 6)).tolist()
        prompts = [rng.integers(2, 40, n).tolist() for n in lens]
        want = run(engine, prompts)
        got = run(engine, prompts, graphs)
        assert torch.equal(got.sid_index, want.sid_index), lens
        torch.testing.assert_close(got.scores, want.scores, atol=1e-4, rtol=1e-4)
    assert any(isinstance(key, PrefillShape) and key.slots == 4 for key in graphs.keys())


def test_a_limit_change_rebuilds_the_staging_once_even_for_eager_prefills(model_dirs, monkeypatch):
    """float32 batches of two prompts prefill eagerly and replay a decode graph; after a
    limit changes the next batch rebuilds the staging buffer (dropping the graphs), as
    ``needs_capture`` said it would, and later ones capture nothing."""
    engine = _interpreted_engine(model_dirs["qwen2"], 40, monkeypatch)
    graphs = CudaGraphs(engine.runner, max_requests=4)
    prompts = [[3, 4, 5], [6, 7]]
    want = run(engine, prompts)
    plan = graphs.plan([3, 2], 8, 8, False)
    assert plan.prefill is None and plan.decode is not None  # eager prefill, graphed search
    for change in (None, 1024, None, None):
        if change:
            graphs.max_prefill_tokens = change
            assert graphs.needs_capture(plan, [3, 2], engine.decode_spec)
        got = run(engine, prompts, graphs)
        assert torch.equal(got.sid_index, want.sid_index)
        assert not graphs.needs_capture(plan, [3, 2], engine.decode_spec)
    assert graphs.captures == 2  # the decode graph, then again after the rebuild


def test_capture_ahead_leaves_a_new_versions_batches_nothing_to_capture(model_dirs, monkeypatch):
    """The decode graphs of a catalog version about to be served, captured from the batch
    shapes of the current one (with item rules too): its batches then replay them (the
    prefill graphs shared, the first-level codes unchanged) and equal eager runs over it."""
    engine = _interpreted_engine(model_dirs["qwen2"], 40, monkeypatch)
    graphs = CudaGraphs(engine.runner, max_requests=4)
    lanes = Lanes(engine.runner, torch.device("cpu"))
    lanes.lanes = (Lane(0, None, graphs),)
    batches = [([[3, 4, 5], [6, 7]], False), ([[9, 10, 11, 12]], False), ([[5, 6]], True)]

    def launch(version, prompts, filtered, graphs):
        rules = [ItemRules(exclude=np.arange(0, 300, 7))] * len(prompts)
        masks = functools.partial(version.masks.masks, rules) if filtered else None
        return launch_semantic_ids(version.spec, prompts, 8, 8, graphs, None, masks).wait()

    old = engine.served_catalog().current
    graphs.use(old.spec)
    for prompts, filtered in batches:
        launch(old, prompts, filtered, graphs)
    decode_keys = [key for key in graphs.keys() if isinstance(key, DecodeGraphKey)]
    assert [len(lens) for _, lens in graphs.decode_batches(old.spec)] == [1, 1, 2]  # latest first
    assert engine.update_catalog(
        add={"new": [f"<{n}_{c}>" for n, c in zip("abc", [15, 14, 13], strict=True)]},
        remove=engine.catalog.item_ids[:5],
    ) == 2  # fmt: skip
    new = engine.served_catalog().current
    assert new.spec.runner is old.spec.runner
    before = graphs.captures
    live = lambda: [old.spec, new.spec]  # noqa: E731
    assert capture_ahead(new.spec, old.spec, lanes, live, pause=0) == len(decode_keys) == 3
    assert capture_ahead(new.spec, old.spec, lanes, live, pause=0) == 0  # held already
    graphs.use(new.spec, [new.spec])
    captured = graphs.captures
    assert captured == before + len(decode_keys)
    for prompts, filtered in batches:
        got = launch(new, prompts, filtered, graphs)
        want = launch(new, prompts, filtered, None)
        assert torch.equal(got.sid_index, want.sid_index)
        torch.testing.assert_close(got.scores, want.scores, atol=1e-5, rtol=1e-5)
    assert graphs.captures == captured
    # The old version's graphs went with it.
    assert all(owner in (new.spec, new.spec.runner) for owner, _ in graphs.cache.keys())


def test_replay_prefill_refuses_inputs_staged_elsewhere():
    model = tiny_model(torch.bfloat16)
    first, second = graphs_of(model), graphs_of(model)
    staged = first.stage([[5, 6, 7, 8]], shape(first, [4]))
    with pytest.raises(ValueError, match="stage"):
        second.replay_prefill(staged)  # another CudaGraphs (another lane)
    with pytest.raises(ValueError, match="stage"):
        first.replay_prefill(prepare_inputs([[5, 6, 7, 8]], torch.device("cpu")))
