"""Decoding speed as users run it: ``hf_sparsity generate``,
``model.generate(custom_generate=native_generate)`` (greedy and sampling), the text-generation ``pipeline``
and transformers' own loop, beside the native loop (``greedy_decode``) and llama.cpp, on pruned model
folders, with WikiText-2 perplexity and bytes per weight on every row.

    python benchmarks/decode_user.py wanda50=OUT/wanda50 wanda70=OUT/wanda70 wanda50+int8=OUT/wanda50:int8 \\
        --gguf F32=smol-f32.gguf,Q8_0=smol-q8_0.gguf,Q4_0=smol-q4_0.gguf,Q4_K_M=smol-q4_k_m.gguf \\
        --threads 2 --tokens 128 --rounds 3 --ppl-windows 16 --data-dir DATA_DIR

Each ``NAME=FOLDER[:int8[:f32head]]`` is a model folder (``hf_sparsity prune`` output: weights and
``sparsity_masks.safetensors``; a folder without masks, a dense or finalized model, converts with its exact
zeros as ``hf_sparsity generate`` does; ``:int8``: int8 values with per-row scales, the LM head too;
``:int8:f32head``: int8 values with the LM head left float32, ``--head float32``: the head's perplexity
cost is the ``ppl`` of ``NAME=FOLDER:int8`` beside ``NAME=FOLDER:int8:f32head``). Per folder the model is
loaded once and converted with ``sparsify_for_inference(model, "auto")``; the rows (one prompt, batch 1):

* ``native loop``: :func:`hf_sparsity.inference.decoding.greedy_decode` (one native call per token);
* ``generate+native``: ``model.generate(ids, do_sample=False, custom_generate=native_generate)``;
* ``generate+native, sampling``: the same with ``do_sample=True, temperature=0.7, top_k=50, top_p=0.9,
  repetition_penalty=1.1``; ``top-p only``: ``do_sample=True, temperature=0.7, top_k=0, top_p=0.9``;
* ``pipeline+native``: ``pipeline("text-generation", model=model, tokenizer=tok)(prompt,
  custom_generate=native_generate)``, greedy;
* ``generate (transformers loop)``: ``model.generate`` without ``custom_generate`` (the forward per token);
* ``hf_sparsity generate``: the command as the README writes it (a subprocess, ``--no-dense``, with
  ``--values int8`` for an ``:int8`` folder): the tok/s it prints, and the loop it says ran; and the same
  with the sampling options above (``--do-sample --temperature 0.7 --top-k 50 --top-p 0.9
  --repetition-penalty 1.1``);
* ``--gguf NAME=FILE``: llama.cpp (``llama-cpp-python``, an optional benchmark dependency) on the GGUF file,
  greedy, the same threads and prompt ids; its perplexity from its own logits on the same windows.

``--isa native|avx2|scalar`` (default ``native``): the instruction level of both engines. Our kernels are
built at it through ``HF_SPARSITY_NATIVE_ISA`` (set for this process and the ``hf_sparsity generate``
subprocesses); llama.cpp's rows import ``llama-cpp-python`` from ``--llama-cpp-dir`` (default: a folder per
level in the cache, ``~/.cache/hf_sparsity/llama-cpp-python/LEVEL``), built there once when missing with
``pip install --target DIR --no-deps --no-binary llama-cpp-python llama-cpp-python==VERSION`` (the version
installed in this environment; ``--llama-cpp-src SDIST``: from that sdist instead) and ``CMAKE_ARGS`` from
:data:`LLAMA_CPP_CMAKE` (``native``: ``-DGGML_NATIVE=ON``; ``avx2``: AVX2 / FMA / F16C without AVX-512;
``scalar``: no SIMD extension beyond the x86-64 baseline): a compile of several minutes. A level the CPU
lacks is refused before anything loads. The CPU's SIMD flags (``/proc/cpuinfo``) and the level are printed
with the table.

``--sampling-only`` keeps the rows sampling is compared with (the native loop, ``generate+native`` greedy,
sampling, top-p only), so more rounds fit in the same time and the compared rows run next to each other.

Every row runs once per round, all rows interleaved over ``--rounds``; the table gives medians of the
decoding rate: the new tokens after the first over their time (the prompt's processing excluded), the
quantity ``benchmarks/decode.py``, llama.cpp's ``eval time`` and ``hf_sparsity generate`` report. The
in-process rows decode exactly ``--tokens`` new tokens: the models' generation configs lose their
end-of-sequence token for the run (as llama.cpp's rows ignore it), so no row pays for a processor a user
would not have. ``hf_sparsity generate`` runs as a user runs it, stopping at the end-of-sequence token if the
model says it first. ``bytes/weight``: the block projections' resident bytes over their weight count (ours:
the converted layers; GGUF: the ``blk.*`` matrices); ``MB/token``: the bytes of weights one decoded token
reads. The last table divides each ``hf_sparsity generate`` row by each llama.cpp row.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import torch
from decode import _decode_rate as _rate  # the rate benchmarks/decode.py reports
from decode import _llama_cpp_runner, _Stamps

SAMPLING = dict(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1)
NUCLEUS = dict(do_sample=True, temperature=0.7, top_k=0, top_p=0.9)  # top-p over the whole vocabulary
SAMPLING_ROWS = ("native loop", "generate+native", "generate+native, sampling", "generate+native, top-p only")
CLI_ROW = "hf_sparsity generate"
CLI_SAMPLING = [
    "--do-sample",
    "--temperature",
    "0.7",
    "--top-k",
    "50",
    "--top-p",
    "0.9",
    "--repetition-penalty",
    "1.1",
]


ISAS = ("native", "avx2", "scalar")
"""``--isa``: the instruction levels (``HF_SPARSITY_NATIVE_ISA`` for our kernels)."""

ISA_FLAGS = {"native": (), "avx2": ("avx", "avx2", "fma", "f16c"), "scalar": ()}
"""The ``/proc/cpuinfo`` flags a level needs."""

SIMD_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "amx_int8",
)  # fmt: skip
"""The flags printed with the table (the ones either engine's kernels may use)."""

_GGML_OFF = "-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_BMI2=OFF"
LLAMA_CPP_CMAKE = {
    "native": "-DGGML_NATIVE=ON",
    "avx2": f"{_GGML_OFF} -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON",
    "scalar": f"{_GGML_OFF} -DGGML_SSE42=OFF -DGGML_AVX=OFF -DGGML_AVX2=OFF -DGGML_FMA=OFF -DGGML_F16C=OFF",
}
"""``CMAKE_ARGS`` of the ``llama-cpp-python`` build per ``--isa`` level."""


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's flags (the first ``flags`` line of ``/proc/cpuinfo``; empty where there is none)."""
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def isa_problem(level: str, flags: set[str]) -> str | None:
    """Why ``--isa level`` cannot run on a CPU with ``flags`` (None: it can)."""
    if level not in ISAS:
        return f"--isa {level!r}: use one of {', '.join(ISAS)}."
    missing = [f for f in ISA_FLAGS[level] if f not in flags]
    if missing:
        return (
            f"--isa {level}: this CPU lacks {', '.join(missing)} (/proc/cpuinfo flags); pick "
            f"{' or '.join(lv for lv in ISAS if not [f for f in ISA_FLAGS[lv] if f not in flags])}."
        )
    return None


def parse_model(item: str) -> dict:
    """``NAME=FOLDER[:int8[:f32head]]`` -> ``dict(name, folder, values, head)``; ValueError (one line)."""
    name, eq, spec = item.partition("=")
    folder, *opts = spec.split(":")
    if not eq or not name or not folder:
        raise ValueError(f"{item!r}: give NAME=FOLDER, NAME=FOLDER:int8 or NAME=FOLDER:int8:f32head.")
    if opts not in ([], ["int8"], ["int8", "f32head"]):
        raise ValueError(
            f"{item!r}: the options after FOLDER are ':int8' (int8 values, LM head too) or "
            "':int8:f32head' (int8 values, the LM head float32)."
        )
    return dict(
        name=name, folder=folder, values="int8" if opts else None, head="float32" if len(opts) == 2 else None
    )


def llama_cpp_build(level: str, target: str, source: str | None = None) -> None:
    """``llama-cpp-python`` at ``level`` into ``target`` (module docstring), unless already there; from the
    sdist ``source`` when given, else from the package index."""
    from importlib.metadata import PackageNotFoundError, version

    if os.path.isdir(os.path.join(target, "llama_cpp")):
        return
    try:
        pin = "==" + version("llama-cpp-python")
    except PackageNotFoundError:
        pin = ""
    cmd = [
        sys.executable, "-m", "pip", "install", "--target", target, "--no-deps", "--no-binary",
        "llama-cpp-python", source or f"llama-cpp-python{pin}",
    ]  # fmt: skip
    said = f"CMAKE_ARGS='{LLAMA_CPP_CMAKE[level]}' {' '.join(cmd)}"
    print(f"building llama-cpp-python for --isa {level} (minutes): {said}", file=sys.stderr)
    subprocess.run(cmd, env={**os.environ, "CMAKE_ARGS": LLAMA_CPP_CMAKE[level]}, check=True)


def _cli(m: dict, args, extra: list[str]) -> tuple[float | None, str]:
    """One ``hf_sparsity generate`` run with ``extra`` options: (its tok/s, the loop it says ran)."""
    cmd = [
        sys.executable, "-c", "import sys; from hf_sparsity.cli import main; sys.exit(main(sys.argv[1:]))",
        "generate", m["folder"], "--prompt", args.prompt, "--max-new-tokens", str(args.tokens), "--no-dense",
        "--threads", str(args.threads),
    ]  # fmt: skip
    if m["values"]:
        cmd += ["--values", m["values"]]
    if m["head"]:
        cmd += ["--head", m["head"]]
    cmd += extra
    res = subprocess.run(cmd, capture_output=True, text=True, check=False)
    m = re.search(r"\[auto: ([0-9.]+) tok/s", res.stderr)
    loop = re.search(r"loop: (.*?)(?:;|\]|$)", res.stderr)
    if m is None:
        return None, res.stderr.strip().splitlines()[-1] if res.stderr.strip() else f"rc {res.returncode}"
    return float(m.group(1)), loop.group(1) if loop else "?"


def _gguf_sizes(path: str) -> tuple[float, float]:
    """(bytes per weight of the ``blk.*`` matrices, MB of all tensors) of a GGUF file."""
    from gguf import GGUFReader

    blk = n = total = 0
    for t in GGUFReader(path).tensors:
        total += int(t.n_bytes)
        if t.name.startswith("blk.") and len(t.shape) == 2:
            blk += int(t.n_bytes)
            n += int(t.n_elements)
    return blk / n, total / 1e6


def _gguf_perplexity(path: str, windows: torch.Tensor, threads: int) -> float:
    """WikiText-2 perplexity from llama.cpp's logits on ``windows`` (the protocol of ``wikitext2_perplexity``:
    the exponential of the mean of the windows' mean next-token losses)."""
    import numpy as np
    from llama_cpp import Llama

    seqlen = int(windows.shape[1])
    llm = Llama(
        model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=seqlen, n_batch=seqlen,
        logits_all=True, verbose=False,
    )  # fmt: skip
    losses = []
    for w in windows.tolist():
        llm.reset()
        llm.eval(w)
        logits = torch.from_numpy(np.array(llm.scores[:seqlen], dtype=np.float64))
        losses.append(float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(w[1:]))))
    return math.exp(sum(losses) / len(losses))


