"""Training examples from item sequences: windows for decoder-only models, (history, next
item) pairs for encoder-decoders.

A prompt is the model's prefix tokens (``<bos>`` for the models xgr trains from scratch,
none for most base models) followed by the code tokens of the history's items, oldest
first: exactly what ``PromptFormat.build`` gives at recommendation time.

Decoder-only (Qwen2, Qwen3, Llama): each user's training sequence is cut into windows of
``max_history + 1`` items written like a prompt. Windows end at the sequence's end and step
back by half a window, so the last window is exactly the context the model sees at
recommendation time. Each item's code tokens carry the next-token loss in one window only
(the earliest one holding it, which gives it the most context), so overlapping windows do
not count an item twice. The prefix carries no loss.

Encoder-decoder (TIGER-style T5): one example per training interaction after a user's
first. The encoder reads the prompt of the last ``max_history`` items before it; the
decoder starts from ``decoder_start_token_id`` and is taught the item's codes by teacher
forcing, cross-entropy over the vocabulary on each code (TIGER, Rajput et al. 2023).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from xgr.catalog import ItemCatalog
from xgr.engine.prompt import PromptFormat

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TrainingWindow:
    """One decoder-only training sequence.

    Attributes:
        input_ids: int64 (length,) token ids, the prefix first.
        labels: int64 (length,) the same ids where the loss applies, IGNORE_INDEX elsewhere.
    """

    input_ids: np.ndarray
    labels: np.ndarray


def training_windows(
    sequences: Sequence[Sequence[str]],
    catalog: ItemCatalog,
    max_history: int,
    code_tokens: np.ndarray,
    prefix: Sequence[int],
) -> list[TrainingWindow]:
    """Cut item sequences into training windows (see the module docstring).

    Args:
        sequences: per user, item ids in time order.
        catalog: maps items to codes.
        max_history: prompt history length; windows hold up to ``max_history + 1`` items.
        code_tokens: int64 (num_levels, codebook_size) code -> token id map.
        prefix: token ids before the first item (no loss).

    Returns:
        windows of at most ``len(prefix) + (max_history + 1) * num_levels`` tokens.

    Raises:
        XgrError: an item is not in the catalog.
    """
    size = max_history + 1
    stride = max(1, size // 2)
    levels, lead = catalog.num_levels, len(prefix)
    windows = []
    items_only, lead_ids = PromptFormat(), np.asarray(prefix, dtype=np.int64)
    for seq in sequences:
        if not seq:
            continue
        tokens = np.asarray(items_only.build(list(seq), catalog, code_tokens))
        starts = list(range(len(seq) - size, 0, -stride))[::-1]
        starts = [0, *starts]
        covered = 0  # items before this index already carry their loss in an earlier window
        for start in starts:
            end = min(start + size, len(seq))
            ids = np.concatenate([lead_ids, tokens[start * levels : end * levels]])
            labels = ids.copy()
            labels[: lead + (covered - start) * levels] = IGNORE_INDEX
            windows.append(TrainingWindow(ids.astype(np.int64), labels.astype(np.int64)))
            covered = end
    return windows


def held_out_windows(
    histories: Sequence[Sequence[str]],
    targets: Sequence[str],
    catalog: ItemCatalog,
    max_history: int,
    code_tokens: np.ndarray,
    prefix: Sequence[int],
) -> list[TrainingWindow]:
    """One window per held-out case, the loss on the target's codes only: the validation
    loss of a decoder-only model (nats per code token of the items it has to predict)."""
    items_only, levels = PromptFormat(), catalog.num_levels
    windows = []
    for history, target in zip(histories, targets, strict=True):
        items = [*list(history)[-max_history:], target]
        ids = np.concatenate(
            [np.asarray(prefix, dtype=np.int64), items_only.build(items, catalog, code_tokens)]
        ).astype(np.int64)
        labels = np.full_like(ids, IGNORE_INDEX)
        labels[-levels:] = ids[-levels:]
        windows.append(TrainingWindow(ids, labels))
    return windows


def collate_windows(batch: Sequence[TrainingWindow], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad windows into int64 (batch, longest) ``input_ids``, ``attention_mask`` and
    ``labels`` (causal attention makes padding after the tokens harmless)."""
    length = max(len(w.input_ids) for w in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, window in enumerate(batch):
        n = len(window.input_ids)
        input_ids[row, :n] = torch.from_numpy(window.input_ids)
        labels[row, :n] = torch.from_numpy(window.labels)
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


@dataclass(frozen=True)
class Seq2SeqExample:
    """One encoder-decoder training pair.

    Attributes:
        input_ids: int64 (prompt length,) encoder tokens, the prefix first.
        labels: int64 (num_levels,) the next item's code tokens, the decoder's targets.
    """

    input_ids: np.ndarray
    labels: np.ndarray


class Seq2SeqExamples(Sequence[Seq2SeqExample]):
    """(history, next item) pairs, built on access.

    Holds each sequence's code tokens once (int64 (items * num_levels,)) and an index of
    (sequence, target position) pairs, instead of one materialized prompt per pair.
    """

    def __init__(
        self, tokens: list[np.ndarray], index: np.ndarray, levels: int, history: int,
        prefix: Sequence[int],
    ):  # fmt: skip
        self._tokens, self._index = tokens, index
        self._levels, self._history = levels, history
        self._prefix = np.asarray(prefix, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> Seq2SeqExample:
        user, target = self._index[i]
        tokens, levels = self._tokens[user], self._levels
        start = max(0, target - self._history)
        history = tokens[start * levels : target * levels]
        return Seq2SeqExample(
            np.concatenate([self._prefix, history]).astype(np.int64),
            tokens[target * levels : (target + 1) * levels].astype(np.int64),
        )


def seq2seq_examples(
    sequences: Sequence[Sequence[str]],
    catalog: ItemCatalog,
    max_history: int,
    code_tokens: np.ndarray,
    prefix: Sequence[int],
) -> Seq2SeqExamples:
    """The encoder-decoder training pairs of item sequences (see the module docstring).

    Args:
        sequences: per user, item ids in time order (the held-out items already removed).
        catalog: maps items to codes.
        max_history: items of history in an encoder prompt (the most recent ones).
        code_tokens: int64 (num_levels, codebook_size) code -> token id map.
        prefix: token ids before the history.

    Returns:
        one example per item with at least one item before it: ``sum(len(s) - 1)`` pairs,
        prompts of at most ``len(prefix) + max_history * num_levels`` tokens.

    Raises:
        XgrError: an item is not in the catalog.
    """
    items_only = PromptFormat()
    tokens, index = [], []
    for seq in sequences:
        if len(seq) < 2:
            continue
        user = len(tokens)
        tokens.append(np.asarray(items_only.build(list(seq), catalog, code_tokens)))
        index.extend((user, target) for target in range(1, len(seq)))
    pairs = np.asarray(index, dtype=np.int64).reshape(-1, 2)
    return Seq2SeqExamples(tokens, pairs, catalog.num_levels, max_history, prefix)


def held_out_pairs(
    histories: Sequence[Sequence[str]],
    targets: Sequence[str],
    catalog: ItemCatalog,
    max_history: int,
    code_tokens: np.ndarray,
    prefix: Sequence[int],
) -> Seq2SeqExamples:
    """One encoder-decoder pair per held-out case with a history (its validation loss)."""
    items_only = PromptFormat()
    sequences = [[*list(h)[-max_history:], t] for h, t in zip(histories, targets, strict=True) if h]
    tokens = [np.asarray(items_only.build(s, catalog, code_tokens)) for s in sequences]
    index = np.asarray([[i, len(s) - 1] for i, s in enumerate(sequences)], dtype=np.int64)
    return Seq2SeqExamples(tokens, index.reshape(-1, 2), catalog.num_levels, max_history, prefix)


def collate_seq2seq(batch: Sequence[Seq2SeqExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad the prompts into int64 (batch, longest) ``input_ids`` and
    ``attention_mask``; ``labels`` int64 (batch, num_levels). The model shifts the labels
    right behind ``decoder_start_token_id`` for teacher forcing."""
    length = max(len(ex.input_ids) for ex in batch)
    input_ids = torch.full((len(batch), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, ex in enumerate(batch):
        input_ids[row, : len(ex.input_ids)] = torch.from_numpy(ex.input_ids)
        mask[row, : len(ex.input_ids)] = 1
    labels = torch.from_numpy(np.stack([ex.labels for ex in batch]))
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}
