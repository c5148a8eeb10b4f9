"""The guide's three commands end to end on the example catalog (docs/your-own-model.md)."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from xgr import Engine
from xgr.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "own-items"


def _run(args):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("own")
    _run(["sid", "build", "--embeddings", EXAMPLE / "embeddings.npy", "--item-ids",
          EXAMPLE / "item_ids.txt", "--levels", "2", "--codebook-size", "16",
          "--collision-level", "--backend", "sklearn", "--output", out / "index.json"])  # fmt: skip
    _run(["train", "--data", EXAMPLE / "interactions.jsonl", "--catalog", out / "index.json",
          "--titles", EXAMPLE / "titles.json", "--size", "tiny", "--epochs", "30",
          "--batch-size", "32", "--lr", "3e-3", "--warmup-steps", "20", "--device", "cpu",
          "--output", out / "model", "--quiet"])  # fmt: skip
    return out


def test_sid_build_gives_every_item_its_own_id(built):
    index = json.loads((built / "index.json").read_text())
    assert len(index) == 240 and len({tuple(v) for v in index.values()}) == 240
    assert all(len(v) == 3 and v[0].startswith("<a_") for v in index.values())
    report = json.loads((built / "index.report.json").read_text())
    assert report["catalog"]["collided_semantic_ids"] == 0
    assert report["quantized"]["per_level"][0]["codes_used"] == 16


def test_trained_folder_serves_and_beats_popularity(built):
    model = built / "model"
    meta = json.loads((model / "xgr_training.json").read_text())
    assert meta["report"]["final_loss"] < meta["report"]["first_loss"]
    assert meta["validation_cases"] == 600 and meta["report"]["best_valid_loss"] is not None
    engine = Engine.from_pretrained(model)
    (result,) = engine.recommend([engine.history_prompt(["tents-01", "tents-02"])], beam_width=16)
    assert result.items and result.items[0].title  # titles travel with the folder
    out = _run(["eval", "--model", model, "--data", EXAMPLE / "interactions.jsonl", "--k", "5",
                "--k", "10", "--json"])  # fmt: skip
    report = json.loads(out[out.index("{") :])
    assert report["cases"] == 600 and report["ks"] == [5, 10]
    assert report["model"]["recall@10"] > 3 * report["popularity"]["recall@10"]
    assert 0 < report["model"]["ndcg@10"] <= report["model"]["recall@10"]


def test_train_refuses_an_existing_model_and_unknown_items(built, tmp_path):
    result = CliRunner().invoke(main, ["train", "--data", str(EXAMPLE / "interactions.jsonl"),
        "--catalog", str(built / "index.json"), "--output", str(built / "model")])  # fmt: skip
    assert result.exit_code != 0 and "already holds a model" in result.output
    data = tmp_path / "d.jsonl"
    data.write_text('{"items": ["tents-01", "nope", "tents-02"]}\n')
    result = CliRunner().invoke(main, ["train", "--data", str(data), "--catalog",
        str(built / "index.json"), "--output", str(tmp_path / "m")])  # fmt: skip
    assert result.exit_code != 0 and "not in the catalog ('nope')" in result.output
