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
    head = f"3 rounds of 5 tokens, 1 threads, values {values}, positions up to 512"
    out = out[out.index(head) :]  # (after libraries' notices)
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


def test_step_ab_refuses_positions_that_cannot_hold_the_prompt_and_a_segment(capsys):
    step_ab = _step_ab()
    assert step_ab.parse_args(["a=f:auto", "--segment", "5", "--positions", "11"]).positions == 11  # 6 + 5
    with pytest.raises(SystemExit) as e:
        step_ab.parse_args(["a=f:auto", "--segment", "5", "--positions", "10"])
    assert e.value.code == 2 and "at least 11" in capsys.readouterr().err


def test_step_ab_restarts_each_cache_before_it_passes_positions(tmp_path, monkeypatch):
    """--positions 16 with segments of 5 after the 6-token prompt: positions 6-10 and 11-15 on one cache, then
    a new one (16 + 5 would pass 16), for every model; no step ever writes position 16 or later."""
    from hf_sparsity.inference import native_step

    tiny_model("llama", vocab=256).save_pretrained(tmp_path / "m")
    made, steps = [], []

    class Counting(native_step.NativeDecoder):
        def start(self, ids, max_len, *a, **k):
            made.append(max_len)
            self.at = ids.shape[1]
            return super().start(ids, max_len, *a, **k)

        def step(self, token, *a, **k):
            steps.append(self.at)
            self.at += 1
            return super().step(token, *a, **k)

    monkeypatch.setattr(native_step, "NativeDecoder", Counting)
    folder = str(tmp_path / "m")
    args = [f"a={folder}:native_dense", f"b={folder}:native_dense", "--values", "float32", "--threads", "1"]
    assert _step_ab().main([*args, "--rounds", "5", "--segment", "5", "--positions", "16"]) == 0
    assert made == [16] * 6  # rounds 1, 3 and 5 start over, for each of the two models
    assert max(steps) == 15 and len(steps) == 2 * 5 * 5
    assert steps[:10] == [6, 7, 8, 9, 10] * 2 and steps[10:20] == [11, 12, 13, 14, 15] * 2
