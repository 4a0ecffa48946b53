"""Console vs reporters on a 30-layer model: totals and FLOPs on the console line, per-layer values in
TensorBoard once ``arrange_logging`` lists the callback first; without that call Trainer's callbacks stay
as Trainer built them."""

from __future__ import annotations

import ast
import logging

import pytest
from transformers import PrinterCallback, ProgressCallback

from hf_sparsity import SparsityCallback, SparsityConfig
from hf_sparsity.logging_utils import (
    LAYER_PREFIX,
    SparsityPrinterCallback,
    SparsityProgressCallback,
    arrange_logging,
    split_metrics,
)
from hf_sparsity.utils import SparsityError

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


def _train(
    tmp_path, capsys, *, log_layers=True, console_layers=False, tqdm=False, print_report=False, layers=LAYERS
):
    cb = SparsityCallback(SparsityConfig(sparsity=0.5), log_layers=log_layers, print_report=print_report)
    trainer = make_trainer(
        tiny_model("llama", layers=layers, hidden=16),
        tmp_path / "out",
        [cb],
        max_steps=4,
        logging_steps=2,
        report_to=["tensorboard"],
        disable_tqdm=not tqdm,
    )
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
    assert type(cbs[-1]) is SparsityPrinterCallback  # the console printer, last as Trainer puts it
    assert not any(type(c) is PrinterCallback for c in cbs)
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


@pytest.mark.slow
def test_without_arrange_logging_the_callbacks_stay_as_trainer_built_them(tmp_path, capsys, caplog):
    pytest.importorskip("tensorboard")
    cb = SparsityCallback(SparsityConfig(sparsity=0.5))
    trainer = make_trainer(
        tiny_model("llama", layers=3, hidden=16),
        tmp_path / "out",
        [cb],
        max_steps=4,
        logging_steps=2,
        report_to=["tensorboard"],
    )
    before = list(trainer.callback_handler.callbacks)
    state_before = dict(vars(cb))
    with caplog.at_level(logging.WARNING, logger="hf_sparsity"):
        trainer.train()
    after = trainer.callback_handler.callbacks
    assert len(after) == len(before) and all(a is b for a, b in zip(after, before))  # same objects, order
    assert type(after[-1]) is PrinterCallback  # Trainer's own printer, not replaced
    assert not set(state_before) - set(vars(cb))  # nothing written on the callback but its own fields
    assert any("arrange_logging(trainer" in r.getMessage() for r in caplog.records)
    out = capsys.readouterr().out
    lines = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{") and "'loss'" in line]
    assert len(lines) == 2
    for line in lines:  # totals and FLOPs, no per-layer values (they would reach no reporter)
        assert all(k in line for k in CONSOLE_KEYS), line
        assert not any(k.startswith(LAYER_PREFIX) for k in line), line
    tags = _tb_tags(tmp_path)
    assert "train/loss" in tags  # the reporter ran before the callback: none of its scalars reached it
    assert not any("sparsity/" in t for t in tags)


def test_arrange_logging_uses_the_public_list_and_refuses_a_stranger(tmp_path):
    cb = SparsityCallback(SparsityConfig(sparsity=0.5))
    other = SparsityCallback(SparsityConfig(sparsity=0.5))
    trainer = make_trainer(tiny_model("gpt2"), tmp_path, [cb], disable_tqdm=False)
    progress = trainer.callback_handler.callbacks[-1]
    assert type(progress) is ProgressCallback
    progress.max_str_len = 7
    names_before = [type(c).__name__ for c in trainer.callback_handler.callbacks if c is not cb][:-1]
    fields = dict(vars(cb))
    arrange_logging(trainer, cb)
    cbs = trainer.callback_handler.callbacks
    assert cbs[0] is cb and [type(c).__name__ for c in cbs[1:-1]] == names_before
    assert type(cbs[-1]) is SparsityProgressCallback and cbs[-1].max_str_len == 7 and not cbs[-1].show_layers
    assert vars(cb) == fields  # the callback's own state untouched: the arrangement is kept outside it
    arrange_logging(trainer, cb, console_layers=True)  # again: the same order, per-layer values shown
    assert trainer.callback_handler.callbacks[0] is cb and trainer.callback_handler.callbacks[-1].show_layers
    assert len(trainer.callback_handler.callbacks) == len(cbs)
    with pytest.raises(SparsityError, match=r"not one of this Trainer's callbacks.*callbacks=\[") as e:
        arrange_logging(trainer, other)
    assert "arrange_logging(trainer, callback)" in str(e.value)


@pytest.mark.parametrize("report_to", ["none", []])
def test_no_reporter_no_warning(tmp_path, caplog, report_to):
    cb = SparsityCallback(SparsityConfig(sparsity=0.5))
    trainer = make_trainer(tiny_model("gpt2"), tmp_path, [cb], max_steps=1, report_to=report_to)
    with caplog.at_level(logging.WARNING, logger="hf_sparsity"):
        trainer.train()
    assert cb.engine is not None  # it trained
    assert not any("arrange_logging" in r.getMessage() for r in caplog.records)
