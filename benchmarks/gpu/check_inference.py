"""Check e: the inference backends on the device against the emulator, and 2:4 against dense speed.

Parity: a Llama model (GQA) with magnitude 2:4 masks on its projections and FFN, run through
``sparsify_for_inference`` on each backend on the device (``csr``, ``masked_dense``, ``emulator`` in
float32; ``semi_structured`` in bfloat16) and compared with the ``emulator`` on the CPU in float32,
the reference every backend is tested against: the largest logit difference relative to the
largest reference logit.

Speed: Llama-7B-shaped layers (q/k/v/o 4096x4096, gate/up 11008x4096, down 4096x11008) in bfloat16
at 1, 16 and 2048 tokens: ``F.linear`` on the masked dense weight against the ``semi_structured``
backend's ``linear``; CUDA-event timing, the median of 5 rounds of 50 calls. In the CPU dry run
the 2:4 backend is unavailable (its reason is reported) and ``masked_dense`` stands in, at small
shapes, so the timing code runs.
"""

from __future__ import annotations

import copy
import statistics
import time

import common

# Largest |logit difference| / largest |reference logit|. bfloat16 keeps 8 bits of mantissa (2^-8 =
# 0.4% per rounding), and every layer, attention and norm included, rounds in bfloat16.
FP32_TOL, BF16_TOL = 1e-4, 5e-2


def model_and_masks(tiny: bool):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_sparsity import SparsityConfig, plan_sparsity
    from hf_sparsity.masks import nm_mask

    hidden, ffn = (64, 128) if tiny else (512, 1408)
    cfg = LlamaConfig(
        num_hidden_layers=2, hidden_size=hidden, intermediate_size=ffn, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=256, vocab_size=512 if tiny else 2048,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms away from 1, as in a trained model
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    names = [d.name for d in plan_sparsity(model, SparsityConfig(sparsity=0.5)) if d.sparsify]
    masks = {n: nm_mask(model.get_parameter(n).detach().abs(), 2, 4, dim=-1) for n in names}
    return model, masks


def logits(model, masks, backend, device, dtype, ids):
    import torch

    from hf_sparsity import sparsify_for_inference

    m = copy.deepcopy(model).to(device=device, dtype=dtype)
    sparsify_for_inference(m, backend, masks=masks)
    with torch.no_grad():
        return m(input_ids=ids.to(device)).logits.float().cpu()


def parity(report, args) -> list[str]:
    import torch

    from hf_sparsity.backends import get_backend

    model, masks = model_and_masks(args.tiny)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    ref = logits(model, masks, "emulator", "cpu", torch.float32, ids)
    scale = ref.abs().max().item()
    rows, problems = {}, []
    cases = [("csr", torch.float32), ("masked_dense", torch.float32), ("emulator", torch.float32)]
    cases.append(("semi_structured", torch.bfloat16))
    for backend, dtype in cases:
        klass = get_backend(backend, check_available=False)
        why = klass.unavailable_reason()
        if why is None and args.device.split(":")[0] not in klass.capabilities.devices:
            why = f"does not run on {args.device}"
        if why is not None:
            rows[backend] = f"skipped: {why}"
            continue
        got = logits(model, masks, backend, args.device, dtype, ids)
        rel = (got - ref).abs().max().item() / scale
        tol = BF16_TOL if dtype == torch.bfloat16 else FP32_TOL
        rows[backend] = {"dtype": str(dtype)[6:], "max_rel_diff": float(f"{rel:.3g}"), "tol": tol}
        if not rel <= tol:
            problems.append(f"{backend} on {args.device}: logits off the emulator's by {rel:.3g} > {tol}")
    report.figures["parity_vs_cpu_emulator"] = rows
    return problems


def timed(fn, device, calls: int, rounds: int = 5) -> float:
    """Median seconds per call of ``fn()`` over ``rounds`` rounds of ``calls`` calls."""
    import torch

    fn()
    common.sync(device)
    out = []
    for _ in range(rounds):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out.append((time.perf_counter() - t0) / calls)
    return statistics.median(out)


def speed(report, args) -> list[str]:
    import torch
    import torch.nn.functional as F

    from hf_sparsity.backends import get_backend
    from hf_sparsity.masks import nm_mask

    semi = get_backend("semi_structured", check_available=False)
    why = semi.unavailable_reason()
    if why is None and not args.device.startswith("cuda"):
        why = "runs on CUDA only"
    name = "semi_structured" if why is None else "masked_dense"
    backend = get_backend(name)
    if why is not None:
        report.note(f"2:4 speed: semi_structured unavailable ({why}); masked_dense stands in")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.tiny:
        shapes = {"qkvo": (128, 128), "gate_up": (352, 128), "down": (128, 352)}
        tokens, calls = (1, 16, 64), 5
    else:
        shapes = {"qkvo": (4096, 4096), "gate_up": (11008, 4096), "down": (4096, 11008)}
        tokens, calls = (1, 16, 2048), 50
    table, problems = {}, []
    g = torch.Generator().manual_seed(0)
    for label, (out_f, in_f) in shapes.items():
        w = (torch.randn(out_f, in_f, generator=g) * 0.02).to(device=args.device, dtype=dtype)
        mask = nm_mask(w.abs().float(), 2, 4, dim=-1).to(args.device)
        dense_w = w * mask.to(dtype)
        sparse = backend.from_dense(w, mask)
        for n in tokens:
            x = torch.randn(n, in_f, generator=g).to(device=args.device, dtype=dtype)
            with torch.no_grad():
                y_dense, y_sparse = F.linear(x, dense_w), sparse.linear(x)
                rel = ((y_sparse.float() - y_dense.float()).abs().max() / y_dense.float().abs().max()).item()
                t_dense = timed(lambda: F.linear(x, dense_w), args.device, calls)  # noqa: B023
                t_sparse = timed(lambda: sparse.linear(x), args.device, calls)  # noqa: B023
            key = f"{label} {out_f}x{in_f} @ {n} tokens"
            table[key] = {
                "dense_us": round(t_dense * 1e6, 1),
                f"{name}_us": round(t_sparse * 1e6, 1),
                "speedup": round(t_dense / t_sparse, 3),
                "max_rel_diff": float(f"{rel:.3g}"),
            }
            report.note(f"{key}: {table[key]}")
            if not rel <= BF16_TOL:
                problems.append(f"{key}: {name} output differs from dense by {rel:.3g}")
    report.figures["speed"] = {"backend": name, "dtype": str(dtype).replace("torch.", ""), "layers": table}
    return problems


def run(report: common.Report, args) -> tuple[str, str]:
    problems = parity(report, args) + speed(report, args)
    rows = report.figures["parity_vs_cpu_emulator"]
    ran = [b for b, r in rows.items() if isinstance(r, dict)]
    skipped = [f"{b} ({r})" for b, r in rows.items() if not isinstance(r, dict)]
    sp = report.figures["speed"]
    speedups = ", ".join(f"{k.split(' @ ')[0].split()[0]}@{k.split(' @ ')[1].split()[0]} {v['speedup']}x"
                         for k, v in sp["layers"].items())  # fmt: skip
    summary = f"parity vs emulator: {', '.join(ran)} ok"
    if skipped:
        summary += f"; {'; '.join(skipped)}"
    summary += f"; {sp['backend']} vs dense: {speedups}"
    if problems:
        return "fail", "; ".join(problems)[:400]
    return "pass", summary


if __name__ == "__main__":
    common.main(run, __doc__)
