"""benchmarks/step_ab.py: models alternate in segments in one process; every model's row, its ratio to the
first one, and bad model specs refused before anything loads."""

from __future__ import annotations

import sys

import pytest
import torch

from .conftest import REPO, tiny_model


def _step_ab():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import step_ab

    return step_ab


@pytest.mark.parametrize("values", ["float32", "int8"])
def test_step_ab_prints_every_model_against_the_first(tmp_path, capsys, values):
    model = tiny_model("llama", vocab=256)
    with torch.no_grad():  # a weight of exact zeros in every projection: the folder's zeros are its masks
        for name, p in model.named_parameters():
            if p.ndim == 2 and "proj" in name:
                p[:, ::2] = 0
    model.save_pretrained(tmp_path / "m")
    folder = str(tmp_path / "m")
    step_ab = _step_ab()
    args = [f"gemv={folder}:native_dense", f"bm={folder}:bitmask", "--values", values]
    assert step_ab.main([*args, "--rounds", "3", "--segment", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    out = out[out.index(f"3 rounds of 5 tokens, 1 threads, values {values}") :]  # (after libraries' notices)
    rows = {line.split()[0]: line for line in out[1:]}
    assert set(rows) == {"gemv", "bm"}
    assert "x gemv: 1.000 (quartiles 1.000-1.000)" in rows["gemv"]
    for line in rows.values():
        tok_s, mib = float(line.split()[1]), float(line.split()[3])
        assert tok_s > 0 and mib > 0


@pytest.mark.parametrize("spec", ["dense", "dense=folder", "=x"])
def test_step_ab_refuses_a_model_without_name_folder_and_backend(spec, capsys):
    with pytest.raises(SystemExit) as e:
        _step_ab().parse_args([spec])
    assert e.value.code == 2
    assert "NAME=FOLDER:BACKEND" in capsys.readouterr().err


def test_step_ab_refuses_one_round():
    with pytest.raises(SystemExit):
        _step_ab().parse_args(["a=f:auto", "--rounds", "1"])
