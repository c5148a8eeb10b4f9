"""Interaction files, semantic-ID levels, and the training loop's resume."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from xgr.core import XgrError
from xgr.training.interactions import read_interactions
from xgr.training.loop import TrainSettings, train_model
from xgr.training.semantic_ids import balanced_kmeans, codebook_report, separate_collisions

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def test_amazon_txt_is_split_leave_one_out(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("u1 1 2 3 4\nu2 5 6\n\nu3 7 8 9\n")
    data = read_interactions(path)
    assert data.train == (("1", "2"), ("5", "6"), ("7",))
    assert data.valid.targets == ("3", "8") and data.valid.histories == (("1", "2"), ("7",))
    assert data.test.targets == ("4", "9") and data.test.histories[0] == ("1", "2", "3")
    assert data.item_ids[:3] == ("1", "2", "3")


def test_csv_rows_become_one_sequence_per_user(tmp_path):
    path = tmp_path / "r.csv"
    path.write_text('user_id,history_item_id,item_id\nA,"[1, 2]",3\nA,"[1, 2, 3]",4\nB,[5],6\n')
    data = read_interactions(path)
    assert data.train == (("1", "2", "3", "4"), ("5", "6"))
    assert data.valid is None and data.test.targets == ("3", "4", "6")
    with pytest.raises(XgrError, match="no validation split"):
        data.split("valid")


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("x.tsv", "", "unknown interaction format"),
        ("x.txt", "u1\n", "x.txt:1"),
        ("x.csv", "user_id,item_id\n", "lacks history_item_id"),
        ("x.csv", "user_id,history_item_id,item_id\nA,oops,3\n", "list literal"),
        ("x.jsonl", '{"items": ["1"]}\n{"history": [], "item": "2"}\n', "mixes"),
        ("x.jsonl", "[1]\n", "JSON object"),
    ],
)
def test_bad_files_are_named(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(XgrError, match=message):
        read_interactions(path)


def test_real_files_when_present():
    beauty = DATA / "amazon-beauty-sports-toys" / "Beauty.txt"
    if not beauty.is_file():
        pytest.skip(f"{beauty} is missing (../shared/data)")
    data = read_interactions(beauty)
    assert len(data.train) == 22363 and len(data.item_ids) == 12101
    assert len(data.test) == 22363
    valid = read_interactions(DATA / "amazon-industrial" / "valid_Industrial_and_Scientific.csv")
    assert len(valid.test) == 4532


def test_collision_level_numbers_shared_ids():
    codes = np.array([[0, 1], [0, 1], [2, 3], [0, 1]])
    out = separate_collisions(codes, 4)
    assert out[:, 2].tolist() == [0, 1, 0, 2]
    assert len({tuple(r) for r in out}) == 4
    with pytest.raises(XgrError, match="3 items share one semantic ID"):
        separate_collisions(codes, 2)
    report = codebook_report(codes, 4)
    assert report["collided_semantic_ids"] == 1 and report["largest_collision"] == 3
    assert report["per_level"][0]["codes_used"] == 2


def test_balanced_kmeans_caps_clusters():
    rng = np.random.default_rng(0)
    data = np.concatenate([rng.normal(0, 0.1, (90, 2)), rng.normal(5, 0.1, (10, 2))])
    labels, _ = balanced_kmeans(data, np.array([[0.0, 0.0], [5.0, 5.0], [0.1, 0.1], [4.9, 5.0]]))
    assert np.bincount(labels, minlength=4).max() <= 25


def _toy(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)

    class Out:
        def __init__(self, loss):
            self.loss = loss

    def forward(x, y):
        return Out(torch.nn.functional.mse_loss(model(x), y))

    wrapper = torch.nn.Module()
    wrapper.lin = model
    wrapper.forward = forward
    examples = [(torch.randn(4), torch.randn(1)) for _ in range(40)]
    return wrapper, examples


def _collate(batch):
    return {"x": torch.stack([b[0] for b in batch]), "y": torch.stack([b[1] for b in batch])}


def test_resume_continues_as_one_run(tmp_path):
    model, examples = _toy()
    settings = TrainSettings(batch_size=8, epochs=4, warmup_steps=2, seed=3, learning_rate=0.05)
    train_model(model, examples, settings, _collate, progress=False)
    whole = model.lin.weight.detach().clone()
    first, _ = _toy()
    part = TrainSettings(batch_size=8, epochs=4, warmup_steps=2, seed=3, learning_rate=0.05,
                         max_steps=None, checkpoint_dir=tmp_path, checkpoint_every=7)  # fmt: skip
    # Stop after 7 of 20 steps by a run of 7 steps would change the schedule; instead keep the
    # checkpoint of step 7 of the full run and resume from it.
    train_model(first, examples, part, _collate, progress=False)
    for p in tmp_path.glob("checkpoint-*.pt"):
        if p.name != "checkpoint-14.pt":
            p.unlink()
    resumed, _ = _toy(seed=1)  # other initial weights: the checkpoint's must win
    report = train_model(resumed, examples, part, _collate, progress=False, resume=True)
    assert report.resumed_from == 14 and report.steps == 20
    torch.testing.assert_close(resumed.lin.weight, whole, rtol=0, atol=0)
    json.dumps(report.__dict__)  # plain values only


def test_faiss_and_parquet_inputs(tmp_path):
    pytest.importorskip("faiss", reason="faiss-cpu is in the dev and train extras")
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is in the dev and train extras")
    import pyarrow as pa

    from xgr.training.semantic_ids import build_catalog, load_embeddings

    rng = np.random.default_rng(0)
    vectors = np.concatenate([rng.normal(0, 0.1, (20, 3)), rng.normal(4, 0.1, (20, 3))])
    ids = [f"i{n}" for n in range(40)]
    pq.write_table(
        pa.table({"item_id": ids, "embedding": vectors.tolist()}), tmp_path / "e.parquet"
    )
    got_ids, got = load_embeddings(tmp_path / "e.parquet")
    assert got_ids == ids and np.allclose(got, vectors)
    catalog, report = build_catalog(ids, got, 1, 2, backend="faiss")
    first = catalog.codes[:, 0]
    assert len(set(first[:20])) == 1 and len(set(first[20:])) == 1 and first[0] != first[20]
    assert report["catalog"]["collided_semantic_ids"] == 2
    assert report["catalog"]["largest_collision"] == 20
    with pytest.raises(XgrError, match="needs --item-ids"):
        np.save(tmp_path / "e.npy", vectors)
        load_embeddings(tmp_path / "e.npy")
