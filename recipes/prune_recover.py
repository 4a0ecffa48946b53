"""Prune -> recover: one-shot prune a dense model, then sparse fine-tuning with fixed masks, then finalize.

    python recipes/prune_recover.py                       # embedded default: ~1 min on a CPU, offline
    python recipes/prune_recover.py --method sparsegpt --sparsity 0.6 --distill_alpha 0.5
    python recipes/prune_recover.py --model models/smollm2/dense --dataset corpus.jsonl \\
        --dense_steps 0 --seqlen 512 --block_size 256 --recover_steps 200 \\
        --wikitext2 DATA_DIR/text/wikitext-2-raw/wiki.test.raw
    python recipes/prune_recover.py --model models/smollm2/dense --pruned out/sgpt28 --dataset corpus.jsonl \\
        --dense_steps 0 --block_size 256 --recover_steps 60 --recover_lr 2e-5 --distill_alpha 1
    python recipes/prune_recover.py --config my.yaml      # overrides from YAML (keys below)

Stages, each followed by an evaluation (perplexity on held-out blocks of the dataset, and
WikiText-2 by the Wanda/SparseGPT protocol when ``--wikitext2`` is given):

1. ``dense``: the embedded tiny Llama trained ``dense_steps`` on the embedded text, long
   enough that pruning costs it something (or a pretrained ``--model``, with ``--dense_steps 0``);
2. ``pruned``: ``prune_oneshot`` (``--method`` magnitude | wanda | sparsegpt) from calibration
   windows of the training text, saved as a sparse folder; or ``--pruned FOLDER``, a folder
   ``hf_sparsity prune`` wrote from ``--model`` (with ``--refit``, ``--reconstruct``, per-layer levels...),
   copied in as it is;
3. ``recovered``: that folder fine-tuned in ``Trainer`` with ``SparsityCallback`` (masks fixed),
   optionally distilled from the dense model (KL on logits, ``--distill_alpha``, ``--distill_temperature``);
4. ``final``: ``finalize_checkpoint`` bakes the masks into a vanilla folder.

Writes ``OUTPUT_DIR/{dense,pruned,recovered,final}/``, ``results.json`` and ``perplexity.png``. The
stages are short and save no checkpoints (``save_strategy="no"``), so there is no ``--resume``: an
interrupted run starts over with ``--overwrite true``.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path

import _common as C  # the recipes' folder: the script's own, first on sys.path
import torch
import torch.nn.functional as F
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

from hf_sparsity import SparsityCallback, SparsityConfig, SparsityError, get_sparsity_config
from hf_sparsity.constants import SPARSITY_MASKS_NAME
from hf_sparsity.data import BlockDataset, build_tokenizer, embedded_text, pack_tokens
from hf_sparsity.loading import load_model_folder
from hf_sparsity.pruning import prune_oneshot, read_documents, sample_calibration, save_pruned
from hf_sparsity.storage.masks_file import has_masks

# ----------------------------------------------------------------------------- defaults
DEFAULTS = dict(
    output_dir="outputs/prune_recover",
    overwrite=False,
    # model: "tiny" (an embedded Llama built and trained here) or a pretrained model folder
    model="tiny",
    hidden_size=64,
    num_layers=2,
    vocab_size=512,
    # data: "embedded" or a .jsonl / .txt file (calibration, fine-tuning and held-out blocks)
    dataset="embedded",
    text_column="text",
    max_texts=3000,
    block_size=64,
    eval_blocks=48,
    # stage 1: dense training (0 for a pretrained model)
    dense_steps=300,
    dense_lr=3e-3,
    # stage 2: one-shot pruning, or a folder `hf_sparsity prune` wrote from --model (then recovered as it is)
    pruned="",
    method="wanda",  # magnitude | wanda | sparsegpt
    sparsity=0.7,
    structure="",  # e.g. "2:4" (then sparsity is 0.5)
    nsamples=32,
    seqlen=64,
    calib_seed=0,
    # stage 3: recovery with masks fixed
    recover_steps=150,
    recover_lr=1e-3,
    distill_alpha=0.5,  # 0: plain LM loss; 1: KL to the dense model only
    distill_temperature=2.0,
    batch_size=8,
    bf16=False,  # mixed precision: bf16 products under torch.autocast, weights and optimizer in float32
    seed=0,
    # optional: WikiText-2 (wiki.test.raw) perplexity after each stage
    wikitext2="",
    wikitext2_seqlen=512,
    wikitext2_windows=64,
)
# ---------------------------------------------------------------------------------------


def load_data(args):
    """Tokenizer, training texts, and packed train / held-out blocks."""
    if args.dataset == "embedded":
        texts = embedded_text(args.max_texts * 4, seed=0)
    else:
        texts = read_documents(args.dataset, args.text_column)[: args.max_texts or None]
    tok = (
        build_tokenizer(texts, args.vocab_size)
        if args.model == "tiny"
        else AutoTokenizer.from_pretrained(args.model)
    )
    blocks = pack_tokens(texts, tok, args.block_size)
    if len(blocks) <= args.eval_blocks:
        raise SparsityError(f"Only {len(blocks)} blocks of {args.block_size} tokens; use more text.")
    return tok, texts, blocks[args.eval_blocks :], blocks[: args.eval_blocks]


def dense_model(args, tok):
    if args.model != "tiny":
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=max(args.block_size, args.seqlen), tie_word_embeddings=True,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(cfg)


@torch.no_grad()
def evaluate(model, held_out, args, tok) -> dict:
    """Held-out perplexity (exp of the mean token loss), and WikiText-2 if asked."""
    model.eval()
    losses = []
    for batch in torch.tensor(held_out).split(args.batch_size):
        losses.append(float(model(input_ids=batch, labels=batch).loss))
    out = {"heldout_ppl": math.exp(sum(losses) / len(losses))}
    if args.wikitext2:
        from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity

        wt = wikitext2_perplexity(model, tok, args.wikitext2, args.wikitext2_seqlen, args.wikitext2_windows)
        out["wikitext2_ppl"] = wt["perplexity"]
    zeros = sum(int((p == 0).sum()) for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n)
    total = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n)
    out["zero_fraction_of_matrices"] = zeros / total
    return out


class DistillTrainer(Trainer):
    """LM loss mixed with KL(teacher || student) on temperature-softened logits (Hinton et al.)."""

    def __init__(self, *a, teacher=None, alpha=0.0, temperature=1.0, **kw):
        super().__init__(*a, **kw)
        self.teacher, self.alpha, self.temperature = teacher, alpha, temperature

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        loss = out.loss
        if self.teacher is not None and self.alpha > 0:
            with torch.no_grad(), self.accelerator.autocast():  # the student's mixed precision (--bf16)
                t_logits = self.teacher(input_ids=inputs["input_ids"]).logits
            T = self.temperature
            kl = F.kl_div(
                F.log_softmax(out.logits.float() / T, -1).flatten(0, 1),  # (bf16 logits under --bf16)
                F.log_softmax(t_logits.float() / T, -1).flatten(0, 1),
                log_target=True,
                reduction="batchmean",
            )
            loss = (1 - self.alpha) * loss + self.alpha * T * T * kl
        return (loss, out) if return_outputs else loss


def train_args(args, out, steps, lr) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=args.batch_size,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=min(20, steps // 10),
        weight_decay=0.0, logging_steps=max(1, steps // 10), save_strategy="no", report_to=[],
        use_cpu=not torch.cuda.is_available(), bf16=args.bf16, seed=args.seed, disable_tqdm=True,
        include_num_input_tokens_seen=True,  # FLOPs and tokens from the real batches
    )  # fmt: skip


def _train(trainer: Trainer) -> None:
    """``trainer.train()``, then the model's own forward back: under ``--bf16`` accelerate wraps it in
    autocast, and the evaluations after training run in float32."""
    trainer.train()
    trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)


def _check_launcher(targs: TrainingArguments) -> None:
    """Set up the process group now (a launcher's processes meet here) and refuse ZeRO-3, which
    partitions the models this recipe prunes and evaluates whole."""
    _ = targs.device  # initializes torch.distributed under a launcher
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        raise SparsityError(
            "prune_recover prunes and evaluates whole models, which DeepSpeed ZeRO-3 partitions. Run it "
            "in one process, under DDP, or with ZeRO-1/2 (recipes/configs/zero2.yaml)."
        )


def _prepare_output(args) -> Path:
    """The run's folder, empty (``--overwrite true`` clears it), once the launcher is known to fit."""
    out = Path(args.output_dir)
    _check_launcher(train_args(args, out / "dense_run", max(args.dense_steps, 1), args.dense_lr))
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            raise SparsityError(f"{out} is not empty; pass --overwrite true or choose another --output_dir.")
        if C.is_main_process():
            shutil.rmtree(out)
    C.wait_for_main_process()
    out.mkdir(parents=True, exist_ok=True)
    return out


def _shapes(folder) -> dict:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def check_pruned(args) -> None:
    """``--pruned FOLDER`` must be a folder ``hf_sparsity prune`` wrote from ``--model``: checked before
    anything is written."""
    if not args.pruned:
        return
    if args.model == "tiny":
        raise SparsityError("--pruned needs --model: the dense folder it was pruned from (the teacher).")
    if not has_masks(args.pruned):
        raise SparsityError(
            f"--pruned {args.pruned}: no {SPARSITY_MASKS_NAME} there; give a folder hf_sparsity prune wrote."
        )
    if _shapes(args.pruned) != _shapes(args.model):
        raise SparsityError(f"--pruned {args.pruned}: its weights are not --model {args.model}'s shapes.")


def _given_pruned(args, out: Path):
    """The ``--pruned`` folder copied in as stage 2, loaded with its masks."""
    if C.is_main_process():
        shutil.copytree(args.pruned, out / "pruned")
    C.wait_for_main_process()
    return load_model_folder(out / "pruned")[0]


def main(argv=None) -> dict:
    args = C.parse_args(DEFAULTS, __doc__, argv)
    check_pruned(args)
    out = _prepare_output(args)
    tok, texts, train, held_out = load_data(args)
    stages, t0 = [], time.time()

    def record(stage, model, **extra):
        stages.append({"stage": stage, **evaluate(model, held_out, args, tok), **extra})
        stages[-1]["elapsed_s"] = round(time.time() - t0, 1)
        C.log(json.dumps(stages[-1]))

    # 1. dense
    dense = dense_model(args, tok)
    if args.dense_steps:
        training_args = train_args(args, out / "dense_run", args.dense_steps, args.dense_lr)
        trainer = Trainer(model=dense, args=training_args, train_dataset=BlockDataset(train))
        _train(trainer)
    if C.is_main_process():
        dense.save_pretrained(out / "dense")
        tok.save_pretrained(out / "dense")
    C.wait_for_main_process()
    record("dense", dense)

    # 2. one-shot prune (a copy: the dense model stays the teacher). Every process prunes the same
    # (deterministic) way; the main one writes the folder.
    structure = args.structure or None
    config = SparsityConfig(sparsity=0.5 if structure else args.sparsity, structure=structure)
    if args.pruned:  # its own levels (config.json's sparsity section), not --sparsity
        student = _given_pruned(args, out)
        config = get_sparsity_config(student.config) or config
        record("pruned", student, pruned_from=args.pruned)
    else:
        student, _ = load_model_folder(out / "dense")
        calib = sample_calibration(texts, tok, args.nsamples, args.seqlen, seed=args.calib_seed)
        result = prune_oneshot(student, config, calib, method=args.method)
        if C.is_main_process():
            save_pruned(student, result, out / "pruned", config=config, tokenizer=tok)
        C.wait_for_main_process()
        record("pruned", student, prune_s=round(result.seconds, 2))
        student, _ = load_model_folder(out / "pruned")  # as saved: the callback finds its masks there

    # 3. recover: the pruned folder in Trainer; SparsityCallback restores its masks and keeps them fixed
    callback = SparsityCallback(config, seq_len=args.block_size)
    training_args = train_args(args, out / "recover_run", args.recover_steps, args.recover_lr)
    trainer = DistillTrainer(
        model=student, args=training_args, train_dataset=BlockDataset(train), callbacks=[callback],
        teacher=dense.eval() if args.distill_alpha > 0 else None,
        alpha=args.distill_alpha, temperature=args.distill_temperature,
    )  # fmt: skip
    if args.recover_steps:
        _train(trainer)
        trainer.save_model(out / "recovered")  # weights + sparsity_masks.safetensors + config section
    elif C.is_main_process():
        shutil.copytree(out / "pruned", out / "recovered")
    if C.is_main_process():
        tok.save_pretrained(out / "recovered")
    C.wait_for_main_process()
    flops = callback.flops  # None when recover_steps is 0 (no training ran)
    record(
        "recovered", student, masks_restored_from=str(callback.restored_from),
        recover_tokens=flops.tokens if flops else 0,
        recover_training_flops=flops.training_flops if flops else 0.0,
    )  # fmt: skip

    # 4. finalize: masks baked into zeros, a vanilla folder
    final = C.finalize(str(out / "recovered"), str(out / "final"))
    record("final", C.load_model(final))

    results = summarize(args, stages)
    C.write_results(str(out / "results.json"), results)
    if C.is_main_process():
        plot(stages, out / "perplexity.png", args)
    C.log(f"gap closed by recovery: {results['gap_closed']:.1%}; wrote {out}/results.json, perplexity.png")
    return results


def summarize(args, stages) -> dict:
    ppl = {s["stage"]: s["heldout_ppl"] for s in stages}
    gap = ppl["pruned"] - ppl["dense"]
    closed = (ppl["pruned"] - ppl["recovered"]) / gap if gap > 0 else float("nan")
    return {"settings": vars(args), "stages": stages, "gap_closed": closed}


def plot(stages, path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ["heldout_ppl"] + (["wikitext2_ppl"] if args.wikitext2 else [])
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5), squeeze=False)
    for ax, key in zip(axes[0], keys):
        vals = [s[key] for s in stages]
        ax.bar([s["stage"] for s in stages], vals, color=["#4c72b0", "#c44e52", "#55a868", "#8172b2"])
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_ylabel(key.replace("_", " "))
    level = "2:4" if args.structure else f"{args.sparsity:.0%}"
    fig.suptitle(f"{args.method} {level}, recover {args.recover_steps} steps, distill α={args.distill_alpha}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        main()
    except SparsityError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
