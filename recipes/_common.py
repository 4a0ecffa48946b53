"""Shared machinery for the recipes: arguments, data, models, one training stage, plots, results.

Each recipe (``static.py``, ``imp.py``, ``spdf.py``, ``variable_spdf.py``,
``sparse_ift.py``) keeps its defaults in one block and its story top to bottom;
what they all need lives here:

* :func:`parse_args`: ``--key value`` for every default, ``--config FILE.yaml``;
  unknown keys refused with the list of known ones.
* :func:`load_texts` / :func:`prepare_data`: the embedded default (no network, nothing
  from any data folder), a local ``.txt`` / ``.jsonl`` file, or any HF dataset name.
* :class:`ScheduledData`: the training stream in a fixed, seeded order, cut into
  segments: a new segment starts at each prune (the seeded reshuffle of
  Cerebras' iterative pruning) and at each stage change (a later stage draws from a disjoint pool of
  blocks, so it never repeats the earlier stage's data, as in Variable SPDF). The order
  is a pure function of the schedule and the seed, and Trainer walks it
  sequentially, so a resumed run sees exactly the samples an uninterrupted one does.
* :func:`train_and_save`: what follows a recipe's own ``Trainer(...)``: resume from
  the last complete checkpoint, train, evaluate, save ``final/``, record the stage
  (:func:`stage_done` skips a stage a resumed run already finished).
* :func:`plot_stages`, :func:`write_results`.

Stateless: nothing here holds state between calls; the recipes build their
``TrainingArguments``, ``Trainer`` and ``SparsityCallback`` themselves.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _data import (  # noqa: F401  (re-exported: recipes use them as C.<name>)
    ScheduledData,
    Segment,
    build_model,
    data_to_text,
    load_texts,
    prepare_data,
    prepare_finetune,
    split_blocks,
    stage_data,
    world_size,
)
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from hf_sparsity.callback import SparsityCallback, move_to_front
from hf_sparsity.modeling import sparsity_table
from hf_sparsity.storage.resume import last_complete_checkpoint

STAGE_DONE = "stage_done.json"


# ---------------------------------------------------------------------- arguments
def _parse_value(text: str, default: Any) -> Any:
    import yaml

    if isinstance(default, bool):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, str):
        return text
    return yaml.safe_load(text)  # None / lists / dicts: YAML literal


def parse_args(defaults: dict[str, Any], doc: str, argv: list[str] | None = None) -> argparse.Namespace:
    """Defaults <- ``--config FILE.yaml`` <- ``--key value``. Unknown keys are refused."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="YAML file of overrides (keys as below)")
    for key, default in defaults.items():
        ap.add_argument(
            f"--{key}",
            default=None,
            type=lambda t, d=default: _parse_value(t, d),
            help=f"default: {default!r}",
        )
    ns = ap.parse_args(argv)
    values = dict(defaults)
    if ns.config:
        import yaml

        with open(ns.config, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            ap.error(f"{ns.config}: expected a mapping of recipe keys")
        unknown = sorted(set(loaded) - set(defaults))
        if unknown:
            ap.error(f"{ns.config}: unknown key(s) {unknown}. Known keys: {', '.join(defaults)}")
        values.update(loaded)
    for key in defaults:
        v = getattr(ns, key)
        if v is not None:
            values[key] = v
    return argparse.Namespace(**values)


# ---------------------------------------------------------------------- one stage
class EvalAt(TrainerCallback):
    """Evaluate at extra steps (just before and right after each event: the sawtooth's teeth)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step in self.steps:
            control.should_evaluate = True
        return control


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def log(msg: str) -> None:
    if is_main_process():
        print(msg, flush=True)


@dataclass
class StageResult:
    name: str
    steps: int
    final_eval_loss: float
    wall_s: float
    flops: dict[str, float]
    levels: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    log_history: list[dict[str, Any]] = field(default_factory=list)
    model_dir: str = ""
    interrupted: bool = False
    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d.pop("log_history")
        return d


def eval_every(steps: int) -> int:
    """The regular evaluation interval for a stage of ``steps`` optimizer steps."""
    return max(steps // (4 if steps >= 40 else 2), 1)


def stage_done(args, out: str) -> StageResult | None:
    """With ``--resume``, the saved result of a stage already completed in ``out`` (else ``None``)."""
    done = Path(out) / STAGE_DONE
    if not (args.resume and done.is_file()):
        return None
    saved = json.loads(done.read_text())
    log(f"[{Path(out).name}] already done: eval loss {saved['final_eval_loss']:.4f} (from {done})")
    return StageResult(**{k: v for k, v in saved.items() if k in StageResult.__dataclass_fields__})


def train_and_save(trainer: Trainer, metrics_cb, resume: bool) -> StageResult:
    """Run ``trainer`` (from its last complete checkpoint with ``resume``), evaluate, save ``final/``,
    record the stage.

    ``metrics_cb``: the run's :class:`SparsityCallback` or :class:`FlopCallback`; it is moved in
    front of Trainer's own callbacks so its scalars reach TensorBoard. An interrupted run (one a
    callback stopped early) returns ``interrupted=True`` after its checkpoint.
    """
    out = Path(trainer.args.output_dir)
    name, steps, t0 = out.name, trainer.args.max_steps, time.time()
    move_to_front(trainer, metrics_cb)
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_Printer(name))
    # The newest complete checkpoint: a run killed while saving leaves a partial newer folder.
    last = last_complete_checkpoint(out) if resume else None
    if last:
        log(f"[{name}] resuming from {last}")
    trainer.train(resume_from_checkpoint=last)
    sparse = isinstance(metrics_cb, SparsityCallback)
    events = list(metrics_cb.events) if sparse else []
    flops = metrics_cb.flops.log_dict(prefix="") if metrics_cb.flops is not None else {}
    history = list(trainer.state.log_history)
    if trainer.state.global_step < steps:
        log(
            f"[{name}] interrupted at step {trainer.state.global_step} (checkpoint saved); rerun with "
            "--resume true"
        )
        return StageResult(name, trainer.state.global_step, float("nan"), time.time() - t0, flops, {}, events,
                           history, interrupted=True)  # fmt: skip
    ev = trainer.evaluate()
    final = out / "final"
    trainer.save_model(str(final))
    if is_main_process():
        trainer.processing_class.save_pretrained(str(final))
    data = trainer.train_dataset
    result = StageResult(
        name=name,
        steps=steps,
        final_eval_loss=float(ev["eval_loss"]),
        wall_s=time.time() - t0,
        flops=flops,
        levels=sparsity_levels(metrics_cb.engine) if sparse else {"total": 0.0},
        events=events,
        log_history=history,
        model_dir=str(final),
        data={"samples": len(data), "unique_blocks": len(set(data.order)), "segments": len(data.segments)},
    )
    if is_main_process():
        d = result.to_dict()
        d["log_history"] = result.log_history
        (out / STAGE_DONE).write_text(json.dumps(d, indent=1, default=float))
    log(f"[{name}] done: {steps} steps, eval loss {result.final_eval_loss:.4f}, {result.wall_s:.0f}s")
    return result


def sparsity_levels(engine) -> dict[str, Any]:
    """Total and per-layer measured sparsity of the engine's targets (the library's sparsity table)."""
    rows = sparsity_table(engine.model, engine.targets, engine.masks)
    total = sum(r["zeros"] for r in rows) / max(sum(r["numel"] for r in rows), 1)
    return {"total": total, "per_layer": {r["name"]: round(r["sparsity"], 6) for r in rows}}


class _Printer(TrainerCallback):
    """One concise line per log (the default printer would dump every per-layer scalar)."""

    def __init__(self, stage: str):
        self.stage = stage

    def on_log(self, args, state, control, logs=None, **kw):
        if not state.is_world_process_zero or not logs:
            return
        parts = [f"[{self.stage}] step {state.global_step:>4}"]
        for key, fmt in (
            ("loss", ".4f"),
            ("eval_loss", ".4f"),
            ("learning_rate", ".2e"),
            ("sparsity/total", ".3f"),
        ):
            if key in logs:
                parts.append(f"{key.split('/')[-1]} {logs[key]:{fmt}}")
        if len(parts) > 1:
            print("  ".join(parts), flush=True)


def finalize(model_dir: str, out_dir: str) -> str:
    """Bake the masks into zeros (``hf_sparsity convert --finalize``): a vanilla checkpoint to fine-tune."""
    from hf_sparsity.export.finalize import finalize_checkpoint

    if is_main_process() and not os.path.isdir(out_dir):
        finalize_checkpoint(model_dir, out_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out_dir


def load_model(path: str):
    """A stage's starting folder (an earlier stage's output), its masks applied."""
    from hf_sparsity.loading import load_model_folder

    return load_model_folder(path)[0]


# ---------------------------------------------------------------------- outputs
def plot_stages(
    stages: list[StageResult], path: str, title: str, baseline: float | None = None
) -> str | None:
    """Loss vs step across stages, events as vertical lines (the IMP sawtooth), stage boundaries dashed."""
    if not is_main_process():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=90)
    offset = 0
    colors = {"prune": "tab:red", "regrow": "tab:green", "densify": "tab:purple", "update": "tab:gray"}
    seen_kinds = set()
    for i, st in enumerate(stages):
        tr = [(h["step"] + offset, h["loss"]) for h in st.log_history if "loss" in h]
        evl = [(h["step"] + offset, h["eval_loss"]) for h in st.log_history if "eval_loss" in h]
        if tr:
            ax.plot(*zip(*tr), lw=1, alpha=0.5, label=f"{st.name} train")
        if evl:
            ax.plot(*zip(*evl), marker="o", ms=3, label=f"{st.name} validation")
        for e in st.events:
            kind = e["kind"] if e["kind"] in colors else "prune"
            if kind == "update":
                continue
            lab = kind if kind not in seen_kinds else None
            seen_kinds.add(kind)
            ax.axvline(e["step"] + offset, color=colors[kind], lw=0.8, ls=":", label=lab)
            tl = e.get("total_level")
            if tl is not None and kind == "prune":
                ax.annotate(f"{tl:.0%}", (e["step"] + offset, 1.0), xycoords=("data", "axes fraction"),
                            fontsize=7, ha="center", va="bottom", color=colors[kind])  # fmt: skip
        if i:
            ax.axvline(offset, color="k", lw=1, ls="--")
        offset += st.steps
    if baseline is not None:
        ax.axhline(baseline, color="k", lw=0.8, label="dense baseline")
    # Zoom on the part worth reading: skip the first 15% of each stage (the initial drop from ~ln V).
    late = [
        h.get("eval_loss", h.get("loss"))
        for st in stages
        for h in st.log_history
        if ("eval_loss" in h or "loss" in h) and h["step"] > 0.15 * st.steps
    ]
    if late:
        lo, hi = min(late + ([baseline] if baseline else [])), max(late + ([baseline] if baseline else []))
        pad = 0.08 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + 3 * pad)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_results(path: str, payload: dict[str, Any]) -> None:
    if is_main_process():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=float)
        os.replace(tmp, path)


def prepare_output_dir(args) -> None:
    out = Path(args.output_dir)
    stages = [p for p in out.glob("*/") if p.is_dir()] if out.is_dir() else []
    if stages and not args.resume and not args.overwrite:
        raise SystemExit(
            f"{out} already holds a run. Pass --resume true to continue it, --overwrite true to start over, "
            "or another --output_dir."
        )
    if args.overwrite and not args.resume and out.is_dir() and is_main_process():
        import shutil

        shutil.rmtree(out)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    out.mkdir(parents=True, exist_ok=True)


def fmt_flops(x: float) -> str:
    if x <= 0 or not math.isfinite(x):
        return str(x)
    e = int(math.floor(math.log10(x)))
    return f"{x / 10**e:.2f}e{e}"
