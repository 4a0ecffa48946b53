"""The model card (``README.md``) that ``hf_sparsity convert --finalize`` writes into a finalized folder.

Hub metadata (YAML front matter: ``library_name: transformers``, ``tags`` with ``sparse``,
``base_model`` and ``license`` where known) and a body with what a reader of a sparse
checkpoint wants: overall and per-projection-type sparsity, nonzero parameters and
inference FLOPs against dense, how the masks were made (from the ``sparsity`` section of
the input's ``config.json``, before finalize strips it) and, given an
``hf_sparsity eval`` results file, the evaluation table.

The sparsity figures are those ``hf_sparsity inspect OUT`` prints for the finalized folder.
An existing ``README.md`` in the input is kept: its metadata is merged (our tags added,
its own values kept) and this card is appended as a section.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import yaml

from ..constants import CONFIG_NAME, CONFIG_SECTION, SPARSITY_MASKS_NAME
from ..evaluation.report import flat_metrics, format_metric, load_results, metric_rows
from ..flops import count_flops_from_config
from ..mask_engine.config import SparsityConfig, get_sparsity_state
from ..storage.folders import MaskReader, inspect_checkpoint
from ..storage.masks_file import read_mask_metadata
from ..utils import SparsityError, atomic_write_text

README_NAME = "README.md"
SECTION_TITLE = "## Sparsity (hf_sparsity)"
TAGS = ("sparse", "sparsity", "hf_sparsity")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LEVEL_TOLERANCE = 0.005  # configured vs measured level: rounding per tensor, and weights that are 0 anyway

logger = logging.getLogger(__name__)


def load_eval_results(path: str | os.PathLike | None) -> dict[str, Any] | None:
    """An ``hf_sparsity eval`` results.json (file or folder), checked before anything is written."""
    if path is None:
        return None

    results = load_results(path)
    if not isinstance(results, dict) or not isinstance(results.get("metrics"), dict):
        raise SparsityError(
            f"{str(path)!r} is not an `hf_sparsity eval` results file (no `metrics`); pass the results.json "
            "that `hf_sparsity eval MODEL --out DIR` wrote."
        )
    return results


def card_section(src: str | os.PathLike) -> Any:
    """The ``sparsity`` section of ``src/config.json`` that the card copies, checked like a config.

    A hand-edited section that is not a valid config (``sparsity: 7``) is refused rather than shown
    beside the measured figures; ``None`` when there is no section.
    """
    path = Path(src) / CONFIG_NAME
    section = _read_json(path).get(CONFIG_SECTION)
    if section is None:
        return None
    try:
        SparsityConfig.from_dict(section)
    except SparsityError as e:
        raise SparsityError(
            f"{str(path)!r}: its `{CONFIG_SECTION}` section is not a valid sparsity config ({e}) and the "
            "model card would copy it. Fix the section (or remove it), or finalize with --no-model-card."
        ) from None
    return section


def _uniform_level(section: Any) -> float | None:
    """The one level a section gives every target, when it does (no schedule, groups or overrides)."""
    cfg = SparsityConfig.from_dict(section)
    pats = cfg.param_name_patterns
    if cfg.has_schedule or cfg.groups or cfg.structure or (isinstance(pats, dict) and pats):
        return None
    return cfg.sparsity


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    """(metadata, body) of a Markdown file with optional ``---`` YAML front matter."""

    m = re.match(r"\A---[ \t]*\n(.*?\n)?---[ \t]*(\n|\Z)", text, re.S)
    if not m:
        return {}, text
    try:
        meta = yaml.safe_load(m.group(1) or "") or {}
    except yaml.YAMLError as e:
        raise SparsityError(
            f"The README.md front matter is not valid YAML ({e}); fix it or remove it."
        ) from None
    if not isinstance(meta, dict):
        raise SparsityError("The README.md front matter is not a YAML mapping; fix it or remove it.")
    return meta, text[m.end() :]


def _projection_type(name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``self_attn.q_proj`` (GPT-2 has attn.c_proj and
    mlp.c_proj)."""
    parts = name.split(".")[:-1]
    return ".".join(parts[-2:]) if parts else name


