"""The engine: model runner and fixed-step generation."""

from xgr.engine.engine import Engine

__all__ = ["Engine"]
