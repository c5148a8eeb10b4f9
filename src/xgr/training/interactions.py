"""Interaction data for training and offline evaluation, in three file formats.

- Amazon ``.txt`` (the TIGER benchmarks): one line per user, ``user_id item_id item_id ...``,
  items in time order, separated by whitespace.
- MiniOneRec ``.csv``: a header with at least ``user_id``, ``history_item_id`` (a Python or
  JSON list literal) and ``item_id``; each row is one held-out case, its history then the
  next item, rows of a user in time order.
- JSON lines (``.jsonl``): each line an object, either a user's sequence
  ``{"user_id": "u1", "items": ["i1", "i2", ...]}`` or a held-out case
  ``{"user_id": "u1", "history": ["i1", ...], "item": "i2"}`` (``user_id`` optional).

Sequences are split leave-one-out (TIGER, Rajput et al. 2023; SASRec, Kang & McAuley
2018): a user's last item is the test target, the second to last the validation target,
and training sees every item before them. Users with fewer than three items are trained on
whole and held out nowhere. Held-out cases (the CSV's rows) are used as given: training on
such a file reads each user's rows as one sequence (the first row's history, then every
row's item), and evaluating on it asks each row's item from its history.
"""

from __future__ import annotations

import ast
import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from xgr.core import XgrError

FORMATS = {".txt": "amazon", ".csv": "csv", ".jsonl": "jsonl"}
CSV_COLUMNS = ("user_id", "history_item_id", "item_id")


@dataclass(frozen=True)
class HeldOut:
    """Cases to predict: per case a user, the history (item ids, oldest first) and the item
    that came next."""

    users: tuple[str, ...]
    histories: tuple[tuple[str, ...], ...]
    targets: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.targets)

    def head(self, count: int | None) -> HeldOut:
        """The first ``count`` cases (None: all)."""
        if count is None:
            return self
        return HeldOut(self.users[:count], self.histories[:count], self.targets[:count])


@dataclass(frozen=True)
class Interactions:
    """One interaction file, split for training and evaluation.

    Attributes:
        path: the file read.
        format: "amazon", "csv" or "jsonl".
        train: per user, the item ids training sees, in time order.
        valid: the validation cases (leave-one-out's second to last items), or None when the
            file gives held-out cases itself.
        test: the test cases (the last items, or the file's rows).
        item_ids: every item id the file names, in order of first appearance.
    """

    path: Path
    format: str
    train: tuple[tuple[str, ...], ...]
    valid: HeldOut | None
    test: HeldOut
    item_ids: tuple[str, ...]

    def split(self, name: str) -> HeldOut:
        """The held-out cases ``name`` ("test" or "valid").

        Raises:
            XgrError: an unknown name, or "valid" for a file of held-out rows.
        """
        if name == "test":
            return self.test
        if name == "valid":
            if self.valid is None:
                raise XgrError(
                    f"{self.path} holds held-out rows, not sequences: it has no validation "
                    "split (evaluate it with --split test)"
                )
            return self.valid
        raise XgrError(f"unknown split {name!r}: use 'test' or 'valid'")


