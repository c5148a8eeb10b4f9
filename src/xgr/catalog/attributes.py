"""Item attributes loaded with a catalog, and the per-request filters over them.

A table keyed by item id (CSV with a header, or JSON lines) gives each item values of typed
columns: string, integer, float or boolean. A filter is a JSON object of conditions on those
columns, combined by AND::

    {"category": {"in": ["Tools", "Lab"]}, "in_stock": true, "price": {"lt": 50}}

A condition is a value (equality), or an object of operators: ``in`` / ``not_in`` (a list of
values) and, for numeric columns, ``lt`` / ``le`` / ``gt`` / ``ge`` (a number); several
operators in one object are combined by AND. An item without a value in a column passes no
condition on it except ``not_in``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xgr.core import XgrError

KINDS = ("string", "int", "float", "bool")
OPERATORS = ("in", "not_in", "lt", "le", "gt", "ge")
_ORDERED = ("lt", "le", "gt", "ge")
_TRUE, _FALSE = {"true", "True", "TRUE", "1"}, {"false", "False", "FALSE", "0"}


@dataclass(frozen=True)
class Column:
    """One attribute of every catalog item, in catalog order.

    Attributes:
        kind: "string", "int", "float" or "bool".
        values: (num_items,) values: int64 category codes for strings (into ``vocabulary``),
            int64, float64 or bool; arbitrary where ``present`` is False.
        present: (num_items,) bool, whether the item has a value.
        vocabulary: the distinct strings of a string column, by code; empty otherwise.
    """

    kind: str
    values: np.ndarray
    present: np.ndarray
    vocabulary: tuple[str, ...] = ()


class ItemAttributes:
    """Typed attribute columns of a catalog's items.

    Args:
        columns: name -> ``Column``, each of the catalog's length.
    """

    def __init__(self, columns: dict[str, Column]) -> None:
        self.columns = columns
        self._codes = {
            name: {s: i for i, s in enumerate(c.vocabulary)}
            for name, c in columns.items()
            if c.kind == "string"
        }
        self._device: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def kinds(self) -> dict[str, str]:
        """Attribute name -> kind."""
        return {name: c.kind for name, c in self.columns.items()}

    def code_of(self, name: str, value: str) -> int:
        """A string column's code of ``value``; -1 when no item has it."""
        return self._codes[name].get(value, -1)

    def on_device(self, name: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, present) of a column on ``device``, copied once."""
        key = str(device)
        cache = self._device.setdefault(key, {})
        if name not in cache:
            column = self.columns[name]
            cache[name] = (
                torch.from_numpy(column.values).to(device),
                torch.from_numpy(column.present).to(device),
            )
        return cache[name]


def load_attributes(path: str | Path, item_index: dict[str, int]) -> ItemAttributes:
    """Read an attribute table keyed by item id.

    Args:
        path: a ``.csv`` file with a header whose first column is the item id, or a JSON-lines
            file (``.jsonl`` / ``.ndjson``) of objects each holding ``"item_id"``.
        item_index: the catalog's item id -> row.

    A CSV column's kind is the narrowest that reads every non-empty cell: bool
    (true/false/1/0... only if not all are integers), int, float, else string; an empty cell
    is a missing value. A JSON-lines column takes its values' JSON types (integers and
    floats together are float; null is missing). Rows of items not in the catalog are
    ignored.

    Raises:
        XgrError: an unreadable file, a missing or repeated item id, a JSON value of another
            type than the column's others (or a list or object), a non-finite number.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise XgrError(f"cannot read item attributes {path}: {exc}") from exc
    names: list[str] = []
    if path.suffix.lower() == ".csv":
        rows = _csv_rows(text, path, names)
    elif path.suffix.lower() in (".jsonl", ".ndjson"):
        rows = _jsonl_rows(text, path)
    else:
        raise XgrError(f"item attributes {path}: expected a .csv or .jsonl file")
    raw: dict[str, dict[int, Any]] = {}
    seen: set[str] = set()
    try:
        read = list(rows)
    except csv.Error as exc:
        raise XgrError(f"item attributes {path}: {exc}") from exc
    for name in names:  # a CSV column without values is still a column
        raw.setdefault(name, {})
    for item_id, values in read:
        if item_id in seen:
            raise XgrError(f"item attributes {path}: item {item_id!r} appears twice")
        seen.add(item_id)
        row = item_index.get(item_id)
        if row is None:
            continue
        for name, value in values.items():
            if value is not None:
                raw.setdefault(name, {})[row] = value
    columns = {name: _column(name, cells, len(item_index), path) for name, cells in raw.items()}
    return ItemAttributes(columns)


