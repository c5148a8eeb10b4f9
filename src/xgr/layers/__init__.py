"""Transformer building blocks running on xgr's KV layout."""
