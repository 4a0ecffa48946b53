"""Sparse vs dense whole-model decoding (``auto``), and optionally CSR per layer, side by side in one run.

    python benchmarks/backends.py --threads 2            # the four models (~5-8 min on 2 cores)
    python benchmarks/backends.py --threads 2 --quick    # fewer rounds and tokens
    python benchmarks/backends.py --models smollm2:0.5 --verbose   # one model, every layer's choice
    python benchmarks/backends.py --layers               # + the per-layer CSR table
    python benchmarks/backends.py --json out.json        # also write the raw numbers
    python benchmarks/backends.py --threads 2 --compile  # + dense and auto with the forward compiled
    python benchmarks/backends.py --threads 2 --dtype bfloat16   # bf16 models (bf16 values in the formats)
    python benchmarks/backends.py --omp-passive          # OMP_WAIT_POLICY=PASSIVE (flatters sparse: below)

Models (random weights, which is fine for speed; masks by magnitude, applied, so dense and
sparse compute the same function): a Llama shaped like SmolLM2-135M (hidden 576, FFN 1536,
30 layers, 9 heads / 3 KV heads, vocab 49152, tied LM head) at 50%, 70% and 2:4, and
GPT-2 small at 90%, all 7 (4) projection / FFN weights per block sparse. For each: three
copies of the model, timed round-robin with greedy ``generate`` (batch 1):

* ``dense``: stock transformers;
* ``dense+``: dense with the same non-sparse improvements ``auto`` uses (the native
  multi-threaded GEMV where it measures faster, e.g. the LM head): what is not sparsity;
* ``auto``: ``sparsify_for_inference(model, "auto")``.

With ``--compile`` also ``dense-c`` and ``auto-c``: the same models, ``generate`` with a static
KV cache and the forward compiled (``hf_sparsity.inference.compiled_generate_kwargs``; the
first call, which compiles, is timed separately): ``auto-c / dense-c`` is what sparsity buys
when both are compiled, ``auto-c / dense`` the gain over stock transformers.

Then the per-token split (sparse-able layers, LM head, rest), a 128-token prefill forward
(auto vs dense, and "auto kd": auto as ``keep_dense_for_prefill=True`` runs it, keeping the
dense weight of every layer whose prefill is slower than dense) and a 512-token one (pf512),
resident weight bytes (whole model, with kd, and the converted layers alone against the same
layers dense: the tied embedding / LM head stays dense and bounds the whole-model ratio), and
auto's choice per group of like layers (decode, prefill up to 256 rows, and above).

(Below: the original description of the per-layer CSR table, ``--layers``.)

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

Every row also reports the bytes of weights one decoding step reads (``MB/tok``), the machine's read
bandwidth (the faster of a STREAM-like sum over a buffer larger than the last-level cache and the native
bitmask kernel's prefetched read of an 84 MB weight), the bound that gives
(bandwidth / bytes per token) and the fraction of it the row reaches (for ``auto`` in the summary).

Timings on a shared 2-core machine are noisy: rerun, compare ratios, not absolute times.
``OMP_WAIT_POLICY`` is left as the environment has it, so ``dense`` is stock transformers
as a user runs it (libgomp's default: threads spin a while after each parallel region,
which is what makes torch's two-thread GEMV fast). ``--omp-passive`` sets ``PASSIVE``
before torch loads (what earlier versions of this script did by default): on a shared
machine it stops spinning threads from stalling each other, but it slows every parallel
torch op, dense included (SmolLM2 shape: 18 against 31 tok/s), so ratios measured that
way flatter the sparse formats. The first line printed says which policy ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--omp-passive" in sys.argv:  # before torch loads libgomp; see the docstring
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402

from hf_sparsity.backends import _native, get_backend  # noqa: E402
from hf_sparsity.inference.bench import (  # noqa: E402
    auto_groups,
    decode_breakdown,
    decode_bytes_per_token,
    decode_tok_s,
    interleaved_ms,
    peak_read_gbs,
)
from hf_sparsity.masks import random_mask  # noqa: E402

SHAPES = [(768, 768), (3072, 768), (768, 3072)]
LEVELS = [0.5, 0.75, 0.9, 0.95]
BATCHES = [1, 64]


def layer_table(repeats: int) -> list[dict]:
    rows = []
    print(
        f"== one layer, float32, {torch.get_num_threads()} threads; medians of {repeats} interleaved "
        "rounds =="
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
                print(
                    f"{row['shape']:>9} {level:>5.2f} {batch:>5} | {t['dense']:>8.3f} {nat:>9.3f} "
                    f"{t['torch']:>8.3f} | {row['native_ratio']:>8.2f} {row['torch_ratio']:>7.2f}"
                )
    return rows


def _build_model(kind: str, level, seed: int = 0):
    """A random-weight model of the given shape with masks applied (the dense baseline computes the same)."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    torch.manual_seed(seed)
    if kind == "smollm2":  # SmolLM2-135M: 30 layers, hidden 576, FFN 1536, 9 heads / 3 KV heads, tied head
        cfg = LlamaConfig(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048,
        )  # fmt: skip
    else:  # GPT-2 small: 12 x 768, vocab 50257, tied head
        cfg = GPT2Config()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    if level == "2:4":
        sc = SparsityConfig(sparsity=0.5, structure="2:4", init_method="topk")
    else:
        sc = SparsityConfig(sparsity=float(level), init_method="topk")
    eng = SparsityEngine(model, sc)
    eng.build_masks()
    eng.apply()
    masks = {n: m.clone() for n, m in eng.masks.items()}
    del eng
    return model, masks


