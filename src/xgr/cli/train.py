"""``xgr sid build`` and ``xgr train``: from one's own items to a model folder."""

from __future__ import annotations

import json
from pathlib import Path

import click

from xgr.cli import main
from xgr.cli.options import fail
from xgr.core import XgrError

FILE = click.Path(exists=True, dir_okay=False, path_type=Path)
FOLDER = click.Path(file_okay=False, path_type=Path)


@main.group(short_help="Semantic IDs for a catalog: xgr sid build.")
def sid() -> None:
    """Semantic IDs: item embeddings (or interactions) quantized into codes."""


@sid.command("build")
@click.option(
    "--embeddings", type=FILE, help="Item embeddings: .npy (with --item-ids) or .parquet."
)
@click.option("--item-ids", type=FILE, help="For .npy: one item id per line, or a JSON list.")
@click.option("--id-column", default="item_id", show_default=True, help="Parquet: the id column.")
@click.option(
    "--embedding-column",
    default="embedding",
    show_default=True,
    help="Parquet: the column of float lists (without it: every other column is a dimension).",
)
@click.option(
    "--interactions",
    type=FILE,
    help="Instead of embeddings: an interaction file (.txt, .csv, .jsonl); items are embedded "
    "by a truncated SVD of who interacted with them, held-out items excluded.",
)
@click.option("--embedding-dim", default=64, show_default=True, type=click.IntRange(1),
              help="With --interactions: SVD components.")  # fmt: skip
@click.option("--levels", default=3, show_default=True, type=click.IntRange(1, 16))
@click.option("--codebook-size", default=256, show_default=True, type=click.IntRange(1, 65536))
@click.option(
    "--collision-level",
    is_flag=True,
    help="Append a level numbering the items that share codes (TIGER), so every item has "
    "its own semantic ID.",
)
@click.option("--balanced", is_flag=True, help="Cap each cluster at ceil(items / codebook size).")
@click.option(
    "--backend",
    type=click.Choice(["auto", "faiss", "sklearn"]),
    default="auto",
    show_default=True,
    help="K-means implementation (auto: faiss where installed).",
)
@click.option("--n-init", default=4, show_default=True, type=click.IntRange(1),
              help="K-means restarts per level.")  # fmt: skip
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--output", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The index JSON to write (item id -> code tokens).")  # fmt: skip
@click.option(
    "--report",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where the report JSON goes (default: beside --output, .report.json).",
)
def sid_build(
    embeddings, item_ids, id_column, embedding_column, interactions, embedding_dim, levels,
    codebook_size, collision_level, balanced, backend, n_init, seed, output, report,
) -> None:  # fmt: skip
    """Build semantic IDs by residual k-means (RQ-KMeans) and write the catalog index."""
    from xgr.training.semantic_ids import build_catalog, item_embeddings, load_embeddings

    if (embeddings is None) == (interactions is None):
        raise click.UsageError("give exactly one of --embeddings and --interactions")
    if interactions is not None and item_ids is not None:
        raise click.UsageError("--item-ids names the rows of --embeddings, not --interactions")
    backend = _backend(backend)
    report_path = report or output.with_name(output.name.removesuffix(".json") + ".report.json")
    try:
        if embeddings is not None:
            ids, vectors = load_embeddings(embeddings, item_ids, id_column, embedding_column)
        else:
            from xgr.training.interactions import read_interactions

            data = read_interactions(interactions)
            ids = list(data.item_ids)
            vectors = item_embeddings(data.train, ids, embedding_dim, seed)
        catalog, summary = build_catalog(
            ids, vectors, levels, codebook_size, seed, n_init, backend, balanced, collision_level
        )
        catalog.to_index_json(output)
        report_path.write_text(json.dumps(summary, indent=2) + "\n")
    except (XgrError, OSError) as exc:
        fail(exc)
    built = summary["catalog"]
    click.echo(f"{built['items']} items, {built['levels']} levels of {codebook_size} codes")
    for level in built["per_level"]:
        click.echo(
            f"  level {level['level']}: {level['codes_used']} codes used, perplexity "
            f"{level['perplexity']}, {level['distinct_prefixes']} distinct prefixes"
        )
    click.echo(
        f"{built['semantic_ids']} semantic IDs; {built['collided_semantic_ids']} shared by "
        f"{built['items_in_collisions']} items (largest: {built['largest_collision']})"
    )
    click.echo(f"wrote {output} and {report_path}")


def _backend(name: str) -> str:
    if name != "auto":
        return name
    try:
        import faiss  # noqa: F401
    except ImportError:
        return "sklearn"
    return "faiss"


@main.command(short_help="Train a generative recommender on interactions.")
@click.option("--data", required=True, type=FILE,
              help="Interactions: .txt (Amazon), .csv (MiniOneRec) or .jsonl.")  # fmt: skip
@click.option("--catalog", required=True, type=FILE, help="The catalog index JSON.")
@click.option("--output", required=True, type=FOLDER, help="The model folder to write.")
@click.option("--arch", type=click.Choice(["qwen2", "qwen3", "llama", "t5"]), default="qwen2",
              show_default=True)  # fmt: skip
@click.option("--size", type=click.Choice(["tiny", "small", "medium", "large"]), default="small",
              show_default=True, help="Named size (the shape options override it).")  # fmt: skip
