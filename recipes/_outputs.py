"""What a recipe leaves behind: the loss plot across stages, ``results.json``, FLOP figures for its
summary line."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from _args import is_main_process
from _stages import StageResult


def plot_stages(
    stages: list[StageResult], path: str, title: str, baseline: float | None = None
) -> str | None:
    """Loss vs step across stages, events as vertical lines (the IMP sawtooth), stage boundaries dashed."""
    if not is_main_process():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=90)
    offset = 0
    colors = {"prune": "tab:red", "regrow": "tab:green", "densify": "tab:purple", "update": "tab:gray"}
    seen_kinds = set()
    for i, st in enumerate(stages):
        tr = [(h["step"] + offset, h["loss"]) for h in st.log_history if "loss" in h]
        evl = [(h["step"] + offset, h["eval_loss"]) for h in st.log_history if "eval_loss" in h]
        if tr:
            ax.plot(*zip(*tr), lw=1, alpha=0.5, label=f"{st.name} train")
        if evl:
            ax.plot(*zip(*evl), marker="o", ms=3, label=f"{st.name} validation")
        for e in st.events:
            kind = e["kind"] if e["kind"] in colors else "prune"
            if kind == "update":
                continue
            lab = kind if kind not in seen_kinds else None
            seen_kinds.add(kind)
            ax.axvline(e["step"] + offset, color=colors[kind], lw=0.8, ls=":", label=lab)
            tl = e.get("total_level")
            if tl is not None and kind == "prune":
                ax.annotate(f"{tl:.0%}", (e["step"] + offset, 1.0), xycoords=("data", "axes fraction"),
                            fontsize=7, ha="center", va="bottom", color=colors[kind])  # fmt: skip
        if i:
            ax.axvline(offset, color="k", lw=1, ls="--")
        offset += st.steps
    if baseline is not None:
        ax.axhline(baseline, color="k", lw=0.8, label="dense baseline")
    # Zoom on the part worth reading: skip the first 15% of each stage (the initial drop from ~ln V).
    late = [
        h.get("eval_loss", h.get("loss"))
        for st in stages
        for h in st.log_history
        if ("eval_loss" in h or "loss" in h) and h["step"] > 0.15 * st.steps
    ]
    if late:
        lo, hi = min(late + ([baseline] if baseline else [])), max(late + ([baseline] if baseline else []))
        pad = 0.08 * (hi - lo or 1.0)
        ax.set_ylim(lo - pad, hi + 3 * pad)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_results(path: str, payload: dict[str, Any]) -> None:
    if is_main_process():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=2, default=float)
        os.replace(tmp, path)


def fmt_flops(x: float) -> str:
    if x <= 0 or not math.isfinite(x):
        return str(x)
    e = int(math.floor(math.log10(x)))
    return f"{x / 10**e:.2f}e{e}"
