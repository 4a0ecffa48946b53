"""``hf_sparsity generate``: generation on a sparse backend, streamed, with tokens/s against dense.

    hf_sparsity generate MODEL_DIR --prompt "The capital of France is"             # backend auto
    hf_sparsity generate MODEL_DIR --prompt TEXT --loop generate    # transformers' own decoding loop
    hf_sparsity generate MODEL_DIR --prompt TEXT --backend bitmask --max-new-tokens 64
    hf_sparsity generate MODEL_DIR --prompt TEXT --masks zeros      # a finalized folder: its exact zeros
    hf_sparsity generate MODEL_DIR --prompt TEXT --compile          # torch.compile'd forward, static cache
    hf_sparsity generate MODEL_DIR --prompt TEXT --values int8      # int8 values, per-row scales, LM head too
    hf_sparsity generate MODEL_DIR --prompt TEXT --values int8 --head float32   # ... the LM head as it is
    hf_sparsity generate MODEL_DIR --prompt TEXT --lean             # greedy_decode's loop (same tokens)
    hf_sparsity generate MODEL_DIR --prompt TEXT --do-sample --temperature 0.7 --top-p 0.9 --seed 0

Decoding is greedy unless ``--do-sample`` (``generate``'s sampling: ``--temperature``, ``--top-k``,
``--top-p``, ``--min-p``, with transformers' defaults where not given; ``--seed`` for the same text again);
``--repetition-penalty`` applies to both. Both runs, dense and sparse, decode the same way.

Masks: ``--masks`` (a mask file / folder, or ``zeros``); by default the folder's
``sparsity_masks.safetensors``, or, for a finalized folder without one, the exact zeros of
the targeted weights (said on stderr). The dense model generates the same number of tokens
first (not shown; ``--no-dense`` skips it), then the sparse one streams its tokens, and both
speeds are printed.

Decoding loop (``--loop``): by default (``auto``) ``model.generate`` with
``custom_generate=hf_sparsity.inference.decoding.native_generate``: one native call per token where the model
allows it (Llama-family models on native formats, float32; the line printed at the end says which loop ran
and, if not the native step, why), else transformers' own loop. ``--loop generate``: transformers' own loop
(the model's forward per token); ``--loop lean`` (or ``--lean``):
``hf_sparsity.inference.decoding.greedy_decode``.
``--compile`` runs transformers' loop over the compiled forward.

The tok/s printed is the decoding rate the benchmarks report (``benchmarks/decode.py``, llama.cpp's
``eval time``): the new tokens after the first over the time from the first to the last (the prompt's
processing excluded); the end-to-end rate (all new tokens over the whole call) is printed beside it.
"""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import argparse
import os
import sys
import time

from ..utils import SparsityError
from . import _checks

GENERATE_DTYPES = ("float32", "bfloat16")  # names from hf_sparsity.loading.DTYPES that generate supports


def _load(model_dir: str, dtype: str | None, prompt: str, max_new_tokens: int):
    """The model, its tokenizer and the prompt's ids; the prompt is checked before the model loads."""
    from transformers import AutoTokenizer

    from ..loading import load_model_folder, resolve_dtype

    if not os.path.isdir(model_dir):
        raise SparsityError(f"{model_dir} is not a folder. Pass a model folder saved with save_pretrained.")
    torch_dtype = resolve_dtype(dtype, allowed=GENERATE_DTYPES, flag="--dtype")
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 - any loader failure is the same user error
        raise SparsityError(f"{model_dir} has no usable tokenizer ({e.__class__.__name__}: {e}).") from None
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise SparsityError("--prompt is empty after tokenization; pass some text.")
    _checks.generate_fits(model_dir, ids, max_new_tokens)
    # Masks are not applied here: sparsify_for_inference takes them (--masks, or the folder's).
    model, _ = load_model_folder(model_dir, dtype=torch_dtype, masks=False)
    return model, tok, ids


