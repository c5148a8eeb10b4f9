"""Shape buckets of the CUDA-graph cache (host arithmetic; the replays are in test_engine_cuda)."""

from __future__ import annotations

import pytest

from xgr.engine.cuda_graph import prefill_bucket


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
