"""Quantizing a loaded model's projections to FP8, and reading FP8 checkpoints.

``quantize_fp8`` turns each decoder layer's four projections (q/k/v, output, gate/up, down)
into ``xgr.layers.fp8.Fp8Linear`` and the norms and gated activation before them into passes
that write FP8 rows. The embeddings, the final norm and the LM head stay in the model dtype.
Two quantizations are offered (``QUANTIZATIONS``): "fp8", one scale per output channel and per
token row, and "fp8-tensorwise", one per tensor for weights and activations. The per-tensor
GEMM is faster, but its activation scale needs the whole tensor's amax before any row is cast
(a second pass), which costs more than the GEMM saves beyond a few hundred rows;
docs/performance.md has both quantizations' speed and agreement.

``dequantize_fp8_checkpoint`` reads the tensors of a Hugging Face FP8 checkpoint
(``quantization_config.quant_method == "fp8"``: e4m3 weights, each with a float32
``weight_scale_inv`` per tensor or per block, 128 x 128 in Qwen's and DeepSeek's FP8
releases), which a model then loads as it loads any checkpoint.
"""

from __future__ import annotations

import math

import torch

from xgr.core import XgrError
from xgr.layers.fp8 import FP8, FP8_OUT_DTYPE, Fp8GatedMLP, Fp8Linear, Fp8RMSNorm
from xgr.models.decoder import CausalLM

# Each quantization's scale granularity: per tensor (True) or per channel and token row.
QUANTIZATIONS = {"fp8": False, "fp8-tensorwise": True}
# The least compute capability with FP8 tensor cores (Ada, Hopper and later).
FP8_MIN_CAPABILITY = (8, 9)
_SCALE_SUFFIX = "_scale_inv"


def check_quantization(quantization: str | None, dtype: torch.dtype, device: torch.device):
    """Refuse a quantization this engine cannot run on ``device`` in ``dtype``.

    Raises:
        XgrError: an unknown name, FP8 with another dtype than bfloat16, or a CUDA device
            without FP8 tensor cores (compute capability under 8.9).
    """
    if quantization is None:
        return
    if quantization not in QUANTIZATIONS:
        raise XgrError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got "
                       f"{quantization!r}")  # fmt: skip
    if dtype != FP8_OUT_DTYPE:
        raise XgrError(f"quantization {quantization!r} keeps activations in bfloat16: use "
                       f"dtype 'bfloat16', not {str(dtype).removeprefix('torch.')!r}")  # fmt: skip
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        raise XgrError(
            f"{device} ({torch.cuda.get_device_name(device)}) has no FP8 tensor cores "
            f"(compute capability 8.9 or later needed); serve it without quantization"
        )


def quantize_fp8(model: CausalLM, quantization: str = "fp8") -> CausalLM:
    """Quantize ``model``'s decoder-layer projections to FP8 in place (fusing them first).

    Args:
        model: a bfloat16 ``CausalLM`` on its device.
        quantization: a name of ``QUANTIZATIONS``: "fp8" (weights per output channel,
            activations per token row) or "fp8-tensorwise" (scales per tensor).

    Returns:
        ``model``, its ``quantization`` attribute set to ``quantization``.

    Raises:
        XgrError: not a decoder-only model, an unknown quantization, not bfloat16, a model
            quantized already in another way, or a projection size that is not a multiple
            of 16.
    """
    if not isinstance(model, CausalLM):
        raise XgrError(
            f"quantization {quantization!r} supports decoder-only models (Qwen2, Qwen3, "
            f"Llama), not {type(model).__name__}"
        )
    check_quantization(quantization, model.lm_head.weight.dtype, model.lm_head.weight.device)
    if model.quantization == quantization:
        return model
    if model.quantization is not None:
        raise XgrError(f"the model is quantized already ({model.quantization!r}); load it "
                       f"again to quantize it as {quantization!r}")  # fmt: skip
    per_tensor = QUANTIZATIONS[quantization]
    model.fuse_projections()
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = Fp8Linear.from_linear(attn.qkv_proj, not per_tensor)
        attn.o_proj = Fp8Linear.from_linear(attn.o_proj, not per_tensor)
        layer.mlp = Fp8GatedMLP(
            Fp8Linear.from_linear(mlp.gate_up_proj, not per_tensor),
            Fp8Linear.from_linear(mlp.down_proj, not per_tensor),
            mlp.act, mlp.kernel_act,
        )  # fmt: skip
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, Fp8RMSNorm.from_norm(getattr(layer, name), per_tensor))
    model.quantization = quantization
    return model