LOOPS = ("auto", "generate", "lean")
"""``--loop``: ``auto`` (model.generate on the native step where the model allows it), ``generate``
(transformers' own loop), ``lean`` (greedy_decode)."""


class _Stamps:
    """A streamer that timestamps each new token and hands it on (the first ``put`` is the prompt)."""

    def __init__(self, inner=None) -> None:
        self.inner, self.stamps, self.prompt = inner, [], True

    def put(self, value) -> None:
        if self.prompt:
            self.prompt = False
        else:
            self.stamps.append(time.perf_counter())
        if self.inner is not None:
            self.inner.put(value)

    def end(self) -> None:
        if self.inner is not None:
            self.inner.end()


def decode_rate(stamps: list[float]) -> float | None:
    """Tokens/s after the first new token: the tokens after the first over their time (the prompt's
    processing excluded), the quantity ``benchmarks/decode.py`` reports."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _generate(model, ids, n: int, streamer=None, loop: str = "generate", **kw) -> tuple[object, float, float]:
    """(output ids, decoding tok/s after the first token, end-to-end tok/s); ``kw``: ``generate``'s keywords
    (sampling, the compiled cache)."""
    import torch

    stamps = _Stamps(streamer)
    if loop == "lean":  # greedy_decode: the native step or the forward loop (generate's greedy tokens)
        from ..inference.decoding import greedy_decode

        t = time.perf_counter()
        stamps.put(ids)  # the prompt (skipped by the streamer)
        out = greedy_decode(model, ids, n, on_token=lambda tok: stamps.put(torch.tensor([tok])))
        dt = time.perf_counter() - t
        stamps.end()
    else:
        if loop == "native":
            from ..inference.decoding import native_generate

            kw = {**kw, "custom_generate": native_generate}
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                streamer=stamps,
                pad_token_id=getattr(model.generation_config, "pad_token_id", None)
                or getattr(model.generation_config, "eos_token_id", None)
                or 0,
                **{"do_sample": False, **kw},
            )
        dt = time.perf_counter() - t
    new = out.shape[1] - ids.shape[1]
    e2e = new / max(dt, 1e-9)
    return out, decode_rate(stamps.stamps) or e2e, e2e


def _loop_for(model, loop: str, length: int) -> tuple[str, str]:
    """(the loop ``_generate`` runs, the words saying so) for ``--loop``."""
    from ..inference.decoding import native_step_reason

    if loop == "generate":
        return "generate", "transformers' generate loop (--loop generate)"
    if loop == "lean":
        reason = native_step_reason(model, length)
        return "lean", "greedy_decode: " + (
            "the native step (one call per token)" if reason is None else f"the forward loop ({reason})"
        )
    reason = native_step_reason(model, length)
    if reason is None:
        return "native", "the native step (model.generate, custom_generate=native_generate; a call per token)"
    return "generate", f"transformers' generate loop (the native step does not run this model: {reason})"


def generate_command(args) -> int:
    """Entry point of ``hf_sparsity generate``."""
    import torch
    from transformers import TextStreamer

    from ..inference import auto_report, resident_weight_bytes, sparsify_for_inference

    _checks.generate_args(args)  # one-line errors for bad input before anything loads
    loop = _requested_loop(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, ids = _load(args.model_dir, args.dtype, args.prompt, args.max_new_tokens)
    length = ids.shape[1] + args.max_new_tokens
    masks = _masks_arg(args)
    dense_tok_s = stock_tok_s = dense_said = None
    dense_bytes = resident_weight_bytes(model)
    kw, compile_s = {}, {}
    if args.compile and not args.no_dense:  # stock transformers (eager) too: what a user has today
        _generate(model, ids, 2)
        _, stock_tok_s, _ = _generate(model, ids, args.max_new_tokens)
    if args.compile:
        from ..inference import compiled_generate_kwargs

        kw = compiled_generate_kwargs()
    kw.update(_sampling_kwargs(args))
    # warm-up; compiled: the same lengths as the timed run (a new length compiles again)
    warm = args.max_new_tokens if args.compile else 2
    if not args.no_dense:
        dense_loop, dense_said = _loop_for(model, loop, length)
        t = time.perf_counter()
        _generate(model, ids, warm, loop=dense_loop, **kw)
        compile_s["dense"] = time.perf_counter() - t
        _, dense_tok_s, _ = _generate(model, ids, args.max_new_tokens, loop=dense_loop, **kw)
    t = time.perf_counter()
    values = {"values": args.values} if args.values else {}
    if args.activations:
        values["activations"] = args.activations
    if args.head:
        values["head"] = args.head
    sparsify_for_inference(model, args.backend, masks=masks, **values)
    convert_s = time.perf_counter() - t
    if args.backend == "auto" and args.show_choices:
        print(auto_report(model), file=sys.stderr)
    if args.compile:
        from ..hooks import forget_compiled_forward

        forget_compiled_forward(model)  # the converted model is another graph
    run_loop, said = _loop_for(model, loop, length)
    t = time.perf_counter()
    _generate(model, ids, warm, loop=run_loop, **kw)
    compile_s[args.backend] = time.perf_counter() - t
    if args.seed is not None:
        from transformers import set_seed

        set_seed(args.seed)
    print(args.prompt, end="", flush=True)
    streamer = TextStreamer(tok, skip_prompt=True)
    _, tok_s, e2e = _generate(model, ids, args.max_new_tokens, streamer, loop=run_loop, **kw)
    line = _summary(
        args, tok_s, e2e, dense_tok_s, stock_tok_s, resident_weight_bytes(model), dense_bytes, convert_s,
        said, dense_said, compile_s,
    )  # fmt: skip
    print(line, file=sys.stderr)
    return 0


def _summary(
    args, tok_s, e2e, dense_tok_s, stock_tok_s, weight_bytes, dense_bytes, convert_s, said, dense_said,
    compile_s,
) -> str:  # fmt: skip
    """The line printed after the streamed text: the speeds, the weights' sizes, the loop that ran."""
    import torch

    line = f"\n[{args.backend}: {tok_s:.2f} tok/s"
    if dense_tok_s:
        line += f", dense {dense_tok_s:.2f} tok/s ({tok_s / dense_tok_s:.2f}x)"
    if stock_tok_s:
        line += f", stock dense (eager) {stock_tok_s:.2f} tok/s ({tok_s / stock_tok_s:.2f}x)"
    line += (
        f" (tok/s: the new tokens after the first over their time, as benchmarks/decode.py; end to end "
        f"{e2e:.2f}); weights {weight_bytes / 2**20:.1f} MiB vs dense "
        f"{dense_bytes / 2**20:.1f} MiB; conversion {convert_s:.1f} s; {torch.get_num_threads()} threads; "
        f"loop: {said}"
    )
    if not args.no_dense and dense_said != said:
        line += f" (dense: {dense_said})"
    if args.compile:
        line += "; compiled, compile + first run " + ", ".join(f"{k} {v:.0f} s" for k, v in compile_s.items())
    return line + "]"


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p")  # generate's keywords, --do-sample only


