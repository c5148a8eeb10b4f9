"""The training loop every architecture shares: AdamW, warm-up and cosine decay, mixed
precision on CUDA, checkpoints that resume exactly, and the best validation state kept.

A checkpoint (``checkpoint-<step>.pt`` in the checkpoint folder) holds the model, optimizer
and schedule states, the step, the best validation loss so far and its weights, and the
torch random states. The batch order is not saved: it is a function of the seed (the order
of epoch ``e`` is the ``e``-th shuffle of one ``random.Random(seed)``), replayed on resume.
"""

from __future__ import annotations

import copy
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from xgr.core import XgrError

# Turns a list of examples into the keyword arguments of the model's forward (which must
# return an output with ``.loss``).
Collate = Callable[[Sequence[Any]], dict[str, torch.Tensor]]
CHECKPOINT = re.compile(r"checkpoint-(\d+)\.pt")


@dataclass(frozen=True)
class TrainSettings:
    """How to train.

    Attributes:
        batch_size: examples per optimizer step.
        epochs: passes over the examples.
        max_steps: stop after this many steps (None: every epoch).
        learning_rate: AdamW peak learning rate (linear warm-up, cosine decay to 10%).
        weight_decay: AdamW decoupled weight decay (not on norm gains and biases).
        warmup_steps: linear warm-up steps.
        seed: the batch order and torch's random state (dropout).
        device: torch device to train on.
        mixed_precision: bfloat16 autocast (CUDA only; weights and optimizer stay float32).
        checkpoint_dir: where checkpoints are written (None: none).
        checkpoint_every: steps between checkpoints (and after the last step).
        keep_checkpoints: the newest checkpoints kept; older ones are deleted.
        eval_every: steps between validation passes (None: once per epoch) when a
            validation set is given.
        max_seconds: stop after this many seconds of training (None: no limit); the
            schedule still spans every step, and a validation pass and a checkpoint follow
            the last step taken.
        desc: the progress bar's label.
    """

    batch_size: int = 32
    epochs: int = 5
    max_steps: int | None = None
    learning_rate: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    seed: int = 0
    device: str = "cpu"
    mixed_precision: bool = False
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    eval_every: int | None = None
    max_seconds: float | None = None
    desc: str = "training"

    def __post_init__(self) -> None:
        for name in ("batch_size", "epochs", "checkpoint_every", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise XgrError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_steps", "eval_every"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise XgrError(f"{name} must be None or an integer >= 1, got {value!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise XgrError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise XgrError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.max_seconds is not None and not (self.max_seconds > 0):
            raise XgrError(f"max_seconds must be None or > 0, got {self.max_seconds}")
        if self.warmup_steps < 0:
            raise XgrError(f"warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class TrainingReport:
    """What training did.

    Attributes:
        steps: optimizer steps in all (including those before a resume).
        windows: training examples.
        seconds: wall-clock seconds of this run (not of the steps before a resume).
        first_loss: the first step's loss of this run (nats per code token).
        final_loss: the mean loss over the last 50 steps.
        best_valid_loss: the lowest validation loss (None without validation).
        best_step: the step whose weights were kept (the last without validation).
        resumed_from: the step the run resumed from (None: a fresh start).
    """

    steps: int
    windows: int
    seconds: float
    first_loss: float
    final_loss: float
    best_valid_loss: float | None = None
    best_step: int | None = None
    resumed_from: int | None = None


def train_model(
    model: torch.nn.Module,
    examples: Sequence[Any],
    settings: TrainSettings,
    collate: Collate,
    progress: bool = True,
    validation: Sequence[Any] | None = None,
    resume: bool = False,
) -> TrainingReport:
    """Train ``model`` in place with AdamW on the loss its forward returns for each batch.

    Each step takes ``settings.batch_size`` examples in a shuffled order (reshuffled every
    epoch) and calls ``model(**collate(batch)).loss``; the learning rate warms up linearly
    for ``warmup_steps`` then follows a cosine down to 10% of ``learning_rate``. Gradients
    are clipped to norm 1. With ``validation``, the mean loss over it is measured every
    ``eval_every`` steps (and at the end), and the weights of the lowest are the ones left
    in the model.

    Args:
        model: a Hugging Face model (float32, on the CPU); moved to ``settings.device``
            for training and back to the CPU, in eval mode, at the end.
        examples: the training examples ``collate`` batches.
        settings: see ``TrainSettings``.
        collate: examples -> forward kwargs.
        progress: show a tqdm bar with the running loss.
        validation: examples whose mean loss picks the weights kept (None: the last).
        resume: continue from the newest checkpoint in ``settings.checkpoint_dir`` (a fresh
            start when there is none).

    Returns:
        the report (see ``TrainingReport``).

    Raises:
        XgrError: no examples, ``resume`` without a checkpoint folder, a checkpoint that
            does not fit the model or is beyond the run's steps, or a loss that is not
            finite.
    """
    if not len(examples):
        raise XgrError("no training examples")
    device = torch.device(settings.device)
    steps_per_epoch = math.ceil(len(examples) / settings.batch_size)
    total = steps_per_epoch * settings.epochs
    if settings.max_steps is not None:
        total = min(total, settings.max_steps)
    eval_every = settings.eval_every or steps_per_epoch
    model.to(device)
    optimizer = torch.optim.AdamW(
        _param_groups(model, settings.weight_decay),
        lr=settings.learning_rate,
        betas=(0.9, 0.98),
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: _lr_factor(step, settings.warmup_steps, total)
    )
    torch.manual_seed(settings.seed)
    state = {"step": 0, "best_loss": None, "best_step": None, "best_weights": None}
    resumed_from = None
    if resume:
        if settings.checkpoint_dir is None:
            raise XgrError("resume needs a checkpoint folder")
        path = latest_checkpoint(settings.checkpoint_dir)
        if path is not None:
            state = _load_checkpoint(path, model, optimizer, schedule, total)
            resumed_from = state["step"]
    autocast = settings.mixed_precision and device.type == "cuda"
    model.train()
    losses: list[float] = []
    started = time.perf_counter()
    deadline = None if settings.max_seconds is None else started + settings.max_seconds
    bar = tqdm(total=total, initial=state["step"], desc=settings.desc, unit="step",
               disable=not progress)  # fmt: skip
    rng = random.Random(settings.seed)
    step = 0
    while step < total:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for first in range(0, len(order), settings.batch_size):
            if step >= total:
                break
            if step < state["step"]:  # replaying the order up to a resumed step
                step += 1
                continue
            batch = [examples[i] for i in order[first : first + settings.batch_size]]
            inputs = {k: v.to(device, non_blocking=True) for k, v in collate(batch).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**inputs).loss
            if not torch.isfinite(loss):
                raise XgrError(
                    f"the training loss is {loss.item()} at step {step + 1}: lower the "
                    "learning rate"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
            state["step"] = step
            bar.update(1)
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}", **_best(state))
            out_of_time = deadline is not None and time.perf_counter() > deadline
            last = step == total or out_of_time
            if validation is not None and (step % eval_every == 0 or last):
                _validate(model, validation, settings, collate, autocast, state)
            if settings.checkpoint_dir is not None and (
                step % settings.checkpoint_every == 0 or last
            ):
                _save_checkpoint(settings, model, optimizer, schedule, state)
            if out_of_time:
                total = step  # ends both loops
    bar.close()
    if state["best_weights"] is not None:
        model.load_state_dict(state["best_weights"])
    model.to("cpu")
    model.eval()
    seconds = time.perf_counter() - started
    return TrainingReport(
        steps=step,
        windows=len(examples),
        seconds=seconds,
        first_loss=losses[0] if losses else float("nan"),
        final_loss=float(np.mean(losses[-50:])) if losses else float("nan"),
        best_valid_loss=state["best_loss"],
        best_step=state["best_step"] if state["best_step"] is not None else step,
        resumed_from=resumed_from,
    )


def validation_loss(
    model: torch.nn.Module,
    examples: Sequence[Any],
    collate: Collate,
    batch_size: int,
    device: str | torch.device = "cpu",
    autocast: bool = False,
) -> float:
    """Mean loss of ``model`` over ``examples`` (each batch's loss weighted by its size), in
    eval mode and without gradients; the model's mode is restored."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for first in range(0, len(examples), batch_size):
            batch = [examples[i] for i in range(first, min(first + batch_size, len(examples)))]
            inputs = {k: v.to(device) for k, v in collate(batch).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(**inputs).loss
            total += loss.item() * len(batch)
            count += len(batch)
    model.train(was_training)
    return total / max(count, 1)


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint of the highest step in ``folder`` (None: no checkpoint)."""
    found = _checkpoints(Path(folder))
    return found[-1] if found else None


def _checkpoints(folder: Path) -> list[Path]:
    """The folder's checkpoints, lowest step first."""
    if not folder.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT.fullmatch(p.name))]
    return [path for _, path in sorted(steps)]


def _best(state: dict) -> dict[str, str]:
    return {} if state["best_loss"] is None else {"valid": f"{state['best_loss']:.3f}"}


def _validate(model, validation, settings, collate, autocast, state) -> None:
    loss = validation_loss(
        model, validation, collate, settings.batch_size, settings.device, autocast
    )
    if state["best_loss"] is None or loss < state["best_loss"]:
        state["best_loss"], state["best_step"] = loss, state["step"]
        state["best_weights"] = {
            k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()
        }


def _save_checkpoint(settings, model, optimizer, schedule, state) -> None:
    folder = Path(settings.checkpoint_dir)
    folder.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": state["step"],
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "best_loss": state["best_loss"],
        "best_step": state["best_step"],
        "best_weights": state["best_weights"],
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    path = folder / f"checkpoint-{state['step']}.pt"
    partial = path.with_name(f".{path.name}.partial")
    torch.save(payload, partial)
    partial.replace(path)  # a crash mid-write never leaves a truncated newest checkpoint
    for stale in _checkpoints(folder)[: -settings.keep_checkpoints]:
        stale.unlink(missing_ok=True)


def _load_checkpoint(path: Path, model, optimizer, schedule, total: int) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        schedule.load_state_dict(payload["schedule"])
    except (OSError, RuntimeError, KeyError, ValueError) as exc:
        raise XgrError(
            f"cannot resume from {path}: {exc} (a checkpoint of another model or settings?)"
        ) from exc
    if payload["step"] > total:
        raise XgrError(f"{path} is at step {payload['step']}, beyond this run's {total} steps")
    torch.set_rng_state(payload["cpu_rng"])
    if payload["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda_rng"])
    best = payload["best_weights"]
    return {
        "step": payload["step"],
        "best_loss": payload["best_loss"],
        "best_step": payload["best_step"],
        "best_weights": copy.deepcopy(best) if best is not None else None,
    }


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
