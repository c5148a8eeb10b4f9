"""The keyed graph cache's bookkeeping (capture on a miss, LRU order, eviction, clear), with
a stand-in for CUDA graph capture so it runs on the CPU."""

from __future__ import annotations

import torch

from xgr.engine.graph_cache import GraphCache


class CountingGraph:
    """Stands in for a captured graph: a replay re-runs the captured work."""

    def __init__(self, run):
        self.run, self.replays = run, 0

    def replay(self):
        self.replays += 1
        self.run()


def capture_on_cpu(cache, key, run, inputs):
    return cache.add(key, CountingGraph(run), inputs, tuple(run()))


def test_a_miss_builds_and_captures_a_hit_refills_and_replays(monkeypatch):
    monkeypatch.setattr(GraphCache, "capture", capture_on_cpu)
    cache = GraphCache(max_graphs=4)
    static = torch.zeros(3)
    out = torch.zeros(3)
    builds, fills = [], []

    def build():
        builds.append(1)
        return (static,), lambda: (out.copy_(static * 2),)

    def fill(value):
        return lambda inputs: (fills.append(value), inputs[0].fill_(value))

    entry = cache.replay("a", build, fill(1.0))
    assert builds == [1] and cache.captures == 1 and "a" in cache and len(cache) == 1
    assert entry.outputs[0].tolist() == [2.0, 2.0, 2.0]
    again = cache.replay("a", build, fill(5.0))
    assert again is entry and builds == [1] and cache.captures == 1  # no second capture
    assert again.graph.replays == 2 and out.tolist() == [10.0, 10.0, 10.0]
    assert fills == [1.0, 5.0]


def test_the_least_recently_used_graph_goes_first_and_clear_drops_all(monkeypatch):
    monkeypatch.setattr(GraphCache, "capture", capture_on_cpu)
    cache = GraphCache(max_graphs=2)

    def build():
        t = torch.zeros(1)
        return (t,), lambda: (t + 1,)

    cache.replay("a", build)
    cache.replay("b", build)
    cache.replay("a", build)  # "a" is now the most recent
    cache.replay("c", build)  # evicts "b"
    assert cache.keys() == ["a", "c"] and cache.captures == 3
    cache.replay("b", build)  # captured again, evicting "a"
    assert cache.keys() == ["c", "b"] and cache.captures == 4
    cache.clear()
    assert len(cache) == 0 and "c" not in cache and cache.captures == 4
