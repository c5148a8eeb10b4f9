"""KV-cache layouts: the shared prompt KV and the per-beam unshared KV."""

from xgr.kv.cache import BeamKV, SharedKV, kv_buffers

__all__ = ["BeamKV", "SharedKV", "kv_buffers"]
