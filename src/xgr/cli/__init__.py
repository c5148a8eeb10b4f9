"""The ``xgr`` command line: recommend, eval, serve and bench serve, on a model folder or the
embedded demo."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import click

from xgr.catalog.catalog import DEFAULT_LEVEL_NAMES
from xgr.cli.options import STREAMS_OPTION, check_writable, engine_options, fail
from xgr.core import MAX_BEAM_WIDTH, XgrError


@click.group()
@click.version_option(package_name="xgr", prog_name="xgr")
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
def main(verbose: bool) -> None:
    """xgr: generative recommendation by catalog-constrained beam search."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )


@main.command()
@engine_options
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
@click.option(
    "--filter",
    "item_filter",
    default=None,
    help='Conditions on the item attributes (--attributes), as JSON, e.g. \'{"genre": "scifi"}\'.',
)
@click.option("--server", default=None, help="Ask a running `xgr serve` at this URL instead.")
@click.option(
    "--from-catalog",
    "catalog_name",
    default=None,
    metavar="NAME",
    help="The catalog to recommend from, by name, where several are served (--catalog "
    "NAME=FILE, or the server's); default: the first.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def recommend(
    source,
    history,
    beam_width,
    top_k,
    num_results,
    item_filter,
    server,
    catalog_name,
    as_json,
) -> None:
    """Recommend items for one user's history."""
    search = {
        "beam_width": beam_width,
        "top_k": beam_width if top_k is None else top_k,
        "num_results": num_results,
    }
    if item_filter is not None:
        try:
            item_filter = json.loads(item_filter)
        except ValueError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--filter") from exc
    started = time.perf_counter()
    if server is not None:
        if source.given or source.catalog_paths:
            raise click.UsageError(
                "--server asks a running server: drop --demo / --model / --catalog (pick one "
                "of its catalogs with --from-catalog NAME)"
            )
        from xgr.client import Client

        try:
            with Client(server) as client:
                started = time.perf_counter()  # the request, not the client's set-up
                result = client.recommend(
                    list(history), **search, item_filter=item_filter, catalog=catalog_name
                )
        except XgrError as exc:
            fail(exc)
        level_names = None
    else:
        from xgr.catalog import resolve_history

        engine = source.load()
        try:
            version = engine.served_catalog(catalog_name).current
            resolved = resolve_history(version.catalog, list(history), version.title_index)
            started = time.perf_counter()
            (result,) = engine.recommend(
                [engine.history_prompt(resolved.item_ids, catalog=catalog_name)],
                exclude_item_ids=[resolved.excluded],
                item_filter=None if item_filter is None else [item_filter],
                catalog=catalog_name,
                **search,
            )
        except XgrError as exc:
            fail(exc)
        level_names = version.catalog.level_names
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
    click.echo(f"{'rank':>4} {'item':<55} {'score':>9}  semantic ID")
    for row in rows:
        name = row["title"] or row["item_id"]
        click.echo(f"{row['rank']:>3}. {name:<55} {row['score']:>9.4f}  {row['semantic_id']}")
    if not result.complete:
        found = len({r.semantic_id for r in result.items})
        click.echo(
            f"(only {found} of the {num_results} semantic IDs asked for have items outside "
            "the history that pass the filter)"
        )
    click.echo(
        f"(score: the semantic ID's log-probability under the model, summed over its codes; "
        f"beam width {beam_width}, {elapsed_ms:.1f} ms)"
    )


