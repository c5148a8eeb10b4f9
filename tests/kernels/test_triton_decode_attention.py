"""The Triton decode-attention kernel against the torch reference.

On the CPU it runs under Triton's interpreter (``TRITON_INTERPRET=1``, set here before
Triton is imported); on a GPU the same tests run compiled. Outputs are poisoned (NaN) before
each run so an element the kernel fails to write shows up.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels import decode_attention_launch as launch_module  # noqa: E402
from xgr.kernels import triton_decode_attention as kernel_module  # noqa: E402
from xgr.kernels.decode_attention import (  # noqa: E402
    decode_attention_reference,
    shared_attention_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_inputs(lengths, beam_width, num_heads, num_kv_heads, head_dim, tokens, dtype, gen):
    rows = len(lengths) * beam_width
    total = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    q = randn(rows, num_heads, head_dim)
    k, v = randn(total, num_kv_heads, head_dim), randn(total, num_kv_heads, head_dim)
    capacity = max(tokens, 1) + 1
    bk, bv = (
        randn(rows, capacity, num_kv_heads, head_dim),
        randn(rows, capacity, num_kv_heads, head_dim),
    )
    # Each beam's j-th token lives at a random row (as when beams follow their ancestry).
    beam_rows = torch.randint(0, rows, (rows, capacity), generator=gen, dtype=torch.int32)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, cu, bk, bv, beam_rows.to(DEVICE)


def reference(q, k, v, cu, bk, bv, beam_rows, tokens, beam_width, scale):
    if tokens == 0:  # no beam tokens yet: the shared part alone
        out, _ = shared_attention_reference(q, k, v, cu, beam_width, scale)
        return out.to(q.dtype)
    slots = torch.arange(tokens, device=q.device)[None, :]
    own_k = bk[beam_rows[:, :tokens].long(), slots]  # [rows, tokens, Hkv, D]
    own_v = bv[beam_rows[:, :tokens].long(), slots]
    return decode_attention_reference(q, k, v, cu, own_k, own_v, beam_width, scale)


MODES = {
    "fused": dict(staged=False, config=launch_module.LaunchConfig(num_splits=1)),
    "staged": dict(staged=True, config=launch_module.LaunchConfig(num_splits=1)),
    # 3 splits: a 1-token or 5-token prompt leaves splits empty, which must weigh nothing.
    "split3": dict(staged=False, config=launch_module.LaunchConfig(num_splits=3)),
    "split5_block16": dict(
        staged=False, config=launch_module.LaunchConfig(block_m=16, block_n=16, num_splits=5)
    ),
    # The merge launch with its own tiles: larger and smaller than the shared stage's.
    "split2_merge64": dict(
        staged=False,
        config=launch_module.LaunchConfig(block_m=16, num_splits=2, merge_block_m=64),
    ),
    "split2_merge4": dict(
        staged=False,
        config=launch_module.LaunchConfig(num_splits=2, merge_block_m=4, merge_num_warps=1),
    ),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("lengths", "beam_width", "num_heads", "num_kv_heads", "head_dim", "tokens"),
    [
        ([5], 3, 4, 2, 16, 0),
        ([1, 70], 5, 4, 2, 32, 2),
        ([129, 3, 64], 4, 8, 1, 16, 1),
        ([33], 70, 2, 2, 64, 3),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_matches_reference(
    lengths, beam_width, num_heads, num_kv_heads, head_dim, tokens, dtype, mode
):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter does not compute in bfloat16; checked on the GPU")
    gen = torch.Generator().manual_seed(hash((tuple(lengths), beam_width, head_dim)) % 2**31)
    q, k, v, cu, bk, bv, beam_rows = make_inputs(
        lengths, beam_width, num_heads, num_kv_heads, head_dim, tokens, dtype, gen
    )
    scale = head_dim**-0.5
    expected = reference(q, k, v, cu, bk, bv, beam_rows, tokens, beam_width, scale).float()
    cu_t = torch.tensor(cu, device=DEVICE)
    got = kernel_module.beam_decode_attention(
        q, k, v, cu_t, bk, bv, beam_rows, tokens, beam_width, scale, **MODES[mode]
    ).float()
    assert not torch.isnan(got).any()
    error = (got - expected).abs().max() / expected.abs().max()
    assert error < TOLERANCE[dtype]


def test_every_output_element_is_written(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu, bk, bv, beam_rows = make_inputs([9, 17], 6, 4, 2, 16, 2, torch.float32, gen)
    poisoned = torch.full_like(q, float("nan"))
    monkeypatch.setattr(kernel_module.torch, "empty_like", lambda t: poisoned)
    out = kernel_module.beam_decode_attention(
        q, k, v, torch.tensor(cu, device=DEVICE), bk, bv, beam_rows, 2, 6, 0.25
    )
    assert out is poisoned and not torch.isnan(out).any()


@pytest.mark.parametrize(
    "fields",
    [
        dict(merge_block_m=-16),  # an empty merge grid: the output would stay unwritten
        dict(merge_block_m=0),
        dict(merge_block_m=12),
        dict(block_m=48),
        dict(block_n=0),
        dict(num_warps=3),
        dict(merge_num_warps=0),
        dict(num_stages=0),
        dict(num_splits=0),
        dict(num_splits=-1),
    ],
)
def test_launch_config_refuses_sizes_triton_cannot_run(fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"LaunchConfig.{name}"):
        launch_module.LaunchConfig(**fields)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"][:, :, :12].contiguous()}, "head_dim"),
        (lambda a: {**a, "beam_width": 5}, "query rows"),
        (lambda a: {**a, "beam_rows": a["beam_rows"].long()}, "int32"),
        (lambda a: {**a, "shared_v": a["shared_v"].half()}, "dtype"),
    ],
)
def test_launcher_refuses_bad_arguments(change, message):
    gen = torch.Generator().manual_seed(1)
    q, k, v, cu, bk, bv, beam_rows = make_inputs([4], 3, 4, 2, 16, 1, torch.float32, gen)
    args = dict(
        q=q,
        shared_k=k,
        shared_v=v,
        cu_seqlens=torch.tensor(cu, device=DEVICE),
        beam_k=bk,
        beam_v=bv,
        beam_rows=beam_rows,
        num_beam_tokens=1,
        beam_width=3,
        scale=0.25,
    )
    with pytest.raises(ValueError, match=message):
        kernel_module.beam_decode_attention(**change(args))


@pytest.mark.parametrize(
    ("lengths", "beam_width", "num_heads", "num_kv_heads", "head_dim"),
    [([5], 3, 4, 4, 16), ([1, 70, 9], 4, 6, 6, 64), ([129, 3], 5, 8, 2, 32)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shared_only_attention_matches_reference(
    lengths, beam_width, num_heads, num_kv_heads, head_dim, dtype
):
    """Cross-attention of an encoder-decoder: the shared KV alone, T5's scale of 1."""
    gen = torch.Generator().manual_seed(sum(lengths) + head_dim)
    q, k, v, cu, *_ = make_inputs(
        lengths, beam_width, num_heads, num_kv_heads, head_dim, 0, dtype, gen
    )
    expected, _ = shared_attention_reference(q, k, v, cu, beam_width, 1.0)
    got = kernel_module.shared_decode_attention(
        q, k, v, torch.tensor(cu, device=DEVICE), beam_width, 1.0
    )
    assert got.dtype == dtype and not torch.isnan(got).any()
    error = (got.float() - expected).abs().max() / expected.abs().max()
    assert error < TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("programs", "splits"),
    [(500, 1), (133, 1), (132, 2), (128, 2), (100, 2), (64, 4), (44, 6), (32, 8), (16, 8)],
)
def test_split_count_aims_at_two_programs_per_sm(monkeypatch, programs, splits):
    """On a 132-SM GPU: grids past the SMs take one fused launch; smaller ones
    are split toward two programs per SM, two splits at least, eight at most."""
    monkeypatch.setattr(launch_module, "multiprocessor_count", lambda device: 132)
    assert launch_module.choose_num_splits(programs, torch.device("cuda", 0)) == splits
    assert launch_module.choose_num_splits(programs, torch.device("cpu")) == 1
