"""The recipes' arguments and output folder: ``--key value`` for every default, ``--config FILE.yaml``,
unknown keys refused; which process prints and writes (and the others wait for it); a run's folder
checked before anything is written."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def wait_for_main_process() -> None:
    """Under DDP, every process waits here until the main one (which alone writes) gets here too."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def log(msg: str) -> None:
    if is_main_process():
        print(msg, flush=True)


def _parse_value(text: str, default: Any) -> Any:
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


def prepare_output_dir(args) -> None:
    out = Path(args.output_dir)
    stages = [p for p in out.glob("*/") if p.is_dir()] if out.is_dir() else []
    if stages and not args.resume and not args.overwrite:
        raise SystemExit(
            f"{out} already holds a run. Pass --resume true to continue it, --overwrite true to start over, "
            "or another --output_dir."
        )
    if args.overwrite and not args.resume and out.is_dir() and is_main_process():
        shutil.rmtree(out)
    wait_for_main_process()
    out.mkdir(parents=True, exist_ok=True)


# ----------------------------------------------------------------------------- shared defaults
# The keys every training recipe has (model, data, training, run control). A recipe's DEFAULTS
# block lists its own keys and any of these it changes (``recipe_defaults``); ``--help`` prints
# every key with its value.
SHARED_DEFAULTS = dict(
    # model: tiny-gpt2 (built here) | a config.json path | an HF model name or path
    model="tiny-gpt2",
    n_embd=64,
    n_layer=2,
    n_head=4,
    vocab_size=512,
    tokenizer="",  # default: the model's own, or one trained on the data for tiny-gpt2
    # data: embedded | a .txt/.jsonl file | an HF dataset name
    dataset="embedded",
    text_column="text",
    max_texts=0,
    block_size=64,
    eval_blocks=32,
    # training
    batch_size=8,
    grad_accum=1,
    learning_rate=3e-3,
    weight_decay=0.1,
    warmup_steps=20,
    lr_scheduler="cosine",
    logging_steps=10,
    save_steps=0,  # 0: half-way and at the end
    tensorboard=True,
    seed=0,
    # run control
    resume=False,  # continue an interrupted run in output_dir
    overwrite=False,
)


def recipe_defaults(**own: Any) -> dict[str, Any]:
    """A recipe's defaults: its own keys first (they replace shared ones of the same name), then the rest
    of :data:`SHARED_DEFAULTS`."""
    return {**own, **{k: v for k, v in SHARED_DEFAULTS.items() if k not in own}}
