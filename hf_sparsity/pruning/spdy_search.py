"""SPDY's search: each layer's error weighed by what it costs the calibration loss.

The dynamic program of :mod:`~.spdy` weighs every layer's relative output error alike, and a layer's
reconstruction error says little about what its level costs the model's loss (Frantar & Alistarh, ICML
2022, arXiv:2201.13096, §3.3: the errors are not comparable across layers). As in the paper, the program
here solves with one coefficient per layer, ``Σ_l c_l · e_l(s_l)``, and a short search chooses the
coefficients whose solution gives the least calibration loss:

* **A database** of every targeted weight pruned by the method at every grid level, each layer alone from
  its dense inputs (SparseGPT's rows come from the same sweep as its errors; Wanda's are its masks), kept
  in float16 beside the model.
* **A candidate's loss**: the database's weights at the candidate's levels stitched into the model, the
  first ``windows`` calibration windows run block by block (from the inputs captured once), the model's
  final norm and LM head, the mean next-token cross-entropy. Every candidate keeps the time budget: it is
  a solution of the program.
* **The search**: two starting points, ``c = 1`` (the plain program) and the uniform profile at the
  lowest grid level ``s_u`` that meets the target, scored as it is, with ``c_l = 1 / e_l(s_u)`` (each
  layer's error there set to 1) as its coefficients; the better one is kept, so the profile found is
  never worse on the calibration loss than that uniform level. Then ``steps`` times a random set of
  coefficients (a quarter of the layers at first, shrinking to one) is scaled by ``exp(N(0, 1))``, the
  program solved, the candidate scored (each distinct assignment once) and the coefficients kept when the
  loss falls.
* **Level moves**: then ``moves`` times, from the best assignment so far, one random layer one grid level
  denser, paid for by one to three random other layers one level sparser each (the first of them that
  brings the predicted time back within the budget), scored and kept when the loss falls. The program's
  solutions move many layers at once and, on a model whose layers' errors mislead it, rarely land near the
  uniform profile; these moves search around the best one found (often the uniform start) directly.

Seeded: the same inputs choose the same levels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from .blocks import block_targets, run_all

logger = logging.getLogger(__name__)

DEFAULT_SEARCH_STEPS = 32
DEFAULT_SEARCH_WINDOWS = 8
DEFAULT_SEARCH_MOVES = 16
_PAY_LAYERS = 3  # at most this many layers one level sparser pay for a layer one level denser
_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_layernorm", "norm_f")


def final_layers(model: nn.Module, prefix: str) -> list[nn.Module] | None:
    """The modules from the last block's output to the logits: the final norm (and OPT's
    ``project_out``) of the blocks' parent, then the LM head; ``None`` when no final norm is found."""
    parent = model.get_submodule(prefix.rsplit(".", 1)[0]) if "." in prefix else model
    norms = [getattr(parent, n) for n in _FINAL_NORMS if isinstance(getattr(parent, n, None), nn.Module)]
    head = model.get_output_embeddings()
    if not norms or head is None:
        return None
    proj = getattr(parent, "project_out", None)
    return [norms[0], *([proj] if isinstance(proj, nn.Module) else []), head]


def database_bytes(targets, levels) -> int:
    """What the database of ``targets`` at ``levels`` holds (float16)."""
    return 2 * len(levels) * sum(int(np.prod(d.shape)) for d in targets)


def available_bytes() -> int | None:
    """The kernel's ``MemAvailable`` (``None`` where there is no ``/proc/meminfo``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass
class CalibrationLoss:
    """The loss of the model with the database's weights at given levels (module docstring)."""

    model: nn.Module
    blocks: nn.ModuleList
    prefix: str
    targets: list
    chunks: list
    labels: list[torch.Tensor]
    stream: object
    dev: torch.device
    database: dict[str, torch.Tensor]
    final: list[nn.Module]
    evaluations: int = 0
    history: list[float] = field(default_factory=list)

    @torch.no_grad()
    def __call__(self, pick: dict[str, int] | None) -> float:
        """Mean next-token cross-entropy with each weight of ``pick`` at its level index (``None``: the
        dense model); the model's weights are the same afterwards."""
        hidden = [c.hidden for c in self.chunks]
        for i, block in enumerate(self.blocks):
            self.stream.load(i)
            home = next(block.parameters()).device
            block.to(self.dev)
            saved = {}
            for d in block_targets(self.model, self.prefix, i, self.targets):
                if pick is not None and d.name in pick:
                    p = self.model.get_parameter(d.name)
                    saved[d.name] = p.detach().clone()
                    p.copy_(self.database[d.name][pick[d.name]].to(p.device, p.dtype))
            hidden = run_all(block, self.chunks, hidden)
            for n, w in saved.items():
                self.model.get_parameter(n).copy_(w)
            block.to(home)
            self.stream.release(i)
        total, count = 0.0, 0
        for h, ids in zip(hidden, self.labels):
            for row in range(h.shape[0]):  # one window at a time: the logits of a batch are large
                x = h[row : row + 1]
                for m in self.final:
                    x = m(x.to(next(m.parameters()).device))
                logits = x[0, :-1].double()
                target = ids[row, 1:].to(logits.device)
                total += float(F.cross_entropy(logits, target, reduction="sum"))
                count += int(target.numel())
        loss = total / max(count, 1)
        if pick is not None:
            self.evaluations += 1
            self.history.append(loss)
        return loss


