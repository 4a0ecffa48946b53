"""benchmarks/frontier.py's smoke mode: a tiny random Llama through every kind of row but llama.cpp's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a subprocess pruning, evaluating and timing a handful of tiny models
def test_frontier_smoke_writes_a_table_json_and_plot_with_every_row(tmp_path):
    from .conftest import wikitext2_head_data_dir

    data = wikitext2_head_data_dir(tmp_path / "data")  # the run evaluates one window of 512 tokens
    env = dict(os.environ, HF_SPARSITY_PLAN_CACHE=str(tmp_path / "plans.json"), PYTHONPATH=str(ROOT))
    out = tmp_path / "frontier"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--smoke", "--data-dir", str(data),
        "--out", str(out), "--levels", "0.5", "--values", "float32", "--ppl-windows", "1", "--threads", "1",
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    record = json.loads((out / "frontier.json").read_text())
    names = [r["name"] for r in record["rows"]]
    assert names == ["dense float32", "u0.5 float32", "spdy@u0.5 float32"]
    for r in record["rows"]:
        assert r["ppl"] > 1 and 0 < r["bytes_per_weight"] <= 4 and r["tok_s"] > 0, r
    spdy = record["rows"][2]
    assert spdy["target"] >= 1.0
    card = (Path(spdy["folder"]) / "README.md").read_text()
    assert "predicted speed-up" in card
    table = (out / "frontier.md").read_text()
    assert all(f"| {n} |" in table for n in names) and "command: python benchmarks/frontier.py" in table
    assert (out / "frontier.png").stat().st_size > 10_000


def test_frontier_help_names_the_drop_in_options():
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "frontier.py"), "--help"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0
    opts = ("--target-speedup", "--head", "--isa", "--no-gguf", "--recover-steps", "--recover-lr", "--refit")
    for opt in (*opts, "--reconstruct-steps", "--smoke", "--recover-temperature", "--recover-bf16"):
        assert opt in res.stdout, opt


def test_the_uniform_perplexity_at_a_measured_speed_is_read_between_the_two_enclosing_rows():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from frontier import uniform_at_speed

    rows = [
        dict(kind="dense", values="int8", tok_s=100.0, ppl=30.0),
        dict(kind="uniform", values="int8", tok_s=160.0, ppl=60.0),
        dict(kind="uniform", values="int8", tok_s=130.0, ppl=34.0),
        dict(kind="uniform", values=None, tok_s=145.0, ppl=1.0),  # another value type: not read
        dict(kind="gguf", values=None, tok_s=140.0, ppl=2.0),
    ]
    at = lambda t: uniform_at_speed(rows, dict(kind="spdy", values="int8", tok_s=t))  # noqa: E731
    assert at(145.0) == pytest.approx(34.0 + 26.0 * 15 / 30)  # halfway from 130 to 160
    assert at(100.0) == 30.0 and at(130.0) == 34.0 and at(160.0) == 60.0
    assert math.isnan(at(170.0)) and math.isnan(at(99.0))  # outside the uniform rows: not extrapolated


def test_the_per_round_ratio_is_the_median_of_same_round_ratios():
    """A machine whose speed drifts between rounds: the ratio of medians mixes rounds, the per-round one
    pairs each row with the dense row of its own round."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from frontier import round_ratio

    dense = [200.0, 100.0, 210.0, 105.0, 150.0]
    row = [220.0, 110.0, 231.0, 115.5, 120.0]  # 1.1x in four rounds, 0.8x in one
    assert round_ratio(row, dense) == pytest.approx(1.1)
    assert sorted(row)[2] / sorted(dense)[2] == pytest.approx(0.8)  # what the medians' ratio says: 120 / 150
    assert round_ratio([1.0, float("nan"), 3.0], [2.0, 2.0, float("nan")]) == 0.5  # pairs with a NaN dropped
    assert math.isnan(round_ratio([1.0], [])) and math.isnan(round_ratio([], [1.0]))


