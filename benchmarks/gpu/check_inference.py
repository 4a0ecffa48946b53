"""Check e: the inference backends on the device against the emulator.

A Llama model (GQA) with magnitude 2:4 masks on its projections and FFN, run through
``sparsify_for_inference`` on each backend on the device (``csr``, ``masked_dense``, ``emulator`` in
float32; ``semi_structured`` and ``cusparselt`` in bfloat16) and compared with the ``emulator`` on the
CPU in float32, the reference every backend is tested against: the largest logit difference relative to
the largest reference logit. The speed of 2:4 against dense is check g (``check_sparse24.py``).
"""

from __future__ import annotations

import copy

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
    cases += [("semi_structured", torch.bfloat16), ("cusparselt", torch.bfloat16)]
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


def run(report: common.Report, args) -> tuple[str, str]:
    problems = parity(report, args)
    rows = report.figures["parity_vs_cpu_emulator"]
    ran = [b for b, r in rows.items() if isinstance(r, dict)]
    skipped = [f"{b} ({r})" for b, r in rows.items() if not isinstance(r, dict)]
    summary = f"parity vs emulator: {', '.join(ran)} ok"
    if skipped:
        summary += f"; {'; '.join(skipped)}"
    if problems:
        return "fail", "; ".join(problems)[:400]
    return "pass", summary


if __name__ == "__main__":
    common.main(run, __doc__)
