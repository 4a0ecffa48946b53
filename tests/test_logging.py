"""Console vs reporters on a 30-layer model: totals and FLOPs on the console line, per-layer values in
TensorBoard."""

from __future__ import annotations

import ast

import pytest

from hf_sparsity import SparsityCallback, SparsityConfig
from hf_sparsity.logging_utils import (
    LAYER_PREFIX,
    SparsityPrinterCallback,
    SparsityProgressCallback,
    arrange_logging,
    split_metrics,
)

from .conftest import tiny_model
from .trainer_utils import make_trainer

LAYERS = 30
TENSORS = 7 * LAYERS  # q, k, v, o, gate, up, down per llama block: 210, as SmolLM2-135M
CONSOLE_KEYS = (
    "loss",
    "learning_rate",
    "sparsity/total",
    "sparsity/train_flops",
    "sparsity/effective_sparsity",
)


def _train(tmp_path, capsys, *, log_layers=True, console_layers=None, tqdm=False, print_report=False):
    cb = SparsityCallback(SparsityConfig(sparsity=0.5), log_layers=log_layers, print_report=print_report)
    trainer = make_trainer(
        tiny_model("llama", layers=LAYERS, hidden=16),
        tmp_path / "out",
        [cb],
        max_steps=4,
        logging_steps=2,
        report_to=["tensorboard"],
        disable_tqdm=not tqdm,
    )
    if console_layers is not None:
        arrange_logging(trainer, cb, console_layers=console_layers)
    capsys.readouterr()
    trainer.train()
    out = capsys.readouterr().out
    lines = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{") and "'loss'" in line]
    return trainer, cb, out, lines


def _tb_tags(tmp_path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags: set[str] = set()
    for f in (tmp_path / "out").rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(f.parent))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    return tags


def test_split_metrics_keeps_order():
    logs = {"loss": 1.0, f"{LAYER_PREFIX}a": 0.5, "sparsity/total": 0.5, f"{LAYER_PREFIX}b": 0.4}
    console, layers = split_metrics(logs)
    assert list(console) == ["loss", "sparsity/total"]
    assert list(layers) == [f"{LAYER_PREFIX}a", f"{LAYER_PREFIX}b"]


@pytest.mark.slow
def test_console_gets_totals_tensorboard_gets_layers(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    trainer, cb, out, lines = _train(tmp_path, capsys, print_report=True)
    cbs = trainer.callback_handler.callbacks
    assert cbs[0] is cb  # before TensorBoardCallback, so the reporter sees every scalar
    assert any(type(c) is SparsityPrinterCallback for c in cbs)
    assert len(lines) == 2  # steps 2 and 4
    for line in lines:
        assert all(k in line for k in CONSOLE_KEYS), line
        assert not any(k.startswith(LAYER_PREFIX) for k in line), line
        assert len(line) < 20
    tags = _tb_tags(tmp_path)
    layer_tags = {t for t in tags if t.startswith("train/" + LAYER_PREFIX)}
    assert len(layer_tags) == TENSORS
    assert "train/sparsity/total" in tags and "train/loss" in tags
    table = [r for r in out.splitlines() if r.startswith("model.layers.")]
    assert len(table) == TENSORS  # the end-of-training table has every layer
    assert "total: 210 tensors" in out


@pytest.mark.slow
def test_switches(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    # per-layer values back on the console, through the tqdm progress printer
    trainer, _, _, lines = _train(tmp_path / "a", capsys, console_layers=True, tqdm=True)
    assert any(type(c) is SparsityProgressCallback for c in trainer.callback_handler.callbacks)
    assert lines and sum(k.startswith(LAYER_PREFIX) for k in lines[0]) == TENSORS
    # no per-layer values anywhere
    _, _, _, lines = _train(tmp_path / "b", capsys, log_layers=False)
    assert lines and "sparsity/total" in lines[0]
    tags = _tb_tags(tmp_path / "b")
    assert "train/sparsity/total" in tags
    assert not any(LAYER_PREFIX in t for t in tags)
