"""``xgr bench serve``: load levels against a running server or the engine in-process."""

from __future__ import annotations

from pathlib import Path

import click

from xgr.cli import main
from xgr.cli.options import (
    PLOT_SUFFIXES,
    STREAMS_OPTION,
    check_writable,
    engine_options,
    fail,
    same_file,
)
from xgr.core import XgrError


@main.group(short_help="Load-test a service: xgr bench serve.")
def bench() -> None:
    """Benchmarks of a service: over HTTP (--url) or the engine in-process."""


@bench.command("serve")
@engine_options
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
@STREAMS_OPTION
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
    if same_file(plot_path, output):  # the plot would overwrite the report
        raise click.UsageError(f"--plot and --output name one file, {output}: give --plot")
    for path, option in ((output, "--output"), (plot_path, "--plot")):
        check_writable(path, option, source)  # before the run: its figures would be lost
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
        fail(exc)
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
        fail(XgrError(f"no request succeeded: {hint}"))
