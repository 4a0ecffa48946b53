"""Sparse fine-tuning of your own model folder with ``transformers.Trainer`` + ``SparsityCallback``.

The model folder is anything ``save_pretrained`` wrote (with its tokenizer). Masks come from

* the folder's ``sparsity_masks.safetensors`` when it has one (``hf_sparsity prune`` output, an
  another training run's ``final/``): they are kept as they are, and without ``--config`` the folder's own
  sparsity section (``config.json``) or the levels in the mask file say which tensors stay sparse;
  with a ``--config`` whose level differs, they are pruned further or regrown to it;
* else the sparsity config (``--config``, default 50% ``topk``), built at train begin.

The text is a ``.jsonl`` file with a ``"text"`` field per line (Pile / OpenWebText style) or a
plain ``.txt`` file.

    hf_sparsity prune DIR out/pruned --method wanda --sparsity 0.5 --calib-data CALIB.jsonl
    python examples/sparse_finetune.py --model out/pruned \\
        --data DATA_DIR/corpus/openwebtext-1000.jsonl --output_dir out/ft --max_steps 20
    python examples/sparse_finetune.py --model DIR --config examples/sparsity_topk50.yaml \\
        --data DATA_DIR/corpus/openwebtext-1000.jsonl --output_dir out/smol50 --max_steps 20

Checkpoints (``OUT/checkpoint-N``, each with its mask file) every ``--save_steps``; rerun the
same command with ``--resume`` after an interruption (``--stop_after N`` simulates one right
after the checkpoint of step N). The final model and tokenizer go to ``OUT/final``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


def _texts(path: str, limit: int) -> list[str]:
    """The first ``limit`` documents of a .jsonl (``text`` field) or .txt file, read as ``prune`` does."""
    from hf_sparsity.pruning import read_documents
    from hf_sparsity.utils import SparsityError

    if not os.path.isfile(path):
        raise SparsityError(
            f"--data {path!r} does not exist. Give a .jsonl file with a 'text' field or a .txt file."
        )
    texts = read_documents(path)[:limit]
    if not texts:
        raise SparsityError(f"--data {path!r} holds no text.")
    return texts


def _sparsity_config(config: str | None, model: str):
    """``--config``; else what the model folder's masks say; else 50% ``topk``."""
    from hf_sparsity import SparsityConfig
    from hf_sparsity.mask_engine.config import get_sparsity_config
    from hf_sparsity.storage.masks_file import has_masks, read_mask_metadata

    if config:
        return SparsityConfig.from_yaml(config)
    if not has_masks(model):
        return SparsityConfig(sparsity=0.5, init_method="topk")
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        section = get_sparsity_config(json.load(f))
    if section is not None:  # the folder says how it was sparsified (targets, levels)
        return section
    # No section: exactly the masked tensors, each at the level its mask has.
    import re

    from hf_sparsity.constants import SPARSITY_MASKS_NAME

    tensors = read_mask_metadata(os.path.join(model, SPARSITY_MASKS_NAME))["tensors"]
    patterns = {"^" + re.escape(n) + "$": {"sparsity": t["level"]} for n, t in tensors.items()}
    return SparsityConfig.from_dict({"sparsity": 0.0, "param_name_patterns": patterns})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (weights + tokenizer)")
    ap.add_argument(
        "--config",
        help="params YAML with a `sparsity:` section "
        "(default: a sparse folder's masks as they are, else 50%% topk)",
    )
    ap.add_argument("--data", required=True, help=".jsonl with a 'text' field per line, or a .txt file")
    ap.add_argument("--output_dir", required=True)
    ap.add_argument("--max_steps", type=int, default=20)
    ap.add_argument("--save_steps", type=int, default=10)
    ap.add_argument("--logging_steps", type=int, default=5)
    ap.add_argument("--block_size", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--learning_rate", type=float, default=1e-5)
    ap.add_argument("--docs", type=int, default=200, help="documents read from --data")
    ap.add_argument(
        "--resume",
        nargs="?",
        const=True,
        metavar="CHECKPOINT",
        help="continue from the last complete checkpoint in --output_dir (or from CHECKPOINT)",
    )
    ap.add_argument(
        "--stop_after", type=int, help="exit right after the checkpoint of this step (test resume)"
    )
    ap.add_argument("--report_to", default=None, help="tensorboard (default when installed) or none")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from hf_sparsity import SparsityCallback, resume_checkpoint
    from hf_sparsity.checks import check_positive
    from hf_sparsity.data import BlockDataset, pack_tokens
    from hf_sparsity.loading import check_model_folder, check_tokenizer_source
    from hf_sparsity.logging_utils import arrange_logging
    from hf_sparsity.utils import SparsityError

    try:
        check_model_folder(args.model, "--model")
        check_tokenizer_source(args.model)
        for flag in ("max_steps", "save_steps", "logging_steps", "block_size", "batch_size", "docs"):
            check_positive(getattr(args, flag), "--" + flag)
        if args.resume and not os.path.isdir(args.output_dir):
            raise SparsityError(f"--resume: {args.output_dir!r} does not exist; run once without --resume.")
        # Not Trainer's resume_from_checkpoint=True: that takes the newest folder, even one a crash
        # left half-written.
        resume_from = resume_checkpoint(args.output_dir, args.resume)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        blocks = pack_tokens(_texts(args.data, args.docs), tokenizer, args.block_size)
        if len(blocks) < args.batch_size:
            raise SparsityError(
                f"--data gives {len(blocks)} blocks of {args.block_size} tokens; give more text."
            )
        sparsity = _sparsity_config(args.config, args.model)
    except SparsityError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    model = AutoModelForCausalLM.from_pretrained(args.model)  # a sparse folder brings its masks along
    report_to = args.report_to or ("tensorboard" if importlib.util.find_spec("tensorboard") else "none")

    class StopAfter(TrainerCallback):
        def on_save(self, a, state, control, **kw):
            if args.stop_after and state.global_step >= args.stop_after:
                sys.exit(
                    f"stopped after step {state.global_step} (simulated interruption); rerun with --resume"
                )

    sparsity_cb = SparsityCallback(sparsity, seq_len=args.block_size, print_report=True)
    trainer = Trainer(
        model=model,
        args=TrainingArguments(
            output_dir=args.output_dir,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            lr_scheduler_type="constant",
            logging_steps=args.logging_steps,
            save_steps=args.save_steps,
            report_to=report_to,
            disable_tqdm=True,
            use_cpu=not __import__("torch").cuda.is_available(),
            seed=0,
        ),
        train_dataset=BlockDataset(blocks),
        processing_class=tokenizer,
        callbacks=[sparsity_cb, StopAfter()],
    )
    # sparsity_cb ahead of the reporters (they get every sparsity/ scalar); per-layer values off the console
    arrange_logging(trainer, sparsity_cb)
    trainer.train(resume_from_checkpoint=resume_from)
    final = os.path.join(args.output_dir, "final")
    trainer.save_model(final)  # weights + sparsity_masks.safetensors + the config's sparsity section
    print(f"wrote {final}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
