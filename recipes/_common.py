"""Shared machinery for the recipes: arguments, data, models, one training stage, plots, results.

Each recipe (``static.py``, ``imp.py``, ``spdf.py``, ``variable_spdf.py``,
``sparse_ift.py``) keeps its defaults in one block and its story top to bottom;
what they all need lives here:

* :func:`parse_args`: ``--key value`` for every default, ``--config FILE.yaml``;
  unknown keys refused with the list of known ones.
* :func:`load_texts` / :func:`prepare_data`: the embedded default (no network, nothing
  from ``../shared``), a local ``.txt`` / ``.jsonl`` file, or any HF dataset name.
* :class:`ScheduledData`: the training stream in a fixed, seeded order, cut into
  segments: a new segment starts at each prune (the seeded reshuffle of seed
  ``001_*``) and at each stage change (a later stage draws from a disjoint pool of
  blocks, so it never repeats the earlier stage's data, seed ``004_*``). The order
  is a pure function of the schedule and the seed, and Trainer walks it
  sequentially, so a resumed run sees exactly the samples an uninterrupted one does.
* :func:`run_stage`: one ``Trainer`` run with checkpoints (masks included),
  TensorBoard logs, FLOP accounting, extra evaluations around events, resume, and a
  simulated interruption for the restart test.
* :func:`plot_stages`, :func:`write_results`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from hf_sparsity.callback import SparsityCallback, move_to_front
from hf_sparsity.config import SparsityConfig
from hf_sparsity.data import BlockDataset, build_tokenizer, embedded_text, pack_tokens
from hf_sparsity.flops import FlopAccountant

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


# ---------------------------------------------------------------------- data
def data_to_text(num: int = 3000, seed: int = 1) -> list[str]:
    """A second embedded task for fine-tuning: structured data -> sentence (a tiny DART, seed ``004_*``)."""
    from hf_sparsity import data as D

    rng = random.Random(seed)
    out = []
    for _ in range(num):
        s, v, o = rng.choice(D._SUBJECTS), rng.choice(D._VERBS), rng.choice(D._OBJECTS)
        t = rng.choice(D._TIMES) if rng.random() < 0.5 else None
        fields = f"subject: {s} | action: {v} | object: {o}" + (f" | time: {t}" if t else "")
        sent = f"{s} {v} {o}" + (f" {t}" if t else "")
        out.append(f"<data> {fields} <text> {sent[0].upper() + sent[1:]}.")
    return out


def load_texts(spec: str, text_column: str = "text", limit: int | None = None) -> list[str]:
    """``embedded`` | ``embedded-d2t`` | a ``.txt`` (paragraphs) / ``.jsonl`` file | an HF dataset name."""
    if spec == "embedded":
        return embedded_text(limit or 20000, seed=0)
    if spec == "embedded-d2t":
        return data_to_text(limit or 3000)
    path = Path(spec)
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            texts = []
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if text_column not in row:
                        raise SystemExit(
                            f"{spec}: line {i + 1} has no {text_column!r} field; pass --text_column NAME."
                        )
                    texts.append(row[text_column])
                    if limit and len(texts) >= limit:
                        break
            return texts
        paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        return paras[:limit] if limit else paras
    if path.suffix or os.sep in spec and not path.exists():
        raise SystemExit(f"--dataset {spec!r}: no such file. Give a .txt/.jsonl path or an HF dataset name.")
    import datasets

    ds = datasets.load_dataset(spec, split="train")
    if text_column not in ds.column_names:
        raise SystemExit(f"{spec}: no column {text_column!r} (has {ds.column_names}); pass --text_column.")
    texts = ds[text_column]
    return list(texts[:limit] if limit else texts)


def split_blocks(blocks: list[list[int]], n_eval: int) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out evaluation blocks first, the rest for training (deterministic)."""
    if len(blocks) < n_eval + 8:
        raise SystemExit(f"Only {len(blocks)} blocks of text: too little data for training and evaluation.")
    return blocks[n_eval:], blocks[:n_eval]