def card_figures(src: str | os.PathLike, out: str | os.PathLike) -> dict[str, Any]:
    """The numbers of the card: sparsity from ``inspect`` of ``out``, FLOPs from ``src``'s masks."""

    report = inspect_checkpoint(out)
    targets = set(MaskReader(src).names())
    per_type: dict[str, dict[str, Any]] = {}
    for row in report["layers"]:
        if row["name"] not in targets:
            continue
        t = per_type.setdefault(
            _projection_type(row["name"]), {"tensors": 0, "params": 0, "nonzero_params": 0}
        )
        t["tensors"] += 1
        t["params"] += row["numel"]
        t["nonzero_params"] += row["nonzeros"]
    for t in per_type.values():
        t["sparsity"] = 1 - t["nonzero_params"] / max(t["params"], 1)
    tp = sum(t["params"] for t in per_type.values())
    tnz = sum(t["nonzero_params"] for t in per_type.values())
    figures = {
        "totals": report["totals"],
        "targeted": {"params": tp, "nonzero_params": tnz, "sparsity": 1 - tnz / max(tp, 1)},
        "per_type": per_type,
        "flops": None,
    }
    try:
        sparse = count_flops_from_config(str(src))
        dense = sparse.dense()
        figures["flops"] = {
            "seq_len": sparse.seq_len,
            "inference_flops_per_token": sparse.inference_flops_per_token,
            "dense_inference_flops_per_token": dense.inference_flops_per_token,
        }
    except Exception as e:  # an architecture the FLOP counter cannot build: the card says so
        figures["flops_error"] = str(e).splitlines()[0][:200]
    return figures


def _metadata(src: Path, existing: dict[str, Any]) -> dict[str, Any]:
    meta = dict(existing)
    meta.setdefault("library_name", "transformers")
    tags = meta.get("tags") or []
    tags = [tags] if isinstance(tags, str) else list(tags)
    meta["tags"] = tags + [t for t in TAGS if t not in tags]
    cfg = _read_json(src / CONFIG_NAME)
    archs = cfg.get("architectures") or []
    if "pipeline_tag" not in meta and any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        meta["pipeline_tag"] = "text-generation"
    if "base_model" not in meta:
        for key in ("base_model", "_name_or_path", "_model_name_or_path"):
            v = cfg.get(key)
            if isinstance(v, str) and _HUB_ID.match(v) and not os.path.exists(v):
                meta["base_model"] = v
                break
    return meta


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _fmt_value(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, sort_keys=True) + "`"
    return f"`{v}`"


def _oneshot_rows(oneshot: dict[str, Any]) -> list[str]:
    """Rows for masks made by ``hf_sparsity prune`` (its record in the section's ``_state``)."""
    rows = [f"| masks made by | one-shot `{oneshot.get('method', '?')}` pruning (`hf_sparsity prune`) |"]
    if oneshot.get("calib_data"):
        n, seqlen = oneshot.get("nsamples", "?"), oneshot.get("seqlen", "?")
        rows.append(
            f"| calibration | `{oneshot['calib_data']}`: {n} samples x {seqlen} tokens, "
            f"seed {oneshot.get('seed', '?')} |"
        )
    rows += [f"| {k} | {_fmt_value(v)} |" for k, v in sorted(oneshot.items()) if k in ("owl", "structure")]
    return rows


def _level_row(section: dict[str, Any], measured: float) -> str:
    """The ``sparsity`` row, flagged when the configured level is not what the weights hold."""
    level = _uniform_level(section)
    row = f"| sparsity | {_fmt_value(section['sparsity'])}"
    if level is not None and abs(level - measured) > LEVEL_TOLERANCE:
        logger.warning(
            "config.json says sparsity %s but the sparsified weights are %.2f%% sparse; the card shows the "
            "measured level and flags the difference.",
            section["sparsity"],
            100 * measured,
        )
        row += f" (**disagrees with the measured {measured:.2%}**; the figures above are measured)"
    return row + " |"


def _how_made(src: Path, measured: float) -> list[str]:

    section = card_section(src)
    lines = ["### How the masks were made", ""]
    if isinstance(section, dict):
        state = get_sparsity_state({CONFIG_SECTION: section})
        oneshot = state.get("oneshot") or {}
        # masks from `hf_sparsity prune`: the method and calibration say how; init_method was not used
        skip = ("_state", "hf_sparsity_version") + (("init_method",) if oneshot else ())
        keys = [k for k in section if k not in skip]
        lines += ["| setting | value |", "|---|---|"]
        if oneshot:
            lines += _oneshot_rows(oneshot)
        lines += [
            _level_row(section, measured) if k == "sparsity" else f"| {k} | {_fmt_value(section[k])} |"
            for k in keys
        ]
        if section.get("hf_sparsity_version"):
            lines.append(f"| hf_sparsity version | `{section['hf_sparsity_version']}` |")
        if state.get("optimizer_steps"):
            lines.append(f"| optimizer steps trained with masks | {state['optimizer_steps']} |")
        events = state.get("events") or []
        if events:
            kinds: dict[str, int] = {}
            for e in events:
                kinds[e.get("kind", "?")] = kinds.get(e.get("kind", "?"), 0) + 1
            lines.append(
                "| mask events | " + ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())) + " |"
            )
        lines.append("")
        lines.append(
            "From the `sparsity` section of the sparse checkpoint's `config.json` (the Cerebras-style "
            "config that `SparsityCallback` trained with); finalizing removed it from this folder."
        )
    else:
        lines.append(
            f"The input had a `{SPARSITY_MASKS_NAME}` but no `sparsity` section in `config.json`, so how the "
            "masks were chosen is not recorded."
        )
    if (src / SPARSITY_MASKS_NAME).is_file():
        meta = read_mask_metadata(src)
        extra = {
            k: v
            for k, v in meta.items()
            if k not in ("format", "format_version", "tensors", "state", "library_version", "checksum")
        }
        if extra:
            lines.append("Mask file metadata: " + ", ".join(f"{k} = `{v}`" for k, v in sorted(extra.items())))
    return lines