def _csv_rows(text: str, path: Path, names_out: list[str]):
    # The reader splits the rows itself: quoted cells may hold line breaks.
    reader = csv.reader(io.StringIO(text.removeprefix("\ufeff"), newline=""))
    header = next(reader, None)
    if not header or len(header) < 2:
        raise XgrError(f"item attributes {path}: a header of the item id and attributes is needed")
    names = header[1:]
    if len(set(names)) != len(names) or "" in names:
        raise XgrError(f"item attributes {path}: column names must be distinct and non-empty")
    names_out.extend(names)
    for line, cells in enumerate(reader, start=2):
        if not cells:
            continue
        if len(cells) != len(header):
            raise XgrError(
                f"item attributes {path}, line {line}: {len(cells)} cells, the header has "
                f"{len(header)}"
            )
        yield cells[0], {n: (c if c != "" else None) for n, c in zip(names, cells[1:], strict=True)}


def _jsonl_rows(text: str, path: Path):
    # Lines end at "\n" only: JSON strings may hold other line separators (U+2028).
    for line, entry in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        if not entry.strip():
            continue
        try:
            obj = json.loads(entry)
        except ValueError as exc:
            raise XgrError(f"item attributes {path}, line {line}: {exc}") from exc
        item = obj.get("item_id") if isinstance(obj, dict) else None
        if isinstance(item, bool) or not isinstance(item, str | int):
            raise XgrError(f"item attributes {path}, line {line}: an object with an item_id")
        item_id = str(obj.pop("item_id"))
        for name, value in obj.items():
            if isinstance(value, list | dict):
                raise XgrError(
                    f"item attributes {path}, line {line}: {name!r} must be a string, number "
                    "or boolean"
                )
        yield item_id, obj


def _csv_kind(cells: list[str]) -> str:
    def all_parse(parse) -> bool:
        try:
            for cell in cells:
                parse(cell)
        except ValueError:
            return False
        return True

    if all_parse(int):
        return "int"
    if all(c in _TRUE or c in _FALSE for c in cells):
        return "bool"
    if all_parse(float):
        return "float"
    return "string"


def _json_kind(values: list[Any], name: str, path: Path) -> str:
    kinds = set()
    for value in values:
        if isinstance(value, bool):
            kinds.add("bool")
        elif isinstance(value, int):
            kinds.add("int")
        elif isinstance(value, float):
            kinds.add("float")
        else:
            kinds.add("string")
    if kinds <= {"int", "float"}:
        return "float" if "float" in kinds else "int"
    if len(kinds) > 1:
        raise XgrError(f"item attributes {path}: {name!r} mixes {sorted(kinds)} values")
    return kinds.pop()


def _column(name: str, cells: dict[int, Any], num_items: int, path: Path) -> Column:
    rows = np.fromiter(cells, dtype=np.int64, count=len(cells))
    values = list(cells.values())
    if not values:  # no item has a value: a string column that no equality matches
        return Column("string", np.full(num_items, -1, dtype=np.int64),
                      np.zeros(num_items, dtype=bool))  # fmt: skip
    from_csv = all(isinstance(v, str) for v in values) and path.suffix.lower() == ".csv"
    kind = _csv_kind(values) if from_csv else _json_kind(values, name, path)
    present = np.zeros(num_items, dtype=bool)
    present[rows] = True
    vocabulary: tuple[str, ...] = ()
    if kind == "string":
        vocabulary = tuple(sorted({str(v) for v in values}))
        codes = {s: i for i, s in enumerate(vocabulary)}
        column = np.full(num_items, -1, dtype=np.int64)
        column[rows] = [codes[str(v)] for v in values]
    elif kind == "bool":
        column = np.zeros(num_items, dtype=bool)
        column[rows] = [v if isinstance(v, bool) else v in _TRUE for v in values]
    elif kind == "int":
        column = np.zeros(num_items, dtype=np.int64)
        try:
            column[rows] = [int(v) for v in values]
        except OverflowError as exc:
            raise XgrError(f"item attributes {path}: {name!r} holds an integer too large") from exc
    else:
        column = np.zeros(num_items, dtype=np.float64)
        try:
            column[rows] = [float(v) for v in values]
        except OverflowError as exc:
            raise XgrError(f"item attributes {path}: {name!r} holds a number too large") from exc
        if not np.isfinite(column[rows]).all():
            raise XgrError(f"item attributes {path}: {name!r} holds a non-finite number")
    return Column(kind, column, present, vocabulary)