def _fmt_level(level) -> str:
    return level if isinstance(level, str) else f"{level:.0%}"


def _dense_prefill_swaps(model) -> list[tuple]:
    """What ``keep_dense_for_prefill=True`` would keep: for each auto layer whose prefill is slower than
    dense, its dense weight. Returns ``(backend, dense weight)`` pairs for :func:`_set_dense_prefill`."""
    from hf_sparsity.inference import sparse_layers

    out = []
    for m in sparse_layers(model).values():
        b = m.backend
        c = getattr(b, "choice", None)
        slower = c and min(c["prefill_vs_dense"], c["prefill_large_vs_dense"]) < 1.0
        if slower and "dense" not in (c["prefill"], c["prefill_large"]):
            out.append((b, (b.prefill, b.prefill_large), b.decode.to_dense().contiguous()))
    return out


def _set_dense_prefill(swaps, on: bool) -> None:
    for b, modes, w in swaps:
        b.prefill, b.prefill_large, b.prefill_weight = ("dense", "dense", w) if on else (*modes, None)


def _prefill_ms(variants: dict, swaps, vocab: int, tokens: int, rounds: int) -> dict[str, float]:
    """Median ms of one forward of a ``tokens``-token prompt per variant, interleaved rounds (``auto kd``:
    the auto model with the ``swaps`` on)."""
    ids = torch.randint(2, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.inference_mode():
        for i in range(rounds + 1):  # the first round warms up
            for k, m in variants.items():
                _set_dense_prefill(swaps, k == "auto kd")
                t = time.perf_counter()
                m(ids)
                if i:
                    times[k].append((time.perf_counter() - t) * 1e3)
    _set_dense_prefill(swaps, False)
    return {k: statistics.median(v) for k, v in times.items()}


def model_decode(
    kind: str,
    level,
    rounds: int,
    new_tokens: int,
    prompt_len: int = 16,
    verbose=False,
    compile_=False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """Whole-model greedy decode: stock dense vs dense with the same improvements vs ``auto``
    (and, with ``compile_``, dense and auto with the forward compiled)."""
    import copy

    from hf_sparsity.inference import (
        auto_report,
        compiled_generate_kwargs,
        resident_weight_bytes,
        sparse_layer_bytes,
        sparsify_for_inference,
    )

    t0 = time.time()
    dense, masks = _build_model(kind, level)
    dense = dense.to(dtype)  # bfloat16: stock dense runs bf16; the packed formats keep bf16 values
    dense_bytes = resident_weight_bytes(dense)
    improved = copy.deepcopy(dense)  # dense + the same non-sparse improvements (native GEMV where faster)
    sparsify_for_inference(improved, "auto", masks=masks, formats=("native_dense",))
    auto = copy.deepcopy(dense)
    t1 = time.time()
    sparsify_for_inference(auto, "auto", masks=masks)
    plan_s = time.time() - t1
    variants = {"dense": dense, "dense+": improved, "auto": auto}
    vocab = dense.config.vocab_size
    ids = torch.randint(2, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = dense(ids).logits
        err = max((m(ids).logits - ref).abs().max().item() for m in (improved, auto))
    runs = {k: (m, {}) for k, m in variants.items()}  # name -> (model, generate kwargs)
    compile_s: dict[str, float] = {}
    if compile_:  # the same models, generate with a static cache and the forward compiled
        runs["dense-c"] = (dense, compiled_generate_kwargs())
        runs["auto-c"] = (auto, compiled_generate_kwargs())
    tok_s: dict[str, list[float]] = {k: [] for k in runs}
    for k, (m, kw) in runs.items():  # warm-up; compiled: the first call compiles (same shapes as timed)
        t = time.perf_counter()
        decode_tok_s(m, ids, new_tokens if kw else 2, **kw)
        if kw:
            compile_s[k] = time.perf_counter() - t
    for _ in range(rounds):
        for k, (m, kw) in runs.items():
            tok_s[k].append(decode_tok_s(m, ids, new_tokens, **kw))
    med = {k: statistics.median(v) for k, v in tok_s.items()}
    bw = peak_read_gbs()
    per_token = {k: decode_bytes_per_token(m) for k, (m, _) in runs.items()}
    bound = {k: bw * 1e9 / b for k, b in per_token.items()}
    # per-token split (timing hooks on a plain cached loop), one pass each, interleaved
    layer_names = sorted({n.rpartition(".")[0] for n in masks})
    split = {k: decode_breakdown(m, ids, new_tokens, layer_names) for k, m in variants.items()}
    # prefill: one forward of a 128-token prompt (and of a 512-token one), interleaved rounds;
    # "auto kd": as keep_dense_for_prefill=True would run (the dense weight where prefill loses)
    swaps = _dense_prefill_swaps(auto)
    _set_dense_prefill(swaps, True)
    kd_bytes = resident_weight_bytes(auto)
    _set_dense_prefill(swaps, False)
    pf_variants = {**variants, "auto kd": auto}
    pf_med = _prefill_ms(pf_variants, swaps, vocab, 128, max(3, rounds))
    pf512 = _prefill_ms({k: pf_variants[k] for k in ("dense", "auto")}, swaps, vocab, 512, 3)
    layer_bytes = sparse_layer_bytes(auto)
    groups, check = auto_groups(auto)
    res = {
        "model": kind,
        "level": _fmt_level(level),
        "threads": torch.get_num_threads(),
        "tok_s": tok_s,
        "median_tok_s": med,
        "auto_vs_dense": med["auto"] / med["dense"],
        "auto_vs_dense_plus": med["auto"] / med["dense+"],
        "dense_plus_vs_dense": med["dense+"] / med["dense"],
        "read_gbs": bw,
        "bytes_per_token": per_token,
        "bound_tok_s": bound,
        "fraction_of_bound": {k: med[k] / bound[k] for k in runs},
        "split_ms": split,
        "prefill_ms": pf_med,
        "prefill_auto_vs_dense": pf_med["dense"] / pf_med["auto"],
        "prefill_auto_keep_dense_vs_dense": pf_med["dense"] / pf_med["auto kd"],
        "prefill_512_ms": pf512,
        "prefill_512_auto_vs_dense": pf512["dense"] / pf512["auto"],
        "resident_bytes": {"dense": dense_bytes, "auto": resident_weight_bytes(auto), "auto kd": kd_bytes},
        "resident_ratio": resident_weight_bytes(auto) / dense_bytes,
        "resident_ratio_keep_dense": kd_bytes / dense_bytes,
        "sparse_layer_bytes": layer_bytes,
        "compile_s": compile_s,
        "max_abs_logit_err": err,
        "plan_s": plan_s,
        "groups": groups,
        "total_s": time.time() - t0,
    }  # fmt: skip
    print(
        f"\n== {kind} shape, {_fmt_level(level)} sparsity, greedy decode of {new_tokens} tokens after "
        f"{prompt_len}, {torch.get_num_threads()} threads, medians of {rounds} interleaved rounds =="
    )
    for k in runs:
        rs = ", ".join(f"{t:.1f}" for t in tok_s[k])
        extra = f"   (compile + first call {compile_s[k]:.1f} s)" if k in compile_s else ""
        print(f"{k:>7}: {med[k]:7.2f} tok/s  ({med[k] / med['dense']:.2f}x dense)   rounds: {rs}{extra}   "
              f"{per_token[k] / 1e6:.0f} MB/token, bound {bound[k]:.0f} tok/s at {bw:.1f} GB/s, "
              f"{med[k] / bound[k]:.0%} of it")  # fmt: skip
    print(f"auto vs dense+ (what sparsity itself buys): {res['auto_vs_dense_plus']:.2f}x")
    if compile_:
        res["auto_c_vs_dense_c"] = med["auto-c"] / med["dense-c"]
        res["auto_c_vs_dense"] = med["auto-c"] / med["dense"]
        res["dense_c_vs_dense"] = med["dense-c"] / med["dense"]
        print(f"compiled: auto-c vs dense-c (what sparsity buys, both compiled) "
              f"{res['auto_c_vs_dense_c']:.2f}x; auto-c vs stock dense {res['auto_c_vs_dense']:.2f}x; "
              f"dense-c vs dense "
              f"{res['dense_c_vs_dense']:.2f}x")  # fmt: skip
    print(f"prefill (128 tokens): dense {pf_med['dense']:.1f} ms, dense+ {pf_med['dense+']:.1f} ms, "
          f"auto {pf_med['auto']:.1f} ms ({res['prefill_auto_vs_dense']:.2f}x dense), auto with "
          f"keep_dense_for_prefill {pf_med['auto kd']:.1f} ms ({res['prefill_auto_keep_dense_vs_dense']:.2f}x"
          f" dense, weights {res['resident_ratio_keep_dense']:.3f} of dense)")  # fmt: skip
    print(f"prefill (512 tokens): dense {pf512['dense']:.1f} ms, auto {pf512['auto']:.1f} ms "
          f"({res['prefill_512_auto_vs_dense']:.2f}x dense)")  # fmt: skip
    print(f"per token ms   {'total':>6} {'sparse-able layers':>18} {'LM head':>7} {'rest':>6}")
    for k, b in split.items():
        print(
            f"{k:>13}  {b['total_ms']:6.2f} {b['layers_ms']:18.2f} {b['lm_head_ms']:7.2f} {b['rest_ms']:6.2f}"
        )
    rb = res["resident_bytes"]
    print(
        f"resident weight bytes: dense {rb['dense'] / 2**20:.1f} MiB, auto {rb['auto'] / 2**20:.1f} MiB "
        f"({res['resident_ratio']:.3f} of dense); the {layer_bytes['layers']} converted layers alone: "
        f"{layer_bytes['sparse'] / 2**20:.1f} MiB vs {layer_bytes['dense'] / 2**20:.1f} MiB dense "
        f"({layer_bytes['ratio']:.3f}); the rest (embedding / tied LM head, norms) stays dense"
    )
    print(f"max |logit diff| {err:.2e}; auto planning {plan_s:.1f} s")
    print(
        f"{'auto choice per layer group':<48} {'layers':>6} {'decode':>12} {'x dense':>7} {'prefill':>7} "
        f"{'x dense':>7} {'>256':>7} {'x dense':>7}"
    )
    for g, c in res["groups"].items():
        print(f"{g:<48} {c['layers']:>6} {c['decode']:>12} {c['decode_vs_dense']:>7.2f} {c['prefill']:>7} "
              f"{c['prefill_vs_dense']:>7.2f} {c['prefill_large']:>7} "
              f"{c['prefill_large_vs_dense']:>7.2f}")  # fmt: skip
    if check:
        dense = check.get("against", "dense")  # native_dense: with int8 values, the int8 dense GEMV
        verdict = "kept" if check["kept"] else f"reverted to {dense} (the plan is in each choice's 'planned')"
        ratio = check["auto_vs_dense"]
        print(f"whole-model check at conversion: converted {ratio:.2f}x {dense} -> {verdict}")
    res["whole_model_check"] = check
    if verbose:
        print(auto_report(auto))
    return res


MODELS = [("smollm2", 0.5), ("smollm2", 0.7), ("smollm2", "2:4"), ("gpt2", 0.9)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and tokens")
    p.add_argument("--threads", type=int, default=None, help="torch threads and the native kernels' threads")
    p.add_argument("--layers", action="store_true", help="also the per-layer CSR table (csr native / torch)")
    p.add_argument("--models", default=None, help="subset, e.g. smollm2:0.5,gpt2:0.9 (default: all four)")
    p.add_argument("--rounds", type=int, default=None, help="decode rounds (default 5, quick 3)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per round (default 32, quick 16)")
    p.add_argument("--verbose", action="store_true", help="print auto's choice for every layer")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also dense and auto with the forward compiled (static KV cache, inductor; see "
        "hf_sparsity.inference.compiled_generate_kwargs)",
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"),
        help="the models' dtype (bfloat16: dense in bf16 against the formats' bf16 values)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write raw results here")
    p.add_argument(
        "--omp-passive", action="store_true",
        help="OMP_WAIT_POLICY=PASSIVE for torch (quieter when shared; slows dense too: see the docstring)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the native kernels use torch.get_num_threads() too
    t0 = time.time()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"torch {torch.__version__}, {args.dtype}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY')}, native kernel: "
          f"{'available' if _native.load() is not None else 'unavailable (' + str(_native.error()) + ')'}"
          f"{f', {_native.isa()}, {_native.pool()} pool' if _native.load() else ''}; "
          f"load average {load}")  # fmt: skip
    out: dict = {"threads": torch.get_num_threads(), "load_before": load}
    if args.layers:
        out["layers"] = layer_table(repeats=7 if args.quick else 21)
    models = MODELS
    if args.models:
        models = []
        for item in args.models.split(","):
            kind, _, level = item.partition(":")
            models.append((kind, level if ":" in level or level == "2:4" else float(level)))
    rounds = args.rounds or (3 if args.quick else 5)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    dtype = getattr(torch, args.dtype)
    out["dtype"] = args.dtype
    out["models"] = [
        model_decode(k, lvl, rounds, new_tokens, verbose=args.verbose, compile_=args.compile, dtype=dtype)
        for k, lvl in models
    ]
    print("\n== summary: whole-model greedy decode, tok/s ratios (medians) ==")
    print("prefill: 128-token forward vs dense (kd: with keep_dense_for_prefill; pf512: a 512-token "
          "forward); bytes: resident weights vs dense (whole model; kd; the converted layers "
          "alone)")  # fmt: skip
    cols = (
        f" | {'dense-c':>7} {'auto-c':>7} {'auto-c/dense-c':>14} {'auto-c/dense':>12}" if args.compile else ""
    )
    print(f"{'model':>8} {'level':>5} | {'dense':>7} {'dense+':>7} {'auto':>7} | {'auto/dense':>10} "
          f"{'auto/dense+':>11} | {'prefill':>7} {'kd':>5} {'pf512':>5} | "
          f"{'bytes':>6} {'kd':>6} {'layers':>6} | {'MB/tok':>6} {'bound':>6} {'of bound':>8}"
          f"{cols}")  # fmt: skip
    for r in out["models"]:
        m = r["median_tok_s"]
        line = (f"{r['model']:>8} {r['level']:>5} | {m['dense']:7.2f} {m['dense+']:7.2f} {m['auto']:7.2f} | "
                f"{r['auto_vs_dense']:10.2f} {r['auto_vs_dense_plus']:11.2f} | "
                f"{r['prefill_auto_vs_dense']:7.2f} {r['prefill_auto_keep_dense_vs_dense']:5.2f} "
                f"{r['prefill_512_auto_vs_dense']:5.2f} | "
                f"{r['resident_ratio']:6.3f} "
                f"{r['resident_ratio_keep_dense']:6.3f} {r['sparse_layer_bytes']['ratio']:6.3f} | "
                f"{r['bytes_per_token']['auto'] / 1e6:6.0f} {r['bound_tok_s']['auto']:6.0f} "
                f"{r['fraction_of_bound']['auto']:8.0%}")  # fmt: skip
        if args.compile:
            line += (f" | {m['dense-c']:7.2f} {m['auto-c']:7.2f} {r['auto_c_vs_dense_c']:14.2f} "
                     f"{r['auto_c_vs_dense']:12.2f}")  # fmt: skip
        print(line)
    out["load_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"(total {time.time() - t0:.0f} s; load average after {out['load_after']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
