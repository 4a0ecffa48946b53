"""``hf_sparsity flops``: parameters and FLOPs of a model config, dense vs sparse.

Counts follow Chinchilla Appendix F (embedding FLOPs excluded, attention and final
logits included, training = 3x forward), each linear layer adjusted for its own
sparsity. The model is built on the meta device: nothing is allocated, so any size works.

Examples::

    hf_sparsity flops --config gpt3-xl/config.json --sparsity 0.838
    hf_sparsity flops --config out/checkpoint-1000 --json        # levels from its masks file
    hf_sparsity flops --config llama/config.json --sparsity 0.75 --seq-len 4096 --per-layer
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import argparse
import json
import os


def flops_command_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``flops`` on the ``hf_sparsity`` command line."""
    p = subparsers.add_parser(
        "flops",
        help="parameters and inference / training FLOPs, dense vs sparse (Chinchilla App. F)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", required=True, help="a config.json path or a model directory")
    p.add_argument(
        "--sparsity",
        type=float,
        help="level for the default projection/FFN targets; default: the model directory's masks, "
        "else the config's sparsity section, else dense",
    )
    p.add_argument("--seq-len", type=int, help="sequence length (default: the config's context length)")
    p.add_argument("--json", action="store_true", help='print {"dense": {...}, "sparse": {...}}')
    p.add_argument("--per-layer", action="store_true", help="also list every layer group")
    p.set_defaults(func=flops_command)
    return p


def _describe_source(args) -> str:
    from ..constants import SPARSITY_MASKS_NAME

    if args.sparsity is not None:
        return f"default projection/FFN targets at {args.sparsity:g}"
    if os.path.isdir(args.config) and os.path.isfile(os.path.join(args.config, SPARSITY_MASKS_NAME)):
        return f"levels from {SPARSITY_MASKS_NAME}"
    return "the config's sparsity section (dense if none)"


def flops_command(args) -> int:
    from ..flops import count_flops_from_config
    from ..mask_engine.config import check_level
    from ..utils import SparsityError
    from . import _checks

    _checks.model_config(args.config)
    if args.sparsity is not None:
        check_level(args.sparsity, "--sparsity")
    if args.seq_len is not None and args.seq_len <= 0:
        raise SparsityError(f"--seq-len must be a positive integer, got {args.seq_len}.")
    sparse = count_flops_from_config(args.config, args.sparsity, seq_len=args.seq_len)
    dense = sparse.dense()
    if args.json:
        out = {"dense": dense.summary(), "sparse": sparse.summary()}
        if args.per_layer:
            out["sparse"]["layers"] = sparse.grouped()
        print(json.dumps(out, indent=2, default=list))
        return 0
    print(format_comparison(dense, sparse, _describe_source(args), per_layer=args.per_layer))
    return 0


def _e(x: float) -> str:
    return f"{x:.4e}"


def format_comparison(dense, sparse, source: str, per_layer: bool = False) -> str:
    """The text table: dense vs sparse, reduction factors, and the FLOPs by kind."""
    lines = [
        f"model: {sparse.model_type}, seq_len {sparse.seq_len}; sparse = {source}",
        f"{'':<30} {'dense':>18} {'sparse':>18} {'reduction':>10}",
    ]
    rows = [
        ("parameters", dense.params, sparse.params, None),
        ("nonzero parameters", dense.nonzero_params, sparse.nonzero_params, None),
        ("inference FLOPs / token", dense.inference_flops_per_token, sparse.inference_flops_per_token, _e),
        ("training FLOPs / token", dense.training_flops_per_token, sparse.training_flops_per_token, _e),
        (
            "inference FLOPs / sequence",
            dense.forward_flops_per_sequence,
            sparse.forward_flops_per_sequence,
            _e,
        ),
        (
            "training FLOPs / sequence",
            dense.training_flops_per_sequence,
            sparse.training_flops_per_sequence,
            _e,
        ),
    ]
    for label, a, b, fmt in rows:
        fa, fb = (fmt(a), fmt(b)) if fmt else (f"{a:,}", f"{b:,}")
        lines.append(f"{label:<30} {fa:>18} {fb:>18} {a / b if b else float('inf'):>9.2f}x")
    lines.append("")
    lines.append("forward FLOPs / token by term:")
    for kind, label in (
        ("linear", "projections + FFN (sparse)"),
        ("attention", "attention logits + softmax"),
        ("logits", "final logits"),
    ):
        a, b = dense.kind_flops_per_token(kind), sparse.kind_flops_per_token(kind)
        share = a / dense.forward_flops_per_token
        lines.append(f"  {label:<28} {_e(a):>18} {_e(b):>18}   ({share:.1%} of dense)")
    lines.append(
        f"  {'embeddings (excluded)':<28} {_e(dense.embedding_flops_per_token):>18} "
        f"{'-':>18}   (Chinchilla App. F term, not counted)"
    )
    targeted = [t for t in sparse.layers if t.kind == "linear" and t.sparsity > 0]
    if targeted:
        tn = sum(t.params for t in targeted)
        tz = sum(t.params - t.nonzero_params for t in targeted)
        lines.append(f"  {len(targeted)} sparse tensors, {tn:,} parameters, level {tz / max(tn, 1):.4f}")
    if per_layer:
        lines.append("")
        w = max(len(r["group"]) for r in sparse.grouped())
        lines.append(
            f"{'layer':<{w}}  {'kind':<9} {'n':>3}  {'shape':<12} {'sparsity':>9} {'FLOPs/token':>12}"
        )
        for r in sparse.grouped():
            shape = "x".join(map(str, r["shape"]))
            lv = (
                r["sparsity"]
                if isinstance(r["sparsity"], float)
                else f"{r['sparsity'][0]}-{r['sparsity'][1]}"
            )
            lv = f"{lv:.4f}" if isinstance(lv, float) else lv
            lines.append(
                f"{r['group']:<{w}}  {r['kind']:<9} {r['count']:>3}  {shape:<12} {lv:>9} "
                f"{_e(r['flops_per_token']):>12}"
            )
    for note in sparse.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
