"""Sparsity schedules: when the masks change, and to what level, in optimizer steps.

A schedule is compiled against the run's real number of optimizer steps
(``total_steps``, Trainer's ``state.max_steps``) into a sorted list of
:class:`ScheduledEvent`. Nothing is estimated from epochs or dataset sizes, so
the final level is reached exactly, at a step that exists, whatever the run
length (a classic failure of other implementations: schedules computed from an
estimate that drift from the real step count and miss the final level).

An event at step ``t`` fires right after optimizer step ``t`` (when ``t`` steps
are done), so step ``t + 1`` is the first to train with the new masks.

Forms (keys of the ``sparsity`` section, see :class:`~hf_sparsity.mask_engine.config.SparsityConfig`):

* **Explicit list** (``algorithm: static``)::

      schedule:
        - {step: 100, sparsity: 0.9}                 # prune (higher) or regrow (lower)
        - {step: 200, sparsity: 0.5}
        - {step: 300, densify: true}                 # masks removed
        - {step: 120, sparsity: 0.8, rewind_to: 20}  # a prune may rewind the LR schedule

* **IMP** (Renda et al. 2020, arXiv:2003.02389: prune a fraction of the *remaining* weights per
  iteration, retrain, rewinding the LR schedule)::

      schedule: {type: imp, prune_fraction: 0.2, iterations: 8, dense_steps: 100, every: 40, rewind_to: 60}

  ``final_sparsity`` may replace ``prune_fraction``: the per-iteration fraction is
  then derived so the last prune lands exactly on it. ``dense_steps`` and
  ``every`` default to splitting the run into ``iterations + 1`` equal parts.

* **GMP** (``algorithm: gmp``; Zhu & Gupta's cubic schedule)::

      s_t = s_f + (s_i - s_f) * (1 - (t - start) / (stop - start)) ** 3

  at ``t = start, start + freq, ...`` and always at ``stop`` (where ``s_t = s_f``
  exactly). ``update: {freq, start, stop}``; ``stop`` defaults to the last step
  and is clamped to it; ``init_sparsity`` is ``s_i`` (default 0).

* **SET / RigL** (``algorithm: set | rigl``): the level stays fixed; every
  ``freq`` steps in ``[start, stop)`` each tensor drops the lowest-magnitude
  ``d_t`` fraction of its active weights and regrows as many positions (SET:
  random; RigL: largest dense-gradient magnitude), with
  ``d_t = drop_fraction * (1 + cos(pi * (t - start) / (stop - start))) / 2``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..checks import check_level
from ..utils import SparsityError

SCHEDULE_TYPES = ("imp",)
_EXPLICIT_KEYS = {"step", "sparsity", "densify", "rewind_to"}
_IMP_KEYS = {"type", "prune_fraction", "final_sparsity", "iterations", "dense_steps", "every", "rewind_to"}
_UPDATE_KEYS = {"freq", "start", "stop"}
_DROP_KEYS = {"type", "init", "half_period"}


@dataclass(frozen=True)
class ScheduledEvent:
    """One mask change, fired right after optimizer step ``step``.

    ``kind``: ``set_level`` (prune or regrow to ``level``, uniform for all targets),
    ``progress`` (GMP: each tensor moves ``fraction`` of the way from ``init_level`` to
    its configured level), ``densify``, or ``update`` (SET/RigL: drop and regrow
    ``fraction`` of the active weights at a constant level).
    """

    step: int
    kind: str
    level: float | None = None
    fraction: float | None = None
    init_level: float = 0.0
    rewind_to: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def level_for(self, configured: float) -> float | None:
        """The level a tensor configured at ``configured`` has after this event (None: dense)."""
        if self.kind == "densify":
            return None
        if self.kind == "set_level":
            return self.level
        if self.kind == "progress":
            lv = self.init_level + (configured - self.init_level) * self.fraction
            return configured if self.fraction >= 1.0 else lv
        return configured  # update: level unchanged


@dataclass
class Schedule:
    """A compiled schedule: the events of one run, and what each tensor's level is at any step."""

    algorithm: str
    total_steps: int | None
    events: list[ScheduledEvent]
    init_level: float | None = None  # None: each tensor starts at its configured level

    def initial_level(self, configured: float) -> float:
        return configured if self.init_level is None else self.init_level

    def level_at(self, step: int, configured: float) -> float | None:
        """Level after all events at steps <= ``step`` (None: densified)."""
        level: float | None = self.initial_level(configured)
        for e in self.events:
            if e.step > step:
                break
            if e.kind == "update":
                continue
            level = e.level_for(configured)
        return level

    def events_at(self, step: int) -> list[ScheduledEvent]:
        return [e for e in self.events if e.step == step]

    def change_steps(self) -> list[int]:
        """Steps at which a prune/regrow/densify happens (not SET/RigL updates): data reshuffle points."""
        return sorted({e.step for e in self.events if e.kind != "update"})

    def final_level(self, configured: float) -> float | None:
        return self.level_at(self.total_steps or (self.events[-1].step if self.events else 0), configured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "total_steps": self.total_steps,
            "events": [e.to_dict() for e in self.events],
        }