@click.option("--hidden-size", type=click.IntRange(1), default=None)
@click.option("--layers", type=click.IntRange(1), default=None)
@click.option("--heads", type=click.IntRange(1), default=None)
@click.option("--kv-heads", type=click.IntRange(1), default=None)
@click.option("--intermediate-size", type=click.IntRange(1), default=None)
@click.option("--dropout", type=click.FloatRange(0, 1, max_open=True), default=None)
@click.option(
    "--base-model",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="Start from this Hugging Face decoder folder (Qwen2/Qwen3/Llama) with the code "
    "tokens added, instead of from scratch.",
)
@click.option("--max-history", default=20, show_default=True, type=click.IntRange(1),
              help="Items of history in a prompt.")  # fmt: skip
@click.option("--epochs", default=10, show_default=True, type=click.IntRange(1))
@click.option("--steps", type=click.IntRange(1), default=None, help="Stop after this many steps.")
@click.option(
    "--max-minutes",
    type=click.FloatRange(0, min_open=True),
    default=None,
    help="Stop after this long, keeping the best weights so far (the schedule still spans "
    "every step).",
)
@click.option("--batch-size", default=128, show_default=True, type=click.IntRange(1))
@click.option("--lr", default=1e-3, show_default=True, type=click.FloatRange(0, min_open=True))
@click.option("--weight-decay", default=0.1, show_default=True, type=click.FloatRange(0))
@click.option("--warmup-steps", default=100, show_default=True, type=click.IntRange(0))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--device", default=None, help="Torch device (default: cuda when present, else cpu).")
@click.option(
    "--precision",
    type=click.Choice(["auto", "bf16", "fp32"]),
    default="auto",
    show_default=True,
    help="bf16: mixed precision (CUDA only); auto: bf16 on CUDA, else fp32.",
)
@click.option("--checkpoint-every", default=1000, show_default=True, type=click.IntRange(1))
@click.option("--eval-every", type=click.IntRange(1), default=None,
              help="Steps between validation passes (default: one per epoch).")  # fmt: skip
@click.option("--no-validation", is_flag=True,
              help="Keep the last weights, not those of the lowest validation loss.")  # fmt: skip
@click.option("--resume", is_flag=True, help="Continue from the newest checkpoint in --output.")
@click.option("--titles", type=FILE,
              help="Item titles: JSON (id -> title), or TSV ending: title, item id.")  # fmt: skip
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(
    data, catalog, output, arch, size, hidden_size, layers, heads, kv_heads, intermediate_size,
    dropout, base_model, max_history, epochs, steps, max_minutes, batch_size, lr, weight_decay,
    warmup_steps, seed, device, precision, checkpoint_every, eval_every, no_validation,
    resume, titles, quiet,
) -> None:  # fmt: skip
    """Train a model on interaction sequences and write a folder `xgr serve --model` takes.

    Sequence files (.txt, .jsonl of "items") are split leave-one-out: training sees all but
    each user's last two items, and the second to last picks the weights kept. A file of
    held-out rows (.csv, .jsonl of "history"/"item") is trained on whole.
    """
    import dataclasses

    import torch

    from xgr.engine.model_folder import resolve_device
    from xgr.training.loop import TrainSettings
    from xgr.training.models import SIZES
    from xgr.training.recommender import TrainJob, train_recommender

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if precision == "bf16" and not device.startswith("cuda"):
        raise click.UsageError("--precision bf16 is mixed precision on CUDA: use a CUDA device")
    shape_options = {
        "hidden_size": hidden_size, "num_layers": layers, "num_heads": heads,
        "num_kv_heads": kv_heads, "intermediate_size": intermediate_size, "dropout": dropout,
    }  # fmt: skip
    given = {k: v for k, v in shape_options.items() if v is not None}
    if base_model is not None and given:
        raise click.UsageError("a --base-model has its own shape: drop the shape options")
    try:
        resolve_device(device)
        shape = SIZES[size]
        if arch == "t5" and "num_kv_heads" not in given:
            given["num_kv_heads"] = given.get("num_heads", shape.num_heads)
        shape = dataclasses.replace(shape, **given)
        settings = TrainSettings(
            batch_size=batch_size,
            epochs=epochs,
            max_steps=steps,
            learning_rate=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            seed=seed,
            device=device,
            mixed_precision=precision != "fp32" and device.startswith("cuda"),
            checkpoint_every=checkpoint_every,
            eval_every=eval_every,
            max_seconds=None if max_minutes is None else max_minutes * 60,
            desc=f"training {arch if base_model is None else 'base model'}",
        )
        job = TrainJob(
            data=data, catalog=catalog, output=output, arch=arch, shape=shape,
            settings=settings, base_model=base_model, max_history=max_history, titles=titles,
            validate=not no_validation, resume=resume,
        )  # fmt: skip
        meta = train_recommender(job, progress=not quiet)
    except (XgrError, OSError) as exc:
        fail(exc)
    report = meta["report"]
    valid = report["best_valid_loss"]
    picked = f", validation loss {valid} at step {report['best_step']}" if valid else ""
    click.echo(
        f"trained {meta['arch']} ({meta['parameters']:,} parameters) for {report['steps']} "
        f"steps in {report['seconds']:.1f} s: loss {report['first_loss']} -> "
        f"{report['final_loss']}{picked}"
    )
    click.echo(f"wrote {output}: serve it with `xgr serve --model {output}`")
