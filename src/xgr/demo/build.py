"""Building (or reusing) the cached demo model folder.

A model folder holds:

- ``config.json``, ``model.safetensors``, ``generation_config.json``: the Qwen2 decoder or
  the T5 encoder-decoder (``DemoConfig.arch``), an ordinary Hugging Face model,
- ``tokenizer.json``, ``tokenizer_config.json``: the word-level tokenizer,
- ``catalog.index.json``: item id -> code tokens (``ItemCatalog.from_index_json``),
- ``xgr_catalog.json``: the catalog fingerprint (``ItemCatalog.write_model_metadata``),
- ``xgr_prompt.json``: the prompt format (``<bos>`` then the last ``max_history`` items),
- ``items.json``: item id -> title,
- ``xgr_demo.json``: the DemoConfig, the ``sid_token_ids`` map and training facts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xgr.catalog import CATALOG_METADATA_FILE, ItemCatalog
from xgr.core import XgrError, read_json
from xgr.demo.config import DemoConfig
from xgr.demo.movielens import INTERACTIONS_FILE as MOVIELENS_INTERACTIONS
from xgr.demo.movielens import ITEMS_FILE as MOVIELENS_ITEMS
from xgr.demo.movielens import MovieLensData, leave_one_out, load_movielens
from xgr.engine.model_folder import DEFAULT_CATALOG_FILE, TITLES_FILE
from xgr.engine.prompt import PROMPT_FORMAT_FILE
from xgr.training.vocab import sid_token_ids

CATALOG_INDEX_FILE = DEFAULT_CATALOG_FILE
ITEMS_FILE = TITLES_FILE
DEMO_METADATA_FILE = "xgr_demo.json"

if TYPE_CHECKING:
    import torch

    from xgr.training.loop import Collate


def build_demo(
    cache_dir: str | Path, config: DemoConfig | None = None, progress: bool = True
) -> Path:
    """The demo model folder for ``config``, built on first use.

    Args:
        cache_dir: holds the MovieLens files and one ``model-<key>`` folder per config
            (``key`` = ``config.cache_key``).
        config: the build settings; default ``DemoConfig()``.
        progress: show tqdm bars while training.

    Returns:
        the model folder (see the module docstring for its files).

    Raises:
        XgrError: the data could not be downloaded or parsed.
        OSError: ``cache_dir`` cannot be made or written.
    """
    config = config or DemoConfig()
    cache_dir = Path(cache_dir).expanduser()
    target = cache_dir / f"model-{config.cache_key}"
    if (target / DEMO_METADATA_FILE).is_file():
        check_demo_files(target, cache_dir)
        return target
    if progress:  # the data and semantic IDs take seconds before the first training bar
        print(
            f"Building the {config.arch} demo model in {target} (first use): MovieLens-100K, "
            "semantic IDs, then training",
            file=sys.stderr,
            flush=True,
        )
    cache_dir.mkdir(parents=True, exist_ok=True)  # fail here, not after the download
    data = load_movielens(cache_dir)
    # Build beside the target and rename: an interrupted build leaves only a temp folder,
    # never a half-written model folder that a later call would reuse.
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        write_demo_model(staging, data, config, progress)
        _record_digests(staging, cache_dir)
        staging.chmod(0o755)  # mkdtemp makes it private; the folder is meant to be shared
        if target.exists():  # a stale folder without metadata, or a concurrent build
            if (target / DEMO_METADATA_FILE).is_file():
                return target
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# What a complete demo folder holds besides xgr_demo.json (training may add more files).
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    CATALOG_INDEX_FILE,
    "xgr_catalog.json",
    PROMPT_FORMAT_FILE,
    ITEMS_FILE,
)


def check_demo_files(model_dir: Path, cache_dir: Path) -> None:
    """Refuse a demo folder whose files, or the MovieLens files it was trained on, are
    missing or changed since the build.

    A complete folder is marked by ``xgr_demo.json``, which holds a SHA-256 digest of every
    other file and of the data. Without them, a removed ``xgr_prompt.json`` changed every
    score silently and a truncated ``ml-100k.inter`` changed ``xgr eval``'s figures. Folders
    built before digests were kept get them on first use (when the cache is writable).

    Raises:
        XgrError: naming what is missing or changed, and how to rebuild.
    """
    meta = read_demo_metadata(model_dir)
    rebuild = (
        f"delete {model_dir} (and {cache_dir / 'ml-100k'} too when a MovieLens file is "
        "named) to rebuild it"
    )
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if missing:
        raise XgrError(f"the demo model in {model_dir} lacks {', '.join(missing)}: {rebuild}")
    recorded = meta.get("digests")
    if not isinstance(recorded, dict):
        _record_digests(model_dir, cache_dir, meta, quiet=True)
    else:
        current = _digests(model_dir, cache_dir)
        changed = [name for name, digest in recorded.items() if current.get(name) != digest]
        if changed:
            raise XgrError(
                f"{', '.join(changed)} changed since the demo model in {model_dir} was built "
                f"(damaged or replaced): {rebuild}"
            )
    _add_items_to_catalog_record(model_dir, cache_dir, meta)


def _add_items_to_catalog_record(model_dir: Path, cache_dir: Path, meta: dict) -> None:
    """Give a demo folder built before catalog records held each item's semantic ID the
    record of its own catalog (the one it was trained on: the fingerprints match), so that
    other catalogs of the model are checked by rule, not refused; its digests follow. A
    read-only cache, or a record that does not match, is left as it is."""
    try:
        record = read_json(model_dir / CATALOG_METADATA_FILE)
        if not isinstance(record, dict) or "items" in record:
            return
        catalog = ItemCatalog.from_index_json(model_dir / CATALOG_INDEX_FILE)
        if record.get("fingerprint") != catalog.fingerprint:
            return  # loading it refuses the folder, naming the mismatch
        catalog.write_model_metadata(model_dir)
    except (OSError, ValueError, XgrError):
        return
    _record_digests(model_dir, cache_dir, meta, quiet=True)


def _digests(model_dir: Path, cache_dir: Path) -> dict[str, str]:
    """SHA-256 of every file of the folder but the metadata, and of the MovieLens files
    (named ``ml-100k/...``); a missing file is absent."""
    paths = {p.name: p for p in model_dir.iterdir() if p.is_file() and p.name != DEMO_METADATA_FILE}
    for name in (MOVIELENS_INTERACTIONS, MOVIELENS_ITEMS):
        paths[f"ml-100k/{name}"] = cache_dir / "ml-100k" / name
    return {
        name: hashlib.sha256(path.read_bytes()).hexdigest()
        for name, path in sorted(paths.items())
        if path.is_file()
    }


def _record_digests(
    model_dir: Path, cache_dir: Path, meta: dict | None = None, quiet: bool = False
) -> None:
    """Add the files' digests to ``xgr_demo.json`` (quiet: skip a cache that is read-only)."""
    meta = read_demo_metadata(model_dir) if meta is None else meta
    meta["digests"] = _digests(model_dir, cache_dir)
    path = model_dir / DEMO_METADATA_FILE
    try:
        # Replaced whole, so that a reader never sees a half-written marker file.
        partial = path.with_name(f".{DEMO_METADATA_FILE}.{os.getpid()}")
        partial.write_text(json.dumps(meta, indent=2) + "\n")
        os.replace(partial, path)
    except OSError:
        if not quiet:
            raise


