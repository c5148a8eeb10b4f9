"""MovieLens-100K, read from the copy shipped inside the ``recbole==1.2.1`` wheel.

The wheel is fetched once with pip (the only way this package reaches the network), the two
files used (``ml-100k.inter`` and ``ml-100k.item``) are copied into a cache folder, and later
calls read them from there. All 100,000 ratings are used as implicit feedback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from xgr.core import XgrError

RECBOLE_REQUIREMENT = "recbole==1.2.1"
_WHEEL_DIR = "recbole/dataset_example/ml-100k/"
INTERACTIONS_FILE = "ml-100k.inter"
ITEMS_FILE = "ml-100k.item"
_INTER_HEADER = ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
_ITEM_HEADER = ["item_id:token", "movie_title:token_seq", "release_year:token", "class:token_seq"]


@dataclass(frozen=True)
class MovieLensData:
    """Interactions and titles of MovieLens-100K.

    Attributes:
        sequences: user id -> the user's item ids in time order (oldest first; ratings with
            the same timestamp keep the file's order).
        titles: item id -> ``"Title (Year)"``, or just the title when the year is unknown.
        item_ids: every item id of the item file, in file order.
    """

    sequences: dict[str, list[str]]
    titles: dict[str, str]
    item_ids: list[str]


@dataclass(frozen=True)
class LeaveOneOut:
    """The leave-one-out split: each user's last item is held out.

    Attributes:
        users: user ids, in the order of ``MovieLensData.sequences``.
        histories: per user, every item before the held-out one (time order); these are
            also the training sequences.
        targets: per user, the held-out last item.
    """

    users: list[str]
    histories: list[list[str]]
    targets: list[str]


def load_movielens(cache_dir: str | Path) -> MovieLensData:
    """Load MovieLens-100K, downloading it into ``cache_dir`` on first use.

    Args:
        cache_dir: folder holding ``ml-100k/ml-100k.inter`` and ``ml-100k/ml-100k.item``;
            created and filled from the recbole wheel when they are missing.

    Returns:
        the parsed data (943 users, 1682 items, 100,000 interactions).

    Raises:
        XgrError: the download failed, or a file is not in the expected format.
    """
    inter_path, item_path = ensure_movielens_files(cache_dir)
    titles = parse_items(_read_text(item_path))
    sequences = parse_interactions(_read_text(inter_path))
    unknown = {i for seq in sequences.values() for i in seq} - titles.keys()
    if unknown:
        raise XgrError(f"{inter_path}: item ids missing from {item_path}: {sorted(unknown)[:5]}")
    return MovieLensData(sequences=sequences, titles=titles, item_ids=list(titles))


def leave_one_out(data: MovieLensData) -> LeaveOneOut:
    """Hold out each user's last item; users with fewer than 2 items are skipped."""
    users, histories, targets = [], [], []
    for user, seq in data.sequences.items():
        if len(seq) >= 2:
            users.append(user)
            histories.append(seq[:-1])
            targets.append(seq[-1])
    return LeaveOneOut(users=users, histories=histories, targets=targets)


def ensure_movielens_files(cache_dir: str | Path) -> tuple[Path, Path]:
    """Paths of the cached interaction and item files, fetching them if missing.

    Raises:
        XgrError: pip could not download the wheel, or the wheel lacks the files.
    """
    folder = Path(cache_dir) / "ml-100k"
    paths = (folder / INTERACTIONS_FILE, folder / ITEMS_FILE)
    if all(p.is_file() for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="xgr-recbole-") as tmp:
        wheel = _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel) as archive:
            for path in paths:
                try:
                    content = archive.read(_WHEEL_DIR + path.name)
                except KeyError as exc:
                    raise XgrError(f"{wheel.name} has no {_WHEEL_DIR + path.name}") from exc
                # Write then rename, so an interrupted copy is never taken for a full file.
                partial = path.with_name(path.name + ".partial")
                partial.write_bytes(content)
                os.replace(partial, path)
    return paths


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", RECBOLE_REQUIREMENT, "--no-deps"]
    cmd += ["--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise XgrError(_download_help(str(exc))) from exc
    wheels = sorted(dest.glob("recbole-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise XgrError(_download_help(" | ".join(tail) or f"pip exited with {proc.returncode}"))
    return wheels[0]


def _download_help(reason: str) -> str:
    return (
        f"could not download MovieLens-100K (from the {RECBOLE_REQUIREMENT} wheel on PyPI): "
        f"{reason}. Check that `{sys.executable} -m pip download {RECBOLE_REQUIREMENT} "
        "--no-deps` works here (network access to PyPI or a configured index), or copy "
        f"{INTERACTIONS_FILE} and {ITEMS_FILE} from that wheel's {_WHEEL_DIR} into "
        "<cache_dir>/ml-100k/."
    )


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # The original GroupLens files are latin-1; recbole re-encoded them, but be lenient.
        return raw.decode("latin-1")


def parse_interactions(text: str) -> dict[str, list[str]]:
    """Parse an atomic ``.inter`` file into time-ordered item sequences per user.

    Args:
        text: tab-separated lines, header ``user_id:token item_id:token rating:float
            timestamp:float``; timestamps are seconds (float).

    Returns:
        user id -> item ids sorted by timestamp, ties in file order (a stable sort); users
        are in natural order (numeric ids by value).

    Raises:
        XgrError: wrong header, a short line or a non-numeric timestamp.
    """
    lines = text.splitlines()
    _check_header(lines, _INTER_HEADER, INTERACTIONS_FILE)
    events: dict[str, list[tuple[float, str]]] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 4:
            raise XgrError(f"{INTERACTIONS_FILE} line {lineno}: expected 4 fields, got {line!r}")
        try:
            stamp = float(fields[3])
        except ValueError as exc:
            raise XgrError(
                f"{INTERACTIONS_FILE} line {lineno}: bad timestamp {fields[3]!r}"
            ) from exc
        events.setdefault(fields[0], []).append((stamp, fields[1]))
    return {
        user: [item for _, item in sorted(events[user], key=lambda e: e[0])]
        for user in sorted(events, key=natural_key)
    }


def parse_items(text: str) -> dict[str, str]:
    """Parse an atomic ``.item`` file into display titles.

    Returns:
        item id -> ``"Title (Year)"`` (``"Godfather, The (1972)"``) in file order; the year
        is left out when the year field is not a number.

    Raises:
        XgrError: wrong header or a short line.
    """
    lines = text.splitlines()
    _check_header(lines, _ITEM_HEADER, ITEMS_FILE)
    titles: dict[str, str] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 3:
            raise XgrError(f"{ITEMS_FILE} line {lineno}: expected 4 fields, got {line!r}")
        title, year = fields[1].strip(), fields[2].strip()
        titles[fields[0]] = f"{title} ({year})" if year.isdigit() else title
    return titles


def _check_header(lines: list[str], expected: list[str], name: str) -> None:
    header = lines[0].split("\t") if lines else []
    if header[: len(expected)] != expected:
        raise XgrError(f"{name}: expected header {expected}, got {header}")


def natural_key(value: str) -> tuple[int, int, str]:
    """Sort key putting numeric strings first, by value, then the rest alphabetically."""
    return (0, int(value), "") if value.isdigit() else (1, 0, value)
