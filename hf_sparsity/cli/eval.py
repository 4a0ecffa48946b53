"""``hf_sparsity eval``: score a model folder on Pile-style loss, LAMBADA, WikiText-103 and harness7.

Examples::

    hf_sparsity eval out/checkpoint-1000 --suite pile,wikitext103,harness7 \\
        --data-dir DATA_DIR --limit 200 --out results/ckpt1000
    hf_sparsity eval --compare results/dense results/sparse50 --out results/compare
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import argparse
import json
import sys

from ..utils import SparsityError


def eval_command_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``eval`` on the ``hf_sparsity`` command line."""
    p = subparsers.add_parser(
        "eval",
        help="evaluate a (sparse) model: Pile loss, LAMBADA, WikiText-103 adjusted ppl, lm-eval harness7",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", nargs="?", help="model folder (sparse with sparsity_masks.safetensors, or vanilla)"
    )
    p.add_argument(
        "--suite",
        default="harness7",
        help="comma-separated: pile, lambada, wikitext103, harness7, or lm-eval task names "
        "(default harness7)",
    )
    p.add_argument(
        "--data-dir",
        help="local data folder with tasks/, corpus/, text/wikitext-103/, text/wikitext-2-raw/ (any of "
        "them) or a tasks folder: lm-eval tasks run offline from it; without it they are lm-eval's "
        "stock (online) tasks",
    )
    p.add_argument("--pile-data", nargs="+", help="Pile-format .jsonl/.jsonl.zst file(s), folder or glob")
    p.add_argument("--wikitext", help="WikiText-103 word-level file (wiki.test.tokens)")
    p.add_argument(
        "--limit",
        help="lm-eval examples per task, Pile documents, WikiText articles: N for every suite, or per suite "
        "like harness7=100,pile=50,wikitext103=10 (default: all)",
    )
    p.add_argument("--batch-size", type=int, default=4, help="windows / requests per forward (default 4)")
    p.add_argument("--context", type=int, help="window length for Pile loss and WikiText (default: model's)")
    p.add_argument(
        "--stride",
        "--overlapping-eval",
        type=int,
        dest="stride",
        help="WikiText tokens scored per window, Megatron's --overlapping-eval "
        "(default: context, no overlap)",
    )
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", help="float32, bfloat16, float16 (default: as saved)")
    p.add_argument("--tokenizer", help="tokenizer folder when the model folder has none")
    p.add_argument("--out", help="folder for results.json and results.md (or compare.md/.png with --compare)")
    p.add_argument("--compare", nargs="+", metavar="DIR", help="compare results folders side by side")
    p.add_argument("--labels", nargs="+", help="column labels for --compare (default: folder names)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--seqlen", type=int, help="wikitext2 suite: window length (default: model's context)")
    p.add_argument("--max-windows", type=int, help="wikitext2 suite: score only the first K windows")
    p.add_argument("--json", action="store_true", help="wikitext2 suite: print its result as JSON")
    p.set_defaults(func=eval_command)
    return p


def eval_command(args: argparse.Namespace) -> int:
    """Run ``hf_sparsity eval``; returns the exit status."""
    from ..evaluation import compare, evaluate, format_markdown, write_report
    from ..evaluation.runner import check_offline_tasks

    if args.compare:
        if args.model:
            raise SparsityError("Give either a MODEL to evaluate or --compare DIR..., not both.")
        if not args.out:
            raise SparsityError("--compare needs --out DIR for compare.md and compare.png.")
        md, png = compare(args.compare, args.out, labels=args.labels)
        print(md.read_text(encoding="utf-8"))
        print(f"wrote {md} and {png}")
        return 0
    if not args.model:
        raise SparsityError("Name the model folder to evaluate: hf_sparsity eval MODEL --suite ...")
    check_offline_tasks(args.suite, args.data_dir)  # lm-eval data would be downloaded: refuse up front
    results = evaluate(
        args.model,
        args.suite,
        tokenizer=args.tokenizer,
        data_dir=args.data_dir,
        pile_data=args.pile_data,
        wikitext_file=args.wikitext,
        limit=args.limit,
        batch_size=args.batch_size,
        context=args.context,
        stride=args.stride,
        seqlen=args.seqlen,
        max_windows=args.max_windows,
        device=args.device,
        dtype=args.dtype,
        tasks_out=f"{args.out}/tasks" if args.out and args.data_dir else None,
        progress=not args.no_progress and sys.stderr.isatty(),
    )
    if "wikitext2" in results["suites"]:  # printed on its own line (or as JSON), as the papers report it
        from ..evaluation.runner import wikitext2_result
        from ..evaluation.wikitext2 import format_wikitext2

        w2 = wikitext2_result(results)
        print(json.dumps(w2, indent=2) if args.json else format_wikitext2(w2))
        if results["suites"] == ["wikitext2"]:
            return 0
    if args.out:
        jpath, mpath = write_report(results, args.out)
        print(format_markdown(results))
        print(f"wrote {jpath} and {mpath}")
    else:
        print(format_markdown(results))
        print(json.dumps(results["metrics"], indent=2, default=str))
    return 0
