"""Schedules: endpoints reached exactly whatever the run length; config forms and errors."""

import pytest

from hf_sparsity import SparsityConfig, SparsityError
from hf_sparsity.mask_engine.schedules import compile_schedule, imp_levels


@pytest.mark.parametrize("total", [7, 10, 99, 1000, 1237])
@pytest.mark.parametrize("freq", [1, 3, 50])
def test_gmp_final_level_exact_at_last_step(total, freq):
    cfg = SparsityConfig(sparsity=0.83, algorithm="gmp", update={"freq": freq})
    s = compile_schedule(cfg, total)
    assert s.events[-1].step == total
    assert s.level_at(total, 0.83) == 0.83
    assert s.level_at(0, 0.83) == 0.0
    levels = [s.level_at(t, 0.83) for t in range(total + 1)]
    assert levels == sorted(levels)  # monotone


def test_gmp_cubic_shape_and_clamped_stop():
    cfg = SparsityConfig(
        sparsity=0.9, algorithm="gmp", init_sparsity=0.1, update={"freq": 10, "start": 0, "stop": 500}
    )
    s = compile_schedule(cfg, 100)  # stop beyond the run: clamped to the last step
    assert s.events[-1].step == 100 and s.level_at(100, 0.9) == 0.9
    mid = s.level_at(50, 0.9)
    assert mid == pytest.approx(0.9 + (0.1 - 0.9) * (1 - 0.5) ** 3)


def test_imp_levels_and_steps():
    assert imp_levels(0.2, 3) == pytest.approx([0.2, 0.36, 0.488])
    lv = imp_levels(None, 7, final_sparsity=0.838)
    assert lv[-1] == 0.838 and lv == sorted(lv)
    cfg = SparsityConfig(
        sparsity=0.8,
        schedule={
            "type": "imp",
            "prune_fraction": 0.3,
            "iterations": 5,
            "dense_steps": 100,
            "every": 40,
            "rewind_to": 60,
        },
    )
    s = compile_schedule(cfg, 300)
    assert [e.step for e in s.events] == [100, 140, 180, 220, 260]
    assert all(e.rewind_to == 60 for e in s.events)
    assert s.level_at(99, 0.8) == 0.0 and s.level_at(300, 0.8) == pytest.approx(1 - 0.7**5)
    assert s.change_steps() == [100, 140, 180, 220, 260]


@pytest.mark.parametrize("total", [11, 60, 301])
def test_imp_split_from_run_length_reaches_final(total):
    cfg = SparsityConfig(sparsity=0.5, schedule={"type": "imp", "final_sparsity": 0.8, "iterations": 4})
    s = compile_schedule(cfg, total)
    assert s.events[-1].step <= total and s.level_at(total, 0.5) == 0.8


def test_imp_event_after_run_is_refused():
    cfg = SparsityConfig(
        sparsity=0.5,
        schedule={"type": "imp", "prune_fraction": 0.2, "iterations": 5, "dense_steps": 100, "every": 50},
    )
    with pytest.raises(SparsityError, match="Train for at least 300 steps"):
        compile_schedule(cfg, 200)


def test_explicit_schedule_levels():
    cfg = SparsityConfig(
        sparsity=0.5,
        schedule=[
            {"step": 30, "densify": True},
            {"step": 10, "sparsity": 0.9},
            {"step": 20, "sparsity": 0.6},
        ],
    )
    s = compile_schedule(cfg, 40)
    assert [e.step for e in s.events] == [10, 20, 30]
    assert [s.level_at(t, 0.5) for t in (0, 9, 10, 25, 30, 40)] == [0.5, 0.5, 0.9, 0.6, None, None]


def test_dynamic_drop_fraction_decays_to_zero_at_stop():
    cfg = SparsityConfig(sparsity=0.9, algorithm="rigl", update={"freq": 10, "stop": 100}, drop_fraction=0.3)
    s = compile_schedule(cfg, 200)
    fr = [e.fraction for e in s.events]
    assert fr[0] == pytest.approx(0.3 * (1 + __import__("math").cos(__import__("math").pi * 10 / 100)) / 2)
    assert fr == sorted(fr, reverse=True) and all(e.step < 100 for e in s.events)
    assert all(s.level_at(t, 0.9) == 0.9 for t in range(0, 201, 17))
    const = SparsityConfig(
        sparsity=0.9, algorithm="set", update={"freq": 10}, drop_fraction={"type": "constant", "init": 0.2}
    )
    assert {e.fraction for e in compile_schedule(const, 100).events} == {0.2}


def test_config_round_trip_with_schedules():
    for cfg in [
        SparsityConfig(
            sparsity=0.8, algorithm="gmp", update={"freq": 5, "start": 2, "stop": 50}, init_sparsity=0.1
        ),
        SparsityConfig(
            sparsity=0.8, algorithm="rigl", update={"freq": 5}, drop_fraction={"init": 0.3, "half_period": 40}
        ),
        SparsityConfig(sparsity=0.8, schedule=[{"step": 5, "densify": True}]),
        SparsityConfig(sparsity=0.8, schedule={"type": "imp", "prune_fraction": 0.2, "iterations": 3}),
    ]:
        again = SparsityConfig.from_json(cfg.to_json())
        assert again == cfg and again.has_schedule
    assert not SparsityConfig(sparsity=0.5).has_schedule


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(algorithm="magic"), "not supported"),
        (dict(schedule=[{"step": 0, "sparsity": 0.5}]), "integer >= 1"),
        (dict(schedule=[{"step": 5}]), "exactly one of"),
        (dict(schedule=[{"step": 5, "sparsity": 1.2}]), "outside"),
        (dict(schedule=[{"step": 5, "sparsity": 0.5}, {"step": 5, "densify": True}]), "Two schedule events"),
        (dict(schedule=[{"step": 5, "level": 0.5}]), "Unknown key"),
        (dict(schedule={"type": "imp", "iterations": 3}), "exactly one of `prune_fraction`"),
        (dict(schedule={"type": "cubic"}), "not known"),
        (dict(algorithm="gmp", schedule=[{"step": 5, "sparsity": 0.5}]), "driven by"),
        (dict(update={"freq": 5}), "need `algorithm: gmp`"),
        (dict(algorithm="rigl", update={"freq": 0}), "update.freq"),
        (dict(algorithm="rigl", update={"freq": 2, "start": 10, "stop": 5}), "must be after"),
        (dict(algorithm="rigl", drop_fraction=1.5), "drop_fraction"),
        (dict(algorithm="gmp", drop_fraction=0.1), "for set/rigl"),
        (dict(algorithm="gmp", init_sparsity=0.9), "higher one"),
        (dict(algorithm="set", update={"every": 5}), "Unknown key"),
    ],
)
def test_bad_schedule_keys_are_refused(kwargs, match):
    with pytest.raises(SparsityError, match=match):
        SparsityConfig(sparsity=0.5, **kwargs)


def test_dynamic_without_run_length_needs_stop():
    cfg = SparsityConfig(sparsity=0.5, algorithm="set", update={"freq": 5})
    with pytest.raises(SparsityError, match="run length"):
        compile_schedule(cfg, None)
    assert compile_schedule(
        SparsityConfig(sparsity=0.5, algorithm="set", update={"freq": 5, "stop": 20})
    ).events
