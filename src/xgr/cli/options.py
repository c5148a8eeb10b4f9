"""The ``xgr`` command's shared options: where the model comes from (``ModelSource``), the
engine options every command takes, and the checks on output files."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from pathlib import Path

import click

from xgr.core import CATALOG_NAME, DEFAULT_CATALOG, XgrError
from xgr.demo.config import ARCHITECTURES, DEFAULT_ARCH
from xgr.models.quantize import QUANTIZATIONS

DEFAULT_CACHE = Path("~/.cache/xgr/demo")


# File types the latency plot can be written as (matplotlib picks the format by suffix).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def check_writable(path: Path, option: str, source: ModelSource) -> None:
    """Refuse an output file that cannot be written, or that lies among the model's own
    files (``refuse_inside_data``), before the work that would fill it.

    A file this check creates is removed again; through a symbolic link, the link's target
    is what is checked (and removed if created), the link is left alone.

    Raises:
        click.UsageError: inside the model's data, no such folder, or the file cannot be
            opened for writing.
    """
    refuse_inside_data(path, option, source)
    target = Path(os.path.realpath(path))  # never raises, unlike Path.resolve on a loop
    if not target.parent.is_dir():
        raise click.UsageError(f"{option}: no folder {target.parent}")
    existed = target.exists()
    try:
        with target.open("a"):
            pass
    except OSError as exc:
        raise click.UsageError(f"{option}: cannot write {path}: {exc.strerror}") from exc
    if not existed:
        target.unlink()


def refuse_inside_data(path: Path, option: str, source: ModelSource) -> None:
    """Refuse an output file inside the folder the model's data comes from (the demo cache,
    the model folder) or naming its catalog file: a report written over one of them (seen:
    over the demo's ml-100k.inter) breaks every later run.

    Raises:
        click.UsageError: naming the folder.
    """
    real = Path(os.path.realpath(path))
    for held in source.data_paths():
        root = Path(os.path.realpath(held))
        if real == root or root in real.parents:
            raise click.UsageError(
                f"{option}: {path} is in {held}, which holds the model's files and data: "
                "write it elsewhere"
            )


def same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same path once links are followed, or two hard
    links of one existing file."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not one file
        return False


def fail(exc: XgrError | OSError) -> None:
    if isinstance(exc, OSError):  # a cache or output path that cannot be written
        path = f": {exc.filename}" if exc.filename else ""
        raise click.ClickException(f"{exc.strerror or exc}{path}") from exc
    raise click.ClickException(str(exc)) from exc


@dataclass(frozen=True)
class ModelSource:
    """Where a command's model comes from: the options every model-loading command takes.

    ``archs`` are the demo architectures asked for (``--arch``, repeatable; empty: the
    default, qwen2); only ``eval`` takes several, through ``per_arch``. ``catalog_paths``
    and ``attributes_paths`` are (name, file) pairs (``--catalog [NAME=]FILE``, repeatable;
    name None: the one catalog given, or the first).
    """

    demo: bool
    model_dir: Path | None
    catalog_paths: tuple[tuple[str | None, Path], ...]
    dtype: str
    device: str
    cache_dir: Path
    archs: tuple[str, ...] = ()
    attributes_paths: tuple[tuple[str | None, Path], ...] = ()
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.archs and not self.demo:
            raise click.UsageError("--arch picks the demo's model: pass --demo with it")

    @property
    def given(self) -> bool:
        return self.demo or self.model_dir is not None

    @property
    def arch(self) -> str:
        """The one demo architecture of this source."""
        if len(self.archs) > 1:
            raise click.UsageError(
                f"this command serves one model: give --arch once (got {', '.join(self.archs)})"
            )
        return self.archs[0] if self.archs else DEFAULT_ARCH

    def per_arch(self) -> list[ModelSource]:
        """One source per ``--arch`` given (repeats dropped), in the order given; a model
        folder is its one source."""
        if not self.demo:
            return [self]
        archs = list(dict.fromkeys(self.archs)) or [self.arch]
        return [replace(self, archs=(arch,)) for arch in archs]

    def data_paths(self) -> list[Path]:
        """What a command reads besides its options: the demo cache, or the model folder and
        ``--catalog``."""
        if self.demo:
            return [self.cache_dir.expanduser()]
        folder = [self.model_dir] if self.model_dir is not None else []
        return folder + [path for _, path in self.catalog_paths]

    def folder(self) -> Path:
        """The model folder (building the demo of ``arch`` on first use)."""
        if self.demo == (self.model_dir is not None):
            raise click.UsageError("give exactly one of --demo and --model")
        if self.model_dir is not None:
            return self.model_dir
        from xgr.demo import DemoConfig, build_demo

        try:
            return build_demo(self.cache_dir.expanduser(), DemoConfig.for_arch(self.arch))
        except (XgrError, OSError) as exc:
            fail(exc)

    def catalog(self):
        """The (first) catalog alone (``--catalog``, else the model folder's), without the
        model."""
        from xgr import ItemCatalog
        from xgr.engine.model_folder import DEFAULT_CATALOG_FILE

        first = self.catalog_paths[0][1] if self.catalog_paths else None
        try:
            return ItemCatalog.from_index_json(first or self.folder() / DEFAULT_CATALOG_FILE)
        except XgrError as exc:
            fail(exc)

    def load(self, **options):
        """The ``xgr.Engine`` of this source (``options`` go to ``Engine``); a clear error
        instead of a traceback."""
        from xgr import Engine, ItemCatalog

        folder = self.folder()
        try:
            catalog = None
            if self.catalog_paths:
                catalog = {
                    name or DEFAULT_CATALOG: ItemCatalog.from_index_json(path)
                    for name, path in self.catalog_paths
                }
            engine = Engine.from_pretrained(
                folder, catalog=catalog, device=self.device, dtype=self.dtype,
                quantization=self.quantization, **options,
            )  # fmt: skip
            for name, path in self.attributes_paths:
                engine.served_catalog(name).catalog.load_attributes(path)
            return engine
        except XgrError as exc:
            fail(exc)


def named_files(values: tuple[str, ...], option: str) -> tuple[tuple[str | None, Path], ...]:
    """``[NAME=]FILE`` option values as (name, path) pairs: a value is NAME=FILE where the
    text before its first '=' is a catalog name (letters, digits, '_', '.', '-'), else a
    file.

    Raises:
        click.UsageError: several values and one without a name, or a name given twice.
    """
    pairs = []
    for value in values:
        name, sep, rest = value.partition("=")
        if sep and rest and CATALOG_NAME.fullmatch(name):
            pairs.append((name, Path(rest)))
        else:
            pairs.append((None, Path(value)))
    if len(pairs) > 1 and any(name is None for name, _ in pairs):
        raise click.UsageError(f"{option}: given several times, each must be NAME=FILE")
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise click.UsageError(f"{option}: a catalog name is given twice")
    return tuple(pairs)


def engine_options(func=None, *, multi_arch: bool = False):
    """Add the model-source options; the command receives them as ``source: ModelSource``.

    ``multi_arch`` (``xgr eval``): --arch may repeat, to compare the demo's architectures.
    """
    if func is None:
        return functools.partial(engine_options, multi_arch=multi_arch)

    @functools.wraps(func)
    def command(
        demo, dtype, device, cache_dir, archs, model_dir=None, catalog_paths=(),
        attributes_paths=(), quantization=None, **kw,
    ):  # fmt: skip
        dtype = dtype or ("bfloat16" if quantization else "float32")
        catalogs = named_files(catalog_paths, "--catalog")
        attributes = named_files(attributes_paths, "--attributes")
        names = [name or DEFAULT_CATALOG for name, _ in catalogs] or [DEFAULT_CATALOG]
        for name, path in attributes:
            if name is not None and name not in names:
                raise click.UsageError(f"--attributes {name}={path}: no --catalog {name}=FILE")
            if not path.is_file():
                raise click.UsageError(f"--attributes: {path} is not a file")
        source = ModelSource(
            demo, model_dir, catalogs, dtype, device, cache_dir, archs, attributes, quantization
        )
        return func(source=source, **kw)

    arch_help = (
        "The demo model's architecture: qwen2 (decoder-only, the default) or t5 "
        "(TIGER-style encoder-decoder)"
    )
    options = [
        click.option(
            "--demo",
            is_flag=True,
            help="Use the MovieLens-100K demo model (downloaded and trained on first use).",
        ),
        click.option(
            "--arch",
            "archs",
            multiple=True,
            type=click.Choice(ARCHITECTURES),
            help=arch_help + ("; repeat it to compare them." if multi_arch else "."),
        ),
        click.option(
            "--model",
            "model_dir",
            type=click.Path(file_okay=False, path_type=Path),
            help="Hugging Face model folder.",
        ),
        click.option(
            "--catalog",
            "catalog_paths",
            multiple=True,
            metavar="[NAME=]FILE",
            help="Catalog index JSON (default: the model folder's catalog.index.json). "
            "Repeat it as NAME=FILE for several catalogs with the model, the first the "
            "default (serve: requests pick one by name; recommend: --from-catalog).",
        ),
        click.option(
            "--attributes",
            "attributes_paths",
            multiple=True,
            metavar="[NAME=]FILE",
            help="Item attributes for request filters: a CSV (header; item id first) or "
            "JSON-lines table keyed by item id; NAME=FILE for catalog NAME (default: the "
            "first), repeatable.",
        ),
        click.option(
            "--dtype",
            default=None,
            type=click.Choice(["float32", "bfloat16", "float16"]),
            help="Weights and activations dtype (half types on a GPU)  [default: float32; "
            "bfloat16 with --quantization]",
        ),
        click.option(
            "--quantization",
            type=click.Choice(list(QUANTIZATIONS)),
            help="The decoder layers' projections in FP8 (e4m3) on load, activations in "
            "bfloat16 between them: fp8 with one scale per output channel and token, "
            "fp8-tensorwise one per tensor (decoder-only models; a GPU with FP8 tensor "
            "cores, or the CPU reference path). FP8 checkpoints load without it, "
            "dequantized.",
        ),
        click.option(
            "--device",
            default="cpu",
            show_default=True,
            help='Torch device: "cpu", "cuda" or "cuda:N".',
        ),
        click.option(
            "--cache-dir",
            type=click.Path(file_okay=False, path_type=Path),
            default=DEFAULT_CACHE,
            envvar="XGR_CACHE",
            show_default=True,
            show_envvar=True,
            help="Where the demo's data and model are cached.",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


# CUDA streams running batches side by side (serve, and bench serve in-process).
STREAMS_OPTION = click.option(
    "--streams",
    default=1,
    show_default=True,
    type=click.IntRange(1, 16),
    help="CUDA streams running batches side by side (GPU only); on each, the next batch "
    "is launched while the current one runs.",
)
