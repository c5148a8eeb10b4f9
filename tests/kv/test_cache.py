"""SharedKV allocation and BeamKV's in-place reorder by parent rows."""

from __future__ import annotations

import pytest
import torch

from xgr.kv import BeamKV, SharedKV


@pytest.mark.parametrize("seqlens", [[1], [5, 1, 12], [3, 3]], ids=str)
def test_shared_kv_allocate(seqlens):
    kv = SharedKV.allocate(2, seqlens, 3, 16, torch.bfloat16, torch.device("cpu"))
    total = sum(seqlens)
    assert kv.k.shape == kv.v.shape == (2, total, 3, 16)
    assert kv.k.dtype == kv.v.dtype == torch.bfloat16
    assert kv.k.data_ptr() != kv.v.data_ptr()
    assert kv.cu_seqlens.dtype == torch.int64
    assert kv.cu_seqlens.device.type == "cpu"
    expected = [0]
    for n in seqlens:
        expected.append(expected[-1] + n)
    assert kv.cu_seqlens.tolist() == expected
    assert kv.seqlens == seqlens
    assert kv.seqlens is not seqlens  # a copy, not the caller's list
    assert kv.nbytes == 2 * (2 * total * 3 * 16 * 2)


def test_token_major_shared_kv_views_one_buffer():
    kv = SharedKV.allocate(3, [4, 2], 2, 8, torch.float32, torch.device("cpu"), token_major=True)
    assert kv.token_major.shape == (6, 3, 2, 2, 8)
    assert kv.k.shape == kv.v.shape == (3, 6, 2, 8)
    assert kv.k.stride() == kv.v.stride() == (2 * 2 * 8, 3 * 2 * 2 * 8, 8, 1)
    kv.token_major.copy_(torch.randn(kv.token_major.shape))
    # Row t of the buffer holds token t's K and V of every layer, in (layer, k/v) order.
    for layer in range(3):
        assert torch.equal(kv.k[layer], kv.token_major[:, layer, 0])
        assert torch.equal(kv.v[layer], kv.token_major[:, layer, 1])
    assert kv.nbytes == kv.token_major.nbytes
    assert SharedKV.allocate(3, [4], 2, 8, torch.float32, torch.device("cpu")).token_major is None


def test_beam_kv_allocate():
    kv = BeamKV.allocate(3, 8, 4, 2, 16, torch.float16, torch.device("cpu"))
    assert kv.k.shape == kv.v.shape == (3, 8, 4, 2, 16)
    assert kv.k.dtype == kv.v.dtype == torch.float16
    assert kv.k.data_ptr() != kv.v.data_ptr()
    assert kv.length == 0


def filled_beam_kv(num_layers=2, rows=6, capacity=4, length=2):
    kv = BeamKV.allocate(num_layers, rows, capacity, 2, 8, torch.float32, torch.device("cpu"))
    kv.k.copy_(torch.randn(kv.k.shape))
    kv.v.copy_(torch.randn(kv.v.shape))
    kv.length = length
    return kv


def test_rows_start_as_identity():
    kv = filled_beam_kv(rows=5, capacity=3)
    assert kv.rows.dtype == torch.int32
    assert torch.equal(kv.rows, torch.arange(5, dtype=torch.int32)[:, None].expand(5, 3))
    k, v = kv.gather(1, 3)
    assert torch.equal(k, kv.k[1]) and torch.equal(v, kv.v[1])


@pytest.mark.parametrize(
    "parents",
    [
        [0, 1, 2, 3, 4, 5],  # identity
        [5, 4, 3, 2, 1, 0],  # permutation
        [0, 0, 2, 2, 2, 1],  # beams forking: row 0 -> two children, row 2 -> three
        [3, 3, 3, 3, 3, 3],  # everything from one beam
        [1, 0, 1, 5, 4, 0],  # swaps mixed with forks (reads rows being overwritten)
    ],
    ids=str,
)
@pytest.mark.parametrize("length", [1, 3, 4])
def test_beam_kv_reorder_follows_parents_without_copying_kv(parents, length):
    kv = filled_beam_kv(length=length)
    k_before, v_before = kv.k.clone(), kv.v.clone()
    before = [kv.gather(layer, length) for layer in range(2)]
    rows_obj, rows_ptr = kv.rows, kv.rows.data_ptr()
    kv.reorder(torch.tensor(parents, dtype=torch.int64))
    assert kv.rows is rows_obj and kv.rows.data_ptr() == rows_ptr  # the index, in place
    assert torch.equal(kv.k, k_before) and torch.equal(kv.v, v_before)  # no KV moved
    assert kv.length == length
    for layer in range(2):
        k, v = kv.gather(layer, length)
        for row, parent in enumerate(parents):
            assert torch.equal(k[row], before[layer][0][parent])
            assert torch.equal(v[row], before[layer][1][parent])
    # Columns not yet written stay the identity: the next token is written at each row.
    assert torch.equal(
        kv.rows[:, length:], torch.arange(6, dtype=torch.int32)[:, None].expand(6, 4 - length)
    )


def test_beam_kv_reorder_twice_composes():
    kv = filled_beam_kv(rows=4, length=2)
    k_first, _ = kv.gather(0, 2)
    first, second = [2, 2, 0, 1], [3, 0, 0, 2]
    kv.reorder(torch.tensor(first))
    kv.reorder(torch.tensor(second))
    k, _ = kv.gather(0, 2)
    for row in range(4):
        assert torch.equal(k[row], k_first[first[second[row]]])


def test_new_token_then_reorder_keeps_each_beams_own_history():
    kv = filled_beam_kv(rows=3, capacity=3, length=1)
    kv.reorder(torch.tensor([2, 2, 0]))  # step 1 selection
    kv.length = 2  # step 2 wrote slot 1 at rows 0..2
    kv.reorder(torch.tensor([1, 0, 0]))  # step 2 selection
    k, _ = kv.gather(0, 2)
    # New beam 0 continues old beam 1 (which continued beam 2): tokens at rows (2, 1).
    assert torch.equal(k[0, 0], kv.k[0, 2, 0]) and torch.equal(k[0, 1], kv.k[0, 1, 1])
    assert torch.equal(k[1, 0], kv.k[0, 2, 0]) and torch.equal(k[1, 1], kv.k[0, 0, 1])


def test_beam_kv_reorder_with_nothing_written_changes_nothing():
    kv = filled_beam_kv(length=0)
    rows_before = kv.rows.clone()
    kv.reorder(torch.tensor([5, 5, 5, 0, 0, 0]))
    assert torch.equal(kv.rows, rows_before)
