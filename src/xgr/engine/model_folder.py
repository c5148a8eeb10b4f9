"""What a model folder holds besides the model: catalog, fingerprint, titles, tokenizer."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError

from xgr.catalog import CATALOG_METADATA_FILE, ItemCatalog
from xgr.core import XgrError, read_json
from xgr.engine.served_catalog import named_catalogs

logger = logging.getLogger(__name__)

# Catalog file a demo or training pipeline saves beside the model; used when none is passed.
DEFAULT_CATALOG_FILE = "catalog.index.json"
# Optional item id -> title map beside the model, copied into results.
TITLES_FILE = "items.json"


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse and check a device name. Raises XgrError for an unknown or unavailable device."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise XgrError(f"unknown device {device!r}: {exc}") from exc
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise XgrError(f"device {device!r} asked for, but this torch build sees no CUDA GPU")
    if parsed.type not in ("cpu", "cuda"):
        raise XgrError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        raise XgrError(f"device {device!r}: this machine has {torch.cuda.device_count()} GPUs")
    return parsed


def check_catalogs_compatible(model_dir: Path, catalogs: Mapping[str, ItemCatalog]) -> dict | None:
    """Refuse catalogs the model saved beside it was not trained for
    (``ItemCatalog.check_compatible``); returns the saved record (None without one).

    An older record holds only the training catalog's fingerprint: a catalog that matches it
    is that catalog, and gives the items the others are checked against by rule.

    Raises:
        XgrError: a catalog disagrees with the record (named where there are several), or
            the record is unreadable. A folder with no record is accepted (and logged),
            since plain HF checkpoints carry none.
    """
    path = model_dir / CATALOG_METADATA_FILE
    if not path.exists():
        logger.info("%s has no %s: catalog not checked", model_dir, CATALOG_METADATA_FILE)
        return None
    try:
        meta = read_json(path)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError, AttributeError) as exc:
        raise XgrError(f"cannot read {path}: {exc!r}") from exc
    if "items" not in meta:
        fingerprint = meta.get("fingerprint")
        trained = next((c for c in catalogs.values() if c.fingerprint == fingerprint), None)
        if trained is not None:
            meta = {**meta, **trained.model_record()}
    for name, catalog in catalogs.items():
        try:
            catalog.check_compatible(meta, f"the model in {path}")
        except XgrError as exc:
            raise XgrError(f"catalog {name!r}: {exc}" if len(catalogs) > 1 else str(exc)) from None
    return meta


def check_code_map(meta: dict | None, sid_token_ids: Any, path: Path) -> None:
    """Refuse a code-to-token map other than the one the model was trained with, where its
    record holds one.

    Raises:
        XgrError: the maps differ.
    """
    if meta is None or "sid_token_ids" not in meta:
        return
    saved = np.asarray(meta["sid_token_ids"], dtype=np.int64)
    given = np.asarray(sid_token_ids, dtype=np.int64)
    if saved.shape != given.shape or not np.array_equal(saved, given):
        raise XgrError(f"the code-to-token map differs from the one saved with the model in {path}")


def load_titles(model_dir: Path) -> dict[str, str]:
    """``items.json`` (item id -> title) of a model folder, or {} without one."""
    path = model_dir / TITLES_FILE
    if not path.exists():
        return {}
    try:
        titles = read_json(path)
    except (OSError, ValueError) as exc:
        raise XgrError(f"cannot read {path}: {exc}") from exc
    if not isinstance(titles, dict):
        raise XgrError(f"{path} must be a JSON object of item id -> title")
    bad = [k for k, v in titles.items() if not isinstance(v, str)]
    if bad:
        raise XgrError(f"{path}: titles must be strings; item {bad[0]!r} has {titles[bad[0]]!r}")
    return {str(k): v for k, v in titles.items()}


def load_tokenizer(model_dir: Path) -> Any:
    """The folder's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None without one."""
    # tokenizer.json holds the whole fast tokenizer; reading it directly avoids transformers'
    # AutoTokenizer, which picks a tokenizer class from config.json's model_type instead.
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    try:
        # Read here (not Tokenizer.from_file) so that a byte-order mark is dropped, as for
        # the folder's other JSON files.
        return Tokenizer.from_str(path.read_text(encoding="utf-8-sig"))
    except Exception as exc:  # tokenizers raises its own (Rust) exception types
        raise XgrError(f"cannot read {path}: {exc}") from exc


