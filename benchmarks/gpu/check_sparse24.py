"""Check g: 2:4 against dense in bfloat16, layer by layer and for a whole model's prefill.

Layers: Llama-7B shapes (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008) with magnitude 2:4
masks, at 1, 16, 512 and 2048 tokens: dense ``F.linear`` on the masked weight, the ``cusparselt`` backend
(compressed once, algorithm searched once per shape) and torch's ``semi_structured`` (the reference it is
tested against), each timed with CUDA events (median of 5 rounds of 20 calls), and the one call captured
in a CUDA graph and replayed (dense and ``cusparselt``), which takes the per-call host work away.

Model: a random Llama of about 1B parameters (16 x 2048, FFN 5632, 32 heads, 4 KV heads, vocab 32000)
in bfloat16, pruned by magnitude to 2:4 on the layers the library targets (masked weights 0), converted
by ``sparsify_for_inference(model, "auto")`` (on CUDA: dense or ``cusparselt`` per layer group, for
decoding and for prefill, measured) against the same pruned model dense: one 2048-token prefill and one
1-token forward, eager and captured (``GraphedForward``), and the logits compared.

In the CPU dry run the CUDA-only parts are skipped with their reasons: ``masked_dense`` stands in for
the two 2:4 backends at small shapes, ``auto`` plans with its CPU formats on a 2-layer Llama, and no graph
is captured; its figures say nothing about speed.
"""

from __future__ import annotations

import copy
import time

import common

BF16_TOL = 5e-2  # largest |difference| / largest |reference|: bfloat16 rounds every layer


def timed(fn, device: str, calls: int, rounds: int = 5) -> float:
    """Median seconds per call: CUDA events on CUDA, the wall clock on the CPU."""
    if device.startswith("cuda"):
        from hf_sparsity.backends import cusparselt

        return cusparselt.cuda_time(fn, calls, rounds)
    fn()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls)
    return sorted(out)[len(out) // 2]


def graphed_time(fn, device: str, calls: int) -> float | str | None:
    """Seconds per replay of ``fn`` captured in a CUDA graph (``None`` off CUDA; the error when the
    capture fails)."""
    if not device.startswith("cuda"):
        return None
    from hf_sparsity.backends import cusparselt

    try:
        graph, _ = cusparselt.capture(fn)
    except Exception as e:
        return f"capture failed: {type(e).__name__}: {e}"[:200]
    return timed(graph.replay, device, calls)


def us(t):
    return round(t * 1e6, 1) if isinstance(t, float) else t


def rel_diff(got, want) -> float:
    return float(((got.float() - want.float()).abs().max() / want.float().abs().max()).item())


def layers(report, args) -> list[str]:
    import torch
    import torch.nn.functional as F

    from hf_sparsity.backends import get_backend
    from hf_sparsity.masks import nm_mask

    cuda = args.device.startswith("cuda")
    names = ["cusparselt", "semi_structured"]
    why = {n: get_backend(n, check_available=False).unavailable_reason() for n in names}
    run = [n for n in names if why[n] is None and cuda]
    if not run:
        run = ["masked_dense"]
        reasons = "; ".join(f"{n}: {why[n] or 'runs on CUDA only'}" for n in names)
        report.note(f"2:4 layers: {reasons}; masked_dense stands in")
    dtype = torch.bfloat16
    if args.tiny:
        shapes = {"qkvo": (128, 128), "gate_up": (352, 128), "down": (128, 352)}
        tokens, calls = (1, 16, 64), 3
    else:
        shapes = {"qkvo": (4096, 4096), "gate_up": (11008, 4096), "down": (4096, 11008)}
        tokens, calls = (1, 16, 512, 2048), 20
    table, problems = {}, []
    g = torch.Generator().manual_seed(0)
    for label, (out_f, in_f) in shapes.items():
        w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(device=args.device, dtype=dtype)
        mask = nm_mask(w.abs().float(), 2, 4, dim=-1).to(args.device)
        dense_w = w * mask.to(dtype)
        backends = {n: get_backend(n).from_dense(w, mask) for n in run}
        for n in tokens:
            x = torch.randn(n, in_f, generator=g).to(device=args.device, dtype=dtype)
            row = {}
            with torch.no_grad():
                want = F.linear(x, dense_w)
                row["dense_us"] = round(timed(lambda: F.linear(x, dense_w), args.device, calls) * 1e6, 1)  # noqa: B023
                graphed = graphed_time(lambda: F.linear(x, dense_w), args.device, calls)  # noqa: B023
                if graphed is not None:
                    row["dense_graphed_us"] = us(graphed)
                for name, b in backends.items():
                    rel = rel_diff(b.linear(x), want)
                    row[f"{name}_us"] = round(timed(lambda: b.linear(x), args.device, calls) * 1e6, 1)  # noqa: B023
                    row[f"{name}_speedup"] = round(row["dense_us"] / row[f"{name}_us"], 3)
                    row[f"{name}_max_rel_diff"] = float(f"{rel:.3g}")
                    if not rel <= BF16_TOL:
                        problems.append(f"{label} @ {n}: {name} differs from dense by {rel:.3g}")
                if "cusparselt" in backends:
                    graphed = graphed_time(lambda: backends["cusparselt"].linear(x), args.device, calls)  # noqa: B023
                    row["cusparselt_graphed_us"] = us(graphed)
                    pair = (row["dense_graphed_us"], row["cusparselt_graphed_us"])
                    if all(isinstance(v, float) for v in pair):
                        row["graphed_speedup"] = round(pair[0] / pair[1], 3)
                    else:
                        problems.append(f"{label} @ {n}: {next(v for v in pair if isinstance(v, str))}")
            key = f"{label} {out_f}x{in_f} @ {n} tokens"
            table[key] = row
            report.note(f"{key}: {row}")
        report.figures["layers"] = {"backends": run, "dtype": "bfloat16", "rows": table}
        report.write("pass", f"partial: layers {label} done")  # what a timeout leaves behind
    return problems


def llama(tiny: bool, device: str):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_sparsity import SparsityConfig, plan_sparsity
    from hf_sparsity.masks import nm_mask

    if tiny:
        cfg = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, vocab_size=512)  # fmt: skip
    else:
        cfg = LlamaConfig(num_hidden_layers=16, hidden_size=2048, intermediate_size=5632,
                          num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                          vocab_size=32000)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # norms away from 1, as in a trained model
    # magnitude 2:4 masks on the layers the library targets by default
    names = [d.name for d in plan_sparsity(model, SparsityConfig(sparsity=0.5)) if d.sparsify]
    masks = {n: nm_mask(model.get_parameter(n).detach().abs().float(), 2, 4, dim=-1) for n in names}
    with torch.no_grad():  # pruned: a layer auto leaves dense computes with the masked weight too
        for n, m in masks.items():
            model.get_parameter(n).mul_(m.to(torch.bfloat16))
    return model, masks


