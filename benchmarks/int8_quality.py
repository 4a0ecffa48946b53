"""What int8 values cost in quality: WikiText-2 perplexity of one sparse model with float32 values, with int8
values in its sparse layers (float32 activations, then int8 activations: the default), and with the LM head
in int8 too (what ``values="int8"`` with ``auto`` gives).

    python benchmarks/int8_quality.py PRUNED_DIR --data-dir DATA_DIR            # e.g. a 50% Wanda folder
    python benchmarks/int8_quality.py PRUNED_DIR --data-dir DATA_DIR --structure-backend nm24   # 2:4

The folder is a pruned model (``hf_sparsity prune``: its ``sparsity_masks.safetensors``). Every sparse layer
goes on the ``bitmask`` backend (``--structure-backend nm24`` for 2:4 masks), so each row differs from the
float32 row in its values only: symmetric per-row int8 codes, round to nearest. Perplexity by the Wanda /
SparseGPT protocol (non-overlapping windows of ``--seqlen`` tokens of the WikiText-2 test split, the first
``--windows``), the protocol of docs/pruning.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def _int8_lm_head(model) -> None:
    from hf_sparsity.backends import get_backend
    from hf_sparsity.inference import SparseLinear
    from hf_sparsity.modeling import replace_module

    head = model.get_output_embeddings()
    name = next(n for n, m in model.named_modules() if m is head)
    w = head.weight.detach()
    backend = get_backend("native_dense").from_dense(w, torch.ones_like(w, dtype=torch.uint8), values="int8")
    replace_module(model, name, SparseLinear(head, backend))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a pruned model folder (with sparsity_masks.safetensors)")
    p.add_argument("--data-dir", required=True, help="data folder holding text/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--windows", type=int, default=64)
    p.add_argument("--structure-backend", default="bitmask", help="bitmask (default) or nm24 for 2:4 masks")
    args = p.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity
    from hf_sparsity.inference import sparsify_for_inference

    path = os.path.join(args.data_dir, "text", "wikitext-2-raw", "wiki.test.raw")
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    rows = {}
    labels = ("float32 values", "int8 values, float32 act.", "int8 values, int8 act.", "int8 + int8 LM head")
    for label in labels:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
        opts = {} if label == "float32 values" else {"values": "int8"}
        if "float32 act" in label:
            opts["activations"] = "float32"
        sparsify_for_inference(model, args.structure_backend, **opts)
        if label.endswith("LM head"):
            _int8_lm_head(model)
        t = time.perf_counter()
        with torch.inference_mode():
            res = wikitext2_perplexity(model, tok, path, seqlen=args.seqlen, max_windows=args.windows)
        rows[label] = res["perplexity"]
        print(f"{label:<28} ppl {rows[label]:8.3f}  ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    base = rows["float32 values"]
    print(f"\nWikiText-2, {args.windows} windows of {args.seqlen} tokens; {args.structure_backend}")
    print(f"{'values':<28} {'ppl':>8} {'vs float32':>10}")
    for label, ppl in rows.items():
        print(f"{label:<28} {ppl:8.3f} {ppl / base - 1:+10.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
