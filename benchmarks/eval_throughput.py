"""Pile-style loss throughput vs a bare Hugging Face forward over the same windows.

``hf_sparsity.evaluation.pile_loss`` reads the corpus, tokenizes it, cuts windows and sums
the cross-entropy in float32. This benchmark times it end to end against the bare
``model(input_ids).logits`` forward over exactly the windows it scores (pre-tokenized,
already batched tensors), interleaving the two for ``--repeats`` rounds, and prints
tokens/s for each and their ratio (target: at least 0.9).

    python benchmarks/eval_throughput.py                       # small GPT-2 built from a config
    python benchmarks/eval_throughput.py --model SMOL_DIR/dense --data-dir DATA_DIR --docs 8 --context 2048
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def build_default(data: Path):
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    tok = GPT2TokenizerFast.from_pretrained(data / "tokenizer" / "gpt2")
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=6, n_embd=384, n_head=6, n_positions=512, vocab_size=len(tok))
    return GPT2LMHeadModel(cfg).eval(), tok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: a 6-layer GPT-2, d=384, built from a config)")
    parser.add_argument(
        "--data-dir",
        required=True,
        help="data folder holding corpus/openwebtext-1000.jsonl and tokenizer/gpt2/",
    )
    parser.add_argument("--docs", type=int, default=24, help="corpus documents to score")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()

    from hf_sparsity.evaluation import load_model_for_eval, pile_loss
    from hf_sparsity.evaluation.perplexity import iter_documents, iter_windows

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.data_dir)
    corpus = data / "corpus" / "openwebtext-1000.jsonl"
    if args.model:
        model, tok, _ = load_model_for_eval(args.model, device="cpu")
    else:
        model, tok = build_default(data)

    # The exact windows pile_loss scores, pre-batched for the bare forward.
    windows = list(iter_windows(iter_documents(corpus, args.docs), tok, args.context, tok.eos_token_id))
    full = [w for w in windows if len(w) == args.context + 1]
    batches = [torch.tensor(full[i : i + args.batch_size]) for i in range(0, len(full), args.batch_size)]
    batches += [torch.tensor([w]) for w in windows if len(w) != args.context + 1]
    n_tokens = sum(b[:, 1:].numel() for b in batches)

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            for b in batches:
                _ = model(input_ids=b[:, :-1]).logits
        return time.perf_counter() - t0

    def ours() -> float:
        t0 = time.perf_counter()
        res = pile_loss(model, tok, corpus, context=args.context, batch_size=args.batch_size, limit=args.docs,
                        progress=False)  # fmt: skip
        dt = time.perf_counter() - t0
        assert res["tokens"] == n_tokens, (res["tokens"], n_tokens)
        return dt

    bare()  # warm-up
    t_bare, t_ours = [], []
    for _ in range(args.repeats):
        t_bare.append(bare())
        t_ours.append(ours())
    tb, to = statistics.median(t_bare), statistics.median(t_ours)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {args.model or 'GPT-2 6x384 (config)'} ({params / 1e6:.1f}M params), "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"windows: {len(windows)} x context {args.context}, batch {args.batch_size}, {n_tokens} scored tokens"
    )
    print(f"bare HF forward : {n_tokens / tb:10.1f} tok/s  (median of {args.repeats}: {tb:.2f}s)")
    print(f"pile_loss       : {n_tokens / to:10.1f} tok/s  (median of {args.repeats}: {to:.2f}s)")
    print(f"ratio pile_loss / bare forward: {tb / to:.3f}  (target >= 0.9)")


if __name__ == "__main__":
    main()