def read_interactions(path: str | Path) -> Interactions:
    """Read and split an interaction file (format by suffix; see the module docstring).

    Raises:
        XgrError: an unknown suffix, an unreadable or malformed file (the line named), or a
            file without any interaction.
    """
    path = Path(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise XgrError(
            f"{path}: unknown interaction format {path.suffix!r}; use .txt (Amazon: user then "
            "items per line), .csv (MiniOneRec) or .jsonl"
        )
    try:
        with path.open(encoding="utf-8-sig", newline="") as handle:
            if kind == "amazon":
                return _from_sequences(path, kind, _amazon(handle, path))
            if kind == "csv":
                return _from_cases(path, kind, _csv_rows(handle, path))
            return _jsonl(handle, path)
    except OSError as exc:
        raise XgrError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise XgrError(f"{path} is not UTF-8 text: {exc}") from exc


def leave_one_out(
    sequences: Sequence[tuple[str, Sequence[str]]],
) -> tuple[list[tuple[str, ...]], HeldOut, HeldOut]:
    """Split (user, items) sequences into training sequences, validation and test cases.

    Returns:
        the training sequences (every item but the last two; whole for users with fewer than
        three items), the validation cases (history: the training items, target: the second
        to last item) and the test cases (history: every item but the last).
    """
    train, valid, test = [], ([], [], []), ([], [], [])
    for user, items in sequences:
        items = tuple(items)
        if len(items) < 3:
            train.append(items)
            continue
        train.append(items[:-2])
        for cases, cut in ((valid, len(items) - 2), (test, len(items) - 1)):
            cases[0].append(user)
            cases[1].append(items[:cut])
            cases[2].append(items[cut])
    return train, _held_out(*valid), _held_out(*test)


def _held_out(users, histories, targets) -> HeldOut:
    return HeldOut(tuple(users), tuple(histories), tuple(targets))


def _from_sequences(path: Path, kind: str, sequences: list[tuple[str, list[str]]]) -> Interactions:
    if not any(items for _, items in sequences):
        raise XgrError(f"{path} holds no interactions")
    train, valid, test = leave_one_out(sequences)
    if not len(test):
        raise XgrError(f"{path}: no user has three items, so nothing is held out for testing")
    items = dict.fromkeys(item for _, seq in sequences for item in seq)
    return Interactions(path, kind, tuple(train), valid, test, tuple(items))


def _from_cases(path: Path, kind: str, cases: list[tuple[str, list[str], str]]) -> Interactions:
    if not cases:
        raise XgrError(f"{path} holds no rows")
    sequences: dict[str, list[str]] = {}
    for user, history, target in cases:
        sequence = sequences.setdefault(user, list(history))
        sequence.append(target)
    items = dict.fromkeys(i for _, history, target in cases for i in (*history, target))
    test = _held_out(*zip(*((u, tuple(h), t) for u, h, t in cases), strict=True))
    return Interactions(path, kind, tuple(map(tuple, sequences.values())), None, test, tuple(items))


def _amazon(handle, path: Path) -> list[tuple[str, list[str]]]:
    sequences = []
    for number, line in enumerate(handle, 1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) < 2:
            raise XgrError(f"{path}:{number}: a user id and at least one item id expected")
        sequences.append((fields[0], fields[1:]))
    return sequences


def _csv_rows(handle, path: Path) -> list[tuple[str, list[str], str]]:
    csv.field_size_limit(min(sys.maxsize, 1 << 31 - 1))  # long histories are long cells
    reader = csv.DictReader(handle)
    missing = [c for c in CSV_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise XgrError(
            f"{path}: the CSV header lacks {', '.join(missing)} (has {reader.fieldnames})"
        )
    rows = []
    try:
        for row in reader:
            where = f"{path}:{reader.line_num}"
            history = _list_cell(row["history_item_id"], where)
            target = (row["item_id"] or "").strip()
            if not target:
                raise XgrError(f"{where}: empty item_id")
            rows.append((str(row["user_id"]), history, target))
    except csv.Error as exc:
        raise XgrError(f"{path}:{reader.line_num}: malformed CSV: {exc}") from exc
    return rows


def _list_cell(text: str | None, where: str) -> list[str]:
    try:
        value = ast.literal_eval((text or "").strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if not isinstance(value, list | tuple):
        raise XgrError(f"{where}: history_item_id must be a list literal like [1, 2], got {text!r}")
    return [_item_id(v, where) for v in value]


def _item_id(value, where: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise XgrError(f"{where}: item ids must be strings or integers, got {value!r}")
    text = str(value).strip()
    if not text:
        raise XgrError(f"{where}: an empty item id")
    return text


def _jsonl(handle, path: Path) -> Interactions:
    sequences, cases = [], []
    for number, line in enumerate(handle, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise XgrError(f"{where}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise XgrError(f"{where}: each line must be a JSON object")
        user = str(row.get("user_id", number))
        if "items" in row:
            items = row["items"]
            if not isinstance(items, list) or not items:
                raise XgrError(f"{where}: 'items' must be a non-empty list of item ids")
            sequences.append((user, [_item_id(i, where) for i in items]))
        elif "history" in row and "item" in row:
            history = row["history"]
            if not isinstance(history, list):
                raise XgrError(f"{where}: 'history' must be a list of item ids")
            cases.append(
                (user, [_item_id(i, where) for i in history], _item_id(row["item"], where))
            )
        else:
            raise XgrError(f"{where}: expected 'items', or 'history' and 'item'")
    if sequences and cases:
        raise XgrError(f"{path} mixes sequences ('items') and held-out rows ('history'): use one")
    if cases:
        return _from_cases(path, "jsonl", cases)
    return _from_sequences(path, "jsonl", sequences)
