"""Model definitions and loading from Hugging Face folders."""

from xgr.models.config import DecoderConfig, T5Config
from xgr.models.decoder import CausalLM
from xgr.models.loader import load_causal_lm, load_model, load_t5, resolve_dtype
from xgr.models.t5 import T5Seq2SeqLM

__all__ = [
    "CausalLM",
    "DecoderConfig",
    "T5Config",
    "T5Seq2SeqLM",
    "load_causal_lm",
    "load_model",
    "load_t5",
    "resolve_dtype",
]
