"""Variable SPDF as published: stage 2 a dense pre-training run of its own (``--stage2_schedule restart``).

Expected learning rates are computed here from the schedule's definition (linear warm-up from 0
to the peak, then cosine to 0, over the run's own steps), not from the recipe's helpers.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from .conftest import REPO
from .test_recipes import StopAt

RECIPES = REPO / "recipes"
SMALL = ["--max_texts", "1500", "--eval_blocks", "16", "--batch_size", "4", "--tensorboard", "false"]
# 24 pre-training steps at 90% -> effective 75%: stage 1 lasts 20 steps, stage 2 lasts 4.
RUN = [
    "--pretrain_steps", 24, "--finetune_steps", 1, "--logging_steps", 1,
    "--learning_rate", 3e-3, "--warmup_steps", 4,
    "--stage2_learning_rate", 1e-3, "--stage2_warmup_steps", 2,
]  # fmt: skip
PEAK1, WARM1, PEAK2, WARM2, S1, S2 = 3e-3, 4, 1e-3, 2, 20, 4


def _recipe():
    sys.path.insert(0, str(RECIPES))
    spec = importlib.util.spec_from_file_location("recipe_variable_spdf", RECIPES / "variable_spdf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(out, *args, callbacks=()):
    return _recipe().main(["--output_dir", str(out), *SMALL, *map(str, args)], callbacks=callbacks)


def warmup_cosine(peak: float, warmup: int, total: int, step: int) -> float:
    """The LR of the ``step``-th optimizer step (1-based): the schedule at ``step - 1`` scheduler steps."""
    t = step - 1
    if t < warmup:
        return peak * t / warmup
    return peak * 0.5 * (1.0 + math.cos(math.pi * (t - warmup) / (total - warmup)))


class SeenBlocks(TrainerCallback):
    """Records every training batch each stage will see (the Trainer's own dataloader, walked once)."""

    def __init__(self):
        self.seen: dict[str, list[tuple[int, ...]]] = {}

    def on_train_begin(self, args, state, control, train_dataloader=None, **kw):
        blocks = [tuple(row.tolist()) for batch in train_dataloader for row in batch["input_ids"]]
        self.seen[Path(args.output_dir).name] = blocks[: args.max_steps * args.per_device_train_batch_size]
        return control


def _lrs(stage_dir: Path) -> dict[int, float]:
    hist = json.loads((stage_dir / "stage_done.json").read_text())["log_history"]
    return {h["step"]: h["learning_rate"] for h in hist if "learning_rate" in h}


@pytest.fixture(scope="module")
def restart_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("restart")
    seen = SeenBlocks()
    res = _run(out, *RUN, callbacks=[seen])
    return out, res, seen.seen


# ---------------------------------------------------------------------- bad input: before any training
@pytest.mark.parametrize(
    "args, match",
    [
        (["--stage2_learning_rate", 0], "--stage2_learning_rate 0.0 must be above 0"),
        (["--stage2_learning_rate", -1e-3], "--stage2_learning_rate -0.001 must be above 0"),
        (["--effective_sparsity", 0.95], "--effective_sparsity 0.95 is above --stage1_sparsity 0.9"),
        (["--effective_sparsity", 0], "--effective_sparsity 0.0 must be above 0"),
        (["--effective_sparsity", -0.2], "--effective_sparsity -0.2 must be above 0"),
        (["--pretrain_steps", 1, "--effective_sparsity", 0.3], "Stage 1 would last 0 of 1"),
        (["--pretrain_steps", 4, "--effective_sparsity", 0.89], "Stage 2 would last 0 of 4"),
        (["--stage2_schedule", "warm"], "--stage2_schedule 'warm'"),
    ],
)
def test_bad_input_is_one_line_before_any_training(args, match, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        _run(out, *args)
    msg = str(exc.value.code)
    assert match in msg and "\n" not in msg, msg
    assert "; " in msg or ": " in msg  # the problem, then the fix
    assert not out.exists()  # nothing prepared, nothing trained


# ---------------------------------------------------------------------- the published restart
@pytest.mark.slow
def test_stage2_starts_with_its_own_warmup_not_stage1s_tail(restart_run):
    out, res, _ = restart_run
    assert res["stage2_schedule"] == "restart"
    assert (res["stage1_steps"], res["stage2_steps"]) == (S1, S2)
    lr1, lr2 = _lrs(out / "stage1"), _lrs(out / "stage2")
    # Stage 1: warm-up and decay over its own 20 steps.
    for step in range(1, S1 + 1):
        assert lr1[step] == pytest.approx(warmup_cosine(PEAK1, WARM1, S1, step), rel=1e-6, abs=1e-12)
    # Stage 2: a warm-up from 0 to its own peak, then decay over its own 4 steps.
    assert [lr2[s] for s in range(1, S2 + 1)] == pytest.approx(
        [0.0, PEAK2 / 2, PEAK2, PEAK2 / 2], rel=1e-6, abs=1e-12
    )
    # What one schedule over all 24 steps would give at the same global steps (21-24): its tail.
    tail = [warmup_cosine(PEAK1, WARM1, S1 + S2, S1 + s) for s in range(1, S2 + 1)]
    assert max(tail) < 0.1 * PEAK1
    assert lr2[3] > 3 * max(tail)


@pytest.mark.slow
def test_stage2_never_repeats_stage1_data(restart_run):
    out, res, seen = restart_run
    s1, s2 = seen["stage1"], seen["stage2"]
    assert len(s1) == S1 * 4 and len(s2) == S2 * 4  # steps x batch
    assert not set(s1) & set(s2)
    assert res["stage_data_overlap_blocks"] == 0
    # Fine-tuning sees only the fine-tuning task.
    assert not set(seen["finetune"]) & (set(s1) | set(s2))


@pytest.mark.slow
def test_conversion_and_flops_over_both_stages(restart_run):
    out, res, _ = restart_run
    names = [st["name"] for st in res["stages"]]
    assert names == ["stage1", "stage2", "finetune"]
    # The conversion: stage 2 starts from a vanilla dense checkpoint whose masked weights are zeros.
    conv = out / "stage1_finalized"
    assert "sparsity" not in json.loads((conv / "config.json").read_text())
    assert not (conv / "sparsity_masks.safetensors").exists()
    w = load_file(conv / "model.safetensors")
    attn = [v for k, v in w.items() if k.endswith("attn.c_attn.weight")]
    assert attn and all((v == 0).double().mean().item() == pytest.approx(0.9, abs=0.01) for v in attn)
    assert not list((out / "stage2").glob("checkpoint-*/sparsity_masks.safetensors"))  # stage 2 is dense
    # Effective sparsity by definition: sparsifiable FLOPs spent / dense, 90% sparse for 20 steps and
    # dense for 4 (same tokens per step) -> 1 - (20 * 0.1 + 4) / 24.
    assert res["effective_sparsity"] == pytest.approx(1 - (S1 * 0.1 + S2) / (S1 + S2), abs=2e-3)
    st1, st2 = res["stages"][0]["flops"], res["stages"][1]["flops"]
    assert st2["train_flops"] == pytest.approx(st2["dense_equivalent_flops"])  # dense
    assert st1["dense_equivalent_flops"] / st2["dense_equivalent_flops"] == pytest.approx(S1 / S2)
    assert res["pretrain_flops"] == pytest.approx(st1["train_flops"] + st2["train_flops"])
    dense = st1["dense_equivalent_flops"] + st2["dense_equivalent_flops"]
    assert res["pretrain_dense_equivalent_flops"] == pytest.approx(dense)
    assert res["pretrain_flops_saved_fraction"] == pytest.approx(1 - res["pretrain_flops"] / dense)
    assert res["pretrain_eval_loss"] == res["stages"][1]["final_eval_loss"]


@pytest.mark.slow
def test_continue_keeps_one_schedule_across_the_densify(tmp_path):
    res = _run(tmp_path, *RUN, "--stage2_schedule", "continue")
    assert [st["name"] for st in res["stages"]] == ["pretrain", "finetune"]
    assert [e["kind"] for e in res["stages"][0]["events"]] == ["densify"]
    lr = _lrs(tmp_path / "pretrain")
    for step in range(1, S1 + S2 + 1):
        assert lr[step] == pytest.approx(warmup_cosine(PEAK1, WARM1, S1 + S2, step), rel=1e-6, abs=1e-12)
    assert res["effective_sparsity"] == pytest.approx(0.75, abs=2e-3)
    assert res["stage_data_overlap_blocks"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("stage, step", [("stage1", 3), ("stage2", 1)])
def test_resume_within_either_stage_is_bit_identical(stage, step, tmp_path):
    args = ["--pretrain_steps", 12, "--finetune_steps", 2, "--logging_steps", 2, "--save_steps", 2]
    full = _run(tmp_path / "full", *args)
    assert _run(tmp_path / "cut", *args, callbacks=[StopAt(stage, step)]) is None
    assert not (tmp_path / "cut" / "results.json").exists()
    resumed = _run(tmp_path / "cut", *args, "--resume", "true")
    a = load_file(tmp_path / "full" / "finetune" / "final" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "finetune" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    for key in ("pretrain_flops", "pretrain_dense_equivalent_flops", "effective_sparsity"):
        assert resumed[key] == pytest.approx(full[key]), key  # FLOPs carried across the resume
