"""Load generation and serving benchmarks (``xgr bench serve``)."""
