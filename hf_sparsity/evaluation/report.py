"""Reports: ``results.json`` plus a Markdown table, and side-by-side comparisons with a bar chart."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..utils import SparsityError, atomic_path, atomic_write_text
from .harness import HARNESS7

RESULTS_NAME = "results.json"
MARKDOWN_NAME = "results.md"

# (key in flat metrics, label, higher is better)
_HEADLINE = [
    ("pile/loss", "Pile-style loss", False),
    ("pile/perplexity", "Pile-style perplexity", False),
    ("wikitext103/adjusted_perplexity", "WikiText-103 adjusted ppl", False),
    ("wikitext103/perplexity", "WikiText-103 token ppl", False),
    ("wikitext2/perplexity", "WikiText-2 ppl (Wanda/SparseGPT protocol)", False),
    ("lambada/acc", "LAMBADA acc", True),
    ("lambada/perplexity", "LAMBADA ppl", False),
]


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``{"pile/loss": ..., "arc_easy/acc": ..., "harness7/average_acc": ...}`` (numbers only)."""
    m = results.get("metrics", {})
    out: dict[str, float] = {}
    for suite in ("pile", "wikitext103", "wikitext2", "lambada", "harness7"):
        for k, v in (m.get(suite) or {}).items():
            if isinstance(v, (int, float)) and not k.endswith("_stderr") and k != "samples":
                out[f"{suite}/{k}"] = float(v)
    for task, row in (m.get("harness") or {}).items():
        for k, v in row.items():
            if isinstance(v, (int, float)) and not k.endswith("_stderr") and k != "samples":
                out[f"{task}/{k}"] = float(v)
    return out


def format_metric(v: Any, key: str = "") -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        if "acc" in key:
            return f"{100 * v:.2f}"
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.2f}"
    return str(v)


def metric_rows(flat: dict[str, float]) -> list[tuple[str, str, bool]]:
    rows = [r for r in _HEADLINE if r[0] in flat]
    if any(k.startswith("lambada_openai/") for k in flat):  # the per-task rows below say the same
        rows = [r for r in rows if not r[0].startswith("lambada/")]
    tasks = sorted(
        {k.split("/")[0] for k in flat} - {"pile", "wikitext103", "wikitext2", "lambada", "harness7"}
    )
    tasks = [t for t in HARNESS7 if t in tasks] + [t for t in tasks if t not in HARNESS7]
    for t in tasks:
        for metric in ("acc", "acc_norm", "perplexity"):
            if f"{t}/{metric}" in flat:
                rows.append((f"{t}/{metric}", f"{t} {metric}", metric != "perplexity"))
    for key, label in (
        ("harness7/average_acc", "harness7 average acc"),
        ("harness7/average_acc_norm", "harness7 average acc_norm"),
    ):
        if key in flat:
            rows.append((key, label, True))
    return rows


def format_markdown(results: dict[str, Any]) -> str:
    """One model's results as Markdown: metrics (accuracies in %), sparsity, FLOPs, settings, wall times."""
    flat = flat_metrics(results)
    sp = results.get("sparsity", {})
    lines = [f"# Evaluation of `{results.get('model')}`", ""]
    lines += ["| metric | value |", "|---|---:|"]
    for key, label, higher in metric_rows(flat):
        arrow = "↑" if higher else "↓"
        lines.append(f"| {label} {arrow} | {format_metric(flat[key], key)} |")
    lines += [""]
    if sp:
        lines.append(
            f"Sparsity ({sp.get('source')}): {100 * sp.get('sparsity', 0):.2f}% of "
            f"{sp.get('targeted_params', 0):,} targeted weights; nonzero parameters "
            f"{sp.get('nonzero_params', 0):,} of {sp.get('total_params', 0):,}."
        )
        f = sp.get("flops") or {}
        if "inference_flops_per_token" in f:
            lines.append(
                f"Inference FLOPs per token (seq {f.get('seq_len')}): {f['inference_flops_per_token']:.4g} "
                f"(dense {f.get('dense_inference_flops_per_token', 0):.4g}, "
                f"{f.get('inference_flop_reduction', 1):.2f}x fewer)."
            )
    s = results.get("settings", {})
    lines.append(
        f"Settings: limit={s.get('limit')}, batch size {s.get('batch_size')}, context "
        f"{s.get('context') or 'model'}, "
        f"stride {s.get('stride') or 'context'}, {s.get('dtype')} on {s.get('device')}; data: "
        f"{results.get('data', {}).get('data_dir') or 'online'}."
    )
    wt = results.get("wall_time_s", {})
    if wt:
        lines.append("Wall time (s): " + ", ".join(f"{k} {v}" for k, v in wt.items()) + ".")
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out_dir: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``out_dir`` (atomically); returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath, mpath = out / RESULTS_NAME, out / MARKDOWN_NAME
    atomic_write_text(jpath, json.dumps(results, indent=2, default=str) + "\n")
    atomic_write_text(mpath, format_markdown(results))
    return jpath, mpath