# ---------------------------------------------------------------------- validation (config time)
def _int(value: Any, key: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SparsityError(f"`{key}` must be an integer >= {minimum}, got {value!r}.")
    return value


def _frac(value: Any, key: str, lo: float = 0.0, hi: float = 1.0, hi_open: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        value = float(value)
        ok = lo <= value and (value < hi if hi_open else value <= hi)
    if not ok:
        bracket = ")" if hi_open else "]"
        raise SparsityError(f"`{key}` must be a number in [{lo}, {hi}{bracket}, got {value!r}.")
    return value


def _unknown(d: dict, allowed: set[str], where: str) -> None:
    bad = sorted(set(d) - allowed)
    if bad:
        raise SparsityError(f"Unknown key(s) {bad} in `{where}`. Allowed: {', '.join(sorted(allowed))}.")


def validate_schedule(schedule: Any) -> Any:
    """Check a ``schedule`` value's shape; returns it normalized (a list of dicts, or an IMP dict)."""
    if schedule is None:
        return None
    if isinstance(schedule, dict):
        kind = schedule.get("type")
        if kind not in SCHEDULE_TYPES:
            raise SparsityError(
                f"`schedule.type` = {kind!r} is not known. Use `type: imp`, or give `schedule` as a list of "
                "{step: N, sparsity: S} / {step: N, densify: true} events."
            )
        _unknown(schedule, _IMP_KEYS, "schedule")
        out = dict(schedule)
        if ("prune_fraction" in out) == ("final_sparsity" in out):
            raise SparsityError(
                "An IMP schedule needs exactly one of `prune_fraction` (of the remaining weights per "
                "iteration; 0.2-0.33 in iterative pruning of GPT-3 1.3B after Renda et al. 2020, "
                "arXiv:2003.02389) or `final_sparsity`."
            )
        if "prune_fraction" in out:
            out["prune_fraction"] = _frac(out["prune_fraction"], "schedule.prune_fraction")
            if out["prune_fraction"] <= 0:
                raise SparsityError("`schedule.prune_fraction` must be > 0.")
        else:
            out["final_sparsity"] = check_level(out["final_sparsity"], "schedule.final_sparsity")
        out["iterations"] = _int(out.get("iterations"), "schedule.iterations", 1)
        for k in ("dense_steps", "every"):
            if out.get(k) is not None:
                out[k] = _int(out[k], f"schedule.{k}", 1)
        if out.get("rewind_to") is not None:
            out["rewind_to"] = _int(out["rewind_to"], "schedule.rewind_to", 0)
        return out
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise SparsityError(
            "`schedule` must be a non-empty list of events like {step: 100, sparsity: 0.9} or "
            "{step: 200, densify: true}, or an IMP spec {type: imp, ...}."
        )
    out_list, seen = [], set()
    for i, e in enumerate(schedule):
        if not isinstance(e, dict):
            raise SparsityError(
                f"`schedule[{i}]` must be a mapping like {{step: 100, sparsity: 0.9}}, got {e!r}."
            )
        _unknown(e, _EXPLICIT_KEYS, f"schedule[{i}]")
        step = _int(e.get("step"), f"schedule[{i}].step", 1)
        if step in seen:
            raise SparsityError(f"Two schedule events at step {step}; merge them into one.")
        seen.add(step)
        dens = e.get("densify", False)
        if not isinstance(dens, bool):
            raise SparsityError(f"`schedule[{i}].densify` must be true or false, got {dens!r}.")
        if dens == ("sparsity" in e):
            raise SparsityError(f"`schedule[{i}]` needs exactly one of `sparsity: LEVEL` or `densify: true`.")
        item = {"step": step}
        if dens:
            item["densify"] = True
        else:
            item["sparsity"] = check_level(e["sparsity"], f"schedule[{i}].sparsity")
        if e.get("rewind_to") is not None:
            item["rewind_to"] = _int(e["rewind_to"], f"schedule[{i}].rewind_to", 0)
        out_list.append(item)
    return sorted(out_list, key=lambda x: x["step"])


def validate_update(update: Any) -> dict[str, int] | None:
    if update is None:
        return None
    if not isinstance(update, dict):
        raise SparsityError(f"`update` must be a mapping {{freq: N, start: N, stop: N}}, got {update!r}.")
    _unknown(update, _UPDATE_KEYS, "update")
    out = {"freq": _int(update.get("freq"), "update.freq", 1)}
    if update.get("start") is not None:
        out["start"] = _int(update["start"], "update.start", 0)
    if update.get("stop") is not None:
        out["stop"] = _int(update["stop"], "update.stop", 1)
    if "stop" in out and out["stop"] <= out.get("start", 0):
        raise SparsityError(
            f"`update.stop` ({out['stop']}) must be after `update.start` ({out.get('start', 0)})."
        )
    return out


def validate_drop_fraction(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        _unknown(value, _DROP_KEYS, "drop_fraction")
        out = dict(value)
        out.setdefault("type", "cosine")
        if out["type"] not in ("cosine", "constant"):
            raise SparsityError(f"`drop_fraction.type` = {out['type']!r}: use cosine or constant.")
        out["init"] = _frac(out.get("init"), "drop_fraction.init", hi_open=False)
        if out.get("half_period") is not None:
            out["half_period"] = _int(out["half_period"], "drop_fraction.half_period", 1)
        return out
    return _frac(value, "drop_fraction", hi_open=False)


# ---------------------------------------------------------------------- compilation (run time)
def _check_in_run(step: int, total: int | None, what: str) -> None:
    if total is not None and step > total:
        raise SparsityError(
            f"The schedule's {what} at step {step} comes after the run's last optimizer step ({total}), so "
            "its "
            f"level would never be reached. Train for at least {step} steps (max_steps) or move the event "
            "earlier."
        )


def compile_schedule(config: Any, total_steps: int | None = None) -> Schedule:
    """Turn a :class:`~hf_sparsity.mask_engine.config.SparsityConfig`'s schedule keys into events for a run of
    ``total_steps``.

    ``total_steps`` is needed for GMP/SET/RigL without an explicit ``update.stop`` and
    for IMP without explicit ``dense_steps``/``every``; events after it are refused.
    """
    algo = config.algorithm
    if total_steps is not None:
        total_steps = int(total_steps)
    if algo == "static":
        sched = config.schedule
        if sched is None:
            return Schedule(algo, total_steps, [])
        if isinstance(sched, dict):
            return _compile_imp(sched, total_steps)
        _check_in_run(sched[-1]["step"], total_steps, "last event")
        events = []
        for e in sched:
            if e.get("densify"):
                events.append(ScheduledEvent(e["step"], "densify", rewind_to=e.get("rewind_to")))
            else:
                events.append(
                    ScheduledEvent(e["step"], "set_level", level=e["sparsity"], rewind_to=e.get("rewind_to"))
                )
        return Schedule(algo, total_steps, events)

    upd = dict(config.update or {})
    start = upd.get("start", 0)
    stop = upd.get("stop")
    if stop is None or (total_steps is not None and stop > total_steps):
        if total_steps is None:
            raise SparsityError(
                f"algorithm {algo!r} needs the run length to place its last update: set `update.stop`, or "
                "let the "
                "callback pass Trainer's max_steps."
            )
        stop = total_steps  # clamp: the final level lands on the last real step
    freq = upd.get("freq", max((stop - start) // 10, 1))
    if stop <= start:
        raise SparsityError(f"`update.start` ({start}) must be before the last step ({stop}).")
    if algo == "gmp":
        init = float(config.init_sparsity or 0.0)
        steps = sorted({t for t in range(start, stop, freq) if t >= 1} | {stop})
        events = []
        for t in steps:
            p = 1.0 - (1.0 - (t - start) / (stop - start)) ** 3
            events.append(ScheduledEvent(t, "progress", fraction=1.0 if t == stop else p, init_level=init))
        return Schedule(algo, total_steps, events, init_level=init)
    # set / rigl
    drop = config.drop_fraction if config.drop_fraction is not None else 0.3
    if isinstance(drop, dict):
        d0, kind, half = drop["init"], drop["type"], drop.get("half_period")
    else:
        d0, kind, half = float(drop), "cosine", None
    period = half or (stop - start)
    events = []
    for t in (t for t in range(start, stop, freq) if t >= 1):
        d = (
            d0
            if kind == "constant"
            else d0 * (1.0 + math.cos(math.pi * min((t - start) / period, 1.0))) / 2.0
        )
        if d > 0:
            events.append(ScheduledEvent(t, "update", fraction=d))
    return Schedule(algo, total_steps, events)


def imp_levels(
    prune_fraction: float | None, iterations: int, final_sparsity: float | None = None
) -> list[float]:
    """Level after each IMP iteration: ``1 - (1 - f) ** k``; with ``final_sparsity`` the last is exact."""
    if final_sparsity is not None:
        prune_fraction = 1.0 - (1.0 - final_sparsity) ** (1.0 / iterations)
    levels = [1.0 - (1.0 - prune_fraction) ** k for k in range(1, iterations + 1)]
    if final_sparsity is not None:
        levels[-1] = final_sparsity  # no floating-point drift on the last level
    return levels


def _compile_imp(spec: dict, total_steps: int | None) -> Schedule:
    n = spec["iterations"]
    dense, every = spec.get("dense_steps"), spec.get("every")
    if dense is None or every is None:
        if total_steps is None:
            raise SparsityError(
                "An IMP schedule without `dense_steps` and `every` needs the run length (max_steps)."
            )
        if every is None:
            rest = total_steps - (dense if dense is not None else 0)
            every = max(rest // (n + (1 if dense is None else 0)), 1)
        if dense is None:
            dense = max(total_steps - n * every, 1)
    levels = imp_levels(spec.get("prune_fraction"), n, spec.get("final_sparsity"))
    _check_in_run(dense + (n - 1) * every, total_steps, f"last IMP prune ({n}/{n})")
    events = []
    for k, lv in enumerate(levels):
        t = dense + k * every
        events.append(ScheduledEvent(t, "set_level", level=lv, rewind_to=spec.get("rewind_to")))
    return Schedule("imp", total_steps, events, init_level=0.0)
