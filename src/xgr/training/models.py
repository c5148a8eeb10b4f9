"""The models xgr trains: decoder-only (Qwen2, Qwen3, Llama) or TIGER-style T5, from scratch
or (decoders) from a Hugging Face base folder with the semantic-ID tokens added.

A model from scratch has the vocabulary of ``xgr.training.vocab`` (the special tokens and
one token per code per level, no text); its prompt starts with ``<bos>``. A base model keeps
its tokenizer, gets one added token per code (``<a_0>`` ...) and a resized embedding (and
head), and its prompt starts with its own BOS token where it has one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xgr.catalog import ItemCatalog
from xgr.core import XgrError
from xgr.training.vocab import BOS, BOS_ID, EOS_ID, PAD_ID, sid_token_ids, vocabulary

DECODER_ARCHITECTURES = ("qwen2", "qwen3", "llama")
ARCHITECTURES = (*DECODER_ARCHITECTURES, "t5")
# Relative-position buckets (HF T5's defaults): exact offsets up to 16, logarithmic up to
# 128 tokens (about 42 items of 3 codes), one shared bucket beyond.
T5_POSITION_BUCKETS = 32
T5_POSITION_MAX_DISTANCE = 128


@dataclass(frozen=True)
class ModelShape:
    """A model's size.

    Attributes:
        hidden_size: model width (T5: d_model).
        num_layers: decoder layers (T5: layers of the encoder and of the decoder each).
        num_heads: attention heads; the head size is ``hidden_size / num_heads``.
        num_kv_heads: key/value heads (< num_heads: grouped-query attention; T5: equal).
        intermediate_size: feed-forward width (T5: d_ff).
        dropout: training dropout (T5: its ``dropout_rate``; decoders: on the embeddings,
            the attention probabilities and each attention and MLP output).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise XgrError(f"model {name} must be an integer >= 1, got {value!r}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise XgrError(
                "hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads "
                f"(got {self.hidden_size}, {self.num_heads}, {self.num_kv_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise XgrError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Named sizes of ``xgr train --size``: tiny for tests, small is the demo's, medium and large
# for catalogs of tens of thousands of items (TIGER's T5 has d_model 128, 4 + 4 layers).
SIZES = {
    "tiny": ModelShape(32, 1, 2, 1, 64),
    "small": ModelShape(128, 2, 4, 2, 512),
    "medium": ModelShape(256, 4, 4, 2, 1024, dropout=0.1),
    "large": ModelShape(512, 6, 8, 4, 2048, dropout=0.1),
}


@dataclass(frozen=True)
class Vocab:
    """How a model writes prompts and codes.

    Attributes:
        code_tokens: int64 (num_levels, codebook_size) code -> token id.
        prefix: token ids before a prompt's history.
        prefix_tokens: the same as token strings (for ``xgr_prompt.json``).
        pad_id: the padding token id.
    """

    code_tokens: np.ndarray
    prefix: tuple[int, ...]
    prefix_tokens: tuple[str, ...]
    pad_id: int


def scratch_vocab(catalog: ItemCatalog) -> Vocab:
    """The vocabulary of a model from scratch: ``<bos>`` before the history."""
    return Vocab(sid_token_ids(catalog), (BOS_ID,), (BOS,), PAD_ID)


def make_decoder(
    arch: str, shape: ModelShape, catalog: ItemCatalog, max_prompt_tokens: int, seed: int
) -> torch.nn.Module:
    """A freshly initialized decoder-only LM for the catalog's vocabulary (float32, CPU).

    Args:
        arch: "qwen2", "qwen3" or "llama".
        shape: the size.
        catalog: gives the vocabulary (``xgr.training.vocab``).
        max_prompt_tokens: the longest prompt; positions are sized for it plus an item.
        seed: ``torch.manual_seed`` before the weights are drawn.

    Raises:
        XgrError: an unknown architecture.
    """
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    kinds = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }
    if arch not in kinds:
        raise XgrError(f"unknown decoder architecture {arch!r}: use one of {list(kinds)}")
    config_class, model_class = kinds[arch]
    extra: dict[str, Any] = {} if arch == "qwen2" else {"head_dim": shape.head_dim}
    config = config_class(
        vocab_size=len(vocabulary(catalog)),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        # Room for the longest prompt plus the generated semantic ID, rounded up.
        max_position_embeddings=int(math.ceil((max_prompt_tokens + 8) / 64) * 64),
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        use_cache=True,
        **extra,
    )
    if shape.dropout:
        config.attention_dropout = shape.dropout
    torch.manual_seed(seed)
    return model_class(config).float()


