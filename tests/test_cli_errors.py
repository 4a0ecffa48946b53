"""Every subcommand answers bad input with one ``error: ...`` line and exit code 2, and writes nothing.

Each case runs ``hf_sparsity.cli.main`` in a scratch folder and checks: the exit status is
nonzero, stderr is one line naming the problem (the expected words below), no traceback
escaped (any other exception fails the test), and the folder holds exactly what it held before.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hf_sparsity.cli import main

from .conftest import tiny_model

SMALL = ["--limit", "2", "--device", "cpu", "--no-progress"]
CALIB_SMALL = ["--nsamples", "2", "--seqlen", "16"]

CASES = {
    "validate": [
        (["validate", "--config", "nosuch.yaml", "--model", "M"], "does not exist"),
        (["validate", "--config", "S.yaml", "--model", "empty"], "no config.json"),
        (["validate", "--config", "S.yaml", "--model", "badtype"], "cannot read this config"),
        (["validate", "--config", "bad.yaml", "--model", "M"], "sparsity"),
    ],
    "inspect": [
        (["inspect", "nosuch"], "does not exist"),
        (["inspect", "noweights"], "no weights"),
        (["inspect", "empty"], "no config.json"),
        (["inspect", "M/config.json"], "is a file"),
    ],
    "convert": [
        (["convert", "--finalize", "nosuch", "out"], "does not exist"),
        (["convert", "--finalize", "noweights", "out"], "no weights"),
        (["convert", "--finalize", "M", "existing"], "already exists"),
        (["convert", "--finalize", "dense", "out"], "nothing to finalize"),
        (["convert", "M", "out"], "one of the arguments"),
        (["convert", "--finalize", "M", "M", "--overwrite"], "is the model folder"),
        (["convert", "--finalize", "M", "M/final", "--overwrite"], "inside the model folder"),
        (["convert", "--to-sentinel", "M", "M/sub/out"], "inside the model folder"),
        (["convert", "--finalize", "M", ".", "--overwrite"], "holds the model folder"),
        (["convert", "--finalize", "garbage", "out"], "sparsity._state is 'garbage'"),
    ],
    "flops": [
        (["flops", "--config", "nosuch"], "no config.json"),
        (["flops", "--config", "badtype"], "cannot read this config"),
        (["flops", "--config", "M", "--sparsity", "1.5"], "1.5"),
        (["flops", "--config", "M", "--seq-len", "0"], "--seq-len"),
    ],
    "ift": [
        (["ift", "--config", "nosuch", "--sparsity", "0.5", "--transform", "wide"], "no config.json"),
        (["ift", "--config", "M", "--sparsity", "1.5", "--transform", "wide"], "1.5"),
        (["ift", "--config", "M", "--sparsity", "0.5", "--transform", "nosuch"], "invalid choice"),
        (
            ["ift", "--config", "M", "--sparsity", "0.5", "--transform", "wide", "--out", "existing"],
            "already exists",
        ),
    ],
    "eval": [
        (["eval", "M", "--suite", "nosuchtask", "--data-dir", "DATA", *SMALL], "arc_easy"),
        (["eval", "M", "--suite", "pile", "--limit", "0", "--data-dir", "DATA"], "positive"),
        (["eval", "M", "--suite", "pile", "--limit", "pile=0", "--data-dir", "DATA"], "for pile"),
        (["eval", "M", "--suite", "pile", "--limit", "x"], "Bad --limit"),
        (
            ["eval", "M", "--suite", "pile", "--data-dir", "DATA", "--limit", "2", "--device", "cuda:99"],
            "cuda",
        ),
        (
            ["eval", "M", "--suite", "pile", "--data-dir", "DATA", "--limit", "2", "--device", "tpu0"],
            "device",
        ),
        (["eval", "M", "--suite", "pile", "--pile-data", "nosuch.jsonl", *SMALL], "--pile-data"),
        (["eval", "M", "--suite", "wikitext103", "--wikitext", "nosuch.tokens", *SMALL], "--wikitext"),
        (["eval", "nosuch", "--suite", "pile", "--data-dir", "DATA", *SMALL], "does not exist"),
        (["eval", "noweights", "--suite", "pile", "--data-dir", "DATA", *SMALL], "no weights"),
        (["eval", "notok", "--suite", "pile", "--data-dir", "DATA", *SMALL], "--tokenizer DIR"),
        (
            ["eval", "notok", "--suite", "pile", "--tokenizer", "nosuch", "--data-dir", "DATA", *SMALL],
            "nosuch",
        ),
        (["eval", "M", "--suite", "pile", "--data-dir", "nosuchdir", *SMALL], "--data-dir"),
        (["eval", "M", "--suite", "pile", "--data-dir", "DATA", "--dtype", "int3", *SMALL], "dtype"),
        (["eval", "M", "--suite", "pile", "--data-dir", "DATA", "--batch-size", "0", *SMALL], "--batch-size"),
        (["eval", "M", "--suite", "pile", "--data-dir", "DATA", "--context", "100000", *SMALL], "--context"),
        (["eval", "M", "--suite", "harness7", *SMALL], "--data-dir"),  # offline: no Hub data
        (["eval", "--suite", "pile"], "Name the model folder"),
        (["eval", "trunc", "--suite", "pile", "--data-dir", "DATA", *SMALL], "truncated"),
        (["eval", "--compare", "M"], "--out"),
        (["eval", "--compare", "nosuch", "--out", "cmp"], "nosuch"),
    ],
    "bench": [
        (["bench", "--backend", "nosuch", "--shape", "8x8"], "nosuch"),
        (["bench", "--device", "cuda:99", "--shape", "8x8"], "cuda"),
        (["bench", "--model", "nosuch"], "does not exist"),
        (["bench", "--model", "noweights"], "no weights"),
        (["bench", "--model", "M", "--masks", "nosuch.safetensors"], "--masks"),
        (["bench", "--shape", "8x8", "--repeats", "0"], "--repeats"),
        (["bench", "--model", "M", "--new-tokens", "0"], "--new-tokens"),
        (["bench", "--shape", "axb"], "--shape"),
    ],
    "prune": [
        (["prune", "nosuch", "out", "--method", "magnitude"], "does not exist"),
        (["prune", "noweights", "out", "--method", "magnitude"], "no weights"),
        (["prune", "empty", "out", "--method", "magnitude"], "no config.json"),
        (["prune", "M/config.json", "out", "--method", "magnitude"], "is a file"),
        (["prune", "notok", "out", "--calib-data", "CALIB", *CALIB_SMALL], "No tokenizer"),
        (["prune", "dense", "out", "--method", "wanda", "--seqlen", "16"], "--calib-data"),
        (["prune", "dense", "out", "--calib-data", "nosuch.jsonl", *CALIB_SMALL], "does not exist"),
        (["prune", "dense", "out", "--method", "magnitude", "--sparsity", "1.5"], "outside [0, 1)"),
        (["prune", "dense", "out", "--method", "magnitude", "--sparsity", "1"], "outside [0, 1)"),
        (["prune", "dense", "out", "--method", "magnitude", "--device", "cuda:99"], "cuda"),
        (["prune", "dense", "out", "--method", "magnitude", "--device", "tpu0"], "device"),
        (["prune", "dense", "existing", "--method", "magnitude"], "--overwrite"),
        (["prune", "dense", "dense/pruned", "--method", "magnitude"], "inside the model folder"),
        (
            ["prune", "dense", "out", "--calib-data", "CALIB", "--seqlen", "16", "--nsamples", "0"],
            "--nsamples",
        ),
        (["prune", "dense", "out", "--calib-data", "CALIB", "--seqlen", "0"], "--seqlen"),
        (["prune", "dense", "out", "--calib-data", "CALIB", "--seqlen", "100000"], "n_positions=64"),
        (["prune", "dense", "out", "--calib-data", "CALIB", "--batch-size", "0"], "--batch-size"),
        (
            ["prune", "dense", "out", "--method", "sparsegpt", "--calib-data", "CALIB", "--blocksize", "0"],
            "--blocksize",
        ),
        (["prune", "dense", "out", "--method", "sparsegpt", "--percdamp", "-1"], "--percdamp"),
        (["prune", "dense", "out", "--method", "magnitude", "--structure", "x:y"], "N:M"),
        (["prune", "dense", "out", "--method", "magnitude", "--config", "nosuch.yaml"], "does not exist"),
        (["prune", "dense", "out", "--method", "nosuch"], "invalid choice"),
        (["prune", "dense", "out", "--calib-data", "bin.jsonl", *CALIB_SMALL], "not UTF-8"),
        (["prune", "dense", "out", "--calib-data", "bin.txt", *CALIB_SMALL], "not UTF-8"),
        (["prune", "dense", "out", "--calib-data", "null.jsonl", *CALIB_SMALL], "'text' is NoneType"),
        (["prune", "dense", "out", "--calib-data", "number.jsonl", *CALIB_SMALL], "'text' is int 12345"),
        (["prune", "dense", "out", "--calib-data", "list.jsonl", *CALIB_SMALL], "'text' is list"),
        (["prune", "dense", "out", "--calib-data", "array.json", *CALIB_SMALL], "one object per line"),
        (["prune", "dense", "out", "--calib-data", "strings.jsonl", *CALIB_SMALL], "not an object"),
        (["prune", "smallvocab", "out", "--calib-data", "CALIB", *CALIB_SMALL], "embedding has 128 rows"),
        (["prune", "trunc", "out", "--method", "magnitude"], "truncated"),
    ],
    "generate": [
        (["generate", "nosuch", "--prompt", "hi"], "does not exist"),
        (["generate", "noweights", "--prompt", "hi"], "no weights"),
        (["generate", "empty", "--prompt", "hi"], "no config.json"),
        (["generate", "notok", "--prompt", "hi"], "No tokenizer"),
        (["generate", "M", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["generate", "M", "--prompt", "hi", "--backend", "nosuch"], "nosuch"),
        (["generate", "M", "--prompt", "hi", "--dtype", "int3"], "--dtype"),
        (["generate", "M", "--prompt", "hi", "--masks", "nosuch.safetensors"], "--masks"),
        (["generate", "M", "--prompt", "hi", "--threads", "0"], "--threads"),
        (["generate", "M"], "--prompt"),
        (["generate", "trunc", "--prompt", "hi"], "truncated"),
        (
            ["generate", "M", "--prompt", "hi", "--max-new-tokens", "100", "--no-dense"],
            "--max-new-tokens 64 or less",
        ),
        (["generate", "M", "--prompt", "hi " * 70, "--no-dense"], "shorten the prompt"),
        (["generate", "smallvocab", "--prompt", "hi there"], "embedding has 128 rows"),
    ],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A scratch folder with a good sparse model ``M`` and the broken folders the cases name."""
    from transformers import GPT2TokenizerFast

    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    from .conftest import shared_data_dir

    data = shared_data_dir()
    root = tmp_path_factory.mktemp("cli_errors")
    tok = GPT2TokenizerFast.from_pretrained(data / "tokenizer/gpt2")
    model = tiny_model("gpt2", vocab=len(tok))
    model.save_pretrained(root / "dense")
    tok.save_pretrained(root / "dense")
    model.save_pretrained(root / "M")
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    engine.build_masks()
    engine.save(root / "M")
    tok.save_pretrained(root / "M")
    model.save_pretrained(root / "notok")
    (root / "empty").mkdir()
    (root / "noweights").mkdir()
    model.config.to_json_file(root / "noweights" / "config.json")
    (root / "badtype").mkdir()
    (root / "badtype" / "config.json").write_text(json.dumps({"model_type": "nosuch_arch"}))
    (root / "existing").mkdir()
    (root / "S.yaml").write_text("sparsity:\n  sparsity: 0.5\n")
    (root / "bad.yaml").write_text("sparsity:\n  sparsity: 7\n")
    shutil.copytree(root / "M", root / "trunc")  # a copy cut short mid-write
    weights = (root / "M" / "model.safetensors").read_bytes()
    (root / "trunc" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(root / "M", root / "garbage")
    cfg = json.loads((root / "M" / "config.json").read_text())
    cfg["sparsity"] = {"sparsity": 0.5, "_state": "garbage"}
    (root / "garbage" / "config.json").write_text(json.dumps(cfg))
    tiny_model("gpt2", vocab=128).save_pretrained(root / "smallvocab")  # with gpt2's 50257-token tokenizer
    tok.save_pretrained(root / "smallvocab")
    long = "word " * 200
    (root / "bin.jsonl").write_bytes(bytes(range(256)) * 8)
    (root / "bin.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)) * 8)
    for name, value in (("null", None), ("number", 12345), ("list", ["a", "b"])):
        rows = [{"text": long}, {"text": value}]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "array.json").write_text(json.dumps([{"text": long}, {"text": long}], indent=1))
    (root / "strings.jsonl").write_text(json.dumps(long) + "\n")
    return root, data


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _cases():
    for command, cases in CASES.items():
        for argv, expect in cases:
            yield pytest.param(argv, expect, id=f"{command}:{' '.join(argv[1:])}"[:90])


def _one_line_error(root: Path, data: Path, argv: list[str], capsys) -> str:
    """Run the CLI on ``argv``; check it failed with one error line and wrote nothing; return the line."""
    calib = str(data / "corpus" / "openwebtext-1000.jsonl")
    argv = [str(data) if a == "DATA" else calib if a == "CALIB" else a for a in argv]
    before = _tree(root)
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: usage line + one error line
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc not in (0, None), f"{argv} succeeded"
    assert "Traceback" not in err
    last = err.splitlines()[-1] if err else ""
    print(f"MSG {' '.join(argv)} -> {last}")  # pytest -s shows every message
    assert last.startswith(("error:", "hf_sparsity")), err
    if not last.startswith("hf_sparsity"):  # argparse puts usage first; ours is one line
        assert len(err.splitlines()) == 1, err
    assert _tree(root) == before, f"{argv} left {sorted(_tree(root) - before)}"
    return last


@pytest.mark.parametrize("argv,expect", list(_cases()))
def test_bad_input_is_one_line(workdir, argv, expect, capsys, monkeypatch):
    root, data = workdir
    monkeypatch.chdir(root)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # as in CI: nothing from the Hub
    last = _one_line_error(root, data, argv, capsys)
    assert expect.lower() in last.lower(), f"expected {expect!r} in {last!r}"


def test_json_array_calibration_names_the_format_not_text_column(workdir, capsys, monkeypatch):
    root, data = workdir
    monkeypatch.chdir(root)
    last = _one_line_error(
        root, data, ["prune", "dense", "out", "--calib-data", "array.json", *CALIB_SMALL], capsys
    )
    assert "JSON array" in last and "JSON Lines" in last and "--text-column" not in last


def _fill_disk(write):
    """A writer that writes half of its output, then fails as a full disk does."""

    def full(tensors, filename, *args, **kwargs):
        write(tensors, filename, *args, **kwargs)
        data = Path(filename).read_bytes()
        Path(filename).write_bytes(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))

    return full