@main.command("eval", short_help="Recall@K / NDCG@K of a model on held-out interactions.")
@engine_options(multi_arch=True)
@click.option(
    "--data",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Interactions to evaluate on: .txt (Amazon), .csv (MiniOneRec) or .jsonl (default "
    "with --demo: its MovieLens data).",
)
@click.option(
    "--split",
    type=click.Choice(["test", "valid"]),
    default="test",
    show_default=True,
    help="Leave-one-out's last items (test) or second to last (valid); a file of held-out "
    "rows is its own test split.",
)
@click.option(
    "--k", "ks", default=(10,), show_default=True, multiple=True, type=click.IntRange(1),
    help="Metric cut-off; repeat for several.",
)  # fmt: skip
@click.option("--beam-width", default=64, show_default=True, type=click.IntRange(1))
@click.option(
    "--keep-history",
    is_flag=True,
    help="Keep a history's own items in its lists (default: excluded, for both rankings).",
)
@click.option(
    "--popularity-data",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The interactions most-popular counts (default: the training part of --data; for "
    "held-out rows, their histories).",
)
@click.option("--max-users", default=None, type=click.IntRange(min=1),
              help="Evaluate only the first cases.")  # fmt: skip
@click.option("--batch-size", default=64, show_default=True, type=click.IntRange(1),
              help="Prompts per engine call.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the figures as JSON here: one report, or with several --arch one per "
    "architecture, keyed by its name.",
)
def evaluate(
    source, data, split, ks, beam_width, keep_history, popularity_data, max_users, batch_size,
    as_json, output,
) -> None:  # fmt: skip
    """Recall@K / NDCG@K of the model next to a most-popular baseline, ranking the whole
    catalog, each history's items excluded; ties (items sharing a semantic ID) in catalog
    order.

    With --data, on that file's held-out cases (leave-one-out for sequences); with --demo
    alone, on the demo's MovieLens data, and with several --arch one row per architecture.
    """
    if not source.given:
        raise click.UsageError("give --model DIR with --data FILE, or --demo")
    if data is None and not source.demo:
        raise click.UsageError("--model needs --data FILE to evaluate on")
    ks = sorted(set(ks))
    if beam_width < ks[-1]:  # before the evaluation, not after it
        raise click.UsageError(f"--beam-width {beam_width} is below --k {ks[-1]}")
    if beam_width > MAX_BEAM_WIDTH:
        raise click.UsageError(f"--beam-width {beam_width} is above the limit {MAX_BEAM_WIDTH}")
    if output is not None:
        check_writable(output.expanduser(), "--output", source)
    from xgr.training.evaluate import evaluate_cases

    try:
        cases, popularity = _eval_cases(source, data, split, popularity_data)
    except (XgrError, OSError) as exc:
        fail(exc)
    cases = cases.head(max_users)
    reports = {}
    for arch_source in source.per_arch():
        engine = arch_source.load()
        try:
            reports[arch_source.arch] = evaluate_cases(
                engine, cases, ks, beam_width, popularity, exclude_history=not keep_history,
                batch_size=batch_size, progress=not as_json,
            )  # fmt: skip
        except (XgrError, OSError) as exc:
            fail(exc)
    first = next(iter(reports.values()))  # the same cases, so the same popularity figures
    # One architecture keeps the single report's layout; several are keyed by arch.
    written = first if len(reports) == 1 else reports
    if as_json:
        click.echo(json.dumps(written, indent=2))
    else:
        seconds = " + ".join(f"{r['seconds']} s" for r in reports.values())
        skipped = f"   skipped (no history): {first['skipped']}" if first["skipped"] else ""
        click.echo(f"cases: {first['cases']}   beam width: {beam_width}   time: {seconds}{skipped}")
        names = [f"{m}@{k}" for k in ks for m in ("Recall", "NDCG")]
        click.echo(f"{'':<14}" + "".join(f"{n:>12}" for n in names))
        keys = [f"{m}@{k}" for k in ks for m in ("recall", "ndcg")]
        rows = [
            ("model" if source.model_dir else f"model ({arch})", r["model"])
            for arch, r in reports.items()
        ]
        for name, scores in [*rows, ("popularity", first["popularity"])]:
            click.echo(f"{name:<14}" + "".join(f"{scores[key]:>12.4f}" for key in keys))
    if output:
        try:
            output.expanduser().write_text(json.dumps(written, indent=2) + "\n")
        except OSError as exc:
            fail(exc)


def _eval_cases(source, data, split, popularity_data):
    """The held-out cases of ``--data`` (or of the demo's MovieLens data) and the training
    sequences the baseline counts."""
    from xgr.training.interactions import read_interactions

    if data is None:
        from xgr.demo import demo_cases, leave_one_out, load_movielens

        if split != "test":
            raise click.UsageError("the demo is evaluated on its test split: drop --split")
        movielens = load_movielens(source.cache_dir.expanduser())
        cases, popularity = demo_cases(movielens), leave_one_out(movielens).histories
    else:
        interactions = read_interactions(data)
        cases = interactions.split(split)
        if interactions.valid is None:  # held-out rows: their histories, never their items
            popularity = list(cases.histories)
        else:
            popularity = list(interactions.train)
    if popularity_data is not None:
        popularity = list(read_interactions(popularity_data).train)
    return cases, popularity


@main.command(short_help="Serve the HTTP API (recommend, completions).")
@engine_options
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
@click.option(
    "--max-body-bytes", default=1 << 20, show_default=True, help="Largest request body (then 413)."
)
@click.option(
    "--max-batch-tokens",
    default=1 << 20,
    show_default=True,
    help="Scheduled tokens (prompt + beam width x levels) per engine call.",
)
@click.option("--max-queue", default=4096, show_default=True, help="Waiting requests (then 429).")
@STREAMS_OPTION
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
@click.option(
    "--header-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds a connection has to send a request's complete headers (from opening, or "
    "from the request's first byte when kept alive); then it is closed.",
)
@click.option(
    "--body-timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds a request's body has to arrive after its headers; then 408.",
)
@click.option(
    "--keep-alive-timeout",
    type=float,
    default=5.0,
    show_default=True,
    help="Seconds an idle kept-alive connection stays open.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1),
    default=8192,
    show_default=True,
    help="Connections open at once. One more closes the connection idle longest (between "
    "requests, or still sending headers), or when every one has a request in progress is "
    "answered 503 and closed. Lowered to what the file-descriptor limit allows (raised at "
    "start to its hard limit).",
)
@click.option(
    "--access-log",
    is_flag=True,
    help="Log a line per request (default: off; each line costs the event loop).",
)
@click.option(
    "--admin-token",
    envvar="XGR_ADMIN_TOKEN",
    default=None,
    help="Turn on the catalog admin API (/v1/catalog) for requests with "
    "'Authorization: Bearer TOKEN' (at least 16 characters; or the XGR_ADMIN_TOKEN "
    "environment variable).",
)
@click.option(
    "--max-catalog-body-bytes",
    default=1 << 28,
    show_default=True,
    help="Largest body of a catalog update (then 413).",
)
@click.option(
    "--ray",
    "on_ray",
    is_flag=True,
    help="Serve replicas of the model on Ray Serve (the ray[serve] extra): on the cluster "
    "RAY_ADDRESS names, else a local one.",
)
@click.option("--replicas", type=click.IntRange(1), default=1, show_default=True,
              help="With --ray: replicas (without autoscaling).")  # fmt: skip
@click.option(
    "--num-gpus-per-replica",
    type=click.FloatRange(0),
    default=None,
    help="With --ray: GPUs of each replica (default: 1 with --device cuda, else 0).",
)
@click.option("--min-replicas", type=click.IntRange(0), default=None,
              help="With --ray: autoscaling's lower bound (with --max-replicas).")  # fmt: skip
@click.option("--max-replicas", type=click.IntRange(1), default=None,
              help="With --ray: autoscaling's upper bound (with --min-replicas).")  # fmt: skip
@click.option(
    "--target-ongoing-requests",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="With --ray: autoscaling's target of requests in a replica at once (default: half "
    "of what a replica is routed at most, from its token budget).",
)
def serve(
    source,
    host,
    port,
    warm_up_tokens,
    header_timeout,
    body_timeout,
    keep_alive_timeout,
    max_connections,
    access_log,
    on_ray,
    replicas,
    num_gpus_per_replica,
    min_replicas,
    max_replicas,
    target_ongoing_requests,
    **limits,
) -> None:
    """Serve the HTTP API: recommend, completions, models, health, ready, metrics."""
    from xgr.server.app import create_app
    from xgr.server.config import ServerConfig
    from xgr.server.http import HttpConfig, run_server

    try:
        config = ServerConfig(**limits)  # the options are named as its fields
        if on_ray:
            from xgr.server.ray_serve import ReplicaOptions

            gpus = num_gpus_per_replica
            if gpus is None:
                gpus = 1.0 if source.device.startswith("cuda") else 0.0
            options = ReplicaOptions(
                replicas, gpus, min_replicas=min_replicas, max_replicas=max_replicas,
                target_ongoing_requests=target_ongoing_requests,
            )  # fmt: skip
        http_config = HttpConfig(
            header_timeout, body_timeout, keep_alive_timeout, max_connections, access_log
        )
    except XgrError as exc:
        fail(exc)
    try:  # before the model loads: uvicorn would say only "Name or service not known"
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise click.UsageError(f"--host {host!r} cannot be resolved: {exc}") from exc
    if on_ray:
        from xgr.cli.ray_app import serve_on_ray

        if http_config != HttpConfig():  # options of xgr's own HTTP server, unused here
            note = (
                "note: --ray serves through Serve's proxy; the HTTP options of xgr's own "
                "server (timeouts, --max-connections, --access-log) do not apply"
            )
            click.echo(note, err=True)
        return serve_on_ray(source, config, options, host, port, warm_up_tokens)
    engine = source.load(cuda_streams=config.streams)
    try:
        app = create_app(engine, config)  # refuses a model too small for one item
        if warm_up_tokens:
            beam = config.default_beam_width
            engine.warm_up(warm_up_tokens, beam, beam, config.max_batch_size)
    except XgrError as exc:
        fail(exc)
    run_server(app, host, port, http_config)


# The bench, sid and train commands register themselves on ``main``.
from xgr.cli import bench as _bench  # noqa: E402, F401
from xgr.cli import train as _train  # noqa: E402, F401
