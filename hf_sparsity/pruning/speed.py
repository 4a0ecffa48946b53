"""The time side of a speed target (:mod:`~hf_sparsity.pruning.spdy`): the decoding step of the model
itself, converted as ``hf_sparsity generate`` converts it, with the layers of one shape at one level.

:func:`step_time_table` measures, for every shape of the targeted weights (``"OUTxIN"``: Q and O share
one, gate and up another) and every grid level ``s``, the step of the model with those layers' weights at
exactly ``round(s · numel)`` random zeros and every other layer dense, converted with ``auto`` in the
given value type, against the dense model's step: the median of ``rounds`` back-to-back differences (a
drift of the machine's speed between rounds cancels in each pair), taken in ``passes`` passes over every
configuration (a change of the machine's speed during the measurement then reaches every configuration
alike, not only those measured after it; a change between whole runs stays: on a shared VM what SmolLM2-135M's
levels past 40% save has moved by up to 2x from one table to the next). It measures the model with every
targeted weight at ``s`` the same way. Each change is made non-increasing in ``s`` (a sparser weight is
never slower: ``auto`` keeps the denser format when it is faster, and fewer values read less) by a monotone
least-squares fit; then at each level the shapes' changes are scaled to sum to the whole model's, so the
table predicts the uniform levels' steps as measured, and the shapes' own measurements divide that change
between them (what the layers of one shape save alone is a few percent of the step; together they are
measured with a margin over the machine's noise). A shape's change per layer is its change over its layer
count. So the table is the step a user decodes, with ``auto``'s own choices, the LM head, attention and
the loop in it, and the cache behaviour of a whole model, not of one layer timed alone. Only differences
enter the program; the dense step is split over the shapes by their share of the weights one step reads
(``other_ms``: the rest).
"""

from __future__ import annotations

import copy
import logging
import statistics
import time
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from ..inference import auto_choices, sparsify_for_inference
from ..inference.decoding import greedy_decode
from ..masks import num_zeros
from ..utils import torch_threads
from .spdy import SpeedTarget, TimeTable, shape_key

logger = logging.getLogger(__name__)

UNIFORM = "uniform"  # every targeted weight at the level together