def _load(args):
    """{name: dict(model, tok, ids, folder, values)} for the model folders, converted with ``auto``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.constants import SPARSITY_MASKS_NAME
    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.inference.decoding import native_step_reason

    models = {}
    for item in args.models:
        spec = parse_model(item)
        name, folder, values, head = spec["name"], spec["folder"], spec["values"], spec["head"]
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # exactly --tokens new tokens (module docstring)
        t = time.perf_counter()
        masks = None if os.path.isfile(os.path.join(folder, SPARSITY_MASKS_NAME)) else "zeros"  # as the CLI
        options = {k: v for k, v in (("values", values), ("head", head)) if v}
        sparsify_for_inference(model, "auto", masks=masks, **options)
        convert_s = time.perf_counter() - t
        ids = tok(args.prompt, return_tensors="pt").input_ids
        reason = native_step_reason(model, ids.shape[1] + args.tokens)
        print(f"{name}: converted in {convert_s:.1f} s; native step: {reason or 'yes'}", file=sys.stderr)
        models[name] = dict(model=model, tok=tok, ids=ids, folder=folder, values=values, head=head)
    return models


def _rows_for(m: dict, args) -> dict:
    """The timed rows of one converted model: name -> a call returning its decoding tok/s."""
    from transformers import pipeline

    from hf_sparsity.inference.decoding import greedy_decode, native_generate

    model, tok, ids, n = m["model"], m["tok"], m["ids"], args.tokens
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    common = dict(max_new_tokens=n, pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)

    def native_loop():
        stamps: list[float] = []
        greedy_decode(model, ids, n, eos_token_id=[], on_token=lambda _: stamps.append(time.perf_counter()))
        return _rate(stamps)

    def gen(extra):
        def run():
            s = _Stamps()
            model.generate(ids, attention_mask=torch.ones_like(ids), streamer=s, **common, **extra)
            return _rate(s.calls[1:])

        return run

    def pipe_run():
        s = _Stamps()
        pipe(args.prompt, streamer=s, do_sample=False, custom_generate=native_generate, **common)
        return _rate(s.calls[1:])

    rows = {
        "native loop": native_loop,
        "generate+native": gen({"do_sample": False, "custom_generate": native_generate}),
        "generate+native, sampling": gen({**SAMPLING, "custom_generate": native_generate}),
        "generate+native, top-p only": gen({**NUCLEUS, "custom_generate": native_generate}),
        "pipeline+native": pipe_run,
        "generate (transformers loop)": gen({"do_sample": False}),
    }
    if not args.no_cli:
        loops = m.setdefault("cli_loops", [])

        def cli(extra):
            def run():
                tok_s, loop = _cli(m, args, extra)
                loops.append(loop)
                return tok_s if tok_s is not None else float("nan")

            return run

        rows[CLI_ROW] = cli([])
        rows[CLI_ROW + ", sampling"] = cli(CLI_SAMPLING)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", help="NAME=FOLDER, NAME=FOLDER:int8 or NAME=FOLDER:int8:f32head")
    p.add_argument("--isa", default="native", choices=ISAS, help="instruction level of both engines")
    p.add_argument(
        "--llama-cpp-dir", default=None, help="llama-cpp-python built at --isa (default: see above)"
    )
    p.add_argument(
        "--llama-cpp-src", default=None, help="a llama-cpp-python sdist to build from (default: PyPI)"
    )
    p.add_argument("--gguf", default=None, help="llama.cpp rows: NAME=file.gguf,NAME=file.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ppl-windows", type=int, default=0, help="WikiText-2 windows (seqlen 512); 0: skip")
    p.add_argument("--data-dir", default=None, help="folder holding text/wikitext-2-raw/wiki.test.raw")
    p.add_argument("--prompt", default="The history of the Roman Empire begins")
    p.add_argument("--no-cli", action="store_true", help="skip the hf_sparsity generate rows")
    p.add_argument(
        "--sampling-only",
        action="store_true",
        help="only the rows sampling is measured against: the native loop, generate+native greedy, sampling "
        "and top-p only (more rounds in the same time; no llama.cpp or hf_sparsity generate rows)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    flags = cpu_flags()
    try:
        problem = isa_problem(args.isa, flags)
        for item in args.models:
            parse_model(item)
    except ValueError as e:
        problem = str(e)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    os.environ["HF_SPARSITY_NATIVE_ISA"] = args.isa  # our kernels, here and in the subprocesses
    torch.set_num_threads(args.threads)

    import hf_sparsity
    from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity, wikitext2_rows, wikitext2_windows
    from hf_sparsity.inference import sparse_layer_bytes
    from hf_sparsity.inference.bench import decode_bytes_per_token

    load0 = os.getloadavg()
    models = _load(args)
    ggufs = dict(item.split("=", 1) for item in args.gguf.split(",")) if args.gguf else {}
    if args.sampling_only:
        args.no_cli, ggufs = True, {}
    runs = {(name, row): fn for name, m in models.items() for row, fn in _rows_for(m, args).items()}
    if args.sampling_only:
        runs = {k: fn for k, fn in runs.items() if k[1] in SAMPLING_ROWS}
    first = next(iter(models.values()))
    if ggufs:  # llama.cpp at the same level: its own build, imported ahead of any other
        target = args.llama_cpp_dir or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
            "hf_sparsity", "llama-cpp-python", args.isa,
        )  # fmt: skip
        llama_cpp_build(args.isa, target, args.llama_cpp_src)
        sys.path.insert(0, target)
    for name, path in ggufs.items():
        run = _llama_cpp_runner(path, args.threads, first["ids"][0].tolist(), args.tokens)
        runs[(name, "llama.cpp")] = lambda run=run: run()[1]
    speeds: dict[tuple, list[float]] = {k: [] for k in runs}
    with torch.inference_mode():
        for (_, row), fn in runs.items():  # warm-up (the command warms itself up)
            if not row.startswith(CLI_ROW):
                fn()
        for _ in range(args.rounds):
            for k, fn in runs.items():
                speeds[k].append(fn())
    load1 = os.getloadavg()
    ppl, bpw, mbt = {}, {}, {}
    path = os.path.join(args.data_dir or "DATA_DIR", "text", "wikitext-2-raw", "wiki.test.raw")
    for name, m in models.items():
        bpw[name] = 4 * sparse_layer_bytes(m["model"])["ratio"]  # the dense projections are float32
        mbt[name] = decode_bytes_per_token(m["model"]) / 1e6
        if args.ppl_windows:
            with torch.inference_mode():
                res = wikitext2_perplexity(
                    m["model"], m["tok"], path, seqlen=512, max_windows=args.ppl_windows
                )
            ppl[name] = res["perplexity"]
    for name, gpath in ggufs.items():
        bpw[name], mbt[name] = _gguf_sizes(gpath)
        if args.ppl_windows:
            windows = wikitext2_windows(first["tok"], wikitext2_rows(path), 512)[: args.ppl_windows]
            ppl[name] = _gguf_perplexity(gpath, windows, args.threads)
    simd = [f for f in SIMD_FLAGS if f in flags]
    llama_at = ""
    if ggufs:
        import llama_cpp

        llama_at = f"; llama-cpp-python {llama_cpp.__version__} from {os.path.dirname(llama_cpp.__file__)}"
    from hf_sparsity.backends import _native

    print(
        f"\n--isa {args.isa} (HF_SPARSITY_NATIVE_ISA; our int8 products: {_native.int8_dot()}; llama.cpp "
        f"CMAKE_ARGS '{LLAMA_CPP_CMAKE[args.isa]}'){llama_at}; CPU SIMD flags: {' '.join(simd) or 'none'}"
    )
    print(
        f"hf_sparsity {hf_sparsity.__version__}, torch {torch.__version__}, {args.threads} threads; "
        f"{args.tokens} new tokens after a {first['ids'].shape[1]}-token prompt, medians of {args.rounds} "
        f"interleaved rounds; load average before {load0[0]:.1f}, after {load1[0]:.1f}"
    )
    print(f"{'model':<14} {'row':<30} {'tok/s':>7} {'x native loop':>13} {'ppl':>8} {'bytes/weight':>12} "
          f"{'MB/token':>8}")  # fmt: skip
    results = []
    med = {k: statistics.median(v) for k, v in speeds.items()}
    for name in [*models, *ggufs]:
        base = med.get((name, "native loop"))
        for (nm, row), v in med.items():
            if nm != name:
                continue
            ratio = f"{v / base:13.2f}" if base else f"{'-':>13}"
            pp = f"{ppl[name]:8.2f}" if name in ppl else f"{'-':>8}"
            print(f"{name:<14} {row:<30} {v:7.1f} {ratio} {pp} {bpw[name]:12.2f} {mbt[name]:8.1f}")
            results.append(
                dict(model=name, row=row, tok_s=v, rounds=speeds[(nm, row)], ppl=ppl.get(name),
                     bytes_per_weight=bpw[name], mb_per_token=mbt[name])
            )  # fmt: skip
        if models.get(name, {}).get("cli_loops"):
            print(f"{'':<14} hf_sparsity generate's loop: {sorted(set(models[name]['cli_loops']))}")
    if ggufs and not args.no_cli:
        print(f"\n{CLI_ROW} over llama.cpp (decoding tok/s):")
        print(f"{'model':<14}" + "".join(f"{g:>9}" for g in ggufs))
        for name in models:
            cells = "".join(f"{med[(name, CLI_ROW)] / med[(g, 'llama.cpp')]:9.2f}" for g in ggufs)
            print(f"{name:<14}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": args.threads, "tokens": args.tokens, "isa": args.isa, "cpu_flags": simd,
                 "rows": results}, f, indent=2,
            )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
