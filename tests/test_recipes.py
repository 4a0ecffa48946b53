"""Recipes: smoke runs (a few steps each), outputs, arguments, deterministic restart, stage data (under DDP:
test_recipes_ddp.py)."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from .conftest import REPO

RECIPES = REPO / "recipes"
SMALL = ["--max_texts", "1500", "--eval_blocks", "16", "--logging_steps", "2", "--batch_size", "4"]


def _recipe(name):
    sys.path.insert(0, str(RECIPES))
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name, out, *args, callbacks=()):
    return _recipe(name).main(["--output_dir", str(out), *SMALL, *map(str, args)], callbacks=callbacks)


class StopAt(TrainerCallback):
    """Checkpoint and stop stage ``stage`` at ``step``: a simulated preemption, injected by the test."""

    def __init__(self, stage: str, step: int):
        self.stage, self.step = stage, step

    def on_step_end(self, args, state, control, **kw):
        if Path(args.output_dir).name == self.stage and state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


def _common():
    sys.path.insert(0, str(RECIPES))
    import _common

    return _common


SMOKE = {
    "static": ["--max_steps", 4],
    "imp": ["--dense_steps", 4, "--rewind_to", 2, "--iterations", 2],
    "spdf": ["--pretrain_steps", 4, "--finetune_steps", 2],
    "variable_spdf": ["--pretrain_steps", 6, "--finetune_steps", 2],
    "sparse_ift": ["--max_steps", 3],
}


@pytest.mark.slow  # a recipe run each
@pytest.mark.parametrize("name", list(SMOKE))
def test_recipe_smoke(name, tmp_path):
    res = _run(name, tmp_path, *SMOKE[name])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["recipe"] == name and res["recipe"] == name
    assert (tmp_path / "loss.png").stat().st_size > 1000
    for st in saved["stages"]:
        assert st["final_eval_loss"] > 0 and st["flops"]["train_flops"] > 0
        stage_dir = tmp_path / st["name"]
        assert list(stage_dir.glob("runs/*/events.out.tfevents*")), "no TensorBoard log"
        masked_stage = name in ("imp", "variable_spdf") and st["name"] not in ("finetune", "stage2")
        if st["levels"]["total"] > 0 or masked_stage:
            assert list(stage_dir.glob("checkpoint-*/sparsity_masks.safetensors")), (
                "checkpoints without masks"
            )
    if name == "static":
        _check_tensorboard(tmp_path)
    if name == "imp":
        assert saved["final_sparsity"] == pytest.approx(1 - 0.7**2, abs=2e-3)
        assert [it["prune_step"] for it in saved["iterations"]] == [4, 6]
        assert [e["kind"] for e in saved["stages"][-1]["events"]] == ["prune", "prune"]
    if name == "variable_spdf":  # the published restart: stage 2 a dense run of its own
        assert saved["stage_data_overlap_blocks"] == 0
        assert [st["name"] for st in saved["stages"]] == ["stage1", "stage2", "finetune"]
        assert 0.7 < saved["effective_sparsity"] < 0.8
    if name == "spdf":  # the fine-tuned model is dense and vanilla
        assert not (tmp_path / "finetune" / "final" / "sparsity_masks.safetensors").exists()
        assert "sparsity" not in json.loads((tmp_path / "pretrain_finalized" / "config.json").read_text())
        _check_reporters_come_after_the_metrics_callback(tmp_path)


def _tensorboard(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(next((run_dir / "runs").iterdir())))
    ev.Reload()
    return ev


def _check_reporters_come_after_the_metrics_callback(tmp_path):
    """The recipe puts its metrics callback ahead of TensorBoard: the sparse stage's logged model config
    carries the sparsity section SparsityCallback adds at train begin, and the dense stage's FLOP count
    (FlopCallback, listed after the reporters by Trainer) reaches TensorBoard."""
    pre = _tensorboard(tmp_path / "pretrain")
    config_text = pre.Tensors("model_config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"sparsity": {' in config_text
    ft = _tensorboard(tmp_path / "finetune")
    tags = set(ft.Tags()["scalars"])
    for tag in (
        "train/sparsity/train_flops",
        "train/sparsity/dense_equivalent_flops",
        "train/sparsity/tokens",
    ):
        assert tag in tags, (tag, sorted(tags))
    tokens = ft.Scalars("train/sparsity/tokens")[-1]
    assert tokens.value == tokens.step * 4 * 64  # batch 4 x 64 tokens per step: every step counted


def _check_tensorboard(tmp_path):
    """Loss, LR, per-layer and total sparsity, cumulative FLOPs vs dense reach TensorBoard."""
    ev = _tensorboard(tmp_path / "train")
    tags = set(ev.Tags()["scalars"])
    for tag in ("train/loss", "train/learning_rate", "train/sparsity/total", "train/sparsity/train_flops",
                "train/sparsity/dense_equivalent_flops", "eval/loss"):  # fmt: skip
        assert tag in tags, (tag, sorted(tags))
    assert any(t.startswith("train/sparsity/layer/") for t in tags)
    assert ev.Scalars("train/sparsity/total")[-1].value == pytest.approx(0.75, abs=1e-3)


def _final_weights(path):
    return load_file(path / "model.safetensors")


@pytest.mark.parametrize(
    "name, args, stop_stage, stop_at, final",
    [
        # interrupted mid-iteration, after a prune + rewind + reshuffle
        ("imp", ["--dense_steps", 4, "--rewind_to", 2, "--iterations", 2], "imp", 5, "imp/final"),
        # interrupted in stage 1 of pre-training; the densify event and fine-tuning happen after the resume
        (
            "variable_spdf",
            [
                "--pretrain_steps",
                6,
                "--finetune_steps",
                2,
                "--save_steps",
                2,
                "--stage2_schedule",
                "continue",
            ],  # fmt: skip
            "pretrain",
            3,
            "finetune/final",
        ),
    ],
)
@pytest.mark.slow  # three recipe runs each
def test_interrupted_and_resumed_run_is_bit_identical(name, args, stop_stage, stop_at, final, tmp_path):
    full = _run(name, tmp_path / "full", *args)
    assert full is not None
    cut = _run(name, tmp_path / "cut", *args, callbacks=[StopAt(stop_stage, stop_at)])
    assert cut is None  # interrupted
    assert not (tmp_path / "cut" / "results.json").exists()
    # A crash while the next checkpoint was written leaves a partial folder: --resume skips it.
    stage = next((tmp_path / "cut").rglob(f"{stop_stage}/checkpoint-{stop_at}"))
    partial = stage.with_name(f"checkpoint-{stop_at + 1}")
    partial.mkdir()
    shutil.copy(stage / "model.safetensors", partial)
    resumed = _run(name, tmp_path / "cut", *args, "--resume", "true")
    a, b = _final_weights(tmp_path / "full" / final), _final_weights(tmp_path / "cut" / final)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    ev_full = [(e["step"], e["kind"]) for st in full["stages"] for e in st["events"]]
    ev_res = [(e["step"], e["kind"]) for st in resumed["stages"] for e in st["events"]]
    assert ev_full == ev_res and ev_full
    fl_full = full["stages"][0]["flops"]["train_flops"]
    assert resumed["stages"][0]["flops"]["train_flops"] == pytest.approx(
        fl_full
    )  # FLOPs carried across resume


@pytest.mark.slow  # two short recipe runs
def test_an_interrupted_first_stage_stops_the_recipe_and_resume_runs_the_rest(tmp_path):
    """IMP with a dense baseline: a preemption in the baseline (the first stage) ends the run there, with
    no later stage started and no results; ``--resume`` continues the baseline from its checkpoint, then
    runs IMP."""
    args = [
        "--dense_steps",
        4,
        "--rewind_to",
        2,
        "--iterations",
        1,
        "--dense_baseline_steps",
        4,
        "--save_steps",
        2,
    ]
    assert _run("imp", tmp_path, *args, callbacks=[StopAt("dense", 2)]) is None
    assert (tmp_path / "dense" / "checkpoint-2").is_dir() and not (tmp_path / "dense" / "final").exists()
    assert not (tmp_path / "imp").exists() and not (tmp_path / "results.json").exists()
    res = _run("imp", tmp_path, *args, "--resume", "true")
    assert [st["name"] for st in res["stages"]] == ["dense", "imp"]
    dense = json.loads((tmp_path / "dense" / "stage_done.json").read_text())
    assert [h["step"] for h in dense["log_history"] if "loss" in h] == [2, 4]  # both halves, once each
    assert res["dense_baseline_eval_loss"] == dense["final_eval_loss"] > 0
    assert dense["flops"]["tokens"] == 4 * 4 * 64  # the FLOP count carried across the resume


def test_stage_data_reshuffles_and_stages_are_disjoint():
    C = _common()

    class A:
        batch_size, grad_accum, seed = 2, 1, 0

    blocks = [[i] * 4 for i in range(40)]
    d = C.stage_data(blocks, A, 20, [(0, list(range(0, 25))), (12, list(range(25, 40)))], reshuffle_steps=[5])
    assert len(d) == 40
    first, second = set(d.order[:24]), set(d.order[24:])
    assert first <= set(range(25)) and second <= set(range(25, 40)) and not first & second
    assert d.segment_of[9] == 0 and d.segment_of[10] == 1 and d.segment_of[24] == 2
    again = C.stage_data(
        blocks, A, 20, [(0, list(range(0, 25))), (12, list(range(25, 40)))], reshuffle_steps=[5]
    )
    assert again.order == d.order  # a pure function of the schedule and the seed
    plain = C.stage_data(blocks, A, 20, [(0, list(range(0, 25))), (12, list(range(25, 40)))])
    assert plain.order[:10] == d.order[:10] and plain.order[10:24] != d.order[10:24]  # the prune reshuffled


def test_recipe_arguments(tmp_path):
    C = _common()
    defaults = {"a": 1, "b": 0.5, "c": "x", "d": False}
    ns = C.parse_args(defaults, "doc", ["--a", "3", "--d", "true"])
    assert (ns.a, ns.b, ns.c, ns.d) == (3, 0.5, "x", True)
    cfg = tmp_path / "r.yaml"
    cfg.write_text("b: 0.25\nc: y\n")
    ns = C.parse_args(defaults, "doc", ["--config", str(cfg), "--c", "z"])
    assert (ns.b, ns.c) == (0.25, "z")  # command line beats the file
    with pytest.raises(SystemExit):
        C.parse_args(defaults, "doc", ["--nope", "1"])
    cfg.write_text("sparsityy: 0.9\n")
    with pytest.raises(SystemExit):
        C.parse_args(defaults, "doc", ["--config", str(cfg)])


def test_recipe_refuses_existing_output_dir(tmp_path):
    (tmp_path / "train").mkdir(parents=True)
    with pytest.raises(SystemExit, match="already holds a run"):
        _run("static", tmp_path, "--max_steps", 2)


@pytest.mark.slow  # a recipe run
def test_recipe_takes_local_jsonl_and_config_json(tmp_path):
    from transformers import GPT2Config

    data = tmp_path / "corpus.jsonl"
    texts = _common().load_texts("embedded", limit=1200)
    data.write_text("\n".join(json.dumps({"content": t}) for t in texts))
    cfg = tmp_path / "model"
    GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=1, n_head=2).save_pretrained(cfg)
    res = _run(
        "static", tmp_path / "out", "--max_steps", 2, "--dataset", data, "--text_column", "content",
        "--model", cfg / "config.json",
    )  # fmt: skip
    assert res["final_eval_loss"] > 0 and res["sparsity"] == pytest.approx(0.75, abs=1e-3)