def _sampling_kwargs(args) -> dict:
    """``generate``'s keywords for ``--do-sample`` and its options, and ``--repetition-penalty``."""
    kw = {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}
    if args.do_sample:
        kw["do_sample"] = True
    if args.repetition_penalty is not None:
        kw["repetition_penalty"] = args.repetition_penalty
    return kw


def _requested_loop(args) -> str:
    """The decoding loop ``--loop`` / ``--lean`` / ``--compile`` ask for (one of :data:`LOOPS`)."""
    loop = "lean" if args.lean else args.loop
    if loop not in LOOPS:
        raise SparsityError(f"--loop {loop!r}: use one of {', '.join(LOOPS)}.")
    if args.lean and args.loop not in ("auto", "lean"):
        raise SparsityError(f"--lean and --loop {args.loop} are two decoding loops; pick one.")
    if args.compile and loop == "lean":
        raise SparsityError("--lean and --compile are two decoding loops; pick one.")
    if loop == "lean" and (args.do_sample or args.repetition_penalty is not None):
        raise SparsityError(
            "--lean decodes greedily without processors; drop --lean (the native step samples through "
            "model.generate) or the sampling options."
        )
    if args.compile:
        loop = "generate"  # the compiled forward runs in transformers' loop
    return loop


def _masks_arg(args):
    """``--masks``, or ``zeros`` (said on stderr) for a folder without a mask file (a finalized one)."""
    from ..constants import SPARSITY_MASKS_NAME

    masks = args.masks
    if masks is None and not os.path.isfile(os.path.join(args.model_dir, SPARSITY_MASKS_NAME)):
        print(
            f"{args.model_dir} holds no {SPARSITY_MASKS_NAME}: using the exact zeros of the targeted weights "
            "(a finalized checkpoint).",
            file=sys.stderr,
        )
        masks = "zeros"
    return masks