@dataclass(frozen=True)
class Condition:
    """One operator on one column, its values already in the column's encoding.

    Attributes:
        name: the column.
        op: "eq", "in", "not_in", "lt", "le", "gt" or "ge".
        values: the operand(s): category codes for string columns (-1: no item has it).
    """

    name: str
    op: str
    values: tuple[Any, ...]


@dataclass(frozen=True)
class ItemFilter:
    """A compiled filter (``compile_filter``): conditions combined by AND."""

    conditions: tuple[Condition, ...]

    def mask(self, attributes: ItemAttributes, device: torch.device) -> torch.Tensor | None:
        """(num_items,) bool on ``device``: the items passing every condition; None for a
        filter without conditions (every item passes)."""
        out = None
        for cond in self.conditions:
            values, present = attributes.on_device(cond.name, device)
            passed = _apply(cond, values, present, torch)
            out = passed if out is None else out & passed
        return out

    def passes(self, attributes: ItemAttributes, rows: np.ndarray) -> np.ndarray:
        """(len(rows),) bool: whether the items of these catalog rows pass (on the host)."""
        out = np.ones(len(rows), dtype=bool)
        for cond in self.conditions:
            column = attributes.columns[cond.name]
            out &= _apply(cond, column.values[rows], column.present[rows], np)
        return out


def _apply(cond: Condition, values, present, xp):
    """A condition over (values, present) arrays of NumPy or torch (``xp``)."""
    if cond.op in ("in", "not_in", "eq"):
        if values.dtype in (torch.bool, np.bool_):
            member = values != values  # all False, of the values' array type
            for value in set(cond.values):
                member = member | (values == value)
        else:
            if xp is torch:
                operand = torch.tensor(cond.values, dtype=values.dtype)
                if values.is_cuda:  # pinned: queued without waiting for the stream's work
                    operand = operand.pin_memory().to(values.device, non_blocking=True)
            else:
                operand = np.asarray(cond.values, dtype=values.dtype)
            member = xp.isin(values, operand)
        member = member & present
        return ~member if cond.op == "not_in" else member
    bound = cond.values[0]
    compare = {"lt": values < bound, "le": values <= bound, "gt": values > bound,
               "ge": values >= bound}[cond.op]  # fmt: skip
    return compare & present


def compile_filter(spec: Any, attributes: ItemAttributes | None) -> ItemFilter:
    """Check a filter against the catalog's attributes and encode its values.

    Args:
        spec: the filter, a dict of attribute -> value or {operator: operand}.
        attributes: the catalog's (None: the catalog has no attributes).

    Raises:
        XgrError: not a dict; an unknown attribute or operator; a value of the wrong type for
            its column (a string for a numeric one, a fraction for an integer one, a
            non-finite number, an ordering on a string or boolean column); an empty operator
            object.
    """
    if not isinstance(spec, dict):
        raise XgrError(f"item_filter must be an object of attribute conditions, got {spec!r}")
    kinds = attributes.kinds if attributes is not None else {}
    conditions = []
    for name, condition in spec.items():
        if name not in kinds:
            known = ", ".join(sorted(kinds)) or "none"
            raise XgrError(f"unknown item attribute {name!r} (the catalog's: {known})")
        kind = kinds[name]
        if isinstance(condition, dict):
            if not condition:
                raise XgrError(f"attribute {name!r}: an empty condition object")
            for op, operand in condition.items():
                if op not in OPERATORS:
                    raise XgrError(
                        f"attribute {name!r}: unknown operator {op!r} (use {', '.join(OPERATORS)})"
                    )
                conditions.append(_condition(name, kind, op, operand, attributes))
        else:
            conditions.append(_condition(name, kind, "eq", condition, attributes))
    return ItemFilter(tuple(conditions))


