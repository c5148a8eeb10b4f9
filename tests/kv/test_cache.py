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
def test_beam_kv_reorder(parents, length):
    kv = filled_beam_kv(length=length)
    k_before, v_before = kv.k.clone(), kv.v.clone()
    k_ptr, v_ptr = kv.k.data_ptr(), kv.v.data_ptr()
    k_obj, v_obj = kv.k, kv.v
    kv.reorder(torch.tensor(parents, dtype=torch.int64))
    # In place: same tensors, same storage.
    assert kv.k is k_obj and kv.v is v_obj
    assert kv.k.data_ptr() == k_ptr and kv.v.data_ptr() == v_ptr
    assert kv.length == length
    for row, parent in enumerate(parents):
        assert torch.equal(kv.k[:, row, :length], k_before[:, parent, :length])
        assert torch.equal(kv.v[:, row, :length], v_before[:, parent, :length])
    # Unwritten slots are left alone.
    assert torch.equal(kv.k[:, :, length:], k_before[:, :, length:])
    assert torch.equal(kv.v[:, :, length:], v_before[:, :, length:])


def test_beam_kv_reorder_twice_composes():
    kv = filled_beam_kv(rows=4, length=2)
    k_before = kv.k.clone()
    first, second = [2, 2, 0, 1], [3, 0, 0, 2]
    kv.reorder(torch.tensor(first))
    kv.reorder(torch.tensor(second))
    for row in range(4):
        parent = first[second[row]]
        assert torch.equal(kv.k[:, row, :2], k_before[:, parent, :2])


def test_beam_kv_reorder_with_nothing_written_changes_nothing():
    kv = filled_beam_kv(length=0)
    k_before, v_before = kv.k.clone(), kv.v.clone()
    kv.reorder(torch.tensor([5, 5, 5, 0, 0, 0]))
    assert torch.equal(kv.k, k_before)
    assert torch.equal(kv.v, v_before)


def test_beam_kv_reorder_per_request_rows():
    # Two requests with beam width 3: row r * 3 + b; parents are global row indices.
    kv = filled_beam_kv(num_layers=1, rows=6, capacity=3, length=1)
    before = kv.k.clone()
    parents = torch.tensor([2, 2, 0, 3, 5, 5])
    kv.reorder(parents)
    for row in range(6):
        assert torch.equal(kv.k[0, row, 0], before[0, int(parents[row]), 0])
