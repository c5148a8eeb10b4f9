"""Model definitions and loading from Hugging Face folders."""

from xgr.models.config import DecoderConfig
from xgr.models.decoder import CausalLM
from xgr.models.loader import load_causal_lm, resolve_dtype

__all__ = ["CausalLM", "DecoderConfig", "load_causal_lm", "resolve_dtype"]
