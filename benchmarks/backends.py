"""CSR vs dense, per layer and for whole-model decoding, measured side by side in one run.

    python benchmarks/backends.py                 # full table (~3-5 min on 2 CPU cores)
    python benchmarks/backends.py --quick         # fewer repeats
    python benchmarks/backends.py --json out.json # also write the raw numbers

Part 1: one layer of each GPT-2-small shape (768x768, 3072x768, 768x3072; OUTxIN) at
50/75/90/95% random sparsity, batch 1 (decoding) and 64, float32: dense ``F.linear``
vs the ``csr`` backend's native kernel and vs torch.sparse CSR, timed round-robin
(dense, native, torch, dense, ...) and reported as medians; ``x`` columns are
``dense_ms / backend_ms`` (above 1: faster than dense).

Part 2: greedy decoding of a GPT-2-small-shaped model (random weights, 124M
parameters) with every projection / FFN weight at 90% sparsity: tokens/s, dense vs
``csr`` (native) vs ``csr`` (torch.sparse), interleaved rounds, medians and ratios.
The LM head (38.6M dense parameters, tied to the embedding) and attention stay dense:
they bound the whole-model speedup (see docs/backends.md). A second pass splits each
token's time (timing hooks on a plain cached decode loop) into the 48 sparse-able
layers, the LM head and the rest, and prints the Amdahl bounds that split allows: the
whole-model speedup if the sparse layers were exactly 1/density faster than dense,
and if they took no time at all.

Timings on a shared 2-core machine are noisy: rerun, compare ratios, not absolute times.
Unless ``OMP_WAIT_POLICY`` is set, this script sets it to ``PASSIVE`` before importing
torch: with libgomp's default spin-then-sleep policy, every parallel torch op (dense
matmuls included) stalls for a scheduler slice when other processes share the cores,
which swamps what is being measured. Both dense and sparse runs use the same setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads libgomp; see the docstring

import torch  # noqa: E402

from hf_sparsity.backends import _native, get_backend  # noqa: E402
from hf_sparsity.backends.bench import decode_breakdown, decode_tok_s, interleaved_ms, speedup_bounds  # noqa: E402
from hf_sparsity.masks import random_mask  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072)]
LEVELS = [0.5, 0.75, 0.9, 0.95]
BATCHES = [1, 64]


def layer_table(repeats: int) -> list[dict]:
    rows = []
    print(
        f"== one layer, float32, {torch.get_num_threads()} threads; medians of {repeats} interleaved rounds =="
    )
    print(f"{'shape':>9} {'level':>5} {'batch':>5} | {'dense ms':>8} {'native ms':>9} {'torch ms':>8} | "
          f"{'native x':>8} {'torch x':>7}")  # fmt: skip
    for out_f, in_f in SHAPES:
        w0 = torch.randn(out_f, in_f) / in_f**0.5
        for level in LEVELS:
            mask = random_mask((out_f, in_f), level, 0, f"{out_f}x{in_f}")
            w = w0 * mask
            native = get_backend("csr").from_dense(w, mask, kernel="native") if _native.load() else None
            tcsr = get_backend("csr").from_dense(w, mask, kernel="torch")
            for batch in BATCHES:
                x = torch.randn(batch, in_f)
                fns = {
                    "dense": lambda x=x, w=w: torch.nn.functional.linear(x, w),
                    "torch": lambda x=x, b=tcsr: b.linear(x),
                }
                if native is not None:
                    fns["native"] = lambda x=x, b=native: b.linear(x)
                with torch.no_grad():
                    t = interleaved_ms(fns, repeats, inner=5 if batch == 1 else 2)
                nat = t.get("native", float("nan"))
                row = {
                    "shape": f"{out_f}x{in_f}",
                    "level": level,
                    "batch": batch,
                    "dense_ms": t["dense"],
                    "native_ms": nat,
                    "torch_ms": t["torch"],
                    "native_ratio": t["dense"] / nat,
                    "torch_ratio": t["dense"] / t["torch"],
                }
                rows.append(row)
                print(f"{row['shape']:>9} {level:>5.2f} {batch:>5} | {t['dense']:>8.3f} {nat:>9.3f} "
                      f"{t['torch']:>8.3f} | {row['native_ratio']:>8.2f} {row['torch_ratio']:>7.2f}")  # fmt: skip
    return rows


def model_decode(rounds: int, new_tokens: int, level: float = 0.9) -> dict:
    from transformers import AutoModelForCausalLM, GPT2Config

    from hf_sparsity.config import SparsityConfig
    from hf_sparsity.engine import SparsityEngine
    from hf_sparsity.inference import restore_dense, sparsify_for_inference

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config()).eval()  # GPT-2 small: 12 x 768, vocab 50257
    eng = SparsityEngine(model, SparsityConfig(sparsity=level, init_method="random"))
    eng.build_masks()
    eng.apply()  # the dense baseline computes the same (masked) function
    ids = torch.randint(2, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    variants = {"dense": None, "csr-torch": {"kernel": "torch"}}
    if _native.load() is not None:
        variants["csr-native"] = {"kernel": "native"}
    tok_s: dict[str, list[float]] = {k: [] for k in variants}
    decode_tok_s(model, ids, 2)
    for r in range(rounds):
        for name, opts in variants.items():
            if opts is not None:
                sparsify_for_inference(model, "csr", masks=eng.masks, **opts)
                if r == 0:
                    decode_tok_s(model, ids, 2)  # warm-up
            tok_s[name].append(decode_tok_s(model, ids, new_tokens))
            if opts is not None:
                restore_dense(model)
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    print(f"\n== GPT-2-small-shaped model, {level:.0%} sparsity on all 48 projection/FFN weights, greedy decode "
          f"of {new_tokens} tokens after 16, {torch.get_num_threads()} threads; medians of {rounds} rounds ==")  # fmt: skip
    for k, v in med.items():
        runs = ", ".join(f"{t:.1f}" for t in tok_s[k])
        print(f"{k:>11}: {v:7.2f} tok/s  ({v / med['dense']:.2f}x dense)   rounds: {runs}")

    # Where the time goes: per-token ms of a cached decode loop, split by timing hooks.
    layer_names = sorted({n.rpartition(".")[0] for n in eng.masks})
    parts: dict[str, list[dict]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, opts in variants.items():
            if opts is not None:
                sparsify_for_inference(model, "csr", masks=eng.masks, **opts)
            parts[name].append(decode_breakdown(model, ids, new_tokens, layer_names))
            if opts is not None:
                restore_dense(model)
    br = {k: {f: statistics.median(p[f] for p in v) for f in v[0]} for k, v in parts.items()}
    print(
        f"\n== per token, ms (plain cached decode loop, inference_mode, timing hooks; medians of {rounds}) =="
    )
    print(f"{'':>11}  {'total':>6}  {'48 layers':>9}  {'LM head':>7}  {'rest':>6}  {'x dense':>7}")
    for k, b in br.items():
        print(f"{k:>11}  {b['total_ms']:6.2f}  {b['layers_ms']:9.2f}  {b['lm_head_ms']:7.2f}  {b['rest_ms']:6.2f}  "
              f"{br['dense']['total_ms'] / b['total_ms']:7.2f}")  # fmt: skip
    density = sum(int(m.sum()) for m in eng.masks.values()) / sum(m.numel() for m in eng.masks.values())
    bounds = speedup_bounds(br["dense"], density)
    best = "csr-native" if "csr-native" in br else "csr-torch"
    print(
        f"48 sparse layers vs dense ({best}): {br['dense']['layers_ms'] / br[best]['layers_ms']:.2f}x; "
        f"the dense LM head and the rest ({br['dense']['total_ms'] - br['dense']['layers_ms']:.1f} ms) stay."
    )
    print(
        f"whole-model bound with these dense parts: {bounds['bound_layers_ideal']:.2f}x if the sparse layers "
        f"were {1 / density:.0f}x faster than dense (every skipped multiply-add free), "
        f"{bounds['bound_layers_free']:.2f}x if they took no time at all."
    )
    return {"level": level, "new_tokens": new_tokens, "tok_s": tok_s, "median_tok_s": med,
            "ratio": {k: v / med["dense"] for k, v in med.items()}, "breakdown_ms": br, **bounds}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer repeats and rounds")
    p.add_argument("--skip-layers", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--rounds", type=int, default=None, help="model decode rounds (default 5, quick 3)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--json", default=None, help="write raw results here")
    args = p.parse_args(argv)
    t0 = time.time()
    print(f"torch {torch.__version__}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, native kernel: "
          f"{'available' if _native.load() is not None else 'unavailable (' + str(_native.error()) + ')'}")  # fmt: skip
    out: dict = {"threads": torch.get_num_threads()}
    if not args.skip_layers:
        out["layers"] = layer_table(repeats=7 if args.quick else 21)
    if not args.skip_model:
        out["model"] = model_decode(args.rounds or (3 if args.quick else 5), args.new_tokens)
    print(f"\n(total {time.time() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
