"""``xgr train``: a generative recommender from interaction data and a catalog, written as a
model folder.

1. Read the interactions (``xgr.training.interactions``) and the catalog index; every item
   the training sequences name must be in the catalog.
2. Make the model: an architecture of a given shape from scratch, or a base decoder with
   the code tokens added (``xgr.training.models``).
3. Cut the training examples (``xgr.training.examples``) and, where the file has a
   validation split, the validation examples whose loss picks the weights kept.
4. Train (``xgr.training.loop``), with checkpoints in ``<output>/checkpoints``.
5. Write the model folder (``xgr.training.folder``) and ``xgr_training.json``: what was
   trained on, how, and the training report.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from xgr.catalog import ItemCatalog
from xgr.core import XgrError
from xgr.training.examples import (
    collate_seq2seq,
    collate_windows,
    held_out_pairs,
    held_out_windows,
    seq2seq_examples,
    training_windows,
)
from xgr.training.interactions import Interactions, read_interactions
from xgr.training.loop import Collate, TrainSettings, train_model
from xgr.training.models import (
    ARCHITECTURES,
    ModelShape,
    Vocab,
    add_decoder_dropout,
    from_base_model,
    scratch_model,
    scratch_vocab,
)

TRAINING_METADATA_FILE = "xgr_training.json"
# Files whose presence means a folder already holds a model.
MODEL_FILES = ("config.json", "model.safetensors", TRAINING_METADATA_FILE)


@dataclass(frozen=True)
class TrainJob:
    """One ``xgr train`` run.

    Attributes:
        data: the interaction file.
        catalog: the catalog index JSON.
        output: the model folder to write.
        arch: "qwen2", "qwen3", "llama" or "t5" (ignored with ``base_model``, whose own
            architecture is used).
        shape: the model's size (from scratch).
        settings: the training loop's settings.
        base_model: a Hugging Face decoder folder to start from (None: from scratch).
        max_history: items of history in a prompt (the most recent ones).
        titles: item titles to serve with the model (``read_titles``), or None.
        validate: pick the weights by the validation loss where the data has a split.
        resume: continue from the newest checkpoint in ``output/checkpoints``.
    """

    data: Path
    catalog: Path
    output: Path
    arch: str = "qwen2"
    shape: ModelShape = field(default_factory=lambda: ModelShape(128, 2, 4, 2, 512))
    settings: TrainSettings = field(default_factory=TrainSettings)
    base_model: Path | None = None
    max_history: int = 20
    titles: Path | None = None
    validate: bool = True
    resume: bool = False

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise XgrError(f"unknown architecture {self.arch!r}: use one of {list(ARCHITECTURES)}")
        if self.base_model is not None and self.arch == "t5":
            raise XgrError("--base-model starts from a decoder-only model: not with --arch t5")
        if not isinstance(self.max_history, int) or self.max_history < 1:
            raise XgrError(f"max_history must be an integer >= 1, got {self.max_history!r}")


def train_recommender(job: TrainJob, progress: bool = True) -> dict[str, Any]:
    """Train a model on ``job.data`` and write its folder to ``job.output`` (the steps of
    the module docstring).

    Returns:
        the contents of ``xgr_training.json``.

    Raises:
        XgrError: unreadable data or catalog, training items outside the catalog, an output
            folder that already holds a model (unless resuming), and every error of the
            training loop.
    """
    from xgr.training.folder import read_titles, write_model_folder
    from xgr.training.vocab import build_tokenizer

    started = time.perf_counter()
    output = Path(job.output)
    if not job.resume and any((output / name).exists() for name in MODEL_FILES):
        raise XgrError(
            f"{output} already holds a model: choose another --output, or --resume to "
            "continue its training"
        )
    data = read_interactions(job.data)
    catalog = ItemCatalog.from_index_json(job.catalog)
    check_items_in_catalog(data, catalog)
    titles = read_titles(job.titles, catalog) if job.titles is not None else {}
    if job.base_model is not None:
        model, tokenizer, vocab = from_base_model(job.base_model, catalog)
        arch = model.config.model_type
    else:
        arch, vocab = job.arch, scratch_vocab(catalog)
        tokenizer = build_tokenizer(catalog)
        model = scratch_model(arch, job.shape, catalog, job.max_history, job.settings.seed)
    if arch != "t5":
        add_decoder_dropout(model, job.shape.dropout if job.base_model is None else 0.0)
    valid = data.valid if job.validate and data.valid is not None and len(data.valid) else None
    examples, validation, collate = training_examples(
        arch, data.train, catalog, job.max_history, vocab, valid
    )
    output.mkdir(parents=True, exist_ok=True)
    settings = job.settings
    if settings.checkpoint_dir is None:
        settings = replace(settings, checkpoint_dir=output / "checkpoints")
    report = train_model(
        model, examples, settings, collate, progress=progress, validation=validation,
        resume=job.resume,
    )  # fmt: skip
    from transformers.utils import logging as hf_logging

    if not progress:  # save_pretrained's own bar
        hf_logging.disable_progress_bar()
    write_model_folder(
        output, model, tokenizer, catalog, vocab, job.max_history, titles,
        record_code_map=job.base_model is not None,
    )  # fmt: skip
    meta = {
        "data": str(job.data),
        "format": data.format,
        "catalog": str(job.catalog),
        "arch": arch,
        "base_model": None if job.base_model is None else str(job.base_model),
        "shape": asdict(job.shape) if job.base_model is None else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_history": job.max_history,
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(settings).items()
        },
        "training_sequences": len(data.train),
        "validation_cases": len(validation) if validation is not None else 0,
        "report": {k: _rounded(v) for k, v in asdict(report).items()},
        "seconds": round(time.perf_counter() - started, 1),
    }
    # Written last: its presence marks a complete folder.
    (output / TRAINING_METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def check_items_in_catalog(data: Interactions, catalog: ItemCatalog) -> None:
    """Refuse training data that names items the catalog lacks.

    Raises:
        XgrError: naming how many and the first few.
    """
    missing = [item for item in data.item_ids if item not in catalog.item_index]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5])
        raise XgrError(
            f"{len(missing)} of the {len(data.item_ids)} items in {data.path} are not in the "
            f"catalog ({shown}{', ...' if len(missing) > 5 else ''}): build the catalog from "
            "the same items (xgr sid build)"
        )


def training_examples(
    arch: str, sequences, catalog: ItemCatalog, max_history: int, vocab: Vocab, held_out=None
) -> tuple[Sequence[Any], Sequence[Any] | None, Collate]:
    """The training examples of ``arch`` cut from ``sequences`` (per user, item ids in time
    order), the examples of the ``held_out`` cases (None without them) and the collate that
    batches either."""
    t5 = arch == "t5"
    cut = seq2seq_examples if t5 else training_windows
    held = held_out_pairs if t5 else held_out_windows
    collate = functools.partial(collate_seq2seq if t5 else collate_windows, pad_id=vocab.pad_id)
    parts = (catalog, max_history, vocab.code_tokens, vocab.prefix)
    examples = cut(sequences, *parts)
    validation = None if held_out is None else held(held_out.histories, held_out.targets, *parts)
    return examples, validation, collate


def _rounded(value):
    return round(value, 4) if isinstance(value, float) else value
