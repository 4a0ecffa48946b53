"""The time side of a speed target (:mod:`~hf_sparsity.pruning.spdy`): per layer shape and level, the
ms of one batch-1 product in the format ``auto`` runs (``auto``'s own measurement, kept in its plan
cache), and the decoding speed of whole models converted as ``hf_sparsity generate`` converts them."""

from __future__ import annotations

import copy
import logging
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from ..backends.auto import plan_layers
from ..inference import sparsify_for_inference
from ..inference.decoding import greedy_decode
from ..masks import num_zeros
from ..utils import torch_threads
from .spdy import SpeedTarget, TimeTable, shape_key

logger = logging.getLogger(__name__)


def measure_time_table(
    shapes: list[str], levels: tuple[float, ...], values: str | None = None, threads: int | None = None,
    plan_cache: bool | str = True, progress: bool = False,
) -> TimeTable:  # fmt: skip
    """Per shape, the ms of one batch-1 product at level 0 and at each grid level in the format ``auto``
    chooses (module docstring); ``other_ms`` is left 0 (see :func:`measure_decode_ms`)."""
    layers = {}
    grid = sorted({0.0, *levels})
    for s in sorted(set(shapes)):
        out_f, in_f = (int(x) for x in s.split("x"))
        g = torch.Generator().manual_seed(out_f * 7919 + in_f)
        w = torch.randn(out_f, in_f, generator=g)
        for lv in grid:
            k = num_zeros(lv, w.numel())
            m = torch.ones(w.numel(), dtype=torch.uint8)
            m[torch.randperm(w.numel(), generator=g)[:k]] = 0
            layers[f"{s}@{lv}"] = (w, m.view(out_f, in_f))
    t0 = time.perf_counter()
    with torch_threads(threads or torch.get_num_threads()):
        # threads set for torch and the kernels, not passed: the cache key of a model converted later
        plan = plan_layers(layers, values=values, plan_cache=plan_cache)
    ms, fmt = {}, {}
    for name, (_, _, _, choice) in plan.items():
        passes = max(1, int(choice.get("measured_on", 1)) * int(choice.get("timed_copies", 1)))
        ms[name] = float(choice["decode_ms"][choice["decode"]]) / passes
        fmt[name] = choice["decode"]
    logger.info("spdy: time table of %d shapes x %d levels in %.1f s", len(set(shapes)), len(grid),
                time.perf_counter() - t0)  # fmt: skip
    return TimeTable(
        levels=tuple(levels),
        ms={s: [ms[f"{s}@{lv}"] for lv in levels] for s in sorted(set(shapes))},
        dense_ms={s: ms[f"{s}@0.0"] for s in sorted(set(shapes))},
        values=values,
        threads=threads,
        formats={s: [fmt[f"{s}@{lv}"] for lv in levels] for s in sorted(set(shapes))},
    )


def decode_ms(model, ids: torch.Tensor, tokens: int) -> float:
    """ms per decoded token of greedy decoding (``hf_sparsity generate``'s loop), the prompt excluded."""
    stamps: list[float] = []
    greedy_decode(model, ids, tokens, eos_token_id=[], on_token=lambda _: stamps.append(time.perf_counter()))
    if len(stamps) < 2:
        return float("nan")
    return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)


def load_for_decoding(folder, values: str | None, dense: bool):
    """A model folder converted as ``hf_sparsity generate`` converts it (``auto``; a dense folder with its
    exact zeros as masks)."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    opts = {"values": values} if values else {}
    sparsify_for_inference(model, "auto", masks="zeros" if dense else None, **opts)
    return model


def measure_decode_ms(
    folders: dict[str, Any], values, threads, tokens: int = 32, rounds: int = 5, stat: str = "median"
):
    """``name -> ms per token`` of each folder (``{name: (folder, dense)}``) converted as ``hf_sparsity
    generate`` runs it, rounds interleaved: medians, or with ``stat="min"`` the fastest round (as the time
    table counts its layers: other work on the machine only ever adds time)."""
    with torch_threads(threads or torch.get_num_threads()):
        models = {n: load_for_decoding(f, values, dense) for n, (f, dense) in folders.items()}
        vocab = min(int(m.config.vocab_size) for m in models.values())
        ids = torch.arange(1, 9).remainder(vocab).unsqueeze(0)
        times: dict[str, list[float]] = {n: [] for n in models}
        for m in models.values():
            decode_ms(m, ids, 4)  # warm-up
        for _ in range(rounds):
            for n, m in models.items():
                times[n].append(decode_ms(m, ids, tokens))
    pick = min if stat == "min" else statistics.median
    return {n: pick(v) for n, v in times.items()}


def model_step_ms(model, values: str | None, threads: int | None, tokens: int = 32, rounds: int = 3) -> float:
    """ms per decoded token of a copy of ``model`` (dense) converted with ``auto``, median of ``rounds``."""
    with torch_threads(threads or torch.get_num_threads()):
        m = copy.deepcopy(model).float().eval()
        sparsify_for_inference(m, "auto", masks="zeros", **({"values": values} if values else {}))
        ids = torch.arange(1, 9).remainder(int(m.config.vocab_size)).unsqueeze(0)
        decode_ms(m, ids, 4)
        return min(decode_ms(m, ids, tokens) for _ in range(rounds))  # the fastest, as the table's


def with_other_ms(table: TimeTable, step_ms: float, shapes: list[str]) -> TimeTable:
    """``table`` with ``other_ms = max(0, step_ms − Σ dense layer ms)``."""
    table.other_ms = max(0.0, step_ms - sum(table.dense_ms[s] for s in shapes))
    return table


def table_for_model(model, targets, speed: SpeedTarget, progress: bool = False) -> TimeTable:
    """The time table for ``targets`` of an in-memory model, with the rest of its step measured on a
    converted copy (:func:`model_step_ms`)."""
    shapes = [shape_key(d) for d in targets]
    table = measure_time_table(shapes, speed.levels, speed.values, speed.threads, progress=progress)
    return with_other_ms(table, model_step_ms(model, speed.values, speed.threads), shapes)
