"""Model runners: each model family's passes behind one interface (``ModelRunner``) that the
engine's search loop calls."""

from __future__ import annotations

import torch

from xgr.runner.base import FirstStep, LevelBatch, ModelRunner, PrefillBatch, Prefilled
from xgr.runner.decoder import DecoderRunner
from xgr.runner.encoder_decoder import EncoderDecoderRunner
from xgr.runner.shapes import PrefillShape

__all__ = [
    "DecoderRunner",
    "EncoderDecoderRunner",
    "FirstStep",
    "LevelBatch",
    "ModelRunner",
    "PrefillBatch",
    "PrefillShape",
    "Prefilled",
    "runner_for",
]


def runner_for(
    model: torch.nn.Module,
    num_levels: int,
    first_code_tokens: torch.Tensor | None,
    attention_backend: str = "torch",
    first_levels_together: bool = True,
) -> ModelRunner:
    """The runner of ``model``'s family (by its ``is_encoder_decoder``); arguments as
    ``DecoderRunner``'s."""
    family = EncoderDecoderRunner if model.is_encoder_decoder else DecoderRunner
    return family(model, num_levels, first_code_tokens, attention_backend, first_levels_together)