@dataclass
class Segment:
    start: int  # first sample index (global, across processes) of the segment
    pool: list[int]  # block ids it draws from
    seed: int


class ScheduledData(torch.utils.data.Dataset):
    """The training stream of a stage: sample ``i`` is a block fixed by the seed and the segments.

    A segment draws from its pool in seeded permutations (a new one per pass); a new
    segment (a prune's reshuffle, a new stage's pool) starts a fresh permutation.
    """

    def __init__(self, blocks: list[list[int]], n_samples: int, segments: list[Segment]):
        self.blocks = blocks
        self.segments = sorted(segments, key=lambda s: s.start)
        if not self.segments or self.segments[0].start != 0:
            raise ValueError("The first segment must start at sample 0.")
        order: list[int] = []
        self.segment_of: list[int] = []
        for k, seg in enumerate(self.segments):
            end = self.segments[k + 1].start if k + 1 < len(self.segments) else n_samples
            need, epoch = end - seg.start, 0
            while need > 0:
                perm = list(seg.pool)
                random.Random(f"{seg.seed}|{seg.start}|{epoch}").shuffle(perm)
                take = perm[:need]
                order += take
                self.segment_of += [k] * len(take)
                need -= len(take)
                epoch += 1
        self.order = order[:n_samples]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor(self.blocks[self.order[i]], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def prepare_data(args, extra_texts: list[str] | None = None):
    """Tokenizer and packed blocks for the pre-training data (plus texts the tokenizer must cover)."""
    texts = load_texts(args.dataset, args.text_column, args.max_texts or None)
    tokenizer = _tokenizer(args, texts + list(extra_texts or []))
    blocks = pack_tokens(texts, tokenizer, args.block_size)
    train, evalb = split_blocks(blocks, args.eval_blocks)
    return tokenizer, train, evalb


def _tokenizer(args, texts: list[str]):
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.model != "tiny-gpt2" and not args.model.endswith(".json"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    else:
        tok = build_tokenizer(texts, vocab_size=args.vocab_size)
    if tok.eos_token_id is None:
        raise SystemExit("The tokenizer has no EOS token; documents cannot be packed. Pass --tokenizer.")
    return tok


# ---------------------------------------------------------------------- models
def build_model(args, tokenizer, seed: int | None = None):
    """``tiny-gpt2`` (embedded default), a ``config.json`` path (random init) or any model name/path."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed if seed is None else seed)
    if args.model == "tiny-gpt2":
        cfg = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=args.block_size,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return GPT2LMHeadModel(cfg)
    if args.model.endswith(".json"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    return AutoModelForCausalLM.from_pretrained(args.model)


# ---------------------------------------------------------------------- one stage
class _SequentialTrainer(Trainer):
    """Walks the stream in its scheduled order, with an LR schedule of its own period (IMP rewinds into it)."""

    lr_period: int | None = None

    def _get_train_sampler(self, train_dataset=None):
        ds = train_dataset if train_dataset is not None else self.train_dataset
        return torch.utils.data.SequentialSampler(ds)

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        return super().create_scheduler(self.lr_period or num_training_steps, optimizer)


class _EvalAt(TrainerCallback):
    """Evaluate at extra steps (just before and right after each event: the sawtooth's teeth)."""

    def __init__(self, steps):
        self.steps = set(steps)

    def on_step_end(self, args, state, control, **kw):
        if state.global_step in self.steps:
            control.should_evaluate = True
        return control


class _Interrupt(TrainerCallback):
    """Checkpoint and stop at a step: simulates a preempted job (for the restart test)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_save = True
            control.should_training_stop = True
        return control


class DenseFlops(TrainerCallback):
    """FLOP accounting for a dense stage (the sparse ones get it from SparsityCallback)."""

    FILE = "dense_flops.json"

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.flops = None
        self._seen = 0

    def on_train_begin(self, args, state, control, model=None, **kw):
        self.flops = FlopAccountant(model, seq_len=self.seq_len)
        ckpt = _checkpoint_dir(args, state)
        if state.global_step > 0 and ckpt and os.path.isfile(os.path.join(ckpt, self.FILE)):
            with open(os.path.join(ckpt, self.FILE)) as f:
                self.flops.load_state_dict(json.load(f))
        self._seen = int(state.num_input_tokens_seen or 0)

    def on_pre_optimizer_step(self, args, state, control, **kw):
        seen = int(state.num_input_tokens_seen or 0)
        self.flops.add_tokens(max(seen - self._seen, 0), {})
        self._seen = seen

    def on_log(self, args, state, control, logs=None, **kw):
        if logs is not None and ("loss" in logs or "eval_loss" in logs):
            logs.update(self.flops.log_dict())

    def on_save(self, args, state, control, **kw):
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if state.is_world_process_zero and os.path.isdir(ckpt):
            with open(os.path.join(ckpt, self.FILE), "w") as f:
                json.dump(self.flops.state_dict(), f)


def _checkpoint_dir(args, state) -> str | None:
    return os.path.join(args.output_dir, f"checkpoint-{state.global_step}")


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


def run_stage(
    name: str,
    args,
    model,
    tokenizer,
    train_data: ScheduledData,
    eval_blocks: list[list[int]],
    steps: int,
    sparsity: SparsityConfig | None = None,
    learning_rate: float | None = None,
    warmup_steps: int | None = None,
    lr_period: int | None = None,
    eval_steps: int | None = None,
    extra_eval_steps: list[int] = (),
) -> StageResult:
    """Train one stage in ``args.output_dir/name``; resume it or skip it when ``--resume`` finds it done."""
    out = Path(args.output_dir) / name
    done = out / STAGE_DONE
    if args.resume and done.is_file():
        saved = json.loads(done.read_text())
        log(f"[{name}] already done: eval loss {saved['final_eval_loss']:.4f} (from {done})")
        return StageResult(**{k: v for k, v in saved.items() if k in StageResult.__dataclass_fields__})
    t0 = time.time()
    eval_steps = eval_steps or max(steps // (4 if steps >= 40 else 2), 1)
    targs = TrainingArguments(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size * 2,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=learning_rate or args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps if warmup_steps is None else warmup_steps,
        lr_scheduler_type=args.lr_scheduler,
        max_grad_norm=1.0,
        logging_steps=args.logging_steps,
        eval_strategy="steps",
        eval_steps=eval_steps,
        save_strategy="steps",
        save_steps=args.save_steps or max(steps // 2, 1),
        save_total_limit=2,
        report_to=["tensorboard"] if args.tensorboard else [],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        include_num_input_tokens_seen=True,
        ddp_find_unused_parameters=False,
    )
    if sparsity is not None:
        metrics_cb = SparsityCallback(sparsity, seq_len=args.block_size)
    else:
        metrics_cb = DenseFlops(args.block_size)
    callbacks = [metrics_cb, _EvalAt(extra_eval_steps)]
    if args.stop_after_step and name == args.stop_stage:
        callbacks.append(_Interrupt(args.stop_after_step))
    trainer = _SequentialTrainer(
        model=model,
        args=targs,
        train_dataset=train_data,
        eval_dataset=BlockDataset(eval_blocks),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.lr_period = lr_period
    move_to_front(trainer, metrics_cb)  # its sparsity / FLOP scalars reach TensorBoard
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(_Printer(name))
    resume = get_last_checkpoint(str(out)) if args.resume and out.is_dir() else None
    if resume:
        log(f"[{name}] resuming from {resume}")
    trainer.train(resume_from_checkpoint=resume)
    interrupted = trainer.state.global_step < steps
    events = list(metrics_cb.events) if sparsity is not None else []
    flops = metrics_cb.flops.log_dict(prefix="") if metrics_cb.flops is not None else {}
    if interrupted:
        log(
            f"[{name}] interrupted at step {trainer.state.global_step} (checkpoint saved); rerun with --resume true"
        )
        return StageResult(name, trainer.state.global_step, float("nan"), time.time() - t0, flops, {}, events,
                           list(trainer.state.log_history), interrupted=True)  # fmt: skip
    ev = trainer.evaluate()
    final = out / "final"
    trainer.save_model(str(final))
    if is_main_process():
        tokenizer.save_pretrained(str(final))
    levels = _levels(metrics_cb) if sparsity is not None else {"total": 0.0}
    result = StageResult(
        name=name,
        steps=steps,
        final_eval_loss=float(ev["eval_loss"]),
        wall_s=time.time() - t0,
        flops=flops,
        levels=levels,
        events=events,
        log_history=list(trainer.state.log_history),
        model_dir=str(final),
        data={
            "samples": len(train_data),
            "unique_blocks": len(set(train_data.order)),
            "segments": len(train_data.segments),
        },
    )
    if is_main_process():
        d = result.to_dict()
        d["log_history"] = result.log_history
        done.write_text(json.dumps(d, indent=1, default=float))
    log(f"[{name}] done: {steps} steps, eval loss {result.final_eval_loss:.4f}, {result.wall_s:.0f}s")
    return result


def _levels(cb: SparsityCallback) -> dict[str, Any]:
    m = cb.metrics()
    return {
        "total": m["sparsity/total"],
        "per_layer": {
            k[len("sparsity/layer/") :]: round(v, 6) for k, v in m.items() if k.startswith("sparsity/layer/")
        },
    }


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


def stage_data(
    blocks, args, steps: int, pools: list[tuple[int, list[int]]], reshuffle_steps=()
) -> ScheduledData:
    """The stream for a stage of ``steps`` optimizer steps.

    ``pools``: ``(first_step, block_ids)`` (a later pool replaces an earlier one: stage
    change); ``reshuffle_steps``: steps after which the order reshuffles (prunes).
    """
    per_step = args.batch_size * args.grad_accum * world_size()
    segs = [Segment(step * per_step, pool, args.seed) for step, pool in pools]
    for t in reshuffle_steps:
        pool = [p for s, p in pools if s <= t][-1]
        segs.append(Segment(t * per_step, pool, args.seed))
    # A prune at a stage boundary is one segment, not two.
    uniq = {s.start: s for s in segs}
    return ScheduledData(blocks, steps * per_step, list(uniq.values()))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def finalize(model_dir: str, out_dir: str) -> str:
    """Bake the masks into zeros (``hf_sparsity convert --finalize``): a vanilla checkpoint to fine-tune."""
    from hf_sparsity.finalize import finalize_checkpoint

    if is_main_process() and not os.path.isdir(out_dir):
        finalize_checkpoint(model_dir, out_dir)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out_dir


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


# ---------------------------------------------------------------------- outputs
def plot_stages(
    stages: list[StageResult], path: str, title: str, baseline: float | None = None
) -> str | None:
    """Loss vs step across stages, events as vertical lines (the seeds' sawtooth), stage boundaries dashed."""
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


def prepare_finetune(args, tokenizer):
    """Blocks of the fine-tuning task (``--finetune_dataset``), split into train / held-out."""
    texts = load_texts(args.finetune_dataset, args.text_column)
    blocks = pack_tokens(texts, tokenizer, args.block_size)
    return split_blocks(blocks, args.eval_blocks)


def finetune(args, pretrained_dir: str, tokenizer, ft_train, ft_eval) -> StageResult:
    """Dense fine-tuning of a finalized (vanilla) checkpoint on the second task."""
    model = load_model(pretrained_dir)
    data = stage_data(ft_train, args, args.finetune_steps, [(0, list(range(len(ft_train))))])
    return run_stage(
        "finetune",
        args,
        model,
        tokenizer,
        data,
        ft_eval,
        args.finetune_steps,
        learning_rate=args.finetune_learning_rate,
        warmup_steps=max(args.finetune_steps // 10, 1),
    )