def test_the_recovery_rows_pass_every_recover_option_to_the_recipe(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import frontier

    args = frontier.parse_args(
        ["--model", "M", "--data-dir", "D", "--out", str(tmp_path), "--no-gguf", "--recover-steps", "37",
         "--recover-lr", "3e-4", "--recover-alpha", "0.5", "--recover-temperature", "1", "--recover-bf16"]
    )  # fmt: skip
    seen = []
    monkeypatch.setattr(frontier.subprocess, "run", lambda cmd, **kw: seen.append(cmd))
    final = frontier._recover(args, Path("DENSE"), "CALIB", tmp_path / "models" / "u0.3", tmp_path)
    assert final == tmp_path / "recover" / "u0.3" / "final"
    flags = dict(zip(seen[0][2::2], seen[0][3::2]))
    assert seen[0][1].endswith("prune_recover.py") and flags["--model"] == "DENSE"
    assert (flags["--pruned"], flags["--dataset"], flags["--dense_steps"]) == (
        str(tmp_path / "models" / "u0.3"),
        "CALIB",
        "0",
    )
    assert (flags["--recover_steps"], float(flags["--recover_lr"]), float(flags["--distill_alpha"])) == (
        "37",
        3e-4,
        0.5,
    )
    assert (float(flags["--distill_temperature"]), flags["--bf16"]) == (1.0, "true")


def test_prune_from_prunes_every_row_from_the_given_folder_and_tags_it(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import frontier

    import hf_sparsity.pruning.pipeline as pipeline

    start = tmp_path / "rec30" / "final"
    start.mkdir(parents=True)
    (start / "config.json").write_text("{}")
    args = frontier.parse_args(
        ["--model", "M", "--data-dir", "D", "--out", str(tmp_path), "--no-gguf", "--no-spdy", "--levels",
         "0.32,0.34", "--values", "int8", "--refit", "--reconstruct-steps", "16", "--prune-from",
         f"u0.3rec={start}", "--recover-steps", "5"]
    )  # fmt: skip
    pruned, recovered = [], []
    monkeypatch.setattr(pipeline, "prune_folder", lambda src, dst, **kw: pruned.append((src, dst, kw)))
    monkeypatch.setattr(frontier.subprocess, "run", lambda cmd, **kw: recovered.append(cmd))
    rows = frontier.build_rows(args, Path("DENSE"), tmp_path)
    assert [(src, dst.name, kw["sparsity"]) for src, dst, kw in pruned] == [
        (start, "u0.32+refit+rc16+from-u0.3rec", 0.32),
        (start, "u0.34+refit+rc16+from-u0.3rec", 0.34),
    ]
    names = [r["name"] for r in rows]
    assert names == [
        "dense int8",
        "u0.32+refit+rc16+from-u0.3rec int8",
        "u0.34+refit+rc16+from-u0.3rec int8",
        "u0.32+refit+rc16+from-u0.3rec+rec int8",
        "u0.34+refit+rc16+from-u0.3rec+rec int8",
    ]
    assert rows[0]["folder"] == Path("DENSE")  # the dense row and the recovery's teacher stay --model
    flags = [dict(zip(cmd[2::2], cmd[3::2])) for cmd in recovered]
    assert [(f["--model"], Path(f["--pruned"]).name) for f in flags] == [
        ("DENSE", "u0.32+refit+rc16+from-u0.3rec"),
        ("DENSE", "u0.34+refit+rc16+from-u0.3rec"),
    ]


@pytest.mark.parametrize("given", ["", "u0.3rec", "=FOLDER", "u0.3rec=", "a/b=FOLDER", "u0.3rec=MISSING"])
def test_prune_from_refuses_anything_but_a_name_and_a_model_folder(tmp_path, given, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import frontier

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    given = given.replace("=FOLDER", f"={folder}").replace("MISSING", str(tmp_path / "missing"))
    with pytest.raises(SystemExit):
        frontier.parse_args(
            ["--model", "M", "--data-dir", "D", "--out", "O", "--no-gguf", "--prune-from", given]
        )
    assert "--prune-from takes NAME=FOLDER" in capsys.readouterr().err
    assert (
        frontier.parse_args(
            ["--model", "M", "--data-dir", "D", "--out", "O", "--no-gguf", "--prune-from", f"ok={folder}"]
        ).prune_from
        == f"ok={folder}"
    )
