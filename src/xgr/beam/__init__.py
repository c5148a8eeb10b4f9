"""Catalog-constrained beam search."""

from xgr.beam.step import BeamState, constrained_beam_step

__all__ = ["BeamState", "constrained_beam_step"]