@pytest.mark.parametrize(
    "argv",
    [
        ["prune", "dense", "out", "--method", "magnitude", "--no-progress"],
        ["prune", "dense", "existing", "--method", "magnitude", "--overwrite", "--no-progress"],
        ["convert", "--finalize", "M", "out"],
        ["convert", "--to-sentinel", "M", "existing", "--overwrite"],
    ],
    ids=lambda a: " ".join(a[:2] + a[3:4]),
)
def test_disk_full_is_one_line_and_leaves_nothing(workdir, argv, capsys, monkeypatch):
    import safetensors.torch
    import transformers.modeling_utils

    root, data = workdir
    monkeypatch.chdir(root)
    # every safetensors write fails: save_pretrained's (prune) and the shard rewrites' (convert)
    monkeypatch.setattr(
        transformers.modeling_utils, "safe_save_file", _fill_disk(transformers.modeling_utils.safe_save_file)
    )
    monkeypatch.setattr(safetensors.torch, "save_file", _fill_disk(safetensors.torch.save_file))
    last = _one_line_error(root, data, argv, capsys)
    assert "No space left on device" in last and "Free some space" in last, last
    assert not any((root / "existing").iterdir())  # --overwrite kept the old folder as it was


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (needs root; skipped elsewhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_convert_onto_a_really_full_disk(workdir, tiny_disk, capsys, monkeypatch):
    root, data = workdir
    monkeypatch.chdir(root)
    before = set(tiny_disk.iterdir())
    last = _one_line_error(root, data, ["convert", "--finalize", "M", str(tiny_disk / "out")], capsys)
    assert "No space left on device" in last, last
    assert set(tiny_disk.iterdir()) == before


def test_every_subcommand_has_cases():
    from hf_sparsity.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    mine = {"validate", "inspect", "convert", "flops", "ift", "eval", "bench", "prune", "generate"}
    assert mine <= set(sub.choices), set(sub.choices)
    assert mine <= set(CASES)


def test_generate_up_to_the_context_runs(workdir, capsys, monkeypatch):
    """The largest --max-new-tokens the context error allows is accepted and runs."""
    root, _ = workdir
    monkeypatch.chdir(root)
    argv = [
        "generate",
        "M",
        "--prompt",
        "hi",
        "--max-new-tokens",
        "64",
        "--no-dense",
        "--backend",
        "masked_dense",
    ]
    assert main(argv) == 0, capsys.readouterr().err