def make_t5(
    shape: ModelShape, catalog: ItemCatalog, max_prompt_tokens: int, seed: int
) -> torch.nn.Module:
    """A freshly initialized T5 encoder-decoder for the catalog's vocabulary (float32, CPU).

    ``shape.num_layers`` layers in the encoder and in the decoder, ReLU feed-forward, head
    tied to the embedding (T5's original layout). ``n_positions`` is the longest prompt, so
    the engine refuses longer ones.

    Raises:
        XgrError: num_kv_heads differs from num_heads (T5 has no grouped-query attention).
    """
    from transformers import T5Config, T5ForConditionalGeneration

    if shape.num_kv_heads != shape.num_heads:
        raise XgrError(
            "a t5 model has no grouped-query attention: num_kv_heads must equal num_heads "
            f"(got {shape.num_kv_heads} and {shape.num_heads})"
        )
    config = T5Config(
        vocab_size=len(vocabulary(catalog)),
        d_model=shape.hidden_size,
        d_kv=shape.head_dim,
        d_ff=shape.intermediate_size,
        num_layers=shape.num_layers,
        num_decoder_layers=shape.num_layers,
        num_heads=shape.num_heads,
        relative_attention_num_buckets=T5_POSITION_BUCKETS,
        relative_attention_max_distance=T5_POSITION_MAX_DISTANCE,
        dropout_rate=shape.dropout,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        n_positions=max_prompt_tokens,
        decoder_start_token_id=PAD_ID,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        use_cache=True,
    )
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config).float()


def scratch_model(
    arch: str, shape: ModelShape, catalog: ItemCatalog, max_history: int, seed: int
) -> torch.nn.Module:
    """A fresh model of ``arch`` for prompts of ``<bos>`` and ``max_history`` items: a T5
    whose encoder takes exactly that, or a decoder with room for one more item (its
    training windows hold ``max_history + 1``)."""
    prompt_tokens = 1 + max_history * catalog.num_levels
    if arch == "t5":
        return make_t5(shape, catalog, prompt_tokens, seed)
    return make_decoder(arch, shape, catalog, prompt_tokens + catalog.num_levels, seed)


def add_decoder_dropout(model: torch.nn.Module, p: float) -> None:
    """Dropout on a decoder's embeddings and on each attention and MLP output before the
    residual add (GPT-2's residual dropout), active in training mode only.

    Hugging Face's Qwen2, Qwen3 and Llama have no such option; forward hooks add it without
    changing the saved model.
    """
    if not p:
        return

    def drop(module, args, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], p, True), *output[1:])
        return torch.nn.functional.dropout(output, p, True)

    base = model.get_base_model() if hasattr(model, "get_base_model") else model.model
    base.embed_tokens.register_forward_hook(drop)
    for layer in base.layers:
        layer.self_attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)


def from_base_model(path: str | Path, catalog: ItemCatalog) -> tuple[torch.nn.Module, Any, Vocab]:
    """A Hugging Face decoder folder with one token per code added (float32, CPU).

    Tokens the tokenizer already has (``<a_0>`` ...) are kept; the embedding (and an untied
    head) grows to the new vocabulary, the new rows drawn as the model initializes them.

    Returns:
        the model, its tokenizer (transformers), and the Vocab (prefix: the tokenizer's BOS
        token where it has one, else nothing; pad: its pad, else EOS, else token 0).

    Raises:
        XgrError: no such folder, not a Qwen2/Qwen3/Llama model, or no tokenizer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise XgrError(f"--base-model {path} is not a Hugging Face model folder (no config.json)")
    try:
        model_type = AutoConfig.from_pretrained(path).model_type
        if model_type not in DECODER_ARCHITECTURES:
            raise XgrError(
                f"{path} holds a {model_type} model: a base model must be one of "
                f"{list(DECODER_ARCHITECTURES)}"
            )
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except XgrError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        raise XgrError(f"cannot load base model {path}: {exc}") from exc
    codes = [f"<{name}_{c}>" for name in catalog.level_names for c in range(catalog.codebook_size)]
    tokenizer.add_tokens([t for t in codes if t not in tokenizer.get_vocab()])
    model.resize_token_embeddings(len(tokenizer))
    ids = np.asarray(tokenizer.convert_tokens_to_ids(codes), dtype=np.int64)
    code_tokens = ids.reshape(catalog.num_levels, catalog.codebook_size)
    bos = tokenizer.bos_token
    prefix = ((tokenizer.bos_token_id,), (bos,)) if bos is not None else ((), ())
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return model, tokenizer, Vocab(code_tokens, prefix[0], prefix[1], int(pad))
