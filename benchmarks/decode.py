"""Batch-1 greedy decoding of a real model: stock transformers, dense on our kernels, sparse (fp32 and int8
values), optionally llama.cpp, side by side in one interleaved run, with the memory-bandwidth bound.

    python benchmarks/decode.py MODEL_DIR --threads 2                       # SmolLM2-135M folder
    python benchmarks/decode.py MODEL_DIR --threads 2 --ppl-windows 8       # + WikiText-2 perplexity
    python benchmarks/decode.py MODEL_DIR --gguf F32=model-f32.gguf,Q8_0=model-q8_0.gguf   # + llama.cpp
    python benchmarks/decode.py llama1b --threads 2 --levels 0.5 --int8 0.5   # random 1B Llama shape

Rows (every model decodes the same prompt; masks by magnitude on the model's own weights, per tensor):

* ``transformers``: stock ``model.generate`` (greedy), fp32 dense: what a user runs today;
* ``dense, ours``: every projection / FFN and the LM head on the native dense GEMV (``auto`` restricted
  to ``native_dense``): dense with our kernels, the baseline sparsity has to beat;
* ``50% auto`` / ``70% auto`` / ``2:4 auto``: ``sparsify_for_inference(model, "auto")`` on the masked
  model; ``+int8``: with ``values="int8"``;
* with ``--gguf``: llama.cpp (``llama-cpp-python``, an optional benchmark dependency: ``pip install
  llama-cpp-python`` builds it from source) on the given GGUF files, same threads, greedy.

Our rows decode with :func:`hf_sparsity.inference.decoding.greedy_decode` (the same tokens as ``generate``):
its native step, one call into the kernel library per token (``--loop forward``: its loop over the model's
forward; ``--loop generate``: ``model.generate``). Rounds are interleaved (every row once per round);
the table gives the median decoding tok/s (the tokens after the first new one over their time: the prompt's
processing excluded, as llama.cpp's ``eval time`` and ``llama-bench``'s ``tg`` count it; every ratio and the
fraction of the bound use it), the median end-to-end tok/s (the new tokens over the whole call, prompt
included), the ratio to each baseline, the bytes of weights one token reads, the bound
(the machine's read bandwidth over those bytes: per round the faster of a STREAM-like sum over a buffer larger
than the LLC and the native bitmask kernel's prefetched read of an 84 MB weight, the median of the rounds
taken), the
fraction of the bound reached, and quality: how many of the greedy tokens match the fp32 dense model's
(an int8 row: its fp32 row's), and (``--ppl-windows``) WikiText-2 perplexity on the first windows
(Wanda / SparseGPT protocol).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time

import torch


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


RANDOM = {
    "llama1b": dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=2048,
    ),
}  # fmt: skip
"""Random-weight models by shape (``model_dir`` one of these names): a 1B Llama (TinyLlama's shape)."""


def build_random(name: str):
    """The random-weight model ``name`` of :data:`RANDOM` (seed 0; ``gguf_export.py`` writes the same)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**RANDOM[name])).eval()


def _cell(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    return f"{value:{spec}}" if value is not None else f"{'-':>{width}}"


def _masked(dense, level):
    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    model = copy.deepcopy(dense)
    if level == "2:4":
        cfg = SparsityConfig(sparsity=0.5, structure="2:4", init_method="topk")
    else:
        cfg = SparsityConfig(sparsity=float(level), init_method="topk")
    eng = SparsityEngine(model, cfg)
    eng.build_masks()
    eng.apply()
    return model, {n: m.clone() for n, m in eng.masks.items()}


def _decode_rate(stamps: list[float]) -> float:
    """Decoded tokens/s after the first new token (the prompt's processing excluded, as llama.cpp's
    ``eval time`` and ``llama-bench``'s ``tg`` count it): the tokens after the first over their time."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")


class _Stamps:
    """A ``generate`` streamer that only timestamps each new token (its first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def put(self, value) -> None:
        self.calls.append(time.perf_counter())

    def end(self) -> None:
        pass


def _llama_cpp_runner(path: str, threads: int, prompt_ids: list[int], n: int):
    from llama_cpp import Llama  # optional benchmark dependency

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)

    def run() -> tuple[float, float, list[int]]:
        llm.reset()
        out: list[int] = []
        stamps: list[float] = []
        t = time.perf_counter()
        for tok in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            stamps.append(time.perf_counter())
            out.append(int(tok))
            if len(out) == n:
                break
        return n / (time.perf_counter() - t), _decode_rate(stamps), out

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="a dense model folder (e.g. SmolLM2-135M-Instruct, fp32), or 'llama1b'")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--levels", default="0.5,0.7,2:4", help="sparsity levels (and 2:4)")
    p.add_argument("--int8", default="0.5,2:4", help="levels that also get an int8-values row")
    p.add_argument(
        "--loop", choices=("native", "forward", "generate"), default="native",
        help="our rows' decoding loop: greedy_decode's native step (where it applies), its forward loop, or "
        "model.generate",
    )  # fmt: skip
    p.add_argument("--ppl-windows", type=int, default=0, help="WikiText-2 windows for perplexity (0: skip)")
    p.add_argument("--ppl-seqlen", type=int, default=512)
    p.add_argument("--data-dir", default=None, help="folder holding text/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--gguf", default=None, help="llama.cpp rows: NAME=file.gguf,NAME=file.gguf")
    p.add_argument("--prompt", default="The history of the Roman Empire begins")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity
    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.inference.bench import decode_bytes_per_token, kernel_read_gbs, read_bandwidth_gbs
    from hf_sparsity.inference.decoding import greedy_decode

    load0 = os.getloadavg()
    if args.model_dir in RANDOM:  # a random-weight model of a known shape (no tokenizer, no perplexity)
        tok = None
        dense = build_random(args.model_dir)
        ids = torch.randint(2, dense.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
        args.ppl_windows = 0
    else:
        tok = AutoTokenizer.from_pretrained(args.model_dir)
        dense = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32).eval()
        ids = tok(args.prompt, return_tensors="pt").input_ids
    rows: dict[str, dict] = {"transformers": {"model": dense, "loop": "generate"}}
    ours = copy.deepcopy(dense)
    t = time.perf_counter()
    sparsify_for_inference(ours, "auto", masks="zeros", formats=("native_dense",), check=False)
    rows["dense, ours"] = {"model": ours, "loop": args.loop, "convert_s": time.perf_counter() - t}
    levels = [lv.strip() for lv in args.levels.split(",") if lv.strip()]
    int8 = {lv.strip() for lv in args.int8.split(",") if lv.strip()}
    for lv in levels:
        for values in [None] + (["int8"] if lv in int8 else []):
            model, masks = _masked(dense, lv)
            name = f"{lv if lv == '2:4' else f'{float(lv):.0%}'} auto{'+int8' if values else ''}"
            opts = {"values": values} if values else {}
            t = time.perf_counter()
            sparsify_for_inference(model, "auto", masks=masks, **opts)
            rows[name] = {"model": model, "loop": args.loop, "convert_s": time.perf_counter() - t}
            print(f"converted {name} in {rows[name]['convert_s']:.1f} s", file=sys.stderr)
    llama = {}
    if args.gguf:
        for item in args.gguf.split(","):
            label, _, path = item.partition("=")
            llama[f"llama.cpp {label}"] = _llama_cpp_runner(path, args.threads, ids[0].tolist(), args.tokens)

    def ours_run(model, loop):
        if loop == "generate":

            def run_generate():
                stamps = _Stamps()
                t = time.perf_counter()
                with torch.inference_mode():
                    out = model.generate(
                        ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                        min_new_tokens=args.tokens, do_sample=False, pad_token_id=0, streamer=stamps,
                    )  # fmt: skip
                e2e = args.tokens / (time.perf_counter() - t)
                return e2e, _decode_rate(stamps.calls[1:]), out[0, ids.shape[1] :].tolist()

            return run_generate

        step = "auto" if loop == "native" else "model"

        def run():
            stamps: list[float] = []
            t = time.perf_counter()
            out = greedy_decode(
                model, ids, args.tokens, eos_token_id=[], step=step,
                on_token=lambda _: stamps.append(time.perf_counter()),
            )  # fmt: skip
            e2e = args.tokens / (time.perf_counter() - t)
            return e2e, _decode_rate(stamps), out[0, ids.shape[1] :].tolist()

        return run

    runs = {k: ours_run(r["model"], r["loop"]) for k, r in rows.items()}
    runs.update(llama)
    with torch.inference_mode():
        want = greedy_decode(dense, ids, args.tokens, eos_token_id=[], step="model")[
            0, ids.shape[1] :
        ].tolist()
    ppl = {}
    if args.ppl_windows:
        if not args.data_dir:
            raise SystemExit("--ppl-windows needs --data-dir DIR holding text/wikitext-2-raw/wiki.test.raw")
        data = args.data_dir
        path = os.path.join(data, "text", "wikitext-2-raw", "wiki.test.raw")
        with torch.inference_mode():
            for k, r in rows.items():
                if k == "dense, ours":
                    continue
                res = wikitext2_perplexity(
                    r["model"], tok, path, seqlen=args.ppl_seqlen, max_windows=args.ppl_windows
                )
                ppl[k] = res["perplexity"]
        ppl["dense, ours"] = ppl["transformers"]
    speeds: dict[str, list[float]] = {k: [] for k in runs}  # decoding only (after the first new token)
    e2es: dict[str, list[float]] = {k: [] for k in runs}  # prompt included
    outs: dict[str, list[int] | None] = {}
    bws: list[float] = []  # per round: the faster of a sum and the bitmask kernel's read of 84 MB
    sums: list[float] = []
    kernels: list[float] = []
    for k, fn in runs.items():  # warm-up
        outs[k] = fn()[2]
    for _ in range(args.rounds):  # the bandwidth too, once per round: on a shared machine it moves
        sums.append(read_bandwidth_gbs(threads=args.threads, fresh=True))
        kernels.append(kernel_read_gbs(args.threads) or 0.0)
        bws.append(max(sums[-1], kernels[-1]))
        for k, fn in runs.items():
            e, s, o = fn()
            speeds[k].append(s)
            e2es[k].append(e)
            outs[k] = o if o is not None else outs[k]
    bw = statistics.median(bws)
    med = {k: statistics.median(v) for k, v in speeds.items()}
    med_e2e = {k: statistics.median(v) for k, v in e2es.items()}
    results = []
    base, ours_dense = med["transformers"], med["dense, ours"]
    print(
        f"\n{_cpu_model()}, {args.threads} threads, torch {torch.__version__}; read bandwidth {bw:.1f} GB/s "
        f"(median of the rounds: {', '.join(f'{b:.1f}' for b in bws)}; a sum read "
        f"{statistics.median(sums):.1f}, the bitmask kernel {statistics.median(kernels):.1f}); "
        f"greedy {args.tokens} tokens after a {ids.shape[1]}-token prompt, medians of {args.rounds} "
        f"interleaved rounds; our rows: {args.loop} loop; load average before {load0[0]:.1f}, after "
        f"{os.getloadavg()[0]:.1f}"
    )
    head = (f"{'row':<16} {'tok/s':>7} {'e2e tok/s':>9} {'x transformers':>14} {'x dense ours':>12} "
            f"{'MB/token':>8} {'bound':>6} {'of bound':>8} {'same tokens':>11} {'ppl':>7} "
            f"{'convert s':>9}")  # fmt: skip
    print(head)
    for k in runs:
        model = rows.get(k, {}).get("model")
        nbytes = decode_bytes_per_token(model) if model is not None else None
        bound = bw * 1e9 / nbytes if nbytes else None
        o = outs.get(k)
        ref = outs.get(k.replace("+int8", "")) if k.endswith("+int8") else want  # int8: vs its fp32 row
        same = sum(a == b for a, b in zip(o, ref)) if o and ref else None
        row = {
            "row": k, "tok_s": med[k], "rounds": speeds[k], "e2e_tok_s": med_e2e[k], "e2e_rounds": e2es[k],
            "vs_transformers": med[k] / base,
            "vs_dense_ours": med[k] / ours_dense, "mb_per_token": nbytes / 1e6 if nbytes else None,
            "bound_tok_s": bound, "of_bound": med[k] / bound if bound else None,
            "same_tokens": same, "ppl": ppl.get(k), "convert_s": rows.get(k, {}).get("convert_s"),
        }  # fmt: skip
        results.append(row)
        cells = [
            _cell(row["vs_transformers"], "14.2f"), _cell(row["vs_dense_ours"], "12.2f"),
            _cell(row["mb_per_token"], "8.0f"), _cell(bound, "6.0f"), _cell(row["of_bound"], "8.0%"),
            f"{f'{same}/{len(want)}' if same is not None else '-':>11}", _cell(ppl.get(k), "7.2f"),
            _cell(row["convert_s"], "9.1f"),
        ]  # fmt: skip
        print(f"{k:<16} {med[k]:7.1f} {med_e2e[k]:9.1f} " + " ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "cpu": _cpu_model(),
                    "threads": args.threads,
                    "read_gbs": bw,
                    "read_gbs_rounds": bws,
                    "sum_read_gbs_rounds": sums,
                    "kernel_read_gbs_rounds": kernels,
                    "rows": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