def load_results(path: str | os.PathLike) -> dict[str, Any]:
    """Read a ``results.json`` (or the folder holding it)."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS_NAME
    if not p.is_file():
        raise SparsityError(
            f"No {RESULTS_NAME} at {str(p)!r}; pass folders written by `hf_sparsity eval --out`."
        )
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SparsityError(f"{p} is not valid JSON ({e}); rerun the evaluation that wrote it.") from None


def compare_markdown(results: Sequence[dict[str, Any]], labels: Sequence[str]) -> str:
    """Several results side by side: one column per model, sparsity and wall time rows at the end."""
    flats = [flat_metrics(r) for r in results]
    keys: list[tuple[str, str, bool]] = []
    for f in flats:
        for row in metric_rows(f):
            if row not in keys:
                keys.append(row)
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for key, label, higher in keys:
        cells = [format_metric(f.get(key), key) for f in flats]
        lines.append(f"| {label} {'↑' if higher else '↓'} | " + " | ".join(cells) + " |")
    sp = [r.get("sparsity", {}) for r in results]
    lines.append(
        "| projection/FFN sparsity | " + " | ".join(f"{100 * s.get('sparsity', 0):.1f}%" for s in sp) + " |"
    )
    lines.append("| nonzero params | " + " | ".join(f"{s.get('nonzero_params', 0):,}" for s in sp) + " |")
    if any("flops" in s for s in sp):
        lines.append(
            "| inference FLOPs/token | " + " | ".join(_flops_cell(s.get("flops")) for s in sp) + " |"
        )
    lines.append(
        "| wall time (s) | "
        + " | ".join(str(r.get("wall_time_s", {}).get("total", "–")) for r in results)
        + " |"
    )
    return "\n".join(lines) + "\n"


def _flops_cell(f: Any) -> str:
    if isinstance(f, dict):
        for k in ("inference_flops_per_token",):
            if isinstance(f.get(k), (int, float)):
                return f"{f[k]:.4g}"
        return "see json"
    if isinstance(f, (int, float)):
        return f"{f:.4g}"
    return "–"


def plot_comparison(
    results: Sequence[dict[str, Any]], labels: Sequence[str], path: str | os.PathLike
) -> Path:
    """Bar chart PNG: accuracies (%) grouped by task on the left; each lower-is-better metric on its own
    axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    flats = [flat_metrics(r) for r in results]
    keys: list[tuple[str, str, bool]] = []
    for f in flats:
        for row in metric_rows(f):
            if row not in keys:
                keys.append(row)
    acc = [k for k in keys if k[0].endswith(("/acc", "/average_acc"))]
    low_keys = (
        "pile/loss",
        "wikitext103/adjusted_perplexity",
        "lambada/perplexity",
        "lambada_openai/perplexity",
    )
    low = [k for k in keys if k[0] in low_keys]
    n_axes = (1 if acc else 0) + len(low)
    if n_axes == 0:
        raise SparsityError("Nothing to plot: the results hold no metrics.")
    widths = ([max(4, 0.9 * len(acc))] if acc else []) + [1.6] * len(low)
    fig, axes = plt.subplots(
        1, n_axes, figsize=(sum(widths) + 1.5, 4.2), gridspec_kw={"width_ratios": widths}
    )
    axes = list(axes) if n_axes > 1 else [axes]
    n = len(flats)
    bw = 0.8 / n
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax_i = 0
    if acc:
        ax = axes[0]
        for j, f in enumerate(flats):
            xs = [i + (j - (n - 1) / 2) * bw for i in range(len(acc))]
            ax.bar(
                xs,
                [100 * f.get(k[0], float("nan")) for k in acc],
                bw,
                label=labels[j],
                color=colors[j % len(colors)],
            )
        ax.set_xticks(range(len(acc)))
        ax.set_xticklabels(
            [k[0].split("/")[0].replace("harness7", "avg (7)") for k in acc], rotation=35, ha="right"
        )
        ax.set_ylabel("accuracy (%) ↑")
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax_i = 1
    for k in low:
        ax = axes[ax_i]
        ax_i += 1
        vals = [f.get(k[0], float("nan")) for f in flats]
        for j, v in enumerate(vals):
            ax.bar(j, v, 0.7, color=colors[j % len(colors)])
        finite = [v for v in vals if v == v and 0 < v < float("inf")]
        if finite and max(finite) / min(finite) > 20:  # perplexities that differ by orders of magnitude
            ax.set_yscale("log")
        ax.set_xticks([])
        ax.set_title(k[1] + " ↓", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def compare(
    dirs: Sequence[str | os.PathLike], out_dir: str | os.PathLike, labels: Sequence[str] | None = None
) -> tuple[Path, Path]:
    """Compare several evaluation folders: writes ``compare.md`` and ``compare.png`` into ``out_dir``."""
    if len(dirs) < 1:
        raise SparsityError("--compare needs at least one results folder.")
    results = [load_results(d) for d in dirs]
    if labels is None:
        labels = [Path(d).name if Path(d).is_dir() else Path(d).parent.name for d in dirs]
    if len(labels) != len(results):
        raise SparsityError(
            f"{len(labels)} labels for {len(results)} results folders; give one label per folder."
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / "compare.md"
    atomic_write_text(md, compare_markdown(results, labels))
    png = plot_comparison(results, labels, out / "compare.png")
    return md, png