def monotone_decreasing(values, weights=None) -> list[float]:
    """The non-increasing sequence nearest to ``values`` in weighted least squares (pool adjacent
    violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights if weights is not None else [1.0] * len(values)):
        blocks.append([float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            (m1, w1, c1), (m2, w2, c2) = blocks[-2], blocks[-1]
            blocks[-2:] = [[(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]]
    return [m for m, _, c in blocks for _ in range(c)]


def _with_zeros(model, levels: dict[str, float], seed: int):
    """A float32 copy of ``model`` with each named weight at exactly its level of random zeros."""
    m = copy.deepcopy(model).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, lv in levels.items():
            p = m.get_parameter(name)
            k = num_zeros(lv, p.numel())
            p.view(-1)[torch.randperm(p.numel(), generator=g)[:k]] = 0
    return m


def _converted(model, levels: dict[str, float], values: str | None, seed: int = 0):
    m = _with_zeros(model, levels, seed)
    # no whole-model check: a converted step slower than dense measures so here, and counts as dense
    sparsify_for_inference(m, "auto", masks="zeros", check=False, **({"values": values} if values else {}))
    return m


def _paired_diffs(dense, m, ids, pairs: int, tokens: int, dense_steps: list[float]) -> list[float]:
    """``pairs`` back-to-back differences of the step from ``dense`` to ``m`` (a drift of the machine's
    speed between pairs cancels in each)."""
    diffs = []
    for _ in range(pairs):
        d = decode_ms(dense, ids, tokens)
        diffs.append(decode_ms(m, ids, tokens) - d)
        dense_steps.append(d)
    return diffs


def _measured_changes(model, classes, grid, values, rounds, tokens, progress, passes):
    """``{config: {level: change of the step}}`` for each shape alone and for all of them together
    (``"uniform"``), the formats ``auto`` chose, and every dense step measured. The ``rounds`` pairs of a
    configuration are spread over ``passes`` passes over all of them (the model converted again in each:
    the same zeros, ``auto``'s cached plan), so a change of the machine's speed during the measurement
    reaches every configuration alike instead of the ones measured after it."""
    dense = _converted(model, {}, values)
    ids = torch.arange(1, 9).remainder(int(dense.config.vocab_size)).unsqueeze(0)
    decode_ms(dense, ids, 4)  # warm-up
    dense_fmt = {s: _decode_format(dense, names[0]) for s, names in classes.items()}
    configs = {**classes, UNIFORM: [n for names in classes.values() for n in names]}
    formats = {s: {lv: dense_fmt[s] for lv in (0.0, *grid)} for s in classes}
    dense_steps = [] if grid else [min(decode_ms(dense, ids, tokens) for _ in range(rounds))]
    steps = [(c, lv) for c in configs for lv in grid]
    passes = max(1, min(passes, rounds))
    diffs: dict[tuple[str, float], list[float]] = {k: [] for k in steps}
    bar = tqdm(total=passes * len(steps), desc="spdy time table", unit="model", disable=not progress)
    for p in range(passes):
        pairs = rounds // passes + (p < rounds % passes)
        for i, (c, lv) in enumerate(steps):
            m = _converted(model, dict.fromkeys(configs[c], lv), values, seed=i + 1)
            decode_ms(m, ids, 4)
            diffs[c, lv] += _paired_diffs(dense, m, ids, pairs, tokens, dense_steps)
            if p == 0 and c in classes:
                formats[c][lv] = _decode_format(m, configs[c][0])
            del m
            bar.update()
    bar.close()
    changes = {c: {lv: statistics.median(diffs[c, lv]) for lv in grid} for c in configs}
    return changes, formats, dense_steps


def _fitted(changes: dict[float, float], grid) -> dict[float, float]:
    """Non-increasing in the level, anchored at 0 for the dense weight, never above it."""
    fit = monotone_decreasing([0.0, *(changes[lv] for lv in grid)], [1e9] + [1.0] * len(grid))
    return {lv: min(0.0, x) for lv, x in zip(grid, fit[1:])}  # the anchor holds 0 up to rounding


def step_time_table(
    model, targets, levels, values: str | None = None, threads: int | None = None, rounds: int = 8,
    tokens: int = 32, progress: bool = False, passes: int = 4,
) -> TimeTable:  # fmt: skip
    """The time table of ``targets`` (the targeted weights of the dense ``model``) at ``levels``, measured
    on the model's own decoding step (module docstring)."""
    classes: dict[str, list[str]] = {}
    for d in targets:
        classes.setdefault(shape_key(d), []).append(d.name)
    grid = [lv for lv in levels if lv > 0]
    t0 = time.perf_counter()
    with torch_threads(threads or torch.get_num_threads()):
        changes, formats, dense_steps = _measured_changes(
            model, classes, grid, values, rounds, tokens, progress, passes
        )
    step = statistics.median(dense_steps)
    sizes = {s: int(np.prod([int(x) for x in s.split("x")])) for s in classes}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    read = sum(sizes[s] * len(n) for s, n in classes.items()) + (0 if head is None else head.weight.numel())
    dense_ms = {s: step * sizes[s] / read for s in classes}  # per layer: its share of the weights read
    fits = {s: _fitted(changes[s], grid) for s in classes}
    total = _fitted(changes[UNIFORM], grid)
    alone = {lv: sum(fits[s][lv] for s in classes) for lv in grid}
    scale = {lv: total[lv] / alone[lv] if alone[lv] < 0 else 0.0 for lv in grid}  # sum to the uniform's
    ms = {}
    for s, names in classes.items():
        per = _fitted({lv: fits[s][lv] * scale[lv] for lv in grid}, grid)
        ms[s] = [max(dense_ms[s] + per[lv] / len(names), 1e-6) if lv > 0 else dense_ms[s] for lv in levels]
    other = step - sum(dense_ms[s] * len(n) for s, n in classes.items())
    logger.info("spdy: time table of %d shapes x %d levels on the model's own step (%.3f ms) in %.1f s",
                len(classes), len(grid), step, time.perf_counter() - t0)  # fmt: skip
    return TimeTable(
        levels=tuple(levels), ms=ms, dense_ms=dense_ms, other_ms=other, values=values, threads=threads,
        formats={s: [formats[s][lv] for lv in levels] for s in classes},
        measured={c: [changes[c].get(lv, 0.0) for lv in levels] for c in changes},
    )  # fmt: skip


def _decode_format(model, name: str) -> str:
    """The decode format ``auto`` chose for the layer of weight ``name`` (``"dense"`` when unconverted)."""
    return auto_choices(model).get(name.rsplit(".", 1)[0], {}).get("decode", "dense")


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


def measure_decode_ms(folders: dict[str, Any], values, threads, tokens: int = 32, rounds: int = 5):
    """``name -> ms per token`` of each folder (``{name: (folder, dense)}``) converted as ``hf_sparsity
    generate`` runs it, rounds interleaved, medians."""
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
    return {n: statistics.median(v) for n, v in times.items()}


def table_for_model(model, targets, speed: SpeedTarget, progress: bool = False) -> TimeTable:
    """The time table for ``targets`` of an in-memory dense model (:func:`step_time_table`)."""
    return step_time_table(model, targets, speed.levels, speed.values, speed.threads, progress=progress)
