"""Training the demo models: the loop all architectures share, and the Qwen2 decoder's data.

``train_model`` runs AdamW over any examples with an architecture's ``collate`` (the T5
encoder-decoder's examples and model are in ``xgr.demo.train_t5``). For the Qwen2 decoder,
each user's training sequence (every item but the held-out last one) is cut into windows
of ``max_history + 1`` items, written like a prompt (``<bos>`` + code tokens). Windows end
at the sequence's end and step back by half a window, so the last window is exactly the
context the model sees at recommendation time. Each item's code tokens carry the
next-token loss in one window only (the earliest one holding it, which gives it the most
context), so overlapping windows do not count an item twice. ``<bos>`` carries no loss.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import Qwen2Config, Qwen2ForCausalLM

from xgr.catalog import ItemCatalog
from xgr.demo.config import DemoConfig
from xgr.demo.vocab import BOS_ID, EOS_ID, PAD_ID, sid_token_ids, vocabulary
from xgr.engine.prompt import PromptFormat

IGNORE_INDEX = -100


@dataclass(frozen=True)
class TrainingWindow:
    """One training sequence.

    Attributes:
        input_ids: int64 (length,) token ids, ``<bos>`` first.
        labels: int64 (length,) the same ids where the loss applies, IGNORE_INDEX elsewhere.
    """

    input_ids: np.ndarray
    labels: np.ndarray


@dataclass(frozen=True)
class TrainingReport:
    """What training did: optimizer steps, examples, seconds (wall clock), and the loss (nats
    per code token) of the first step and the mean of the last 50."""

    steps: int
    windows: int
    seconds: float
    first_loss: float
    final_loss: float


def training_windows(
    sequences: Sequence[Sequence[str]], catalog: ItemCatalog, max_history: int
) -> list[TrainingWindow]:
    """Cut item sequences into training windows (see the module docstring).

    Args:
        sequences: per user, item ids in time order.
        catalog: maps items to code tokens.
        max_history: prompt history length; windows hold up to ``max_history + 1`` items.

    Returns:
        windows of at most ``1 + (max_history + 1) * num_levels`` tokens.

    Raises:
        XgrError: an item is not in the catalog.
    """
    size = max_history + 1
    stride = max(1, size // 2)
    levels = catalog.num_levels
    windows = []
    code_tokens, items_only = sid_token_ids(catalog), PromptFormat()
    for seq in sequences:
        if not seq:
            continue
        tokens = np.asarray(items_only.build(list(seq), catalog, code_tokens))
        starts = list(range(len(seq) - size, 0, -stride))[::-1]
        starts = [0, *starts]
        covered = 0  # items before this index already carry their loss in an earlier window
        for start in starts:
            end = min(start + size, len(seq))
            ids = np.concatenate([[BOS_ID], tokens[start * levels : end * levels]])
            labels = ids.copy()
            labels[: 1 + (covered - start) * levels] = IGNORE_INDEX
            windows.append(TrainingWindow(ids.astype(np.int64), labels.astype(np.int64)))
            covered = end
    return windows


def make_model(config: DemoConfig, catalog: ItemCatalog) -> Qwen2ForCausalLM:
    """A freshly initialized Qwen2 decoder for the catalog's vocabulary (float32, CPU).

    Weights are drawn after ``torch.manual_seed(config.seed)``.
    """
    prompt_tokens = 1 + (config.max_history + 1) * catalog.num_levels
    model_config = Qwen2Config(
        vocab_size=len(vocabulary(catalog)),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        # Room for the longest prompt plus the generated semantic ID, rounded up.
        max_position_embeddings=int(math.ceil((prompt_tokens + 8) / 64) * 64),
        tie_word_embeddings=True,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype="float32",
        use_cache=True,
    )
    torch.manual_seed(config.seed)
    return Qwen2ForCausalLM(model_config).float()


# Turns a list of examples into the keyword arguments of the model's forward (which must
# return an output with ``.loss``).
Collate = Callable[[Sequence[Any]], dict[str, torch.Tensor]]


def train_model(
    model: torch.nn.Module,
    windows: Sequence[Any],
    config: DemoConfig,
    progress: bool = True,
    collate: Collate | None = None,
) -> TrainingReport:
    """Train ``model`` in place with AdamW on the loss its forward returns for each batch.

    Each step takes ``config.batch_size`` examples in a shuffled order (reshuffled every
    epoch) and calls ``model(**collate(batch)).loss``; the learning rate warms up linearly
    for ``config.warmup_steps`` then follows a cosine down to 10% of
    ``config.learning_rate``. Gradients are clipped to norm 1.

    Args:
        model: a Hugging Face model (float32); left in eval mode.
        windows: the training examples (``TrainingWindow`` for ``collate_windows``).
        config: batch size, epochs, step cap, optimizer settings and seed.
        progress: show a tqdm bar with the running loss.
        collate: examples -> forward kwargs; default ``collate_windows`` (Qwen2 windows).

    Returns:
        the steps run, the example count, the wall-clock seconds, the first step's loss and
        the mean loss over the last 50 steps (nats per code token).
    """
    collate = collate or collate_windows
    steps_per_epoch = math.ceil(len(windows) / config.batch_size)
    total = steps_per_epoch * config.epochs
    if config.max_steps is not None:
        total = min(total, config.max_steps)
    optimizer = torch.optim.AdamW(
        _param_groups(model, config.weight_decay), lr=config.learning_rate, betas=(0.9, 0.98)
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, config.warmup_steps, total)
    )
    rng = random.Random(config.seed)
    torch.manual_seed(config.seed)
    model.train()
    losses: list[float] = []
    started = time.perf_counter()
    desc = f"training demo model ({config.arch})"
    bar = tqdm(total=total, desc=desc, unit="step", disable=not progress)
    step = 0
    while step < total:
        order = list(range(len(windows)))
        rng.shuffle(order)
        for first in range(0, len(order), config.batch_size):
            if step >= total:
                break
            batch = [windows[i] for i in order[first : first + config.batch_size]]
            loss = model(**collate(batch)).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    bar.close()
    model.eval()
    seconds = time.perf_counter() - started
    return TrainingReport(step, len(windows), seconds, losses[0], float(np.mean(losses[-50:])))


def collate_windows(batch: Sequence[TrainingWindow]) -> dict[str, torch.Tensor]:
    """Right-pad windows into int64 (batch, longest) ``input_ids``, ``attention_mask`` and
    ``labels`` (causal attention makes padding after the tokens harmless)."""
    length = max(len(w.input_ids) for w in batch)
    input_ids = torch.full((len(batch), length), PAD_ID, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, window in enumerate(batch):
        n = len(window.input_ids)
        input_ids[row, :n] = torch.from_numpy(window.input_ids)
        labels[row, :n] = torch.from_numpy(window.labels)
        mask[row, :n] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    # Norm gains and biases are not decayed: shrinking them only hurts.
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _lr_factor(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
