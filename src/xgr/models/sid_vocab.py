"""The map from semantic-ID codes to vocabulary token ids."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from xgr.catalog import ItemCatalog
from xgr.core import XgrError, read_json

_CODE_TOKEN = re.compile(r"<([a-z])_\d+>")
_CODE_LEVEL = re.compile(r"[a-z]")


def tokenizer_vocab(model_dir: str | Path) -> dict[str, int]:
    """Token string -> id from a HF folder's ``tokenizer.json`` and ``tokenizer_config.json``.

    Reads the model vocabulary (when it is a dict), the added tokens and
    ``added_tokens_decoder``; returns an empty dict when the folder has no tokenizer files.
    """
    vocab: dict[str, int] = {}
    model_dir = Path(model_dir)
    tok_file = model_dir / "tokenizer.json"
    cfg_file = model_dir / "tokenizer_config.json"
    path = tok_file
    try:
        if tok_file.exists():
            data = read_json(tok_file)
            model_vocab = (data.get("model") or {}).get("vocab")
            if isinstance(model_vocab, dict):
                vocab.update(model_vocab)
            vocab.update({t["content"]: t["id"] for t in data.get("added_tokens", [])})
        path = cfg_file
        if cfg_file.exists():
            decoder = read_json(cfg_file).get("added_tokens_decoder", {})
            vocab.update({t["content"]: int(i) for i, t in decoder.items()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise XgrError(f"cannot read the tokenizer's {path}: {exc!r}") from exc
    return vocab


def sid_token_ids_from_tokenizer(model_dir: str | Path, catalog: ItemCatalog) -> np.ndarray:
    """Find each code's token id by its name (``<a_12>``) in the folder's tokenizer.

    Returns:
        (num_levels, codebook_size) int64; -1 for codes the tokenizer lacks and no item uses.

    Raises:
        XgrError: no tokenizer in the folder, or a code used by the catalog has no token.
    """
    vocab = tokenizer_vocab(model_dir)
    if not vocab:
        raise XgrError(
            f"{model_dir} has no tokenizer to find the semantic-ID tokens in; pass sid_token_ids"
        )
    # Codes named <letter_n>: the tokenizer's levels must be the catalog's (a catalog with a
    # level missing would decode with the wrong tokens and rank nonsense).
    letters = sorted({m[1] for t in vocab if (m := _CODE_TOKEN.fullmatch(t))})
    # Checked only where both name levels a, b, c, ... (other names are another scheme).
    as_levels = letters == [chr(ord("a") + i) for i in range(len(letters))]
    if as_levels and letters and all(_CODE_LEVEL.fullmatch(n) for n in catalog.level_names):
        if letters != sorted(catalog.level_names):
            raise XgrError(
                f"the tokenizer has codes of levels {', '.join(letters)}, but the catalog's "
                f"levels are {', '.join(catalog.level_names)}: is this catalog the model's?"
            )
    table = np.full((catalog.num_levels, catalog.codebook_size), -1, dtype=np.int64)
    for level, letter in enumerate(catalog.level_names):
        for code in range(catalog.codebook_size):
            table[level, code] = vocab.get(f"<{letter}_{code}>", -1)
    return table


def validate_sid_token_ids(table: Any, catalog: ItemCatalog, vocab_size: int) -> np.ndarray:
    """Check a code -> token id map against the catalog and the model's vocabulary.

    Args:
        table: int array-like (num_levels, codebook_size) of token ids (-1 for unused codes).
        catalog: the catalog served.
        vocab_size: the model's vocabulary size.

    Returns:
        The table as (num_levels, codebook_size) int64; unused codes that map to the token
        of a used code of their level are given -1.

    Raises:
        XgrError: not integers; levels differ from the catalog's; the codebook is smaller
            than the catalog's; a code used by the catalog maps outside the vocabulary; or
            two codes of one level used by the catalog map to one token (their scores could
            not be told apart).
    """
    raw = np.asarray(table)
    if raw.ndim != 2 or raw.shape[0] != catalog.num_levels:
        raise XgrError(
            f"sid_token_ids has shape {raw.shape}; the catalog has {catalog.num_levels} levels"
        )
    if raw.shape[1] < catalog.codebook_size:
        raise XgrError(
            f"sid_token_ids covers {raw.shape[1]} codes per level; the catalog uses codes up to "
            f"{catalog.codebook_size - 1}"
        )
    if raw.dtype.kind not in "iu":
        raise XgrError(f"sid_token_ids must hold integer token ids, got dtype {raw.dtype}")
    table = raw.astype(np.int64)
    used = np.zeros(table.shape, dtype=bool)
    for level in range(catalog.num_levels):
        used[level, np.unique(catalog.codes[:, level])] = True
    bad = used & ((table < 0) | (table >= vocab_size))
    if bad.any():
        level, code = (int(i) for i in np.argwhere(bad)[0])
        name = f"<{catalog.level_names[level]}_{code}>"
        if table[level, code] < 0:
            raise XgrError(
                f"the catalog uses code {code} of level {level}, but the tokenizer has no "
                f"{name} token (is this catalog the model's?)"
            )
        raise XgrError(
            f"code {code} of level {level} ({name}) maps to token id "
            f"{int(table[level, code])}, outside the vocabulary of {vocab_size}"
        )
    for level in range(catalog.num_levels):
        codes = np.flatnonzero(used[level])
        tokens, counts = np.unique(table[level, codes], return_counts=True)
        if (counts > 1).any():
            token = int(tokens[counts > 1][0])
            a, b = codes[table[level, codes] == token][:2]
            raise XgrError(
                f"codes {a} and {b} of level {level} both map to token id {token}: each code "
                "needs its own token"
            )
        # An unused code on a used code's token would take that token's place in the
        # level's normalizer (the first code of a token counts); it can never be chosen.
        shared = ~used[level] & np.isin(table[level], table[level, codes])
        table[level, shared] = -1
    return table