def load_engine(
    model_dir: Path,
    catalog: ItemCatalog | None,
    device,
    dtype,
    sid_token_ids: Any,
    make,
    quantization: str | None = None,
) -> Any:
    """``make(**parts)`` of a model folder's parts: model, catalog, code map, tokenizer,
    name, prompt format and titles (``Engine.from_pretrained``: arguments and errors as
    there; ``make`` builds the engine, and its errors are reported as the folder's too)."""
    if not model_dir.is_dir():
        raise XgrError(f"model folder {model_dir} does not exist")
    device = resolve_device(device)
    try:
        return make(**_load(model_dir, catalog, device, dtype, sid_token_ids, quantization))
    except XgrError:
        raise
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        ZeroDivisionError,
        SafetensorError,
    ) as exc:  # a malformed file anywhere in the folder
        raise XgrError(
            f"cannot load model folder {model_dir}: {type(exc).__name__}: {exc}"
        ) from exc


def _load(model_dir, catalog, device, dtype, sid_token_ids, quantization) -> dict[str, Any]:
    from xgr.engine.prompt import PromptFormat
    from xgr.models import load_model
    from xgr.models.sid_vocab import sid_token_ids_from_tokenizer, tokenizer_vocab

    if catalog is None:
        path = model_dir / DEFAULT_CATALOG_FILE
        if not path.exists():
            raise XgrError(f"no catalog given and {path} does not exist")
        catalog = ItemCatalog.from_index_json(path)
    catalogs = named_catalogs(catalog)
    meta = check_catalogs_compatible(model_dir, catalogs)
    model = load_model(model_dir, device, dtype, quantization)
    if sid_token_ids is None:  # found by the codes' names: for the widest codebook
        widest = max(catalogs.values(), key=lambda c: c.codebook_size)
        sid_token_ids = sid_token_ids_from_tokenizer(model_dir, widest)
    check_code_map(meta, sid_token_ids, model_dir / CATALOG_METADATA_FILE)
    return {
        "model": model,
        "catalog": catalogs,
        "sid_token_ids": sid_token_ids,
        "tokenizer": load_tokenizer(model_dir),
        "name": model_dir.name,
        "prompt_format": PromptFormat.from_model_dir(model_dir, tokenizer_vocab(model_dir)),
        "titles": load_titles(model_dir),
        "chat_template": load_chat_template(model_dir),
        "training_record": meta,
    }


def load_chat_template(model_dir: Path) -> ChatTemplate | None:
    """The folder's chat template (``chat_template.jinja``, or ``chat_template`` in
    ``tokenizer_config.json``), or None without one."""
    config = model_dir / "tokenizer_config.json"
    if not (model_dir / "tokenizer.json").is_file():  # the template is applied by it
        return None
    has = (model_dir / "chat_template.jinja").is_file()
    if not has and config.is_file():
        try:
            has = bool(json.loads(config.read_text()).get("chat_template"))
        except (OSError, ValueError, AttributeError):
            has = False
    return ChatTemplate(model_dir) if has else None


class ChatTemplate:
    """A model folder's chat template, applied by transformers' tokenizer of the folder
    (loaded at the first conversation: a server that never gets one never pays for it)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._lock = threading.Lock()
        self._tokenizer = None

    def format(self, messages: list[dict]) -> str:
        """The conversation as the model's prompt text, ready for the assistant's turn.

        Raises:
            XgrError: the template fails on these messages (its message included).
        """
        with self._lock:
            if self._tokenizer is None:
                from transformers import PreTrainedTokenizerFast

                try:
                    self._tokenizer = PreTrainedTokenizerFast.from_pretrained(self.model_dir)
                except Exception as exc:  # transformers raises ValueError, OSError, ...
                    raise XgrError(
                        f"the chat template of {self.model_dir} needs the folder's tokenizer, "
                        f"which cannot be loaded: {exc}"
                    ) from exc
        try:
            return self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except Exception as exc:  # jinja2's TemplateError and the template's raise_exception
            raise XgrError(f"the chat template refused the messages: {exc}") from exc
