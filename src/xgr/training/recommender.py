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

import json
import time
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
from xgr.training.loop import TrainSettings, train_model
from xgr.training.models import (
    ARCHITECTURES,
    ModelShape,
    add_decoder_dropout,
    from_base_model,
    make_decoder,
    make_t5,
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
        prompt_tokens = len(vocab.prefix) + job.max_history * catalog.num_levels
        if arch == "t5":
            model = make_t5(job.shape, catalog, prompt_tokens, job.settings.seed)
        else:
            model = make_decoder(
                arch, job.shape, catalog, prompt_tokens + catalog.num_levels, job.settings.seed
            )
    if arch != "t5":
        add_decoder_dropout(model, job.shape.dropout if job.base_model is None else 0.0)
    examples, validation, collate = _examples(job, data, catalog, vocab, arch)
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


def _examples(job: TrainJob, data: Interactions, catalog, vocab, arch: str):
    valid = data.valid if job.validate and data.valid is not None and len(data.valid) else None
    code_tokens, prefix, history = vocab.code_tokens, vocab.prefix, job.max_history
    if arch == "t5":
        examples = seq2seq_examples(data.train, catalog, history, code_tokens, prefix)
        validation = (
            held_out_pairs(valid.histories, valid.targets, catalog, history, code_tokens, prefix)
            if valid is not None
            else None
        )
        return examples, validation, lambda batch: collate_seq2seq(batch, vocab.pad_id)
    examples = training_windows(data.train, catalog, history, code_tokens, prefix)
    validation = (
        held_out_windows(valid.histories, valid.targets, catalog, history, code_tokens, prefix)
        if valid is not None
        else None
    )
    return examples, validation, lambda batch: collate_windows(batch, vocab.pad_id)


def _rounded(value):
    return round(value, 4) if isinstance(value, float) else value
