"""Quality x speed x bytes of sparse models and llama.cpp's quantized ones: one model, machine and run.

    python benchmarks/frontier.py --model MODELS/SmolLM2-135M-Instruct --data-dir DATA_DIR \\
        --gguf-f32 GGUF_DIR/smol-f32.gguf --out OUT/frontier [--recover-steps 120] [--threads 2]
    python benchmarks/frontier.py --smoke --data-dir DATA_DIR --out /tmp/frontier-smoke   # tiny, no llama.cpp

Rows (every one WikiText-2 perplexity, bytes per weight, ``hf_sparsity generate`` tok/s):

* ``dense`` (float32 values, and ``dense int8``: ``hf_sparsity generate --values int8`` of the dense folder);
* ``u{L}``: ``hf_sparsity prune --method sparsegpt --sparsity L`` for each ``--levels`` L (default
  0.1 ... 0.7), each decoded with float32 and with int8 values;
* ``spdy{L}``: ``hf_sparsity prune --method sparsegpt --target-speedup S`` with S the speed-up the time
  table predicts for ``u{L}`` in the same value type (so each profile sits at the speed of the uniform row
  it is compared with), float32 and int8 (the error table is computed once and reused); ``spdy {S}x``
  (``--spdy-targets S1,S2``) instead: profiles at the given speed-ups;
* ``--refit`` / ``--reconstruct-steps N``: every pruned row is pruned with ``hf_sparsity prune --refit`` /
  ``--reconstruct --reconstruct-steps N`` too, and its name and folder carry ``+refit`` / ``+rc{N}``;
* ``--prune-from NAME=FOLDER``: every pruned row starts from FOLDER (a sparse model, e.g. a recovered row's
  ``final`` folder) instead of ``--model``: gradual pruning, a recovered level pruned further and recovered
  again. ``--model`` stays the dense rows, the speed baseline and the recovery's teacher; the names and
  folders carry ``+from-NAME``;
* ``u{L}+rec`` (``--recover-steps N``): ``recipes/prune_recover.py --pruned`` on the ``u{L}`` folder,
  ``N`` steps of sparse fine-tuning distilled from the dense model (``--recover-lr``, ``--recover-alpha``,
  ``--recover-temperature``, ``--recover-bf16``; the token budget, ``N x batch 8 x block 256``, is printed);
* llama.cpp (``--gguf-f32 FILE``, unless ``--no-gguf``): the F32 file and its Q8_0, Q6_K, Q4_K_M and
  Q4_0 quantizations (made beside it with ``benchmarks/gguf_quantize.py`` when missing); perplexity from
  llama.cpp's own logits on the same token windows, tok/s greedy with the same threads and prompt ids.

Protocol: WikiText-2 test, ``--ppl-windows`` (64) windows of 512 tokens; bytes per weight of the block
projections as converted (ours: resident bytes of the converted layers, the layers ``auto`` left dense at
4 bytes; GGUF: the ``blk.*`` matrices); ``hf_sparsity generate`` as a user runs it (a subprocess per run,
``--threads`` 2, ``--tokens`` 128), all rows interleaved over ``--rounds`` rounds, medians. Output:
``OUT/frontier.json``, ``OUT/frontier.md`` (the table, with date, CPU, versions and the command) and
``OUT/frontier.png`` (perplexity against tok/s, every row labelled).

Options that pass through to ``hf_sparsity generate`` as they appear: ``--head int8|float32`` (the LM
head's value type) and ``--generate-arg ARG`` (repeatable); ``--isa NAME`` sets
``HF_SPARSITY_NATIVE_ISA`` for every measurement. Reuses ``benchmarks/decode_user.py``'s machinery (the
``hf_sparsity generate`` subprocess, llama.cpp perplexity and sizes) and ``benchmarks/decode.py``'s
llama.cpp runner.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from decode import _llama_cpp_runner
from decode_user import _cli, _gguf_perplexity, _gguf_sizes

from hf_sparsity.pruning.spdy_search import DEFAULT_SEARCH_MOVES, DEFAULT_SEARCH_WINDOWS

GGUF_TYPES = ("Q8_0", "Q6_K", "Q4_K_M", "Q4_0")
DEFAULT_LEVELS = "0.1,0.2,0.3,0.4,0.5,0.6,0.7"
SPDY_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
RECOVER_BATCH, RECOVER_BLOCK = 8, 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the dense model folder (with its tokenizer)")
    p.add_argument("--data-dir", required=True, help="DATA_DIR: text/wikitext-2-raw/wiki.test.raw, corpus/")
    p.add_argument("--calib-data", help="calibration .jsonl (default DATA_DIR/corpus/openwebtext-1000.jsonl)")
    p.add_argument("--out", required=True, help="output folder (the pruned folders go in OUT/models)")
    p.add_argument("--levels", default=DEFAULT_LEVELS, help=f"uniform levels (default {DEFAULT_LEVELS})")
    p.add_argument("--values", default="float32,int8", help="value types of every pruned row")
    p.add_argument("--no-spdy", action="store_true", help="no --target-speedup rows")
    grid = ",".join(f"{lv:g}" for lv in SPDY_GRID)
    p.add_argument(
        "--spdy-levels",
        default=grid,
        help=f"the SPDY rows' level grid, the uniform levels added (default {grid})",
    )
    p.add_argument(
        "--spdy-targets", default="", help="the SPDY rows' speed-ups (default: each uniform row's)"
    )
    p.add_argument(
        "--spdy-search-windows",
        type=int,
        default=DEFAULT_SEARCH_WINDOWS,
        help=f"calibration windows that score each SPDY search candidate (default {DEFAULT_SEARCH_WINDOWS})",
    )
    p.add_argument(
        "--spdy-search-moves",
        type=int,
        default=DEFAULT_SEARCH_MOVES,
        help=f"level moves of each SPDY search after its steps (default {DEFAULT_SEARCH_MOVES})",
    )
    p.add_argument("--nsamples", type=int, default=64, help="calibration windows (default 64)")
    p.add_argument("--seqlen", type=int, default=512, help="calibration tokens per window (default 512)")
    p.add_argument("--refit", action="store_true", help="every pruned row: hf_sparsity prune --refit")
    p.add_argument(
        "--reconstruct-steps",
        type=int,
        default=0,
        help="every pruned row: hf_sparsity prune --reconstruct --reconstruct-steps N (0: none)",
    )
    p.add_argument(
        "--prune-from",
        metavar="NAME=FOLDER",
        help="every pruned row starts from FOLDER (a sparse model), not --model; names carry +from-NAME",
    )
    p.add_argument("--recover-steps", type=int, default=0, help="u{L}+rec rows: recovery steps (0: none)")
    p.add_argument("--recover-lr", type=float, default=2e-5, help="u{L}+rec rows: peak learning rate")
    p.add_argument(
        "--recover-alpha", type=float, default=1.0, help="u{L}+rec rows: the distillation loss's weight"
    )
    p.add_argument(
        "--recover-temperature",
        type=float,
        default=2.0,
        help="u{L}+rec rows: the distillation's softmax temperature (1: the KL is the cross-entropy gap)",
    )
    p.add_argument(
        "--recover-bf16", action="store_true", help="u{L}+rec rows: bf16 mixed precision (recipe's --bf16)"
    )
    p.add_argument("--gguf-f32", help="llama.cpp F32 GGUF of the same dense weights")
    p.add_argument("--no-gguf", action="store_true", help="no llama.cpp rows")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ppl-windows", type=int, default=64, help="WikiText-2 windows of 512 tokens")
    p.add_argument("--prompt", default="The history of the Roman Empire begins")
    p.add_argument("--head", choices=["int8", "float32"], help="passed to hf_sparsity generate as --head")
    p.add_argument("--isa", help="sets HF_SPARSITY_NATIVE_ISA for every measurement")
    p.add_argument("--generate-arg", action="append", default=[], help="one more hf_sparsity generate option")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="keep the folders in OUT/models and the perplexities in OUT/quality.json",
    )
    p.add_argument(
        "--no-speed",
        action="store_true",
        help="perplexity and bytes only (a later --reuse run measures speed on a quiet machine)",
    )
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama, few rows and windows (a check)")
    if p.parse_known_args(argv)[0].smoke:  # the smoke defaults; options given still win
        p.set_defaults(
            levels="0.3,0.6",
            rounds=1,
            tokens=8,
            ppl_windows=2,
            nsamples=2,
            seqlen=32,
            no_gguf=True,
            spdy_levels="0,0.8",
        )
    args = p.parse_args(argv)
    if not args.smoke and not args.model:
        p.error("--model is required (or --smoke)")
    if args.prune_from is not None:
        name, sep, folder = args.prune_from.partition("=")
        if not (sep and name and "/" not in name and folder and Path(folder, "config.json").is_file()):
            p.error(f"--prune-from takes NAME=FOLDER with a model folder, not {args.prune_from!r}")
    if not args.no_gguf and not args.gguf_f32:
        p.error("give --gguf-f32 FILE (llama.cpp's convert_hf_to_gguf.py --outtype f32) or --no-gguf")
    return args


def _smoke_model(out: Path, data_dir: str) -> Path:
    """A tiny random Llama with the GPT-2 tokenizer of DATA_DIR (no download)."""
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM

    folder = out / "models" / "dense"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=50257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        )  # fmt: skip
        LlamaForCausalLM(cfg).save_pretrained(folder)
        GPT2TokenizerFast.from_pretrained(os.path.join(data_dir, "tokenizer", "gpt2")).save_pretrained(folder)
    return folder


def _values(v: str) -> str | None:
    return None if v == "float32" else v


def build_rows(args, dense: Path, out: Path) -> list[dict]:
    """Prune every row's folder (kept with ``--reuse``); rows: name, folder, values, kind, level."""
    from hf_sparsity.pruning.pipeline import folder_time_table, prune_folder

    calib = args.calib_data or os.path.join(args.data_dir, "corpus", "openwebtext-1000.jsonl")
    levels = [float(x) for x in args.levels.split(",")]
    values = args.values.split(",")
    rows = [dict(name=f"dense {v}", folder=dense, values=_values(v), kind="dense", level=0.0) for v in values]
    common = dict(method="sparsegpt", calib_data=calib, nsamples=args.nsamples, seqlen=args.seqlen,
                  threads=args.threads, overwrite=True, refit=args.refit,
                  reconstruct_steps=args.reconstruct_steps or None)  # fmt: skip
    tag = _prune_tag(args)
    source = Path(args.prune_from.partition("=")[2]) if args.prune_from else dense

    def prune(folder: Path, **kw):
        if args.reuse and (folder / "config.json").is_file():
            return None
        t = time.perf_counter()
        res = prune_folder(source, folder, **common, **kw)
        print(f"pruned {folder.name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        return res

    for lv in levels:
        folder = out / "models" / f"u{lv:g}{tag}"
        prune(folder, sparsity=lv)
        rows += [dict(name=f"u{lv:g}{tag} {v}", folder=folder, values=_values(v), kind="uniform", level=lv)
                 for v in values]  # fmt: skip
    if not args.no_spdy:
        grid = tuple(sorted({*(float(x) for x in args.spdy_levels.split(",")), *levels}))
        # one error table and search database for every target (same model, data, grid): one error pass
        shared = dict(spdy_errors=None, spdy_database={}, spdy_levels=grid, measure_rounds=0,
                      spdy_search_windows=args.spdy_search_windows,
                      spdy_search_moves=args.spdy_search_moves)  # fmt: skip
        given = [float(x) for x in args.spdy_targets.split(",") if x.strip()]
        for v in values:
            # (folder, row name, uniform level, target): the given targets, else each uniform level's
            # predicted speed-up; a kept folder's own target with --reuse (no time table measured then)
            targets = [(f"spdy{t:g}x{tag}-{v}", f"spdy {t:g}x{tag} {v}", None, t) for t in given] or [
                (f"spdy{lv:g}{tag}-{v}", f"spdy@u{lv:g}{tag} {v}", lv, None) for lv in levels
            ]
            kept = [_kept_target(out / "models" / t[0]) if args.reuse else None for t in targets]
            table = None
            if None in kept:
                table, shapes = folder_time_table(dense, _values(v), grid, args.threads)
            targets = [(f, n, lv, k or (t if t is not None else table.uniform_speedup(shapes, lv)))
                       for (f, n, lv, t), k in zip(targets, kept)]  # fmt: skip
            for folder_name, name, lv, target in targets:
                folder = out / "models" / folder_name
                res = prune(folder, target_speedup=max(1.0, target), values=v, spdy_table=table, **shared)
                if res is not None and res.spdy is not None:
                    shared["spdy_errors"] = res.spdy.errors
                rows.append(dict(name=name, folder=folder, values=_values(v), kind="spdy", level=lv,
                                 target=round(max(1.0, target), 4)))  # fmt: skip
    if args.recover_steps:
        for lv in levels:
            folder = _recover(args, dense, calib, out / "models" / f"u{lv:g}{tag}", out)
            rows += [dict(name=f"u{lv:g}{tag}+rec {v}", folder=folder, values=_values(v), kind="recovered",
                          level=lv) for v in values]  # fmt: skip
    return rows


def _kept_target(folder: Path) -> float | None:
    """The speed-up a kept ``--target-speedup`` folder was pruned for (``None``: no such folder)."""
    try:
        state = json.loads((folder / "config.json").read_text())["sparsity"]["_state"]
        return float(state["oneshot"]["spdy"]["target_speedup"])
    except (OSError, KeyError, TypeError, ValueError):
        return None


def _prune_tag(args) -> str:
    """What the pruned rows' names and folders carry beyond SparseGPT: ``+refit``, ``+rc{N}``,
    ``+from-NAME``."""
    steps = args.reconstruct_steps
    start = f"+from-{args.prune_from.partition('=')[0]}" if args.prune_from else ""
    return ("+refit" if args.refit else "") + (f"+rc{steps}" if steps else "") + start


def _recover(args, dense: Path, calib: str, pruned: Path, out: Path) -> Path:
    """``recipes/prune_recover.py --pruned`` on the uniform row's folder (distilled): its finalized folder."""
    run = out / "recover" / pruned.name
    final = run / "final"
    if args.reuse and (final / "config.json").is_file():
        return final
    root = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable, str(root / "recipes" / "prune_recover.py"), "--model", str(dense), "--dataset", calib,
        "--dense_steps", "0", "--pruned", str(pruned),
        "--block_size", str(RECOVER_BLOCK if not args.smoke else 32),
        "--batch_size", str(RECOVER_BATCH), "--recover_steps", str(args.recover_steps),
        "--recover_lr", str(args.recover_lr), "--distill_alpha", str(args.recover_alpha),
        "--distill_temperature", str(args.recover_temperature),
        "--output_dir", str(run), "--overwrite", "true", "--eval_blocks", "2" if args.smoke else "48",
        "--bf16", "true" if args.recover_bf16 else "false",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return final


def _gguf_rows(args) -> list[dict]:
    if args.no_gguf:
        return []
    f32 = Path(args.gguf_f32)
    stem = f32.name.removesuffix(".gguf").removesuffix("-f32")
    files = {"F32": f32}
    missing = []
    for q in GGUF_TYPES:
        files[q] = f32.parent / f"{stem}-{q.lower()}.gguf"
        if not files[q].is_file():
            missing.append(q)
    if missing:
        import gguf_quantize

        gguf_quantize.main([str(f32), *missing, "--threads", str(args.threads)])
    return [dict(name=f"llama.cpp {q}", gguf=str(p), kind="gguf") for q, p in files.items()]


def _bytes_per_weight(model) -> float:
    """Resident bytes per weight of the decoder blocks' projections as converted (dense layers: 4)."""
    from hf_sparsity.inference import sparse_layer_bytes

    left_dense = sum(
        m.weight.numel() for n, m in model.named_modules()
        if type(m) is torch.nn.Linear and not n.endswith("lm_head")
    )  # fmt: skip
    conv = sparse_layer_bytes(model)  # the converted layers (the LM head left out), float32 weights
    converted = conv["dense"] / 4 if conv["layers"] else 0
    return (conv["sparse"] + 4 * left_dense) / max(left_dense + converted, 1)


def _load_quality(path: Path, reuse: bool) -> dict:
    if not (reuse and path.is_file()):
        return {}
    return json.loads(path.read_text())


def _save_quality(path: Path, done: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(done, indent=2))
    os.replace(tmp, path)


def quality(rows: list[dict], args, windows_path: str) -> None:
    """Perplexity and bytes per weight of every row (one model in memory at a time).

    Each row's figures go to ``OUT/quality.json`` as soon as they are measured; ``--reuse`` reads them back.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.constants import SPARSITY_MASKS_NAME
    from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity, wikitext2_rows, wikitext2_windows
    from hf_sparsity.inference import sparsify_for_inference

    cache = Path(args.out) / "quality.json"
    done = _load_quality(cache, args.reuse)
    tok = None
    for row in rows:
        if row["kind"] == "gguf":
            continue
        tok = AutoTokenizer.from_pretrained(row["folder"])
        if row["name"] in done:
            row.update(done[row["name"]])
            continue
        model = AutoModelForCausalLM.from_pretrained(row["folder"], dtype=torch.float32).eval()
        masks = None if (Path(row["folder"]) / SPARSITY_MASKS_NAME).is_file() else "zeros"
        with torch.inference_mode(False):  # auto measures; the first call may build kernels
            opts = {"values": row["values"]} if row["values"] else {}
            sparsify_for_inference(model, "auto", masks=masks, **opts)
        row["bytes_per_weight"] = _bytes_per_weight(model)
        with torch.inference_mode():
            res = wikitext2_perplexity(model, tok, windows_path, seqlen=512, max_windows=args.ppl_windows)
        row["ppl"] = res["perplexity"]
        bpw = row["bytes_per_weight"]
        print(f"{row['name']}: ppl {row['ppl']:.2f}, {bpw:.3f} bytes/weight", file=sys.stderr)
        done[row["name"]] = {"ppl": row["ppl"], "bytes_per_weight": bpw}
        _save_quality(cache, done)
        del model
    for row in rows:
        if row["kind"] == "gguf":
            if row["name"] not in done:
                bpw, _ = _gguf_sizes(row["gguf"])
                windows = wikitext2_windows(tok, wikitext2_rows(windows_path), 512)[: args.ppl_windows]
                done[row["name"]] = {"ppl": _gguf_perplexity(row["gguf"], windows, args.threads),
                                     "bytes_per_weight": bpw}  # fmt: skip
                print(f"{row['name']}: ppl {done[row['name']]['ppl']:.2f}", file=sys.stderr)
                _save_quality(cache, done)
            row.update(done[row["name"]])


def speed(rows: list[dict], args) -> None:
    """``hf_sparsity generate`` (and llama.cpp) tok/s, every row once per round, rounds interleaved."""
    from transformers import AutoTokenizer

    extra = list(args.generate_arg)
    ids = None
    runs = {}
    for row in rows:
        if row["kind"] == "gguf":
            if ids is None:
                first = next(r for r in rows if r["kind"] != "gguf")
                ids = AutoTokenizer.from_pretrained(first["folder"])(args.prompt).input_ids
            run = _llama_cpp_runner(row["gguf"], args.threads, ids, args.tokens)
            runs[row["name"]] = lambda run=run: run()[1]
        else:
            spec = {"folder": str(row["folder"]), "values": row["values"], "head": args.head}
            runs[row["name"]] = lambda spec=spec: _cli(spec, args, extra)[0]
    times = {n: [] for n in runs}
    for r in range(args.rounds):
        for name, fn in runs.items():
            v = fn()
            times[name].append(float("nan") if v is None else v)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    for row in rows:
        vals = [v for v in times[row["name"]] if not math.isnan(v)]
        row["tok_s"] = statistics.median(vals) if vals else float("nan")
        row["tok_s_rounds"] = times[row["name"]]


def round_ratio(vals: list[float], base: list[float]) -> float:
    """The median over rounds of a row's tok/s over the dense row's in the same round (NaN without a pair):
    steadier than the ratio of the medians on a machine whose speed drifts from round to round."""
    pairs = [v / b for v, b in zip(vals, base) if not (math.isnan(v) or math.isnan(b)) and b > 0]
    return statistics.median(pairs) if pairs else float("nan")


def uniform_at_speed(rows: list[dict], row: dict) -> float:
    """The perplexity the uniform levels (the dense row as level 0) of ``row``'s value type reach at ``row``'s
    measured tok/s: linear between the two uniform rows whose speeds enclose it (NaN outside them)."""
    pts = sorted(
        (r["tok_s"], r["ppl"]) for r in rows
        if r["kind"] in ("dense", "uniform") and r.get("values") == row.get("values")
        and not (math.isnan(r["tok_s"]) or math.isnan(r["ppl"]))
    )  # fmt: skip
    t = row["tok_s"]
    for (t0, p0), (t1, p1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return p0 if t1 == t0 else p0 + (p1 - p0) * (t - t0) / (t1 - t0)
    return float("nan")


def report(rows: list[dict], args, out: Path, seconds: float) -> None:
    import hf_sparsity

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    head = (
        f"{datetime.date.today().isoformat()}, {cpu}, {args.threads} threads, hf_sparsity "
        f"{hf_sparsity.__version__}, torch {torch.__version__}; WikiText-2 {args.ppl_windows} windows of "
        f"512; {args.tokens} new tokens, medians of {args.rounds} interleaved rounds; "
        f"{seconds / 60:.0f} min\n"
        f"command: python benchmarks/frontier.py {' '.join(sys.argv[1:])}"
    )
    if args.recover_steps:
        head += f"\nrecovery: {args.recover_steps} steps x {RECOVER_BATCH} x {RECOVER_BLOCK} = "
        head += f"{args.recover_steps * RECOVER_BATCH * RECOVER_BLOCK:,} tokens per recovered row"
        head += f", distilled at temperature {args.recover_temperature:g}"
        head += " (bf16 mixed precision)" if args.recover_bf16 else ""
    dense_tok = {r["values"]: r["tok_s"] for r in rows if r["kind"] == "dense"}
    dense_rounds = {r["values"]: r["tok_s_rounds"] for r in rows if r["kind"] == "dense"}
    lines = [head, "", "| row | target | ppl | bytes/weight | tok/s | x dense (same values) | per round | "
             "uniform ppl at its tok/s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        base = dense_tok.get(r.get("values"), float("nan")) if r["kind"] != "gguf" else float("nan")
        ratio = r["tok_s"] / base if base and not math.isnan(base) else float("nan")
        r["x_dense_per_round"] = round_ratio(r["tok_s_rounds"], dense_rounds.get(r.get("values"), []))
        target = f"{r['target']:.3f}x" if "target" in r else ""
        if r["kind"] == "spdy":
            r["uniform_ppl_at_speed"] = uniform_at_speed(rows, r)
        same = f"{r['uniform_ppl_at_speed']:.2f}" if "uniform_ppl_at_speed" in r else ""
        lines.append(f"| {r['name']} | {target} | {r['ppl']:.2f} | {r['bytes_per_weight']:.3f} | "
                     f"{r['tok_s']:.1f} | {ratio:.2f} | {r['x_dense_per_round']:.2f} | {same} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "frontier.md").write_text(text)
    rec = [{k: (str(v) if isinstance(v, Path) else v) for k, v in r.items()} for r in rows]
    (out / "frontier.json").write_text(json.dumps({"header": head, "rows": rec}, indent=2))
    plot(rows, out / "frontier.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {"dense": ("k", "s"), "uniform": ("#4c72b0", "o"), "spdy": ("#c44e52", "^"),
             "recovered": ("#55a868", "D"), "gguf": ("#8172b2", "*")}  # fmt: skip
    fig, ax = plt.subplots(figsize=(9, 6))
    for kind, (color, marker) in style.items():
        for int8 in (False, True):
            pts = [r for r in rows if r["kind"] == kind and (r.get("values") == "int8") == int8]
            pts = [r for r in pts if not (math.isnan(r["tok_s"]) or math.isnan(r["ppl"]))]
            if not pts:
                continue
            label = f"{kind}{' int8' if int8 else ''}" if kind != "gguf" else "llama.cpp"
            ax.scatter([r["tok_s"] for r in pts], [r["ppl"] for r in pts], marker=marker, edgecolors=color,
                       facecolors="none" if int8 else color, label=label)  # fmt: skip
            for r in pts:
                ax.annotate(r["name"], (r["tok_s"], r["ppl"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")  # fmt: skip
    ax.set_xlabel("hf_sparsity generate / llama.cpp decoding tok/s")
    ax.set_ylabel("WikiText-2 perplexity (log)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.isa:
        os.environ["HF_SPARSITY_NATIVE_ISA"] = args.isa
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    dense = _smoke_model(out, args.data_dir) if args.smoke else Path(args.model)
    rows = build_rows(args, dense, out) + _gguf_rows(args)
    quality(rows, args, os.path.join(args.data_dir, "text", "wikitext-2-raw", "wiki.test.raw"))
    if args.no_speed:
        for row in rows:
            row["tok_s"], row["tok_s_rounds"] = float("nan"), []
    else:
        speed(rows, args)
    report(rows, args, out, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
