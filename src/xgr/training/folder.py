"""Writing a trained model as a folder ``xgr serve --model`` takes.

A model folder holds:

- ``config.json``, ``model.safetensors``, ``generation_config.json``: an ordinary Hugging
  Face model (decoder-only or T5),
- the tokenizer's files (``tokenizer.json``, ``tokenizer_config.json``, ...),
- ``catalog.index.json``: item id -> code tokens (``ItemCatalog.from_index_json``),
- ``xgr_catalog.json``: what later catalogs must agree with
  (``ItemCatalog.write_model_metadata``),
- ``xgr_prompt.json``: the prompt format (prefix tokens, then the last ``max_history_items``
  items),
- ``items.json``: item id -> title, when titles are known.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from xgr.catalog import ItemCatalog
from xgr.core import XgrError
from xgr.engine.model_folder import DEFAULT_CATALOG_FILE, TITLES_FILE
from xgr.engine.prompt import PROMPT_FORMAT_FILE
from xgr.training.models import Vocab


def write_model_folder(
    folder: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    catalog: ItemCatalog,
    vocab: Vocab,
    max_history: int,
    titles: Mapping[str, str] | None = None,
    record_code_map: bool = False,
) -> None:
    """Write every file of a model folder (see the module docstring) into ``folder``.

    Args:
        folder: an existing folder.
        model: the trained Hugging Face model (saved in its own dtype).
        tokenizer: a transformers tokenizer (``save_pretrained``).
        catalog: the catalog trained on.
        vocab: the code tokens and the prompt's prefix.
        max_history: items of history a prompt keeps.
        titles: item id -> title (None or empty: no ``items.json``).
        record_code_map: save the code-to-token map in ``xgr_catalog.json`` (for base models,
            whose code tokens are not where their names alone would put them).
    """
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    catalog.to_index_json(folder / DEFAULT_CATALOG_FILE)
    catalog.write_model_metadata(folder, vocab.code_tokens if record_code_map else None)
    prompt_format = {"prefix_tokens": list(vocab.prefix_tokens), "max_history_items": max_history}
    (folder / PROMPT_FORMAT_FILE).write_text(json.dumps(prompt_format) + "\n")
    if titles:
        (folder / TITLES_FILE).write_text(json.dumps(dict(titles), ensure_ascii=False, indent=0))


def read_titles(path: str | Path, catalog: ItemCatalog) -> dict[str, str]:
    """Item titles of the catalog's items from a file.

    Args:
        path: a JSON object of item id -> title, or tab-separated lines whose last field is
            the item id and whose second to last is the title (as the Amazon Industrial
            ``SID<TAB>title<TAB>item_id`` file).

    Returns:
        item id -> title, only for items of the catalog.

    Raises:
        XgrError: an unreadable file, a title that is not a string, or a line with fewer
            than two fields.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise XgrError(f"cannot read titles {path}: {exc}") from exc
    titles: dict[str, str] = {}
    if path.suffix.lower() == ".json":
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise XgrError(f"titles {path}: not JSON: {exc}") from None
        if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
            raise XgrError(f"titles {path} must be a JSON object of item id -> title string")
        titles = {str(k): v for k, v in raw.items()}
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            fields = line.split("\t")
            if len(fields) < 2:
                raise XgrError(f"{path}:{number}: expected '...<TAB>title<TAB>item_id'")
            titles[fields[-1].strip()] = fields[-2].strip()
    return {item: title for item, title in titles.items() if item in catalog.item_index}
