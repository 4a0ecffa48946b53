"""lm-eval (EleutherAI harness) tasks: the seven-task suite, online or from a local data folder.

Online, tasks are lm-eval's stock definitions (their data come from the Hub). Offline,
:func:`write_offline_tasks` generates task YAMLs from the *installed* lm-eval's stock
YAMLs: every key (prompt, ``doc_to_text``, ``doc_to_choice``, ``process_docs``, metrics,
version) is copied; only the data source is swapped to ``dataset_path: json`` with
absolute ``data_files``, and splits the folder lacks are set to ``null``. ``!function``
references point at the stock Python modules inside ``lm_eval.tasks``, so the offline
task runs the very same code. The folder layout is ``DIR/<task>/<split>.jsonl``, as in
``DATA_DIR/tasks`` (``<task>/<split>.jsonl``).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..utils import SparsityError, atomic_write_text

logger = logging.getLogger(__name__)

HARNESS7 = ("arc_easy", "arc_challenge", "hellaswag", "lambada_openai", "openbookqa", "piqa", "winogrande")
"""The seven zero-shot tasks of Cerebras-GPT (Dey et al. 2023, arXiv:2304.03208) and Variable SPDF."""

# Where the stock YAML of each harness7 task lives inside lm_eval/tasks (saves indexing ~10k files).
_STOCK_YAML = {
    "arc_easy": "arc/arc_easy.yaml",
    "arc_challenge": "arc/arc_challenge.yaml",
    "hellaswag": "hellaswag/hellaswag.yaml",
    "lambada_openai": "lambada/lambada_openai.yaml",
    "openbookqa": "openbookqa/openbookqa.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
}
_SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
_DATA_KEYS = ("dataset_path", "dataset_name", "dataset_kwargs")
_DATA_SUFFIXES = (".jsonl", ".json")


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise SparsityError(
            "lm-eval tasks need the lm-eval package: pip install 'hf_sparsity[eval]'."
        ) from None
    return lm_eval


def stock_tasks_root() -> Path:
    """The installed lm-eval's ``lm_eval/tasks`` folder."""
    return Path(_require_lm_eval().__file__).parent / "tasks"


def find_stock_yaml(task: str) -> Path:
    """Path of the stock YAML that defines ``task`` in the installed lm-eval."""
    root = stock_tasks_root()
    if task in _STOCK_YAML and (root / _STOCK_YAML[task]).is_file():
        return root / _STOCK_YAML[task]
    pattern = re.compile(rf"^task:\s*['\"]?{re.escape(task)}['\"]?\s*$", re.M)
    for path in sorted(root.glob("**/*.yaml")):
        try:
            if pattern.search(path.read_text(encoding="utf-8")):
                return path
        except (OSError, UnicodeDecodeError):
            continue
    raise SparsityError(f"lm-eval has no stock task named {task!r}; `lm_eval ls tasks` lists them.")


class _Function:
    """A ``!function module.fn`` reference, kept symbolic, re-rooted as an importable dotted name."""

    def __init__(self, spec: str, base_dir: Path):
        self.spec = spec
        self.base_dir = base_dir

    def dotted(self) -> str:
        root = stock_tasks_root()
        mod, _, fn = self.spec.rpartition(".")
        try:
            rel = self.base_dir.resolve().relative_to(root.resolve())
        except ValueError:
            raise SparsityError(
                f"!function {self.spec} in {self.base_dir} is outside lm_eval/tasks"
            ) from None
        parts = ["lm_eval", "tasks", *rel.parts, *mod.split(".")]
        return ".".join(parts + [fn])


