"""Load models from Hugging Face folders (config.json + safetensors): decoder-only LMs and
T5-family encoder-decoders."""

from __future__ import annotations

import logging
from pathlib import Path, PurePosixPath, PureWindowsPath

import torch
from safetensors.torch import load_file

from xgr.core import XgrError, read_json
from xgr.models.config import T5_MODEL_TYPE, DecoderConfig, T5Config
from xgr.models.config_checks import check_weight_shapes, read_weight_shapes
from xgr.models.decoder import CausalLM
from xgr.models.quantize import (
    check_quantization,
    dequantize_fp8_checkpoint,
    fp8_checkpoint_blocks,
    quantize_fp8,
)
from xgr.models.t5 import T5Seq2SeqLM

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SINGLE_FILE = "model.safetensors"
_SHARD_INDEX = "model.safetensors.index.json"
# Tensors some T5 checkpoints carry that the model does not use: aliases of ``shared.weight``,
# and a position bias table on the cross-attention that T5 never reads.
_T5_UNUSED_WEIGHTS = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' (or that torch dtype) -> torch dtype; else XgrError."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        raise XgrError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def read_config(model_dir: str | Path) -> tuple[DecoderConfig | T5Config, dict]:
    """Read ``config.json``; returns the parsed config (``T5Config`` for model_type "t5",
    else ``DecoderConfig``) and the raw dict. Raises XgrError."""
    path = Path(model_dir) / "config.json"
    try:
        raw = read_json(path)
    except (OSError, ValueError) as exc:
        raise XgrError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise XgrError(f"cannot read {path}: not a JSON object")
    try:
        if raw.get("model_type") == T5_MODEL_TYPE:
            return T5Config.from_hf(raw), raw
        return DecoderConfig.from_hf(raw), raw
    except XgrError as exc:  # the configs' own checks (an XgrError is a ValueError too)
        raise XgrError(f"{path}: {exc}") from exc
    except KeyError as exc:
        raise XgrError(f"{path} lacks {exc.args[0]!r}, which its model type needs") from exc
    except (TypeError, ValueError, ZeroDivisionError, AttributeError) as exc:
        raise XgrError(f"{path} has a value of the wrong type or range: {exc}") from exc


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a folder: ``model.safetensors``, else the shards its
    ``model.safetensors.index.json`` names.

    Every shard must be a relative name inside the folder (no absolute path, no ``..``, its
    folder resolving inside the model folder) naming an existing regular file; nothing else
    is opened, so an index cannot make the loader read files outside the folder.

    Raises:
        XgrError: neither file; an unreadable index or one without a ``weight_map`` object;
            a shard entry that is not a string, leaves the folder or names no file (the
            message names the entry).
    """
    model_dir = Path(model_dir)
    if (model_dir / _SINGLE_FILE).exists():
        return [model_dir / _SINGLE_FILE]
    index = model_dir / _SHARD_INDEX
    if not index.exists():
        raise XgrError(f"{model_dir} has neither {_SINGLE_FILE} nor {_SHARD_INDEX}")
    try:
        weight_map = read_json(index).get("weight_map")
    except (OSError, ValueError, AttributeError) as exc:
        raise XgrError(f"cannot read {index}: {exc}") from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise XgrError(f"{index} has no weight_map object of tensor name -> shard file")
    root = model_dir.resolve()
    shards: dict[str, Path] = {}
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str) or shard not in shards:  # a list is not hashable
            shards[shard] = _shard_path(model_dir, root, index, tensor, shard)
    return [shards[name] for name in sorted(shards)]


def _shard_path(model_dir: Path, root: Path, index: Path, tensor: str, shard) -> Path:
    """``model_dir / shard`` once ``shard`` is checked (``checkpoint_files``). Raises XgrError."""
    entry = f"{index}: the shard of {tensor!r}, {shard!r},"
    if not isinstance(shard, str) or not shard.strip() or "\x00" in shard:
        raise XgrError(f"{entry} is not a file name")
    relative = PurePosixPath(shard)
    if relative.is_absolute() or PureWindowsPath(shard).drive or ".." in relative.parts:
        raise XgrError(f"{entry} is not a relative name inside {model_dir}; refused")
    if "\\" in shard:  # a Windows separator: on POSIX a strange name, on Windows a way out
        raise XgrError(f"{entry} has a backslash; shard names are plain relative names")
    path = model_dir / relative
    # The shard's folder must resolve inside; the shard itself may be a symbolic link, as
    # every file of a Hugging Face hub cache snapshot is (to ../../blobs), model.safetensors
    # and config.json included.
    if not path.parent.resolve().is_relative_to(root):
        raise XgrError(f"{entry} resolves outside {model_dir}; refused")
    if not path.is_file():
        raise XgrError(f"{entry} does not exist in {model_dir}")
    return path


def load_model(
    model_dir: str | Path,
    device: str | torch.device,
    dtype: str | torch.dtype,
    quantization: str | None = None,
) -> CausalLM | T5Seq2SeqLM:
    """Build the folder's model (by config.json's model_type) with its weights in ``dtype``.

    An FP8 checkpoint (``quantization_config.quant_method`` "fp8") is dequantized to
    ``dtype``; with ``quantization`` ("fp8" or "fp8-tensorwise") the decoder layers'
    projections are then quantized to FP8 again (``xgr.models.quantize.quantize_fp8``), which
    rounds each weight of such a checkpoint a second time where its published scale differs
    from the new one (per tensor or per output channel).

    Raises:
        XgrError: unreadable config, unsupported architecture or checkpoint quantization,
            missing or unexpected weights, or a quantization this device or model cannot run
            (``check_quantization``, ``quantize_fp8``).
    """
    cfg, _ = read_config(model_dir)
    check_quantization(quantization, resolve_dtype(dtype), torch.device(device))
    if isinstance(cfg, T5Config):
        if quantization is not None:
            raise XgrError(f"{model_dir}: quantization {quantization!r} supports decoder-only "
                           f"models (Qwen2, Qwen3, Llama), not T5")  # fmt: skip
        model = load_t5(model_dir, device, dtype)
    else:
        model = load_causal_lm(model_dir, device, dtype)
    return model if quantization is None else quantize_fp8(model, quantization)


def load_causal_lm(
    model_dir: str | Path, device: str | torch.device, dtype: str | torch.dtype
) -> CausalLM:
    """Build a ``CausalLM`` from a HF folder with its weights in ``dtype`` on ``device``.

    Raises:
        XgrError: unreadable config, unsupported architecture, shards outside the folder
            (``checkpoint_files``), a config that disagrees with the weights' headers
            (``check_weight_shapes``), missing or unexpected weights.
    """
    cfg, raw = read_config(model_dir)
    if not isinstance(cfg, DecoderConfig):
        raise XgrError(f"{model_dir} holds a {cfg.model_type} model, not a decoder-only LM")
    state = _read_weights(cfg, raw, model_dir, dtype, device)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    if "lm_head.weight" not in state:
        if not cfg.tie_word_embeddings:
            raise XgrError(f"{model_dir}: lm_head.weight missing and embeddings are not tied")
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    model = _build(CausalLM, cfg, state, model_dir)
    logger.info(
        "loaded %s (%d layers, hidden %d, vocab %d) from %s as %s on %s",
        cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, model_dir,
        state["lm_head.weight"].dtype, device,
    )  # fmt: skip
    return model


def load_t5(
    model_dir: str | Path, device: str | torch.device, dtype: str | torch.dtype
) -> T5Seq2SeqLM:
    """Build a ``T5Seq2SeqLM`` from a HF ``T5ForConditionalGeneration`` folder.

    The LM head is the checkpoint's ``lm_head.weight`` when it has one, else ``shared.weight``
    (as transformers 5 loads T5: it always ties, unless the file holds a different head).

    Raises:
        XgrError: unreadable or unsupported config, shards outside the folder, a config that
            disagrees with the weights' headers, missing or unexpected weights.
    """
    cfg, raw = read_config(model_dir)
    if not isinstance(cfg, T5Config):
        raise XgrError(f"{model_dir} holds a {cfg.model_type} model, not a T5 model")
    state = _read_weights(cfg, raw, model_dir, dtype, device)
    for name in _T5_UNUSED_WEIGHTS:
        state.pop(name, None)
    if "lm_head.weight" not in state and "shared.weight" in state:
        state["lm_head.weight"] = state["shared.weight"]
    model = _build(T5Seq2SeqLM, cfg, state, model_dir)
    logger.info(
        "loaded t5 (%d + %d layers, d_model %d, vocab %d, %s feed-forward) from %s as %s on %s",
        cfg.num_layers, cfg.num_decoder_layers, cfg.d_model, cfg.vocab_size,
        "gated " + cfg.dense_act_fn if cfg.is_gated_act else cfg.dense_act_fn, model_dir,
        state["lm_head.weight"].dtype, device,
    )  # fmt: skip
    return model


def _read_weights(
    cfg, raw: dict, model_dir: str | Path, dtype: str | torch.dtype, device: str | torch.device
) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in ``dtype`` on ``device``, once its headers match ``cfg``
    (``check_weight_shapes``): a config that disagrees fails before any data is read; ``raw``,
    the config.json dict, says whether the checkpoint is FP8."""
    torch_dtype = resolve_dtype(dtype)
    blocks = fp8_checkpoint_blocks(raw, str(Path(model_dir) / "config.json"))
    files = checkpoint_files(model_dir)
    check_weight_shapes(cfg, read_weight_shapes(files), model_dir)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(path, device=str(device)))
    if blocks is not False:  # an FP8 checkpoint: its weights dequantized on the device
        state = dequantize_fp8_checkpoint(state, blocks, str(model_dir))
    return {name: tensor.to(dtype=torch_dtype) for name, tensor in state.items()}


def _build(model_cls, cfg, state: dict[str, torch.Tensor], model_dir) -> torch.nn.Module:
    """``model_cls(cfg)`` holding exactly ``state`` (no copies), in eval mode."""
    with torch.device("meta"):
        model = model_cls(cfg)
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
    return model.eval()
