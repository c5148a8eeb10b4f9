"""The demo's TIGER-style T5 encoder-decoder and its training examples.

The vocabulary is the demo's (``xgr.demo.vocab``): the special tokens and one token per code
per level, no text. One example per training interaction after a user's first: the encoder
reads the prompt the decoder-only model reads (``<bos>`` then the code tokens of the last
``max_history`` items before it, oldest first); the decoder starts from
``decoder_start_token_id`` (``<pad>``, T5's convention) and is taught the item's codes by
teacher forcing, cross-entropy over the vocabulary on each code (TIGER, Rajput et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import T5Config, T5ForConditionalGeneration

from xgr.catalog import ItemCatalog
from xgr.demo.config import DemoConfig
from xgr.demo.vocab import BOS_ID, EOS_ID, PAD_ID, sid_token_ids, vocabulary
from xgr.engine.prompt import PromptFormat

# No dropout, as in the Qwen2 demo: one epoch does not overfit, and dropout on the attention
# probabilities costs a third of a CPU training step.
T5_DROPOUT = 0.0
# Relative-position buckets (HF T5's defaults): exact offsets up to 16, logarithmic up to
# 128 tokens (about 42 items of 3 codes), one shared bucket beyond.
T5_POSITION_BUCKETS = 32
T5_POSITION_MAX_DISTANCE = 128


@dataclass(frozen=True)
class Seq2SeqExample:
    """One training pair.

    Attributes:
        input_ids: int64 (prompt length,) encoder tokens, ``<bos>`` first.
        labels: int64 (num_levels,) the next item's code tokens, the decoder's targets.
    """

    input_ids: np.ndarray
    labels: np.ndarray


class Seq2SeqExamples(Sequence[Seq2SeqExample]):
    """Every (history, next item) pair of the training sequences, built on access.

    Holds each user's code tokens once (int64 (items * num_levels,)) and an index of
    (user, target position) pairs, instead of ~100k materialized prompts.
    """

    def __init__(self, tokens: list[np.ndarray], index: np.ndarray, levels: int, history: int):
        self._tokens, self._index = tokens, index
        self._levels, self._history = levels, history

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> Seq2SeqExample:
        user, target = self._index[i]
        tokens, levels = self._tokens[user], self._levels
        start = max(0, target - self._history)
        history = tokens[start * levels : target * levels]
        return Seq2SeqExample(
            np.concatenate([[BOS_ID], history]).astype(np.int64),
            tokens[target * levels : (target + 1) * levels].astype(np.int64),
        )


def seq2seq_examples(
    sequences: Sequence[Sequence[str]], catalog: ItemCatalog, max_history: int
) -> Seq2SeqExamples:
    """The T5 training pairs of item sequences (see the module docstring).

    Args:
        sequences: per user, item ids in time order (the held-out items already removed).
        catalog: maps items to code tokens.
        max_history: items of history in an encoder prompt (the most recent ones).

    Returns:
        one example per item with at least one item before it: ``sum(len(s) - 1)`` pairs,
        prompts of at most ``1 + max_history * num_levels`` tokens.

    Raises:
        XgrError: an item is not in the catalog.
    """
    code_tokens, items_only = sid_token_ids(catalog), PromptFormat()
    tokens, index = [], []
    for seq in sequences:
        if len(seq) < 2:
            continue
        user = len(tokens)
        tokens.append(np.asarray(items_only.build(list(seq), catalog, code_tokens)))
        index.extend((user, target) for target in range(1, len(seq)))
    pairs = np.asarray(index, dtype=np.int64).reshape(-1, 2)
    return Seq2SeqExamples(tokens, pairs, catalog.num_levels, max_history)


def make_t5_model(config: DemoConfig, catalog: ItemCatalog) -> T5ForConditionalGeneration:
    """A freshly initialized T5 encoder-decoder for the catalog's vocabulary (float32, CPU).

    ``config.num_layers`` layers in the encoder and in the decoder, ReLU feed-forward, head
    tied to the embedding (T5's original layout). ``n_positions`` is the longest prompt, so
    the engine refuses longer ones. Weights are drawn after ``torch.manual_seed(config.seed)``.
    """
    model_config = T5Config(
        vocab_size=len(vocabulary(catalog)),
        d_model=config.hidden_size,
        d_kv=config.hidden_size // config.num_heads,
        d_ff=config.intermediate_size,
        num_layers=config.num_layers,
        num_decoder_layers=config.num_layers,
        num_heads=config.num_heads,
        relative_attention_num_buckets=T5_POSITION_BUCKETS,
        relative_attention_max_distance=T5_POSITION_MAX_DISTANCE,
        dropout_rate=T5_DROPOUT,
        feed_forward_proj="relu",
        tie_word_embeddings=True,
        n_positions=1 + config.max_history * catalog.num_levels,
        decoder_start_token_id=PAD_ID,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        use_cache=True,
    )
    torch.manual_seed(config.seed)
    return T5ForConditionalGeneration(model_config).float()


def collate_seq2seq(batch: Sequence[Seq2SeqExample]) -> dict[str, torch.Tensor]:
    """Right-pad the prompts into int64 (batch, longest) ``input_ids`` and
    ``attention_mask``; ``labels`` int64 (batch, num_levels). The model shifts the labels
    right behind ``decoder_start_token_id`` for teacher forcing."""
    length = max(len(ex.input_ids) for ex in batch)
    input_ids = torch.full((len(batch), length), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, ex in enumerate(batch):
        input_ids[row, : len(ex.input_ids)] = torch.from_numpy(ex.input_ids)
        mask[row, : len(ex.input_ids)] = 1
    labels = torch.from_numpy(np.stack([ex.labels for ex in batch]))
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