def fp8_checkpoint_blocks(raw_config: dict, where: str) -> tuple[int, int] | None | bool:
    """The weight block size of a config's ``quantization_config``: (rows, columns) for
    block-wise scales, None for one scale per tensor, False for an unquantized checkpoint.

    Raises:
        XgrError: another quantization method or format (the message names it).
    """
    qc = raw_config.get("quantization_config")
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise XgrError(
            f"{where}: quantization_config quant_method {method!r} is not supported; xgr "
            f"loads unquantized (float32, bfloat16, float16) checkpoints and 'fp8' ones "
            f"(e4m3 weights with per-tensor or block-wise scales)"
        )
    if qc.get("fmt", "e4m3") != "e4m3":
        raise XgrError(f"{where}: FP8 format {qc.get('fmt')!r} is not supported (only e4m3)")
    block = qc.get("weight_block_size")
    if block is None:
        return None
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise XgrError(f"{where}: weight_block_size must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def dequantize_fp8_checkpoint(
    state: dict[str, torch.Tensor], blocks: tuple[int, int] | None, where: str
) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint's tensors with every e4m3 weight dequantized to float32 (W =
    values * scale, per tensor or per ``blocks`` block) and its ``weight_scale_inv`` dropped;
    static activation scales (``input_scale``) are dropped too (activations are quantized
    with dynamic scales as they are produced). Other tensors are returned as they are.

    Raises:
        XgrError: an e4m3 weight without its scale, a scale without its weight, or a scale
            whose shape does not fit the weight and block size.
    """
    out = {}
    for name, tensor in state.items():
        if name.endswith(_SCALE_SUFFIX):
            if name.removesuffix(_SCALE_SUFFIX) not in state:
                raise XgrError(f"{where}: {name} scales no weight of the checkpoint")
            continue
        if name.endswith(".input_scale"):
            continue
        if tensor.dtype != FP8:
            out[name] = tensor
            continue
        scale = state.get(name + _SCALE_SUFFIX)
        if scale is None:
            raise XgrError(f"{where}: the FP8 weight {name} has no {name}{_SCALE_SUFFIX}")
        out[name] = _dequantize(tensor, scale.float(), blocks, f"{where}: {name}")
    return out


def _dequantize(values: torch.Tensor, scale: torch.Tensor, blocks, where: str) -> torch.Tensor:
    w = values.float()
    if blocks is None:
        if scale.numel() != 1:
            raise XgrError(f"{where}: a per-tensor scale must be one value, got "
                           f"{tuple(scale.shape)}")  # fmt: skip
        return w * scale.reshape(())
    if w.dim() != 2:
        raise XgrError(f"{where}: block-wise scales need a 2-D weight, got {tuple(w.shape)}")
    rows, cols = w.shape
    expected = (math.ceil(rows / blocks[0]), math.ceil(cols / blocks[1]))
    if tuple(scale.shape) != expected:
        raise XgrError(f"{where}: block scales of shape {tuple(scale.shape)}, expected "
                       f"{expected} for a {rows} x {cols} weight in {blocks[0]} x "
                       f"{blocks[1]} blocks")  # fmt: skip
    full = scale.repeat_interleave(blocks[0], 0)[:rows].repeat_interleave(blocks[1], 1)[:, :cols]
    return w * full