def whole_model(report, args) -> list[str]:
    import torch

    from hf_sparsity import sparsify_for_inference
    from hf_sparsity.backends import cusparselt

    cuda = args.device.startswith("cuda")
    t0 = time.perf_counter()
    model, masks = llama(args.tiny, args.device)
    params = sum(p.numel() for p in model.parameters())
    dense = copy.deepcopy(model)
    options = {} if cuda else {"plan_cache": False, "check": False, "rounds": 2, "stream_bytes": 1 << 20}
    t1 = time.perf_counter()
    sparsify_for_inference(model, "auto", masks=masks, **options)
    convert_s = time.perf_counter() - t1
    choices = [m.backend.choice for m in model.modules() if hasattr(m, "backend")]
    picked = {r: sorted({str(c.get(r)) for c in choices}) for r in ("decode", "prefill")}
    fig = {
        "model": f"random Llama {model.config.num_hidden_layers} x {model.config.hidden_size}, "
        f"~{params / 1e9:.2f}B params, bfloat16, 2:4 masks on {len(masks)} projections",
        "build_s": round(t1 - t0, 1),
        "auto_convert_s": round(convert_s, 1),
        "auto_choices": picked,
        "converted_layers": len(choices),
    }
    if cuda:
        fig["groups"] = {c["group"]: {"decode": c["decode"], "prefill": c["prefill"], "ms": c["ms"]}
                         for c in choices if "group" in c}  # fmt: skip
    problems = []
    prefill = 64 if args.tiny else 2048
    vocab = model.config.vocab_size
    for label, n in (("prefill", prefill), ("one token", 1)):
        ids = torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(args.device)
        with torch.no_grad():
            want, got = dense(input_ids=ids).logits, model(input_ids=ids).logits
            rel = rel_diff(got, want)
            row = {"tokens": n, "max_rel_diff": float(f"{rel:.3g}")}
            row["dense_ms"] = round(timed(lambda: dense(input_ids=ids), args.device, 3) * 1e3, 3)  # noqa: B023
            row["auto_ms"] = round(timed(lambda: model(input_ids=ids), args.device, 3) * 1e3, 3)  # noqa: B023
        row["speedup"] = round(row["dense_ms"] / row["auto_ms"], 3)
        if cuda:
            try:
                gd, ga = cusparselt.GraphedForward(dense, ids), cusparselt.GraphedForward(model, ids)
            except Exception as e:  # the eager figures stand; the capture's failure is the finding
                row["graphed"] = f"capture failed: {type(e).__name__}: {e}"[:300]
                problems.append(f"whole model, {label}: {row['graphed']}")
            else:
                row["dense_graphed_ms"] = round(timed(lambda: gd(ids), args.device, 3) * 1e3, 3)  # noqa: B023
                row["auto_graphed_ms"] = round(timed(lambda: ga(ids), args.device, 3) * 1e3, 3)  # noqa: B023
                row["graphed_speedup"] = round(row["dense_graphed_ms"] / row["auto_graphed_ms"], 3)
                rel_g = rel_diff(ga(ids), want)
                row["graphed_max_rel_diff"] = float(f"{rel_g:.3g}")
                rel = max(rel, rel_g)
                del gd, ga
        else:
            row["graphed"] = "skipped: CUDA graphs need a CUDA device"
        fig[label] = row
        report.note(f"{label}: {row}")
        if not rel <= BF16_TOL:
            problems.append(f"whole model, {label}: logits differ from the dense model's by {rel:.3g}")
    report.figures["model"] = fig
    return problems


def run(report: common.Report, args) -> tuple[str, str]:
    problems = layers(report, args) + whole_model(report, args)
    if problems:
        return "fail", "; ".join(problems)[:400]
    rows = report.figures["layers"]["rows"]
    name = report.figures["layers"]["backends"][0]
    best = max(rows, key=lambda k: rows[k][f"{name}_speedup"])
    m = report.figures["model"]
    summary = f"{name} vs dense: best {best} {rows[best][f'{name}_speedup']}x"
    if "graphed_speedup" in rows[best]:
        summary += f" (graphed {rows[best]['graphed_speedup']}x)"
    summary += f"; Llama {m['model'].split(',')[1].strip()}: prefill {m['prefill']['speedup']}x"
    if "graphed_speedup" in m["prefill"]:
        summary += f" (graphed {m['prefill']['graphed_speedup']}x)"
    summary += f", one token {m['one token']['speedup']}x; auto chose {m['auto_choices']}"
    return "pass", summary


if __name__ == "__main__":
    common.main(run, __doc__)