def _eval_lines(results: dict[str, Any]) -> list[str]:

    flat = flat_metrics(results)
    lines = ["### Evaluation", ""]
    rows = metric_rows(flat)
    if not rows:
        return lines + ["The results file holds no metric this card knows how to show.", ""]
    lines += ["| metric | value |", "|---|---:|"]
    for key, label, higher in rows:
        lines.append(f"| {label} {'↑' if higher else '↓'} | {format_metric(flat[key], key)} |")
    s = results.get("settings", {})
    lines += [
        "",
        f"`hf_sparsity eval` of `{results.get('model')}`: limit={s.get('limit')}, context "
        f"{s.get('context') or 'model'}, {s.get('dtype')} on {s.get('device')}.",
        "",
    ]
    return lines


def card_body(src: Path, figures: dict[str, Any], results: dict[str, Any] | None) -> str:
    t, tg = figures["totals"], figures["targeted"]
    lines = [
        SECTION_TITLE,
        "",
        f"This checkpoint is **{tg['sparsity']:.2%} sparse** in its "
        f"{sum(v['tensors'] for v in figures['per_type'].values())} "
        f"sparsified weight matrices (unstructured: masked weights are stored as exact zeros in dense "
        f"tensors). Over all {t['params']:,} parameters, {t['nonzero_params']:,} are nonzero "
        f"({t['sparsity']:.2%} sparse overall). It loads with plain `transformers`; the zeros stay zeros "
        "unless you train it (use `hf_sparsity`'s `SparsityCallback` to keep them).",
        "",
        "| projection type | tensors | parameters | nonzero | sparsity |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, v in sorted(figures["per_type"].items()):
        lines.append(
            f"| {name} | {v['tensors']} | {v['params']:,} | {v['nonzero_params']:,} | {v['sparsity']:.2%} |"
        )
    lines.append(
        f"| **all sparsified** | | {tg['params']:,} | {tg['nonzero_params']:,} | {tg['sparsity']:.2%} |"
    )
    lines.append("")
    f = figures.get("flops")
    lines += ["| | this model | dense |", "|---|---:|---:|"]
    lines.append(f"| nonzero parameters | {t['nonzero_params']:,} | {t['params']:,} |")
    if f:
        lines.append(
            f"| inference FLOPs per token (seq {f['seq_len']}) | {f['inference_flops_per_token']:.4g} | "
            f"{f['dense_inference_flops_per_token']:.4g} |"
        )
        ratio = f["dense_inference_flops_per_token"] / max(f["inference_flops_per_token"], 1e-30)
        lines += [
            "",
            f"Inference FLOPs are {ratio:.2f}x fewer than dense if every zero is skipped (`hf_sparsity "
            "flops`'s "
            "count; attention and embeddings stay dense). Dense kernels skip none: the speed-up needs a "
            "sparse backend (`hf_sparsity.sparsify_for_inference`).",
        ]
    else:
        lines += ["", f"FLOPs not counted: {figures.get('flops_error')}."]
    lines.append("")
    lines += _how_made(src, tg["sparsity"])
    lines.append("")
    if results is not None:
        lines += _eval_lines(results)
    lines.append("Figures: `hf_sparsity inspect` of this folder (sparsity) and `hf_sparsity flops` (FLOPs).")
    return "\n".join(lines) + "\n"


def write_model_card(
    src: str | os.PathLike, out: str | os.PathLike, results: dict[str, Any] | None = None
) -> Path:
    """Write (or extend) ``out/README.md`` for the finalized folder ``out`` made from the sparse ``src``."""
    src, out = Path(src), Path(out)
    path = out / README_NAME
    existing = path.read_text(encoding="utf-8") if path.is_file() else None
    meta, body = split_front_matter(existing) if existing is not None else ({}, "")
    meta = _metadata(src, meta)
    section = card_body(src, card_figures(src, out), results)
    if existing is None:
        title = meta.get("base_model") or src.resolve().name
        body = f"# {title}, sparse\n\n{section}"
    else:
        body = body.rstrip("\n") + "\n\n" + section
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    text = f"---\n{front}---\n\n{body.lstrip(chr(10))}"

    atomic_write_text(path, text)
    return path


__all__ = ["card_figures", "card_section", "load_eval_results", "split_front_matter", "write_model_card"]