def _load_raw_yaml(path: Path) -> dict[str, Any]:
    """Load a stock task YAML with ``include:`` merged (as lm-eval does) and ``!function`` kept symbolic."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor(
        "!function", lambda loader, node: _Function(loader.construct_scalar(node), path.parent)
    )
    with open(path, encoding="utf-8") as f:
        cfg = yaml.load(f, Loader=Loader)  # noqa: S506 (SafeLoader plus one tag)
    includes = cfg.pop("include", None)
    if includes is None:
        return cfg
    merged: dict[str, Any] = {}
    for inc in includes if isinstance(includes, list) else [includes]:
        inc_cfg = _load_raw_yaml(path.parent / inc if not Path(inc).is_absolute() else Path(inc))
        inc_cfg.pop("task_list", None)
        merged.update(inc_cfg)
    merged.update(cfg)
    return merged


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Function, lambda d, f: d.represent_scalar("!function", f.dotted()))


def local_splits(data_dir: str | os.PathLike, task: str) -> dict[str, Path]:
    """``{split: file}`` for ``DATA_DIR/<task>/<split>.jsonl`` (or ``.json``)."""
    folder = Path(data_dir) / task
    if not folder.is_dir():
        return {}
    out = {}
    for p in sorted(folder.iterdir()):
        for suf in _DATA_SUFFIXES:
            if p.name.endswith(suf) and p.is_file():
                out.setdefault(p.name[: -len(suf)], p.resolve())
    return out


def offline_task_config(task: str, data_dir: str | os.PathLike) -> dict[str, Any]:
    """The stock config of ``task`` with its data source swapped to the local files (see module doc)."""
    stock = find_stock_yaml(task)
    cfg = _load_raw_yaml(stock)
    files = local_splits(data_dir, task)
    if not files:
        raise SparsityError(
            f"No local data for task {task!r}: expected {Path(data_dir) / task}/<split>.jsonl "
            "(a folder holding <task>/<split>.jsonl, or its parent)."
        )
    eval_split = cfg.get("test_split") or cfg.get("validation_split")
    if eval_split not in files:
        raise SparsityError(
            f"lm-eval's {task!r} evaluates its {eval_split!r} split, but {Path(data_dir) / task} has only "
            f"{sorted(files)}. Add {eval_split}.jsonl so the offline task scores the same split."
        )
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if key in _DATA_KEYS:
            if key == "dataset_path":
                out["dataset_path"] = "json"
                out["dataset_kwargs"] = {"data_files": {s: str(p) for s, p in files.items()}}
            continue
        if key in _SPLIT_KEYS and value is not None and value not in files:
            value = None  # a split the local folder does not ship (zero-shot never reads it)
        out[key] = value
    return out


def write_offline_tasks(
    data_dir: str | os.PathLike, out_dir: str | os.PathLike, tasks: Sequence[str] = HARNESS7
) -> Path:
    """Write one YAML per task into ``out_dir`` mirroring lm-eval's stock task over ``data_dir``'s files.

    Use the folder with ``TaskManager(include_defaults=False, include_path=out_dir)`` or
    ``lm_eval run --include_path out_dir``.
    """
    import lm_eval

    data_dir = Path(data_dir).resolve()
    out_dir = Path(out_dir)
    for task in tasks:
        cfg = offline_task_config(task, data_dir)
        stock = find_stock_yaml(task).relative_to(stock_tasks_root())
        header = (
            f"# Generated by hf_sparsity from lm-eval {getattr(lm_eval, '__version__', '?')} stock task "
            f"lm_eval/tasks/{stock.as_posix()}.\n# Identical to it except the data source "
            f"(local files under {data_dir / task}) and splits the folder lacks (null).\n"
        )
        body = yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1000)
        atomic_write_text(out_dir / task / f"{task}.yaml", header + body)
    return out_dir


def resolve_tasks_dir(data_dir: str | os.PathLike) -> Path:
    """Accept either a tasks folder (``.../tasks``) or a data root that holds ``tasks/``."""
    d = Path(data_dir)
    if (d / "tasks").is_dir():
        return d / "tasks"
    if not d.is_dir():
        raise SparsityError(f"--data-dir {str(d)!r} does not exist.")
    return d


def _num(x: Any) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v


def parse_results(raw: dict[str, Any], tasks: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{task: {metric: value, metric_stderr: value, "samples": n}}`` from ``simple_evaluate``'s output."""
    out: dict[str, dict[str, Any]] = {}
    for task in tasks:
        res = raw["results"].get(task, {})
        row: dict[str, Any] = {}
        for key, value in res.items():
            if "," not in key:
                continue
            metric, _filter = key.split(",", 1)
            if metric.endswith("_stderr"):
                row[metric] = _num(value)
            else:
                row[metric] = _num(value)
        n = raw.get("n-samples", {}).get(task, {})
        if n:
            row["samples"] = n.get("effective")
        out[task] = row
    return out


def harness_averages(
    per_task: dict[str, dict[str, Any]], tasks: Sequence[str] = HARNESS7
) -> dict[str, float]:
    """Mean ``acc`` over ``tasks`` (the "average accuracy" of Dey et al. 2023, arXiv:2304.03208) and
    mean ``acc_norm`` (``acc`` where absent)."""
    accs = [per_task[t]["acc"] for t in tasks if t in per_task and per_task[t].get("acc") is not None]
    norms = [
        per_task[t].get("acc_norm", per_task[t]["acc"])
        for t in tasks
        if t in per_task and per_task[t].get("acc") is not None
    ]
    if len(accs) != len(tasks):
        return {}
    return {"average_acc": sum(accs) / len(accs), "average_acc_norm": sum(norms) / len(norms)}


def run_harness(
    model: Any,
    tokenizer: Any,
    tasks: Sequence[str],
    *,
    data_dir: str | os.PathLike | None = None,
    tasks_out: str | os.PathLike | None = None,
    limit: int | float | None = None,
    batch_size: int = 8,
    bootstrap_iters: int = 1000,
) -> dict[str, Any]:
    """Zero-shot lm-eval tasks on an in-memory HF model via ``lm_eval.simple_evaluate``.

    With ``data_dir`` (a folder holding ``<task>/<split>.jsonl``, or its parent) the tasks
    are generated offline (:func:`write_offline_tasks`, into ``tasks_out`` or a temp
    folder) and lm-eval's built-in tasks are not indexed; without, lm-eval's stock
    tasks are used (network). Returns ``{"tasks": per-task metrics, "tasks_dir": ...,
    "lm_eval_version": ...}``.
    """
    lm_eval = _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks = list(tasks)
    tmp = None
    tasks_dir = None
    if data_dir is not None:
        if tasks_out is None:
            tmp = tempfile.TemporaryDirectory(prefix="hf_sparsity_tasks_")
            tasks_out = tmp.name
        tasks_dir = write_offline_tasks(resolve_tasks_dir(data_dir), tasks_out, tasks)
        manager = TaskManager(include_defaults=False, include_path=str(tasks_dir))
    else:
        manager = TaskManager()
    was_training = model.training
    model.eval()
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        raw = simple_evaluate(
            model=lm,
            tasks=tasks,
            num_fewshot=0,
            limit=limit,
            task_manager=manager,
            log_samples=False,
            bootstrap_iters=bootstrap_iters,
        )
    finally:
        model.train(was_training)
        if tmp is not None:
            tmp.cleanup()
    return {
        "tasks": parse_results(raw, tasks),
        "tasks_dir": str(tasks_dir) if tasks_dir and tmp is None else None,
        "lm_eval_version": getattr(lm_eval, "__version__", None),
    }