def _condition(name: str, kind: str, op: str, operand: Any, attributes) -> Condition:
    operand = _plain(operand)
    if op in ("in", "not_in"):
        if isinstance(operand, list | tuple):
            operand = [_plain(v) for v in operand]
        if not isinstance(operand, list):
            raise XgrError(f"attribute {name!r}: {op!r} takes a list of values")
        values = tuple(_encode(name, kind, v, attributes) for v in operand)
    elif op in _ORDERED:
        if kind not in ("int", "float"):
            raise XgrError(f"attribute {name!r} is {kind}: {op!r} needs a numeric attribute")
        if isinstance(operand, bool) or not isinstance(operand, int | float):
            raise XgrError(f"attribute {name!r}: {op!r} takes a number, got {operand!r}")
        if isinstance(operand, float) and not math.isfinite(operand):
            raise XgrError(f"attribute {name!r}: {op!r} takes a finite number")
        if kind == "int" and isinstance(operand, float):
            # Exact on integers: v < 2.5 is v <= 2, v >= 2.5 is v >= 3 (no float64 rounding).
            if operand.is_integer():
                operand = int(operand)
            elif op in ("lt", "le"):
                op, operand = "le", math.floor(operand)
            else:
                op, operand = "ge", math.ceil(operand)
        if kind == "int":
            op, operand = _int64_bound(op, operand)
        else:
            operand = _as_float(name, operand)
        values = (operand,)
    else:
        values = (_encode(name, kind, operand, attributes),)
    return Condition(name, op, values)


def _plain(value: Any) -> Any:
    """NumPy scalars as the Python values they hold."""
    return value.item() if isinstance(value, np.generic) else value


def encode_value(name: str, kind: str, value: Any, codes: dict[str, int]) -> Any:
    """An item's new value of a column as stored: a string's code in ``codes`` (string ->
    code, in code order; a new string gets the next code), or the number or bool itself,
    type-checked.

    Raises:
        XgrError: a value of another type than the column's, a non-finite float, or an
            integer outside 64 bits.
    """
    value = _plain(value)
    if kind != "string":
        return _number_or_bool(name, kind, value)
    _check_string(name, value)
    return codes.setdefault(value, len(codes))


def _encode(name: str, kind: str, value: Any, attributes: ItemAttributes) -> Any:
    """One operand in the column's encoding, type-checked."""
    if kind != "string":
        return _number_or_bool(name, kind, value)
    _check_string(name, value)
    return attributes.code_of(name, value)


def _check_string(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise XgrError(f"attribute {name!r} is a string: got {_short(value)}")


def _number_or_bool(name: str, kind: str, value: Any) -> Any:
    """A value of a numeric or boolean column, type-checked: a bool, a finite float, or an
    integer within 64 bits (an integral float taken as one)."""
    if kind == "bool":
        if not isinstance(value, bool):
            raise XgrError(f"attribute {name!r} is a boolean: got {_short(value)}")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise XgrError(f"attribute {name!r} is a number ({kind}): got {_short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise XgrError(f"attribute {name!r}: {value!r} is not a finite number")
    if kind == "float":
        return _as_float(name, value)
    if isinstance(value, float):
        if not value.is_integer():
            raise XgrError(f"attribute {name!r} is an integer: got {value!r}")
        value = int(value)
    if not INT64_MIN <= value <= INT64_MAX:
        raise XgrError(
            f"attribute {name!r} is a 64-bit integer: {_short(value)} is outside its range"
        )
    return value


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _int64_bound(op: str, bound: int) -> tuple[str, int]:
    """An integer bound beyond the 64-bit range as the in-range one that passes the same
    items (every int64 value is below a larger bound and above a smaller one)."""
    if bound > INT64_MAX:
        return ("le", INT64_MAX) if op in ("lt", "le") else ("gt", INT64_MAX)
    if bound < INT64_MIN:
        return ("lt", INT64_MIN) if op in ("lt", "le") else ("ge", INT64_MIN)
    return op, bound


def _as_float(name: str, value: int | float) -> float:
    """A number as a float64 operand (an integer too large for one is refused)."""
    try:
        return float(value)
    except OverflowError:
        raise XgrError(f"attribute {name!r}: {_short(value)} is beyond the float64 range") from None


def _short(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (a 4,000-digit number is not echoed)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 4000 else "a huge int"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
