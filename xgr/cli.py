"""The ``xgr`` command line: recommend, eval and serve, on a model folder or the embedded demo."""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from xgr.catalog.catalog import DEFAULT_LEVEL_NAMES
from xgr.core import MAX_BEAM_WIDTH, XgrError
from xgr.demo.config import ARCHITECTURES, DEFAULT_ARCH

DEFAULT_CACHE = Path("~/.cache/xgr/demo")


# File types the latency plot can be written as (matplotlib picks the format by suffix).
PLOT_SUFFIXES = (".png", ".svg", ".pdf")


def _check_writable(path: Path, option: str, source: ModelSource) -> None:
    """Refuse an output file that cannot be written, or that lies among the model's own
    files (``_refuse_inside_data``), before the work that would fill it.

    A file this check creates is removed again; through a symbolic link, the link's target
    is what is checked (and removed if created), the link is left alone.

    Raises:
        click.UsageError: inside the model's data, no such folder, or the file cannot be
            opened for writing.
    """
    _refuse_inside_data(path, option, source)
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


def _refuse_inside_data(path: Path, option: str, source: ModelSource) -> None:
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


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file: the same path once links are followed, or two hard
    links of one existing file."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): not one file
        return False


def _fail(exc: XgrError | OSError) -> None:
    if isinstance(exc, OSError):  # a cache or output path that cannot be written
        path = f": {exc.filename}" if exc.filename else ""
        raise click.ClickException(f"{exc.strerror or exc}{path}") from exc
    raise click.ClickException(str(exc)) from exc


@dataclass(frozen=True)
class ModelSource:
    """Where a command's model comes from: the options every model-loading command takes.

    ``archs`` are the demo architectures asked for (``--arch``, repeatable; empty: the
    default, qwen2); only ``eval`` takes several, through ``per_arch``.
    """

    demo: bool
    model_dir: Path | None
    catalog_path: Path | None
    dtype: str
    device: str
    cache_dir: Path
    archs: tuple[str, ...] = ()

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
        """One source per ``--arch`` given (repeats dropped), in the order given."""
        archs = list(dict.fromkeys(self.archs)) or [self.arch]
        return [replace(self, archs=(arch,)) for arch in archs]

    def data_paths(self) -> list[Path]:
        """What a command reads besides its options: the demo cache, or the model folder and
        ``--catalog``."""
        if self.demo:
            return [self.cache_dir.expanduser()]
        return [p for p in (self.model_dir, self.catalog_path) if p is not None]

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
            _fail(exc)

    def catalog(self):
        """The catalog alone (``--catalog``, else the model folder's), without the model."""
        from xgr import ItemCatalog
        from xgr.engine.model_folder import DEFAULT_CATALOG_FILE

        try:
            return ItemCatalog.from_index_json(
                self.catalog_path or self.folder() / DEFAULT_CATALOG_FILE
            )
        except XgrError as exc:
            _fail(exc)

    def load(self, **options):
        """The ``xgr.Engine`` of this source (``options`` go to ``Engine``); a clear error
        instead of a traceback."""
        from xgr import Engine, ItemCatalog

        folder = self.folder()
        try:
            catalog = ItemCatalog.from_index_json(self.catalog_path) if self.catalog_path else None
            return Engine.from_pretrained(
                folder, catalog=catalog, device=self.device, dtype=self.dtype, **options
            )
        except XgrError as exc:
            _fail(exc)