def build_catalog(data: MovieLensData, config: DemoConfig) -> ItemCatalog:
    """Semantic IDs of every MovieLens item, from the training interactions only.

    The held-out last item of each user is left out of the embeddings so that the test
    interaction cannot leak into the IDs.
    """
    from xgr.training.semantic_ids import semantic_ids  # scikit-learn: only when building

    split = leave_one_out(data)
    codes = semantic_ids(
        split.histories,
        data.item_ids,
        num_levels=config.num_levels,
        codebook_size=config.codebook_size,
        embedding_dim=config.embedding_dim,
        seed=config.seed,
    )
    return ItemCatalog.from_codes(data.item_ids, codes, config.codebook_size)


def write_demo_model(
    model_dir: Path, data: MovieLensData, config: DemoConfig, progress: bool = True
) -> None:
    """Build the catalog, train the model and write every file of the folder into model_dir."""
    # The training stack (transformers) is imported only when a model has to be built.
    from xgr.training.folder import write_model_folder
    from xgr.training.loop import train_model
    from xgr.training.models import scratch_vocab
    from xgr.training.vocab import build_tokenizer

    started = time.perf_counter()
    catalog = build_catalog(data, config)
    split = leave_one_out(data)
    model, examples, collate = training_setup(config, catalog, split.histories)
    report = train_model(model, examples, config.training(), collate, progress=progress)
    write_model_folder(
        model_dir, model, build_tokenizer(catalog), catalog, scratch_vocab(catalog),
        config.max_history, data.titles,
    )  # fmt: skip
    meta = {
        "config": config.to_dict(),
        "cache_key": config.cache_key,
        "max_history": config.max_history,
        "sid_token_ids": sid_token_ids(catalog).tolist(),
        "num_items": len(catalog),
        "num_semantic_ids": catalog.num_semantic_ids,
        "training": {
            "steps": report.steps,
            "windows": report.windows,
            "train_seconds": round(report.seconds, 1),
            "build_seconds": round(time.perf_counter() - started, 1),
            "first_loss": round(report.first_loss, 4),
            "final_loss": round(report.final_loss, 4),
        },
    }
    # Written last: its presence marks a complete folder.
    (model_dir / DEMO_METADATA_FILE).write_text(json.dumps(meta, indent=2) + "\n")


def training_setup(
    config: DemoConfig, catalog: ItemCatalog, histories: Sequence[Sequence[str]]
) -> tuple[torch.nn.Module, Sequence[Any], Collate]:
    """The fresh model of ``config.arch``, its training examples cut from ``histories``
    (per user, item ids in time order) and the collate that batches them."""
    from xgr.training.models import scratch_model, scratch_vocab
    from xgr.training.recommender import training_examples

    shape = config.shape()
    model = scratch_model(config.arch, shape, catalog, config.max_history, config.seed)
    examples, _, collate = training_examples(
        config.arch, histories, catalog, config.max_history, scratch_vocab(catalog)
    )
    return model, examples, collate


def read_demo_metadata(model_dir: str | Path) -> dict:
    """The parsed ``xgr_demo.json`` of a demo model folder.

    Raises:
        XgrError: the folder is not a complete demo model folder.
    """
    path = Path(model_dir) / DEMO_METADATA_FILE
    try:
        meta = read_json(path)
    except (OSError, ValueError) as exc:
        raise XgrError(
            f"{model_dir} is not a demo model folder: cannot read {path}: {exc}"
        ) from None
    if not isinstance(meta, dict):
        raise XgrError(f"{model_dir} is not a demo model folder: {path} is not a JSON object")
    return meta


def load_demo_catalog(model_dir: str | Path) -> ItemCatalog:
    """The catalog saved in a demo model folder."""
    meta = read_demo_metadata(model_dir)
    return ItemCatalog.from_index_json(
        Path(model_dir) / CATALOG_INDEX_FILE, codebook_size=meta["config"]["codebook_size"]
    )