def search_coefficients(names, errors, solve, score, steps: int, seed_levels: int | None, seed: int = 0,
                        progress: bool = False, within=None,
                        moves: int = 0) -> tuple[list[int], dict]:  # fmt: skip
    """The level indices of the best assignment found, and the search's record.

    ``solve(c)`` -> level indices for coefficients ``c`` (the program); ``score(pick)`` -> the loss of
    ``{name: index}``; ``seed_levels``: the grid index of the uniform start (``None``: none fits);
    ``within(pick)``: whether level indices keep the time budget, for ``moves`` level moves after the
    coefficient steps (none without it)."""
    e = np.asarray([errors[n] for n in names], dtype=np.float64)
    L = len(names)
    seen: dict[tuple[int, ...], float] = {}

    def loss_of(pick: list[int]) -> float:
        key = tuple(pick)
        if key not in seen:
            seen[key] = score(dict(zip(names, pick)))
        return seen[key]

    starts = [("plain", np.ones(L), None)]
    if seed_levels is not None:  # the uniform level itself, scored as it is (it fits the budget)
        starts.append(("uniform", 1.0 / np.maximum(e[:, seed_levels], 1e-12), [seed_levels] * L))
    record = {}
    best_c, best_pick, best_loss = None, None, float("inf")
    for label, c, given in starts:
        pick = given if given is not None else solve(c)
        loss = loss_of(pick)
        record[f"loss_{label}"] = loss
        if loss < best_loss:
            best_c, best_pick, best_loss = c, pick, loss
    rng = np.random.default_rng(seed)
    for step in tqdm(range(steps), desc="spdy search", unit="step", disable=not progress):
        m = max(1, round(L / 4 * (1 - step / max(steps, 1))))
        c = best_c.copy()
        idx = rng.choice(L, size=min(m, L), replace=False)
        c[idx] *= np.exp(rng.normal(0.0, 1.0, size=len(idx)))
        pick = solve(c)
        loss = loss_of(pick)
        if loss < best_loss:
            best_c, best_pick, best_loss = c, pick, loss
    kept, moves = 0, moves if within is not None else 0
    for _ in tqdm(range(moves), desc="spdy moves", unit="move", disable=not progress):
        pick = level_move(best_pick, e.shape[1], within, rng)
        if pick is None:
            break
        loss = loss_of(pick)
        if loss < best_loss:
            best_pick, best_loss, kept = pick, loss, kept + 1
    record.update(steps=steps, moves=moves, moves_kept=kept, evaluations=len(seen), loss=best_loss)
    return best_pick, record


def level_move(pick: list[int], levels: int, within, rng, tries: int = 64) -> list[int] | None:
    """``pick`` with one random layer one level denser (a lower index) and one to ``_PAY_LAYERS`` random
    other layers one level sparser each, as soon as ``within`` says it keeps the budget; ``None`` when
    ``tries`` draws find no such move."""
    L = len(pick)
    denser = [i for i in range(L) if pick[i] > 0]
    for _ in range(tries if denser and L > 1 else 0):
        move = list(pick)
        a = denser[int(rng.integers(len(denser)))]
        move[a] -= 1
        for _ in range(_PAY_LAYERS):
            sparser = [i for i in range(L) if i != a and move[i] < levels - 1]
            if not sparser:
                break
            move[sparser[int(rng.integers(len(sparser)))]] += 1
            if within(move):
                return move
    return None


def database_for(speed, inside, model, prefix: str, calibration) -> dict | None:
    """An empty database when the search runs (``speed.search_steps``, calibration ids, a final norm the
    loss can use, and memory for it), else ``None`` (with one logged line saying why)."""
    if not speed.search_steps or calibration is None:
        return None
    if final_layers(model, prefix) is None:
        logger.warning("spdy: no final norm found beside %s; the plain program chooses the levels.", prefix)
        return None
    need, free = database_bytes(inside, speed.levels), available_bytes()
    if free is not None and need > free // 2:
        logger.warning(
            "spdy: the search's database (%.1f GiB) would take more than half the free memory (%.1f GiB); "
            "the plain program chooses the levels (fewer --spdy-levels make it smaller).",
            need / 2**30, free / 2**30,
        )  # fmt: skip
        return None
    return {}


def searcher(model, blocks, prefix, inside, chunks, calibration, stream, dev, database, errors, speed,
             progress=False):  # fmt: skip
    """The ``search`` of :func:`~.spdy.plan_levels`: scores on the first ``speed.search_windows``
    calibration windows (whole chunks), the dense loss in its record."""
    use, rows = [], 0
    for c in chunks:
        if rows >= speed.search_windows:
            break
        use.append(c)
        rows += c.hidden.shape[0]
    labels = list(calibration[:rows].split([c.hidden.shape[0] for c in use]))
    score = CalibrationLoss(model, blocks, prefix, inside, use, labels, stream, dev, database,
                            final_layers(model, prefix))  # fmt: skip
    dense = score(None)

    def search(names, solve, seed_level, within=None):
        pick, record = search_coefficients(
            names, errors, solve, score, speed.search_steps, seed_level, progress=progress, within=within,
            moves=speed.search_moves,
        )  # fmt: skip
        record.update(loss_dense=dense, windows=rows, history=[round(x, 6) for x in score.history])
        return pick, record

    return search


__all__ = [
    "CalibrationLoss",
    "DEFAULT_SEARCH_MOVES",
    "DEFAULT_SEARCH_STEPS",
    "database_for",
    "final_layers",
    "level_move",
    "search_coefficients",
    "searcher",
]