def _engine_options(func=None, *, demo_only: bool = False):
    """Add the model-source options; the command receives them as ``source: ModelSource``.

    ``demo_only`` (``xgr eval``): no --model / --catalog, and --arch may repeat.
    """
    if func is None:
        return functools.partial(_engine_options, demo_only=demo_only)

    @functools.wraps(func)
    def command(demo, dtype, device, cache_dir, archs, model_dir=None, catalog_path=None, **kw):
        source = ModelSource(demo, model_dir, catalog_path, dtype, device, cache_dir, archs)
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
            help=arch_help + ("; repeat it to compare them." if demo_only else "."),
        ),
    ]
    if not demo_only:
        options += [
            click.option(
                "--model",
                "model_dir",
                type=click.Path(file_okay=False, path_type=Path),
                help="Hugging Face model folder.",
            ),
            click.option(
                "--catalog",
                "catalog_path",
                type=click.Path(dir_okay=False, path_type=Path),
                help="Catalog index JSON (default: the model folder's catalog.index.json).",
            ),
        ]
    options += [
        click.option(
            "--dtype",
            default="float32",
            show_default=True,
            type=click.Choice(["float32", "bfloat16", "float16"]),
            help="Weights and activations dtype (half types on a GPU).",
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
_STREAMS_OPTION = click.option(
    "--streams",
    default=1,
    show_default=True,
    type=click.IntRange(1, 16),
    help="CUDA streams running batches side by side (GPU only); on each, the next batch "
    "is launched while the current one runs.",
)


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
def main(verbose: bool) -> None:
    """xgr: generative recommendation by catalog-constrained beam search."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


@main.command()
@_engine_options
@click.option(
    "--history",
    "history",
    multiple=True,
    required=True,
    help="One history item, oldest first: an item id, a title with its year, or a "
    "semantic ID like '<a_1><b_2><c_3>'. Repeat for each item.",
)
@click.option("--beam-width", default=64, show_default=True, help="Beams kept per decode step.")
@click.option("--top-k", default=None, type=int, help="Candidates per beam (default beam width).")
@click.option(
    "--num-results",
    default=10,
    show_default=True,
    help="Semantic IDs to return, best first; each brings all its items, so semantic-ID "
    "collisions print more items than this.",
)
@click.option("--server", default=None, help="Ask a running `xgr serve` at this URL instead.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def recommend(
    source,
    history,
    beam_width,
    top_k,
    num_results,
    server,
    as_json,
) -> None:
    """Recommend items for one user's history."""
    search = {
        "beam_width": beam_width,
        "top_k": beam_width if top_k is None else top_k,
        "num_results": num_results,
    }
    started = time.perf_counter()
    if server is not None:
        if source.given:
            raise click.UsageError("--server asks a running server: drop --demo / --model")
        from xgr.client import Client

        try:
            with Client(server) as client:
                started = time.perf_counter()  # the request, not the client's set-up
                result = client.recommend(list(history), **search)
        except XgrError as exc:
            _fail(exc)
        level_names = None
    else:
        from xgr.catalog import resolve_history

        engine = source.load()
        try:
            resolved = resolve_history(engine.catalog, list(history), engine.title_index)
            started = time.perf_counter()
            (result,) = engine.recommend(
                [engine.history_prompt(resolved.item_ids)],
                exclude_item_ids=[resolved.excluded],
                **search,
            )
        except XgrError as exc:
            _fail(exc)
        level_names = engine.catalog.level_names
    elapsed_ms = (time.perf_counter() - started) * 1e3
    # Over HTTP the level letters are not sent back: the catalogs' usual a, b, c, ... are used.
    letters = level_names or DEFAULT_LEVEL_NAMES
    rows = [
        {
            "rank": rank,
            "item_id": r.item_id,
            "title": r.title,
            "score": round(r.score, 4),
            "semantic_id": "".join(
                f"<{n}_{c}>" for n, c in zip(letters, r.semantic_id, strict=False)
            ),
        }
        for rank, r in enumerate(result.items, 1)
    ]
    if as_json:
        report = {"items": rows, "complete": result.complete, "latency_ms": round(elapsed_ms, 1)}
        click.echo(json.dumps(report, indent=2))
        return
    for row in rows:
        name = row["title"] or row["item_id"]
        click.echo(f"{row['rank']:>3}. {name:<55} {row['score']:>9.4f}  {row['semantic_id']}")
    if not result.complete:
        found = len({r.semantic_id for r in result.items})
        click.echo(
            f"(only {found} of the {num_results} semantic IDs asked for have items outside "
            f"the history among the {beam_width} final beams; a larger --beam-width may find "
            "more)"
        )
    click.echo(f"(beam width {beam_width}, {elapsed_ms:.1f} ms)")


@main.command("eval", short_help="Recall@K / NDCG@K of the demo model(s) on MovieLens.")
@_engine_options(demo_only=True)
@click.option("--k", default=10, show_default=True, type=click.IntRange(1), help="Metric cut-off.")
@click.option("--beam-width", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--max-users", default=None, type=click.IntRange(min=1), help="Evaluate only the first users."
)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the figures as JSON here: one report, or with several --arch one per "
    "architecture, keyed by its name.",
)
def evaluate(source, k, beam_width, max_users, output) -> None:
    """Leave-one-out Recall@K / NDCG@K of the demo model next to a most-popular baseline.

    Runs on the demo's MovieLens data, so it needs --demo. With several --arch, one row per
    architecture's model on the same users.
    """
    from xgr.demo import evaluate_demo, load_movielens

    if not source.demo:
        raise click.UsageError("eval runs on the demo's data: pass --demo")
    if beam_width < k:  # before the evaluation, not after it
        raise click.UsageError(f"--beam-width {beam_width} is below --k {k}")
    if beam_width > MAX_BEAM_WIDTH:
        raise click.UsageError(f"--beam-width {beam_width} is above the limit {MAX_BEAM_WIDTH}")
    if output is not None:
        _check_writable(output.expanduser(), "--output", source)
    reports = {}
    for arch_source in source.per_arch():
        engine = arch_source.load()
        try:
            reports[arch_source.arch] = evaluate_demo(
                engine,
                load_movielens(source.cache_dir.expanduser()),
                k=k,
                beam_width=beam_width,
                max_users=max_users,
            )
        except (XgrError, OSError) as exc:
            _fail(exc)
    first = next(iter(reports.values()))  # the same users, so the same popularity figures
    seconds = " + ".join(f"{r['seconds']} s" for r in reports.values())
    click.echo(f"users: {first['users']}   beam width: {beam_width}   time: {seconds}")
    click.echo(f"{'':<14}{'Recall@' + str(k):>12}{'NDCG@' + str(k):>12}")
    rows = [(f"model ({arch})", r["model"]) for arch, r in reports.items()]
    for name, scores in [*rows, ("popularity", first["popularity"])]:
        click.echo(f"{name:<14}{scores[f'recall@{k}']:>12.4f}{scores[f'ndcg@{k}']:>12.4f}")
    if output:
        # One architecture keeps the single report's layout; several are keyed by arch.
        written = first if len(reports) == 1 else reports
        try:
            output.expanduser().write_text(json.dumps(written, indent=2) + "\n")
        except OSError as exc:
            _fail(exc)


@main.command(short_help="Serve the HTTP API (recommend, completions, models, health, metrics).")
@_engine_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--max-beam-width", default=512, show_default=True, help="Largest beam width.")
@click.option(
    "--default-beam-width",
    default=64,
    show_default=True,
    help="Beam width of completions that name none.",
)
@click.option("--max-batch-size", default=32, show_default=True, help="Requests per engine call.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True)
@click.option(
    "--max-batch-tokens",
    default=1 << 20,
    show_default=True,
    help="Scheduled tokens (prompt + beam width x levels) per engine call.",
)
@click.option("--max-queue", default=4096, show_default=True, help="Waiting requests (then 429).")
@_STREAMS_OPTION
@click.option(
    "--max-batch-ms",
    type=float,
    default=None,
    help="Longest predicted run time of a batch (ms); requests arriving meanwhile wait for it "
    "(default: no limit).",
)
@click.option(
    "--warm-up-tokens",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="On a GPU, capture before listening the CUDA graphs that batches of prompts of about "
    "this many tokens (+-20%) need at the default beam width (0: capture on first use).",
)
def serve(source, host, port, warm_up_tokens, **limits) -> None:
    """Serve the HTTP API: recommend, completions, models, health, ready, metrics."""
    import uvicorn

    from xgr.server.app import create_app
    from xgr.server.config import ServerConfig

    try:
        config = ServerConfig(**limits)  # the options are named as its fields
    except XgrError as exc:
        _fail(exc)
    try:  # before the model loads: uvicorn would say only "Name or service not known"
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise click.UsageError(f"--host {host!r} cannot be resolved: {exc}") from exc
    engine = source.load(cuda_streams=config.streams)
    if warm_up_tokens:
        beam = config.default_beam_width
        try:
            engine.warm_up(warm_up_tokens, beam, beam, config.max_batch_size)
        except XgrError as exc:
            _fail(exc)
    uvicorn.run(create_app(engine, config), host=host, port=port)


@main.group(short_help="Load-test a service: xgr bench serve.")
def bench() -> None:
    """Benchmarks of a service: over HTTP (--url) or the engine in-process."""


@bench.command("serve")
@_engine_options
@click.option("--url", default=None, help="A running `xgr serve` (default: the engine in-process).")
@click.option("--rate", "rates", type=float, multiple=True, help="Open-loop Poisson rate (req/s).")
@click.option("--concurrency", "concurrencies", type=int, multiple=True, help="Fixed clients.")
@click.option("--duration", default=10.0, show_default=True, help="Seconds per load level.")
@click.option("--history-len", default=20, show_default=True, help="Items per random history.")
@click.option("--beam-width", default=64, show_default=True, type=click.IntRange(1))
@click.option("--num-results", default=10, show_default=True, type=click.IntRange(1))
@click.option("--deadline-ms", default=None, type=click.IntRange(1), help="Per-request deadline.")
@click.option(
    "--max-batch-size", default=32, show_default=True, type=click.IntRange(1), help="In-process."
)
@click.option(
    "--max-batch-ms", type=float, default=None, help="In-process: longest predicted batch (ms)."
)
@click.option("--seed", default=0, show_default=True)
@_STREAMS_OPTION
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Latency-vs-throughput plot, .png, .svg or .pdf (default: OUTPUT with .png).",
)
def bench_serve(
    source,
    url,
    rates,
    concurrencies,
    duration,
    history_len,
    beam_width,
    num_results,
    deadline_ms,
    max_batch_size,
    max_batch_ms,
    seed,
    streams,
    output,
    plot_path,
) -> None:
    """Load levels (Poisson rates and/or fixed concurrency) -> P50/P95/P99, throughput, errors.

    Histories are random items of the model's catalog. With --url, --demo or --model only
    supplies that catalog (the server's model answers). Writes JSON to OUTPUT and a PNG
    plot; prints one line per level.
    """
    import asyncio

    from xgr.bench import serve as bench

    if not rates and not concurrencies:
        raise click.UsageError("give at least one --rate or --concurrency")
    if num_results > beam_width:  # every request would be refused (400)
        raise click.UsageError(f"--num-results {num_results} exceeds --beam-width {beam_width}")
    if not source.given:
        raise click.UsageError("give --demo or --model (its catalog supplies the histories)")
    output = output.expanduser()
    if not output.name:
        raise click.UsageError("--output: give a file name")
    plot_path = (plot_path or output.with_suffix(".png")).expanduser()
    if plot_path.suffix.lower() not in PLOT_SUFFIXES:
        raise click.UsageError(f"--plot: give a file ending in {', '.join(PLOT_SUFFIXES)}")
    if _same_file(plot_path, output):  # the plot would overwrite the report
        raise click.UsageError(f"--plot and --output name one file, {output}: give --plot")
    for path, option in ((output, "--output"), (plot_path, "--plot")):
        _check_writable(path, option, source)  # before the run: its figures would be lost
    first_errors: dict[str, str] = {}  # an HTTP run's first answer per error status
    try:
        if url is None:
            engine = source.load(cuda_streams=streams)
            item_ids = engine.catalog.item_ids
        else:
            item_ids = source.catalog().item_ids
        plan = bench.LoadPlan(
            bench.history_sampler(item_ids, history_len, seed),
            beam_width, num_results, deadline_ms, rates, concurrencies, duration,
        )  # fmt: skip
        if url is None:
            # Capture the CUDA graphs first: the first batch of each shape would pay for it.
            sample = engine.tokenize(engine.history_prompt(plan.histories(), truncate=True))
            engine.warm_up(len(sample), beam_width, beam_width, max_batch_size, spread=0.0)
            coroutine = bench.bench_in_process(engine, plan, max_batch_size, max_batch_ms)
        else:
            coroutine = bench.bench_http(url, plan, first_errors=first_errors)
        points = asyncio.run(coroutine)
    except XgrError as exc:
        _fail(exc)
    settings = {
        "target": url or "in-process",
        "beam_width": beam_width,
        "num_results": num_results,
        "history_len": history_len,
        "duration_s": duration,
        "deadline_ms": deadline_ms,
        "streams": streams if url is None else None,
        "max_batch_ms": max_batch_ms if url is None else None,
    }
    report = bench.write_report(points, settings, output)
    bench.plot(points, plot_path, f"xgr, beam width {beam_width} ({settings['target']})")
    for p in points:
        p99 = f"{p.p99_ms:.1f}" if p.p99_ms is not None else "-"
        p50 = f"{p.p50_ms:.1f}" if p.p50_ms is not None else "-"
        click.echo(
            f"{p.mode} {p.load:g}: {p.throughput:.1f} req/s, P50 {p50} ms, P99 {p99} ms, "
            f"{p.ok}/{p.requests} ok, errors {p.errors or 'none'}"
        )
    best = report["max_throughput_within_budget"]
    if best:
        click.echo(f"best throughput with P99 <= 200 ms and <= 1% errors: {best:.1f} req/s")
    else:
        click.echo("no level kept P99 <= 200 ms with <= 1% errors")
    click.echo(f"wrote {output} and {plot_path}")
    if not any(p.ok for p in points):
        said = "; ".join(f"HTTP {status}: {body}" for status, body in first_errors.items())
        hint = f"the server answered {said}" if said else "is the server up?"
        _fail(XgrError(f"no request succeeded: {hint}"))


if __name__ == "__main__":
    main()
