"""The ``xgr`` command line on a small model folder (click's CliRunner)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from xgr.cli import main


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_recommend_prints_titles_and_semantic_ids(served_model_dir):
    result = run(
        "recommend",
        "--model",
        str(served_model_dir),
        "--history",
        "item3",
        "--history",
        "Title of item7",
        "--beam-width",
        "16",
        "--num-results",
        "3",
    )
    assert result.exit_code == 0, result.output
    header, first = result.output.splitlines()[:2]
    assert header.split() == ["rank", "item", "score", "semantic", "ID"]
    assert first.lstrip().startswith("1. Title of item") and "<a_" in first
    assert "beam width 16" in result.output and "log-probability" in result.output


def test_recommend_json_excludes_history(served_model_dir):
    result = run(
        "recommend",
        "--model",
        str(served_model_dir),
        "--history",
        "item3",
        "--beam-width",
        "16",
        "--num-results",
        "5",
        "--json",
    )
    assert result.exit_code == 0, result.output
    items = json.loads(result.output)["items"]
    assert len(items) >= 5 and "item3" not in {i["item_id"] for i in items}
    assert json.loads(result.output)["complete"] is True
    assert all(i["title"] == f"Title of {i['item_id']}" for i in items)


def test_recommend_from_one_of_several_catalogs(served_model_dir, tmp_path):
    from xgr import ItemCatalog

    us = ItemCatalog.from_index_json(served_model_dir / "catalog.index.json")
    eu = ItemCatalog.from_codes(us.item_ids[150:], us.codes[150:], us.codebook_size)
    eu.to_index_json(tmp_path / "eu.json")
    common = ["recommend", "--model", str(served_model_dir), "--catalog",
              f"us={served_model_dir / 'catalog.index.json'}", "--catalog",
              f"eu={tmp_path / 'eu.json'}", "--history", "item200", "--beam-width", "16",
              "--num-results", "5", "--json"]  # fmt: skip
    eu_items = {
        i["item_id"] for i in json.loads(run(*common, "--from-catalog", "eu").output)["items"]
    }
    assert eu_items and eu_items <= set(eu.item_ids)
    us_items = {i["item_id"] for i in json.loads(run(*common).output)["items"]}
    assert us_items - set(eu.item_ids)  # the default reaches items eu lacks
    missing = run(*common[:-1], "--from-catalog", "asia")
    assert missing.exit_code != 0 and "no catalog named 'asia'" in missing.output
    served = run("recommend", "--server", "http://127.0.0.1:1", "--catalog", "x.json",
                 "--history", "item3")  # fmt: skip
    assert served.exit_code != 0 and "--from-catalog" in served.output


def test_errors_are_messages_not_tracebacks(served_model_dir, tmp_path):
    model = str(served_model_dir)
    index = str(served_model_dir / "catalog.index.json")
    (tmp_path / "file").write_text("")  # a --cache-dir below a file cannot be made
    (tmp_path / "report.json").write_text("{}")
    (tmp_path / "hard.png").hardlink_to(tmp_path / "report.json")
    (tmp_path / "loop.png").symlink_to(tmp_path / "loop.png")
    cases = [
        (("recommend", "--model", model, "--history", "nope"), "unknown items in history: 'nope'"),
        (("recommend", "--history", "x"), "give exactly one of --demo and --model"),
        (
            ("recommend", "--model", model, "--server", "http://127.0.0.1:1", "--history", "x"),
            "--server asks a running server",
        ),
        (("recommend", "--server", "127.0.0.1:1", "--history", "x"), "http://"),
        (("recommend", "--model", str(tmp_path / "none"), "--history", "x"), "does not exist"),
        (("recommend", "--model", model, "--device", "foo", "--history", "x"), "unknown device"),
        (("recommend", "--model", model, "--top-k", "0", "--history", "item3"), "top_k"),
        (("serve", "--model", model, "--port", "99999"), "99999"),
        (
            ("serve", "--model", model, "--catalog", index, "--catalog", index),
            "--catalog: given several times, each must be NAME=FILE",
        ),
        (
            ("serve", "--model", model, "--catalog", f"us={index}", "--catalog", f"us={index}"),
            "--catalog: a catalog name is given twice",
        ),
        (
            ("serve", "--model", model, "--catalog", f"us={index}", "--attributes", f"eu={index}"),
            "--attributes eu=",
        ),
        (("serve", "--model", model, "--attributes", str(tmp_path)), "is not a file"),
        (
            (
                "recommend",
                "--model",
                model,
                "--catalog",
                f"us={tmp_path / 'none.json'}",
                "--history",
                "item3",
            ),
            "none.json",
        ),  # fmt: skip
        (("serve", "--model", model, "--host", "not a host!"), "--host 'not a host!' cannot be"),
        (("serve", "--model", model, "--warm-up-tokens", "100000"), "100000 tokens exceed"),
        (("serve", "--model", model, "--max-batch-ms", "0"), "max_batch_ms"),
        (
            (
                "bench",
                "serve",
                "--model",
                model,
                "--rate",
                "5",
                "--beam-width",
                "8",
                "--output",
                str(tmp_path / "b.json"),
            ),
            "--num-results 10 exceeds --beam-width 8",
        ),
        *(
            (
                ("bench", "serve", "--model", model, "--rate", "5", "--duration", "1", *extra),
                message,
            )
            for extra, message in [
                (("--output", str(tmp_path / "no" / "b.json")), "--output: no folder"),
                (("--output", "/proc/xgr-bench.json"), "--output: cannot write"),
                (
                    ("--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "p.txt")),
                    "--plot: give a file ending in .png, .svg, .pdf",
                ),
                (
                    ("--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "file/p.png")),
                    "--plot: no folder",
                ),
                (("--output", str(tmp_path / "r.png")), "--plot and --output name one file"),
                (
                    (
                        "--output",
                        str(tmp_path / "report.json"),
                        "--plot",
                        str(tmp_path / "hard.png"),
                    ),
                    "--plot and --output name one file",
                ),
                (
                    ("--output", str(tmp_path / "b.json"), "--plot", str(tmp_path / "loop.png")),
                    "--plot: cannot write",
                ),
                (("--output", ""), "--output: give a file name"),
            ]
        ),
        (
            ("bench", "serve", "--model", model, "--rate", "5", "--output", f"{model}/r.json"),
            "holds the model's files and data",
        ),
        (
            (
                "eval",
                "--demo",
                "--cache-dir",
                str(tmp_path / "c"),
                "--output",
                str(tmp_path / "c/x"),
            ),
            "holds the model's files and data",
        ),
        (("eval", "--demo", "--beam-width", "5000"), "--beam-width 5000 is above the limit 4096"),
        (("eval",), "give --model DIR with --data FILE, or --demo"),
        (("eval", "--model", "m"), "--model needs --data FILE"),
        (("recommend", "--model", model, "--arch", "t5", "--history", "x"), "pass --demo with"),
        (
            ("recommend", "--demo", "--arch", "qwen2", "--arch", "t5", "--history", "x"),
            "give --arch once (got qwen2, t5)",
        ),
        (("eval", "--demo", "--arch", "bert"), "'bert' is not one of 'qwen2', 't5'"),
        # Refused before the evaluation runs, not after it.
        (("eval", "--demo", "--k", "0"), "0 is not in the range x>=1"),
        (("eval", "--demo", "--beam-width", "5"), "--beam-width 5 is below --k 10"),
        (("eval", "--demo", "--output", str(tmp_path / "no" / "x.json")), "--output: no folder"),
        (("eval", "--demo", "--output", "/proc/xgr-eval.json"), "--output: cannot write"),
        (
            (
                "recommend",
                "--demo",
                "--cache-dir",
                str(tmp_path / "file" / "sub"),
                "--history",
                "x",
            ),
            "Not a directory",
        ),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code != 0, args
        assert message in result.output, (args, result.output)
        assert "Traceback" not in result.output
    assert (tmp_path / "report.json").read_text() == "{}"


def test_output_checks_leave_a_dangling_link_as_it_was(served_model_dir, tmp_path):
    (tmp_path / "dangling.json").symlink_to(tmp_path / "target" / "report.json")
    (tmp_path / "target").mkdir()
    args = ["bench", "serve", "--model", str(served_model_dir), "--output"]
    result = run(*args, str(tmp_path / "dangling.json"), "--rate", "0")
    assert result.exit_code != 0 and "rate" in result.output
    assert (tmp_path / "dangling.json").is_symlink()
    assert not (tmp_path / "target" / "report.json").exists()


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    import xgr

    result = run("--version")
    assert result.exit_code == 0
    assert result.output.strip() == f"xgr, version {version('xgr')}"
    assert xgr.__version__ == version("xgr")


def test_recommend_with_fp8_quantization(served_model_dir):
    common = ["recommend", "--model", str(served_model_dir), "--history", "item3",
              "--beam-width", "16", "--num-results", "5", "--json"]  # fmt: skip
    result = run(*common, "--quantization", "fp8")  # bfloat16 activations by default
    assert result.exit_code == 0, result.output
    items = json.loads(result.output)["items"]
    assert len(items) >= 5 and all(i["score"] < 0 for i in items)
    refused = CliRunner().invoke(main, [*common, "--quantization", "fp8", "--dtype", "float32"])
    assert refused.exit_code != 0 and "use dtype 'bfloat16'" in refused.output