def generate_command_parser(subparsers):
    """Register ``hf_sparsity generate``."""
    p = subparsers.add_parser(
        "generate",
        help="Generate text on a sparse backend (streamed) and print tokens/s against dense.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_dir", help="A model folder (with sparsity_masks.safetensors, or finalized)")
    p.add_argument("--prompt", required=True, help="The prompt text")
    p.add_argument("--backend", default="auto", help="auto (default), bitmask, nm24, csr, masked_dense, ...")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Tokens to generate (default 64)")
    p.add_argument("--masks", default=None, help="A mask file / folder, or 'zeros' (default: see above)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: as saved)")
    p.add_argument(
        "--values",
        default=None,
        choices=("int8",),
        help="Store the kept values as int8 with per-row scales (bitmask, nm24, auto); default: the dtype",
    )
    p.add_argument(
        "--activations",
        default=None,
        choices=("int8", "float32"),
        help="With --values int8: int8 activations, 32 scales per row (default; int8 dot products), or "
        "float32 (bitmask, nm24, native_dense)",
    )
    p.add_argument(
        "--head",
        default=None,
        choices=("int8", "float32"),
        help="With --values int8: the LM head's values, int8 codes with per-row scales (default; a tied "
        "input embedding reads the same codes) or float32 (the head as it is)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch / native kernel threads")
    p.add_argument("--no-dense", action="store_true", help="Skip the dense comparison run")
    p.add_argument("--show-choices", action="store_true", help="With auto: print the choice per layer")
    p.add_argument(
        "--compile",
        action="store_true",
        help="Compile the forward (static KV cache, inductor) for both runs; the first run of each compiles",
    )
    p.add_argument(
        "--loop",
        default="auto",
        choices=LOOPS,
        help="Decoding loop of both runs: auto (default; model.generate on the native step, one native call "
        "per token, where the model allows it, else transformers' loop), generate (transformers' own loop "
        "over the model's forward), lean (hf_sparsity.inference.decoding.greedy_decode)",
    )
    p.add_argument(
        "--lean",
        action="store_true",
        help="--loop lean: both runs decode with hf_sparsity.inference.decoding.greedy_decode (the native "
        "step where it applies, else its forward loop; the same tokens as generate)",
    )
    p.add_argument("--do-sample", action="store_true", help="Sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="With --do-sample: the temperature")
    p.add_argument("--top-k", type=int, default=None, help="With --do-sample: top-k (0: none; default 50)")
    p.add_argument("--top-p", type=float, default=None, help="With --do-sample: nucleus sampling's mass")
    p.add_argument("--min-p", type=float, default=None, help="With --do-sample: min-p")
    p.add_argument("--repetition-penalty", type=float, default=None, help="The repetition penalty (> 0)")
    p.add_argument("--seed", type=int, default=None, help="A seed for the sampled run (the same text again)")
    p.set_defaults(func=generate_command)
    return p
