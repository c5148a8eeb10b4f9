"""Load decoder-only models from Hugging Face folders (config.json + safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from xgr.core import XgrError
from xgr.models.config import DecoderConfig
from xgr.models.decoder import CausalLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SINGLE_FILE = "model.safetensors"
_SHARD_INDEX = "model.safetensors.index.json"


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or that torch dtype) -> torch dtype; else XgrError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise XgrError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def read_config(model_dir: str | Path) -> tuple[DecoderConfig, dict]:
    """Read ``config.json``; returns the parsed config and the raw dict. Raises XgrError."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise XgrError(f"cannot read {path}: {exc}") from exc
    return DecoderConfig.from_hf(raw), raw


def read_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint. Raises XgrError."""
    model_dir = Path(model_dir)
    if (model_dir / _SINGLE_FILE).exists():
        return load_file(model_dir / _SINGLE_FILE)
    index = model_dir / _SHARD_INDEX
    if not index.exists():
        raise XgrError(f"{model_dir} has neither {_SINGLE_FILE} nor {_SHARD_INDEX}")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_file(model_dir / shard))
    return state


def load_causal_lm(
    model_dir: str | Path, device: str | torch.device, dtype: str | torch.dtype
) -> CausalLM:
    """Build a ``CausalLM`` from a HF folder with its weights in ``dtype`` on ``device``.

    Raises:
        XgrError: unreadable config, unsupported architecture, missing or unexpected weights.
    """
    cfg, _ = read_config(model_dir)
    torch_dtype = resolve_dtype(dtype)
    state = {
        name: tensor.to(dtype=torch_dtype, device=device)
        for name, tensor in read_state_dict(model_dir).items()
        if not name.endswith("rotary_emb.inv_freq")
    }
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise XgrError(f"{model_dir}: lm_head.weight missing and embeddings are not tied")
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    with torch.device("meta"):
        model = CausalLM(cfg)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise XgrError(
            f"{model_dir}: weights do not match a {cfg.model_type} model: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    try:
        model.load_state_dict(state, assign=True)
    except RuntimeError as exc:  # shape mismatches between config.json and the weights
        raise XgrError(f"{model_dir}: weights do not match config.json: {exc}") from exc
    logger.info(
        "loaded %s (%d layers, hidden %d, vocab %d) from %s as %s on %s",
        cfg.model_type,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        model_dir,
        torch_dtype,
        device,
    )
    return model.eval()
