"""Per-layer levels for a decoding speed target (SPDY, Frantar & Alistarh, ICML 2022, arXiv:2201.13096).

Three tables and one dynamic program:

* **Time** ``t_l(s)``: milliseconds of layer ``l``'s product at level ``s`` in one decoding step, with
  the given value type (``values=None``: float32, ``"int8"``: int8 values with row scales), on this
  machine and thread count, measured on the model's own step (:func:`~.speed.step_time_table`): the model
  converted as ``hf_sparsity generate`` converts it (``auto``'s choices, the LM head, attention, the loop),
  with the layers of one shape at exactly ``round(s · numel)`` random zeros, against the dense model,
  back to back, in passes over every shape and level; a shape's change of the step over its layer count,
  non-increasing in ``s``, the shapes scaled at each level to the change measured with every targeted
  weight at ``s``.
  The end-to-end model is then ``T(levels) = T_other + Σ_l t_l(s_l)`` (``T_other``: the step's share of
  what is not targeted), and the speed-up over the dense model ``T(0) / T(levels)``.
* **Error** ``e_l(s)``: the relative output error of layer ``l`` pruned at ``s`` by the method,
  ``‖W X − Ŵ_s X‖² / ‖W X‖²`` over the calibration tokens, from one statistic per layer collected in one
  dense pass over the blocks (as OWL's levels are): SparseGPT runs its OBS sweep at every grid level at
  once (the weight's rows stacked once per level: one sweep, one Hessian, one inverse) and the error is
  ``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)`` exactly; Wanda's is the diagonal form
  ``Σ_pruned w_ij² ‖x_j‖² / Σ w_ij² ‖x_j‖²`` (its mask keeps the other weights unchanged).
* **Dynamic program** (:func:`solve_levels`) over all targeted layers: minimize ``Σ_l e_l(s_l)`` subject
  to ``Σ_l t_l(s_l) ≤ B = T(0) / S − T_other``. Time is counted in ``resolution`` buckets of ``B /
  resolution`` (default 10 000), each layer's time rounded *up* to whole buckets, so the real,
  un-discretized budget is never exceeded; the answer is optimal up to one bucket per layer.

The plain program weighs each layer's relative error alike; SPDY's paper refines it with one coefficient
per layer chosen by a short search scored on the calibration loss, run here by default
(:mod:`~.spdy_search`, ``search_steps``).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..masks import lowest_k, num_zeros
from ..utils import SparsityError, torch_threads
from . import methods as M
from .blocks import block_targets, linear_view, run_all
from .spdy_search import (
    DEFAULT_SEARCH_MOVES,
    DEFAULT_SEARCH_STEPS,
    DEFAULT_SEARCH_WINDOWS,
    database_for,
    searcher,
)
from .statistics import InputHessian, InputNorms, StatsHooks

logger = logging.getLogger(__name__)

DEFAULT_LEVELS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
DEFAULT_RESOLUTION = 10_000
VALUES = (None, "float32", "int8")


def check_levels(levels) -> tuple[float, ...]:
    """The candidate level grid: non-empty, every level in ``[0, 1)``; sorted, duplicates dropped."""
    try:
        grid = sorted({float(x) for x in levels})
    except (TypeError, ValueError):
        raise SparsityError(f"--spdy-levels {levels!r}: give numbers, e.g. 0,0.2,0.4,0.6.") from None
    if not grid:
        raise SparsityError("--spdy-levels is empty: give at least one level in [0, 1), e.g. 0,0.3,0.5,0.7.")
    bad = [x for x in grid if not (0.0 <= x < 1.0) or math.isnan(x)]
    if bad:
        raise SparsityError(
            f"--spdy-levels: level {bad[0]} is outside [0, 1); every candidate level must be at least 0 "
            "and below 1."
        )
    return tuple(grid)


def parse_levels(text: str) -> tuple[float, ...]:
    """``"0,0.3,0.5"`` -> the checked grid."""
    try:
        levels = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SparsityError(f"--spdy-levels {text!r}: give numbers with commas, e.g. 0,0.3,0.5.") from None
    return check_levels(levels)


@dataclass
class TimeTable:
    """Milliseconds per batch-1 product for each layer shape (``"OUTxIN"``) at each grid level, the dense
    time of each shape (level 0), and the rest of a decoding step (``other_ms``); ``measured``: the changes
    of the whole step the table was fitted from, per shape (all its layers) and ``"uniform"``, by level."""

    levels: tuple[float, ...]
    ms: dict[str, list[float]]
    dense_ms: dict[str, float]
    other_ms: float = 0.0
    values: str | None = None
    threads: int | None = None
    formats: dict[str, list[str]] = field(default_factory=dict)
    measured: dict[str, list[float]] = field(default_factory=dict)  # the raw changes of the step, by level

    def dense_total(self, shapes: list[str]) -> float:
        return self.other_ms + sum(self.dense_ms[s] for s in shapes)

    def fastest_total(self, shapes: list[str]) -> float:
        return self.other_ms + sum(min(self.ms[s]) for s in shapes)

    def uniform_speedup(self, shapes: list[str], level: float) -> float:
        """The predicted speed-up with every layer at ``level`` (a grid level)."""
        k = self.levels.index(level)
        return self.dense_total(shapes) / (self.other_ms + sum(self.ms[s][k] for s in shapes))

    def to_dict(self) -> dict[str, Any]:
        return {
            "levels": list(self.levels), "values": self.values or "float32", "threads": self.threads,
            "other_ms": round(self.other_ms, 5),
            "ms": {s: [round(x, 5) for x in v] for s, v in self.ms.items()},
            "dense_ms": {s: round(v, 5) for s, v in self.dense_ms.items()},
            "formats": self.formats,
            "measured": {c: [round(x, 5) for x in v] for c, v in self.measured.items()},
        }  # fmt: skip


@dataclass
class SpeedTarget:
    """``--target-speedup``: the decoding speed-up ``speedup`` over the dense model with the same value
    type, per-layer levels chosen from ``levels``; ``table`` (measured when ``None``)."""

    speedup: float
    levels: tuple[float, ...] = DEFAULT_LEVELS
    values: str | None = None
    threads: int | None = None
    resolution: int = DEFAULT_RESOLUTION
    table: TimeTable | None = None
    errors: dict[str, list[float]] | None = None  # a plan's error table, reused (same model, data, grid)
    search_steps: int = (
        DEFAULT_SEARCH_STEPS  # SPDY's coefficient search on the calibration loss (0: the plain program)
    )
    search_windows: int = DEFAULT_SEARCH_WINDOWS  # calibration windows that score each candidate
    search_moves: int = DEFAULT_SEARCH_MOVES  # level moves after the coefficient steps (needs the search)
    database: dict | None = None  # the search's database: kept here (empty), or reused with ``errors``

    def __post_init__(self) -> None:
        check_speedup(self.speedup)
        self.levels = check_levels(self.levels)
        if self.values not in VALUES:
            raise SparsityError(f"--values {self.values!r}: use float32 or int8.")
        if self.values == "float32":
            self.values = None
        if self.threads is not None and self.threads < 1:
            raise SparsityError(f"--threads {self.threads}: use at least 1 thread.")
        if self.resolution < 1:
            raise SparsityError(f"resolution {self.resolution}: use at least 1 time bucket.")
        if self.search_steps < 0:
            raise SparsityError(f"--spdy-search-steps {self.search_steps}: use 0 (no search) or more.")
        if self.search_windows < 1:
            raise SparsityError(f"--spdy-search-windows {self.search_windows}: use at least 1 window.")
        if self.search_moves < 0:
            raise SparsityError(f"--spdy-search-moves {self.search_moves}: use 0 (no moves) or more.")


def check_speedup(speedup: float) -> float:
    if not isinstance(speedup, (int, float)) or math.isnan(speedup) or speedup < 1.0:
        raise SparsityError(
            f"--target-speedup {speedup}: a speed-up below 1 asks for a slower model; give 1 or more "
            "(e.g. --target-speedup 1.5)."
        )
    return float(speedup)


def shape_key(d) -> str:
    """``"OUTxIN"`` of a target in its linear view."""
    shape = tuple(d.shape)
    out_f, in_f = (shape[1], shape[0]) if d.input_dim == 0 else (shape[0], shape[1])
    return f"{out_f}x{in_f}"


# ------------------------------------------------------------------------------------------------ the DP
def solve_levels(times, errors, budget: float, resolution: int = DEFAULT_RESOLUTION) -> list[int]:
    """Indices ``k_l`` minimizing ``Σ_l errors[l][k_l]`` with ``Σ_l times[l][k_l] ≤ budget``.

    Times are counted in ``resolution`` buckets of ``budget / resolution``, each rounded up, so the
    answer never exceeds the real budget; ties go to the lower index. Refuses when no assignment fits.
    """
    t = np.asarray(times, dtype=np.float64)
    e = np.asarray(errors, dtype=np.float64)
    if t.ndim != 2 or t.shape != e.shape or t.shape[0] == 0:
        raise SparsityError("solve_levels: times and errors must be equal [layers, levels] tables.")
    fastest = float(t.min(1).sum())
    if not budget > 0 or fastest > budget:
        raise SparsityError(
            f"No assignment of levels fits the time budget ({budget:.4g} ms; the fastest levels take "
            f"{fastest:.4g} ms): lower --target-speedup or add higher levels."
        )
    best = [int(k) for k in e.argmin(1)]  # each layer's least error (ties: the lower index)
    if float(t[np.arange(len(best)), best].sum()) <= budget:
        return best  # optimal, and exact: no bucket rounding can cost it
    r = int(resolution)
    while r >= 1:
        q = budget / r
        cost = np.ceil(t / q).astype(np.int64)
        choice = _dp(cost, e, r)
        if choice is not None and float(t[np.arange(len(choice)), choice].sum()) <= budget:
            return choice
        r = r - 1 if choice is not None else r * 2  # a float rounding at the edge: one bucket less
        if r > 8 * int(resolution):
            break
    order = np.lexsort((e, t), axis=1)[:, 0]  # each layer's fastest level (ties: the least error)
    if float(t[np.arange(len(order)), order].sum()) <= budget:
        return [int(k) for k in order]  # a budget at the fastest total: buckets rounded up never fit it
    raise SparsityError(
        f"No assignment of levels fits the time budget ({budget:.4g} ms) at this resolution; raise the "
        "resolution or lower --target-speedup."
    )


def _dp(cost: np.ndarray, e: np.ndarray, r: int) -> list[int] | None:
    """Minimum-error choice with ``Σ cost ≤ r`` (``None`` if none); ``dp[b]``: least error at exactly b."""
    L, K = cost.shape
    dp = np.full(r + 1, np.inf)
    dp[0] = 0.0
    pick = np.zeros((L, r + 1), dtype=np.int32)
    for layer in range(L):
        new = np.full(r + 1, np.inf)
        for k in range(K):
            c = int(cost[layer, k])
            if c > r:
                continue
            cand = dp[: r + 1 - c] + e[layer, k]
            better = cand < new[c:]
            new[c:][better] = cand[better]
            pick[layer, c:][better] = k
        dp = new
    if not np.isfinite(dp).any():
        return None
    b = int(np.argmin(dp))  # the least error; among equals the least time
    out = [0] * L
    for layer in range(L - 1, -1, -1):
        k = int(pick[layer, b])
        out[layer] = k
        b -= int(cost[layer, k])
    return out


# ---------------------------------------------------------------------------------------------- errors
@torch.no_grad()
def sparsegpt_level_errors(
    W: torch.Tensor, H: torch.Tensor, counts: list[int], blocksize: int = 128, percdamp: float = 0.01,
    hinv: tuple[torch.Tensor, torch.Tensor] | None = None, name: str = "weight", keep: list | None = None,
) -> list[float]:  # fmt: skip
    """Relative output error ``tr(ΔW H ΔWᵀ) / tr(W H Wᵀ)`` of SparseGPT at each zero count of ``counts``:
    one sweep over the rows of ``W`` stacked once per count (the sweep is row-wise), the same mask and
    update as :func:`~hf_sparsity.pruning.methods.sparsegpt_prune` at each count. ``keep``: a list that
    receives the pruned weight of each count (the search's database)."""
    with torch_threads(1):  # as sparsegpt_prune: its floats
        Hinv, dead = hinv if hinv is not None else M.damped_inverse_cholesky(H, percdamp, name)
        W0 = W.detach().float().clone()
        W0[:, dead] = 0
        rows, cols = W0.shape
        K = len(counts)
        Ws = W0.repeat(K, 1)
        per_block = [M.block_zero_counts(k, rows, cols, blocksize) for k in counts]
        for b, i1 in enumerate(range(0, cols, blocksize)):
            i2 = min(i1 + blocksize, cols)
            W1 = Ws[:, i1:i2].clone()
            Q1 = torch.zeros_like(W1)
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            d1 = torch.diag(Hinv1)
            score = W1**2 / d1.reshape(1, -1) ** 2
            mask1 = torch.cat([lowest_k(score[j * rows : (j + 1) * rows], per_block[j][b]) for j in range(K)])
            for i in range(i2 - i1):
                w = W1[:, i]
                q = w.clone()
                q[mask1[:, i]] = 0
                Q1[:, i] = q
                err = (w - q) / d1[i]
                W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
                Err1[:, i] = err
            Ws[:, i1:i2] = Q1
            Ws[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    Hf = H.float()
    Wd = W.detach().float()
    ref = float(torch.einsum("ij,jk,ik->", Wd, Hf, Wd))
    out = []
    for j in range(K):
        D = Wd - Ws[j * rows : (j + 1) * rows]
        out.append(float(torch.einsum("ij,jk,ik->", D, Hf, D)) / max(ref, 1e-30))
    if keep is not None:
        keep.extend(Ws[j * rows : (j + 1) * rows] for j in range(K))
    return out


def wanda_level_errors(W: torch.Tensor, sq_norm: torch.Tensor, counts: list[int], keep: list | None = None):
    """Wanda's relative error at each zero count: ``Σ_pruned w² ‖x_j‖² / Σ w² ‖x_j‖²`` with Wanda's mask
    (the lowest ``|w|·‖x_j‖`` in each row, :func:`~.methods.prune_per_row`): one sort per row for every
    count (the pruned entries of a row are a prefix of its order), running sums in float64. ``keep``: a
    list that receives the masked weight of each count (the search's database)."""
    score = M.wanda_score(W, sq_norm)
    order = torch.sort(score, dim=1, stable=True).indices
    contrib = (W.detach().double() ** 2) * sq_norm.double().reshape(1, -1)
    run = torch.cumsum(torch.gather(contrib, 1, order), dim=1)
    run = torch.cat([torch.zeros(run.shape[0], 1, dtype=run.dtype), run], dim=1)
    total = max(float(contrib.sum()), 1e-300)
    rows, cols = W.shape
    if keep is not None:
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(cols).expand(rows, cols).contiguous())
        keep.extend(W.detach().float() * (rank >= M.row_counts(k, rows).unsqueeze(1)) for k in counts)
    return [float(run.gather(1, M.row_counts(k, rows).unsqueeze(1)).sum()) / total for k in counts]


def level_errors(method: str, W: torch.Tensor, stat: torch.Tensor, counts: list[int], ctx, name: str,
                 keep: list | None = None):  # fmt: skip
    """The error row of one layer for ``method`` (``sparsegpt`` or ``wanda``) from its statistic."""
    if method == "sparsegpt":
        group = ctx.groups.get(name, name)
        if group not in ctx.inverses:  # Q/K/V and gate/up share one Hessian, so one inverse
            ctx.inverses[group] = M.sparsegpt_inverse(stat, ctx.percdamp, name)
        hinv = ctx.inverses[group]
        return sparsegpt_level_errors(W, stat, counts, ctx.blocksize, ctx.percdamp, hinv, name, keep)
    norms = torch.diagonal(stat) / 2 if stat.dim() == 2 else stat
    return wanda_level_errors(W, norms, counts, keep)


def error_table(
    model, blocks, prefix, targets, chunks, method, ctx_factory, levels, dev, stream, progress=False,
    database: dict | None = None,
):  # fmt: skip
    """``name -> [e(s) for s in levels]`` for every targeted weight inside the blocks, from one dense
    pass over the calibration chunks (each block fed the dense outputs of the one before). ``database``:
    a dict that receives ``name -> [levels, *shape]`` float16, the weight pruned at each level, in the
    parameter's layout (:mod:`~.spdy_search`)."""
    statistic = InputHessian if method == "sparsegpt" else InputNorms
    hidden = [c.hidden for c in chunks]
    table: dict[str, list[float]] = {}
    for i in tqdm(range(len(blocks)), desc="spdy errors", unit="block", disable=not progress):
        block = blocks[i]
        stream.load(i)
        home = next(block.parameters()).device
        block.to(dev)
        ds = block_targets(model, prefix, i, targets)
        mods = {d.name: model.get_submodule(d.name.rsplit(".", 1)[0]) for d in ds}
        hooks = StatsHooks(mods, statistic)
        hidden = run_all(block, chunks, hidden)
        stats = hooks.result()
        ctx = ctx_factory(hooks.group)
        for d in ds:
            W = linear_view(model.get_parameter(d.name), d)
            counts = [num_zeros(s, d.numel) for s in levels]
            keep = [] if database is not None else None
            table[d.name] = level_errors(method, W, stats[d.name], counts, ctx, d.name, keep)
            if keep is not None:
                stack = torch.stack(keep).to("cpu", torch.float16)
                database[d.name] = stack.transpose(1, 2).contiguous() if d.input_dim == 0 else stack
        block.to(home)
        stream.release(i)
    return table


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class SpdyPlan:
    """What the program chose: a level per layer and the speed it predicts."""

    levels: dict[str, float]
    speedup: float
    predicted_speedup: float
    dense_ms: float
    predicted_ms: float
    budget_ms: float
    errors: dict[str, list[float]]
    table: TimeTable
    measured_speedup: float | None = None
    measured_ms: dict[str, float] = field(default_factory=dict)
    search: dict | None = None  # the coefficient search's record (losses, evaluations), when it ran

    def to_dict(self) -> dict[str, Any]:
        """The JSON-simple record kept in ``config.json`` (``_state.oneshot.spdy``)."""
        return {
            "target_speedup": self.speedup, "predicted_speedup": round(self.predicted_speedup, 4),
            "dense_step_ms": round(self.dense_ms, 5), "predicted_step_ms": round(self.predicted_ms, 5),
            "budget_ms": round(self.budget_ms, 5), "levels": {n: round(v, 6) for n, v in self.levels.items()},
            "errors": {n: [round(x, 6) for x in v] for n, v in self.errors.items()},
            "time_table": self.table.to_dict(),
            **({"measured_speedup": round(self.measured_speedup, 4)} if self.measured_speedup else {}),
            **({"search": self.search} if self.search else {}),
        }  # fmt: skip

    def lines(self) -> list[str]:
        """The per-layer levels and the speed-ups, as the command prints them."""
        vt = self.table.values or "float32"
        threads = self.table.threads or torch.get_num_threads()
        out = [
            f"spdy: target {self.speedup:.3g}x over dense {vt} ({threads} threads): predicted "
            f"{self.predicted_speedup:.3f}x (step {self.predicted_ms:.3f} ms of dense "
            f"{self.dense_ms:.3f} ms, other {self.table.other_ms:.3f} ms)"
            + (f", measured {self.measured_speedup:.3f}x" if self.measured_speedup else "")
        ]
        if self.search:
            r = self.search
            out.append(
                f"spdy search: calibration loss {r['loss']:.4f} (dense {r['loss_dense']:.4f}, plain program "
                f"{r['loss_plain']:.4f}"
                + (f", uniform start {r['loss_uniform']:.4f}" if "loss_uniform" in r else "")
                + f"; {r['evaluations']} candidates, {r['windows']} windows"
                + (f"; {r['moves_kept']} of {r['moves']} level moves kept" if r.get("moves") else "")
                + ")"
            )
        out += [f"  {n:<44} {v:.2f}" for n, v in self.levels.items()]
        return out


def reachable(speedup: float, dense_ms: float, fastest_ms: float, levels) -> None:
    """Refuse a target above what the sparsest grid levels reach (one line, naming the fix)."""
    top = dense_ms / max(fastest_ms, 1e-12)
    if speedup > top * (1 + 1e-9):
        raise SparsityError(
            f"--target-speedup {speedup:g} is above what the level grid reaches here: the fastest levels of "
            f"{list(levels)} give {top:.3f}x over dense on this machine. Lower --target-speedup or add "
            "higher levels with --spdy-levels."
        )


def plan_levels(
    names: list[str], shape_of: dict[str, str], errors: dict[str, list[float]], table: TimeTable,
    speedup: float, resolution: int = DEFAULT_RESOLUTION, search=None,
) -> SpdyPlan:  # fmt: skip
    """Solve the program for the layers ``names`` (module docstring). ``search(names, solve, seed,
    within)``: SPDY's search (:func:`~.spdy_search.searcher`), given ``solve(c)`` (the program with layer
    ``l``'s errors scaled by ``c[l]``), the grid index of the lowest uniform level that meets the target
    and ``within(pick)`` (whether level indices keep the budget); returns the level indices and its
    record."""
    shapes = [shape_of[n] for n in names]
    dense = table.dense_total(shapes)
    reachable(speedup, dense, table.fastest_total(shapes), table.levels)
    times = [table.ms[s] for s in shapes]
    t = np.asarray(times, dtype=np.float64)
    # a reachable target (within reachable's 1e-9) never asks less than the fastest levels' time, summed
    # as solve_levels sums it (numpy's pairwise sum and a running sum can differ in the last bit)
    budget = max(dense / speedup - table.other_ms, float(t.min(1).sum()))
    e = np.asarray([errors[n] for n in names], dtype=np.float64)
    record = None
    if search is None:
        pick = solve_levels(times, e, budget, resolution)
    else:
        fits = [k for k, lv in enumerate(table.levels) if table.uniform_speedup(shapes, lv) >= speedup]
        pick, record = search(
            names, lambda c: solve_levels(times, e * np.asarray(c)[:, None], budget, resolution),
            fits[0] if fits else None, lambda p: float(t[np.arange(len(p)), p].sum()) <= budget,
        )  # fmt: skip
    used = table.other_ms + sum(times[i][k] for i, k in enumerate(pick))
    return SpdyPlan(
        levels={n: table.levels[k] for n, k in zip(names, pick)}, speedup=speedup,
        predicted_speedup=dense / used, dense_ms=dense, predicted_ms=used, budget_ms=budget,
        errors={n: errors[n] for n in names}, table=table, search=record,
    )  # fmt: skip


def spdy_counts(model, blocks, prefix, targets, chunks, speed: SpeedTarget, method, ctx_factory, dev, stream,
                progress=False, calibration=None) -> tuple[dict[str, int], SpdyPlan]:  # fmt: skip
    """Zeros per targeted tensor at the levels the program chooses (targets outside the blocks keep the
    config's level: their time is part of ``other_ms``), and the plan. With ``speed.search_steps`` the
    program's coefficients are searched on the loss of ``calibration`` (:mod:`~.spdy_search`)."""
    if tuple(speed.table.levels) != tuple(speed.levels):
        raise SparsityError(
            f"The time table's levels {list(speed.table.levels)} are not the target's {list(speed.levels)}: "
            "measure the table for the same grid."
        )
    inside = [d for i in range(len(blocks)) for d in block_targets(model, prefix, i, targets)]
    if speed.errors is not None:
        errors = speed.errors
        if set(errors) != {d.name for d in inside} or any(
            len(v) != len(speed.levels) for v in errors.values()
        ):
            raise SparsityError(
                "The given error table does not fit: it must have one error per grid level for every "
                "targeted weight in the blocks (a plan's errors for the same model, targets and levels)."
            )
    database = database_for(speed, inside, model, prefix, calibration)
    if database is not None and speed.database is not None:
        database = speed.database  # the caller's: reused as it is, or filled by the error pass below
    reuse = (
        database is not None and speed.errors is not None and set(database) == set(errors)
        and all(len(v) == len(speed.levels) for v in database.values())
    )  # fmt: skip
    if speed.errors is None or (database is not None and not reuse):  # the database comes with the errors
        if database is not None:
            database.clear()
        errors = error_table(model, blocks, prefix, targets, chunks, method, ctx_factory, speed.levels, dev,
                             stream, progress, database)  # fmt: skip
    names = [d.name for d in targets if d.name in errors]
    shape_of = {d.name: shape_key(d) for d in targets}
    search = None
    if database is not None:
        search = searcher(model, blocks, prefix, inside, chunks, calibration, stream, dev, database, errors,
                          speed, progress)  # fmt: skip
    plan = plan_levels(names, shape_of, errors, speed.table, speed.speedup, speed.resolution, search)
    counts = {d.name: num_zeros(plan.levels.get(d.name, float(d.sparsity)), d.numel) for d in targets}
    return counts, plan


__all__ = [
    "DEFAULT_LEVELS",
    "SpdyPlan",
    "SpeedTarget",
    "plan_levels",
    "reachable",
    "shape_key",
    "TimeTable",
    "check_levels",
    "error_table",
    "solve_levels",
    "sparsegpt_level_errors",
    "wanda_level_errors",
]
