"""Levels for a decoding speed target (SPDY): the dynamic program against every assignment, the error table
against pruning each layer directly, exact levels, the time table, and every refusal before anything is
written."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from hf_sparsity import SparsityConfig, SparsityError
from hf_sparsity.mask_engine.targeting import plan_sparsity
from hf_sparsity.pruning import methods as M
from hf_sparsity.pruning import prune_oneshot
from hf_sparsity.pruning.spdy import (
    SpeedTarget,
    TimeTable,
    check_levels,
    plan_levels,
    shape_key,
    solve_levels,
)
from hf_sparsity.pruning.speed import monotone_decreasing

from .conftest import tiny_model


# ------------------------------------------------------------------------------------- the program
def _brute(times, errors, budget):
    """The least total error over every assignment whose real total time fits ``budget`` (None: none)."""
    best = None
    for ks in itertools.product(*[range(len(r)) for r in times]):
        t = sum(times[i][k] for i, k in enumerate(ks))
        if t <= budget:
            e = sum(errors[i][k] for i, k in enumerate(ks))
            if best is None or e < best[0]:
                best = (e, ks)
    return best


def _table(g, layers, levels, integer=False):
    if integer:
        times = torch.randint(1, 20, (layers, levels), generator=g).double()
    else:
        times = torch.rand(layers, levels, generator=g, dtype=torch.float64) * 3 + 0.1
    errors = torch.rand(layers, levels, generator=g, dtype=torch.float64)
    return times.tolist(), errors.tolist()


@pytest.mark.parametrize("seed", range(12))
def test_the_program_finds_the_brute_force_optimum_on_integer_tables(seed):
    """Integer times and one bucket per unit of time: discretizing loses nothing, so the program's choice
    is the optimum over every assignment, and never over the budget."""
    g = torch.Generator().manual_seed(seed)
    layers, levels = 3 + seed % 3, 2 + seed % 3
    times, errors = _table(g, layers, levels, integer=True)
    lo = sum(min(r) for r in times)
    hi = sum(max(r) for r in times)
    budget = float(lo + (hi - lo) * (seed % 4 + 1) // 5)
    ks = solve_levels(times, errors, budget, resolution=int(budget))
    assert len(ks) == layers and all(0 <= k < levels for k in ks)
    assert sum(times[i][k] for i, k in enumerate(ks)) <= budget
    best, _ = _brute(times, errors, budget)
    assert sum(errors[i][k] for i, k in enumerate(ks)) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_the_program_on_real_valued_times_keeps_the_real_budget_and_loses_at_most_a_bucket_a_layer(seed):
    g = torch.Generator().manual_seed(100 + seed)
    layers, levels = 4, 3 + seed % 2
    times, errors = _table(g, layers, levels)
    lo, hi = sum(min(r) for r in times), sum(max(r) for r in times)
    budget = lo + (hi - lo) * float(torch.rand((), generator=g))
    resolution = 50
    ks = solve_levels(times, errors, budget, resolution)
    got_t = sum(times[i][k] for i, k in enumerate(ks))
    got_e = sum(errors[i][k] for i, k in enumerate(ks))
    assert got_t <= budget  # the real, un-discretized budget
    best, _ = _brute(times, errors, budget)
    assert got_e >= best - 1e-12  # nothing beats the optimum
    # rounding each layer's time up costs at most one bucket per layer: at least as good as the optimum
    # with that much less time
    tighter = _brute(times, errors, budget - layers * budget / resolution)
    if tighter is not None:
        assert got_e <= tighter[0] + 1e-12
    # and exactly the optimum of the rounded-up problem (each time in whole buckets, ceil)
    q = budget / resolution
    costs = [[math.ceil(t / q) for t in r] for r in times]
    rounded, _ = _brute(costs, errors, resolution)
    assert got_e == pytest.approx(rounded, abs=1e-12)


def test_the_program_at_exactly_the_dense_time_keeps_every_layer_dense():
    """A budget equal to the least-error assignment's time (a speed-up of 1) fits it exactly, whatever
    the bucket rounding would have cost."""
    times = [[0.3, 0.2, 0.1]] * 5
    errors = [[0.0, 0.1, 0.4]] * 5
    assert solve_levels(times, errors, 1.5, resolution=7) == [0] * 5
    assert solve_levels(times, errors, 1.5 - 1e-9, resolution=7) != [0] * 5


def test_an_impossible_budget_is_refused():
    with pytest.raises(SparsityError, match="No assignment of levels fits"):
        solve_levels([[2.0, 1.0], [2.0, 1.0]], [[0, 1], [0, 1]], 1.9)
    with pytest.raises(SparsityError, match="No assignment of levels fits"):
        solve_levels([[2.0, 1.0]], [[0, 1]], 0.0)
    with pytest.raises(SparsityError, match="equal"):
        solve_levels([[1.0, 2.0]], [[0.0]], 3.0)


@pytest.mark.parametrize(
    "levels, message",
    [((), "empty"), ((0.2, 1.0), "outside"), ((-0.1, 0.5), "outside"), ((0.5, float("nan")), "outside")],
)
def test_a_level_grid_outside_0_1_is_refused(levels, message):
    with pytest.raises(SparsityError, match=message):
        check_levels(levels)
    with pytest.raises(SparsityError, match=message):
        SpeedTarget(1.5, levels)


@pytest.mark.parametrize("s", [0.99, 0.0, -2.0, float("nan")])
def test_a_speedup_below_1_is_refused(s):
    with pytest.raises(SparsityError, match="below 1"):
        SpeedTarget(s)


# ------------------------------------------------------------------------------------- the errors
def _calib(n=4, seqlen=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (n, seqlen), generator=g)


def _dense_inputs(model, names, calib):
    """Each targeted linear's inputs in the dense model (float64 rows), captured by hooks."""
    xs = {}
    hooks = []
    for n in names:
        mod = model.get_submodule(n.rsplit(".", 1)[0])
        hooks.append(
            mod.register_forward_hook(
                lambda m, i, o, n=n: xs.__setitem__(n, i[0].detach().reshape(-1, i[0].shape[-1]).double())
            )
        )
    with torch.no_grad():
        model(calib)
    for h in hooks:
        h.remove()
    return xs


def _linear_weight(model, d):
    w = model.get_parameter(d.name).detach()
    return w.t() if d.input_dim == 0 else w


def _synthetic_table(targets, levels, other=1.0):
    """Time falls with the level, faster for bigger shapes: a table the program has to trade in."""
    shapes = {}
    for d in targets:
        o, i = (d.shape[1], d.shape[0]) if d.input_dim == 0 else d.shape
        shapes[f"{o}x{i}"] = o * i / 1000
    ms = {s: [base * (1 - 0.8 * lv) for lv in levels] for s, base in shapes.items()}
    return TimeTable(tuple(levels), ms, {s: base for s, base in shapes.items()}, other_ms=other)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("method", ["sparsegpt", "wanda"])
def test_the_error_table_equals_pruning_each_layer_at_each_level(arch, method):
    """``e(s)`` of every layer against the layer pruned directly at ``s`` from its dense inputs: SparseGPT's
    sweep (its own update), the true output error in float64; Wanda's diagonal error with its mask
    computed here (lowest |w|·‖x‖ per row)."""
    levels = (0.0, 0.25, 0.5, 0.75)
    model = tiny_model(arch)
    dense = tiny_model(arch).eval()  # dropout off, as the pruner runs it
    calib = _calib()
    targets = [d for d in plan_sparsity(model, _cfg()) if d.sparsify]
    table = _synthetic_table(targets, levels)
    speed = SpeedTarget(1.2, levels, table=table)
    res = prune_oneshot(model, _cfg(), calib, method, speed=speed, batch_size=2)
    errors = res.spdy.errors
    xs = _dense_inputs(dense, [d.name for d in targets], calib)
    assert set(errors) == {d.name for d in targets}
    for d in targets:
        W = _linear_weight(dense, d).double()
        X = xs[d.name]
        for j, s in enumerate(levels):
            k = round(s * W.numel())
            if method == "sparsegpt":
                H = (2 * X.t() @ X / calib.shape[0]).float()
                W_new, pruned = M.sparsegpt_prune(W.float(), H, k)
                assert int(pruned.sum()) == k
                ref = float(((X @ W.t() - X @ W_new.double().t()) ** 2).sum() / ((X @ W.t()) ** 2).sum())
                assert errors[d.name][j] == pytest.approx(ref, rel=2e-3, abs=1e-7), (d.name, s)
            else:
                n2 = (X**2).sum(0) / calib.shape[0]
                score = W.abs() * n2.sqrt()
                rows, cols = W.shape
                pruned = torch.zeros_like(W, dtype=torch.bool)
                for r in range(rows):
                    take = k // rows + (1 if r < k % rows else 0)
                    order = sorted(range(cols), key=lambda c: (float(score[r, c]), c))
                    pruned[r, order[:take]] = True
                contrib = W**2 * n2
                ref = float(contrib[pruned].sum() / contrib.sum())
                assert errors[d.name][j] == pytest.approx(ref, rel=1e-4, abs=1e-9), (d.name, s)


def _cfg():
    from hf_sparsity import SparsityConfig

    return SparsityConfig(sparsity=0.5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_chosen_levels_are_exact_per_layer_and_keep_the_budget(arch):
    levels = (0.0, 0.2, 0.4, 0.6, 0.8)
    model = tiny_model(arch)
    targets = [d for d in plan_sparsity(model, _cfg()) if d.sparsify]
    table = _synthetic_table(targets, levels, other=0.5)
    target = 1.8
    res = prune_oneshot(model, _cfg(), _calib(), "sparsegpt", speed=SpeedTarget(target, levels, table=table))
    plan = res.spdy
    chosen = plan.levels
    assert set(chosen) == {d.name for d in targets}
    assert len(set(chosen.values())) > 1  # a non-uniform answer: the table makes it trade
    used = table.other_ms
    dense = table.other_ms
    for d in targets:
        o, i = (d.shape[1], d.shape[0]) if d.input_dim == 0 else d.shape
        base = o * i / 1000
        dense += base
        used += base * (1 - 0.8 * chosen[d.name])
        mask = res.masks[d.name]
        assert int((mask == 0).sum()) == round(chosen[d.name] * mask.numel()), d.name
        p = model.get_parameter(d.name).detach()
        assert torch.all(p[mask == 0] == 0)
    assert dense / used >= target * (1 - 1e-12)  # the real budget, recomputed here
    assert plan.predicted_speedup == pytest.approx(dense / used)
    record = res.info["spdy"]
    assert record["levels"] == {n: round(v, 6) for n, v in chosen.items()}
    json.dumps(record)  # JSON-simple: config.json keeps it


def test_a_reused_error_table_gives_the_same_masks_and_a_foreign_one_is_refused():
    levels = (0.0, 0.3, 0.6)
    model = tiny_model("llama")
    targets = [d for d in plan_sparsity(model, _cfg()) if d.sparsify]
    table = _synthetic_table(targets, levels, other=0.5)
    first = prune_oneshot(model, _cfg(), _calib(), "wanda", speed=SpeedTarget(1.4, levels, table=table))
    again = prune_oneshot(
        tiny_model("llama"), _cfg(), _calib(), "wanda",
        speed=SpeedTarget(1.4, levels, table=table, errors=first.spdy.errors),
    )  # fmt: skip
    assert again.spdy.levels == first.spdy.levels
    assert all(torch.equal(again.masks[n], first.masks[n]) for n in first.masks)
    with pytest.raises(SparsityError, match="not the target's"):
        prune_oneshot(
            tiny_model("llama"), _cfg(), _calib(), "wanda", speed=SpeedTarget(1.4, (0.0, 0.3), table=table)
        )
    short = {n: v[:2] for n, v in first.spdy.errors.items()}
    missing = dict(list(first.spdy.errors.items())[1:])
    for bad in (short, missing):
        with pytest.raises(SparsityError, match="error table does not fit"):
            prune_oneshot(
                tiny_model("llama"), _cfg(), _calib(), "wanda",
                speed=SpeedTarget(1.4, levels, table=table, errors=bad),
            )  # fmt: skip


def test_a_target_above_the_grid_is_refused_before_pruning():
    levels = (0.0, 0.5)
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    targets = [d for d in plan_sparsity(model, _cfg()) if d.sparsify]
    table = _synthetic_table(targets, levels, other=0.5)  # the fastest levels: 0.6x of each layer
    with pytest.raises(SparsityError, match="above what the level grid reaches"):
        prune_oneshot(model, _cfg(), _calib(), "sparsegpt", speed=SpeedTarget(3.0, levels, table=table))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(method="magnitude"), "needs a layer error"),
        (dict(method="sparsegpt", masks="given"), "--masks gives the levels"),
        (dict(method="sparsegpt", owl=True), "OWL chooses levels"),
    ],
)
def test_speed_targets_refuse_what_chooses_levels_otherwise(kw, message):
    from hf_sparsity.pruning import OWLSettings

    model = tiny_model("llama")
    targets = [d for d in plan_sparsity(model, _cfg()) if d.sparsify]
    if kw.get("masks"):
        kw["masks"] = {d.name: torch.ones(d.shape, dtype=torch.uint8) for d in targets}
    if kw.get("owl"):
        kw["owl"] = OWLSettings()
    speed = SpeedTarget(1.1, (0.0, 0.5), table=_synthetic_table(targets, (0.0, 0.5)))
    with pytest.raises(SparsityError, match=message):
        prune_oneshot(model, _cfg(), _calib(), speed=speed, **kw)


# ------------------------------------------------------------------------------------- the time table
def test_the_monotone_fit_by_hand():
    """Pool adjacent violators, each case computed by hand: the nearest non-increasing sequence."""
    assert monotone_decreasing([3.0, 1.0, 2.0]) == [3.0, 1.5, 1.5]
    assert monotone_decreasing([1.0, 2.0, 3.0]) == [2.0, 2.0, 2.0]
    assert monotone_decreasing([1.0, 3.0], [3.0, 1.0]) == [1.5, 1.5]
    # the anchored level 0 (a huge weight) stays 0: a measured gain of time is pooled into it
    fit = monotone_decreasing([0.0, 0.1, -0.2, -0.1, -0.5], [1e9, 1, 1, 1, 1])
    assert fit == pytest.approx([0.0, 0.0, -0.15, -0.15, -0.5], abs=1e-6)
    assert monotone_decreasing([5.0, 4.0, 4.0, -1.0]) == [5.0, 4.0, 4.0, -1.0]  # already so: unchanged


def _fake_step(key_of, slope, bump=None, joint=None):
    """A decoding step in ms from the model's weights: 1 + each targeted weight's ``slope`` of its shape
    (``key_of``: name -> shape) times its share of non-zeros (a shape's dense layer costs its slope), plus
    ``bump[(shape, level)]`` (a disturbed measurement) when only that shape's layers are sparse, at that
    level, and ``joint[level]`` (what the shapes' sum misses) when every shape sits at that level."""

    def step(model, ids, tokens):
        total, levels = 1.0, {}
        for name, key in key_of.items():
            share = float((model.get_parameter(name) != 0).double().mean())
            total += slope[key] * share
            if share < 1:
                levels[key] = round(1 - share, 3)
        if len(levels) == 1:
            total += sum((bump or {}).get(kv, 0.0) for kv in levels.items())
        if len(levels) == len(set(key_of.values())) and len(set(levels.values())) == 1:
            total += (joint or {}).get(next(iter(levels.values())), 0.0)
        return total

    return step


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_time_table_is_the_model_step_per_shape_and_level(arch, monkeypatch):
    """On a step whose time is known: each shape's change, fitted non-increasing where a sparser level
    was disturbed (slower), then scaled at each level so the shapes sum to the uniform model's measured
    change (which here saves more than the shapes alone); per layer over the layer count; the uniform
    levels' predicted speed-ups the step's own ratios; the dense step split with nothing left below zero."""
    from hf_sparsity.pruning import speed

    model = tiny_model(arch).eval()
    targets = [d for d in plan_sparsity(model, SparsityConfig(sparsity=0.5)) if d.sparsify]
    shapes = [shape_key(d) for d in targets]
    slope = {s: 0.01 * (k + 1) for k, s in enumerate(sorted(set(shapes)))}
    n = {s: shapes.count(s) for s in slope}
    first = sorted(slope)[0]
    monkeypatch.setattr(speed, "sparsify_for_inference", lambda m, *a, **k: m)
    key_of = {d.name: shape_key(d) for d in targets}
    bump = {(first, 0.75): 0.3 * slope[first] * n[first]}  # 0.75 measured as 0.45: slower than 0.5
    joint = {0.25: -0.002, 0.5: -0.004, 0.75: -0.01}
    monkeypatch.setattr(speed, "decode_ms", _fake_step(key_of, slope, bump, joint))
    levels = (0.0, 0.25, 0.5, 0.75)
    table = speed.step_time_table(model, targets, levels, "int8", threads=1, rounds=3, tokens=2)
    step = 1.0 + sum(slope[s] * n[s] for s in slope)
    assert table.dense_total(shapes) == pytest.approx(step) and table.other_ms > 0
    for k, lv in enumerate(levels[1:], 1):
        alone = {s: -slope[s] * n[s] * lv for s in slope}  # each shape's whole change, measured alone
        if lv >= 0.5:  # the disturbed 0.75 pooled with 0.5: (-0.5 - 0.45) / 2 of the shape's slope
            alone[first] = -slope[first] * n[first] * (0.5 + 0.45) / 2
        whole = sum(-slope[s] * n[s] * lv for s in slope) + joint[lv]
        for s in slope:
            per_layer = table.ms[s][k] - table.dense_ms[s]
            assert per_layer == pytest.approx(alone[s] * whole / sum(alone.values()) / n[s], rel=1e-9)
        assert table.uniform_speedup(shapes, lv) == pytest.approx(step / (step + whole), rel=1e-9)
    assert all(table.formats[s] == ["dense"] * len(levels) for s in slope)
    whole = [sum(-slope[s] * n[s] * lv for s in slope) + joint.get(lv, 0.0) for lv in levels]
    assert table.to_dict()["measured"]["uniform"] == pytest.approx(whole, abs=1e-5)


def test_a_change_of_the_machine_speed_mid_table_reaches_every_configuration_alike(monkeypatch):
    """The machine's sparse savings halve after the first half of the measurement: with the pairs spread
    over two passes every shape and level (and the uniform model) gets one pair in each state, so each
    measured change is the median of (x, x / 2), 3/4 of the steady change, at every level alike."""
    from hf_sparsity.pruning import speed

    model = tiny_model("gpt2").eval()
    targets = [d for d in plan_sparsity(model, SparsityConfig(sparsity=0.5)) if d.sparsify]
    shapes = [shape_key(d) for d in targets]
    slope = {s: 0.01 * (k + 1) for k, s in enumerate(sorted(set(shapes)))}
    n = {s: shapes.count(s) for s in slope}
    levels = (0.0, 0.25, 0.5, 0.75)
    steady = _fake_step({d.name: shape_key(d) for d in targets}, slope)
    dense = 1.0 + sum(slope[s] * n[s] for s in slope)
    configs = len(levels[1:]) * (len(slope) + 1)
    calls = []

    def drifting(m, ids, tokens):  # the first pass: 1 warm-up of dense, then per configuration 1 + 2 calls
        calls.append(1)
        t = steady(m, ids, tokens)
        return t if len(calls) <= 1 + 3 * configs else dense + (t - dense) / 2

    monkeypatch.setattr(speed, "sparsify_for_inference", lambda m, *a, **k: m)
    monkeypatch.setattr(speed, "decode_ms", drifting)
    table = speed.step_time_table(model, targets, levels, "int8", threads=1, rounds=2, tokens=2, passes=2)
    assert len(calls) == 1 + 2 * 3 * configs
    measured = table.to_dict()["measured"]
    for k, lv in enumerate(levels[1:], 1):
        for s in slope:
            assert measured[s][k] == pytest.approx(-0.75 * slope[s] * n[s] * lv, abs=1e-5)
        whole = -0.75 * lv * sum(slope[s] * n[s] for s in slope)
        assert measured["uniform"][k] == pytest.approx(whole, abs=1e-5)


@pytest.mark.parametrize("values", [None, "int8"])
def test_the_time_table_converts_the_model_as_generate_does(values, tmp_path, monkeypatch):
    """The real measurement on a tiny model: every shape at every level, a time per product above 0,
    non-increasing in the level, the formats ``auto`` chose recorded."""
    from hf_sparsity.pruning.speed import step_time_table

    monkeypatch.setenv("HF_SPARSITY_PLAN_CACHE", str(tmp_path / "plans.json"))
    model = tiny_model("llama").eval()
    targets = [d for d in plan_sparsity(model, SparsityConfig(sparsity=0.5)) if d.sparsify]
    levels = (0.0, 0.75)
    table = step_time_table(model, targets, levels, values, threads=1, rounds=1, tokens=2)
    assert sorted(table.ms) == sorted({shape_key(d) for d in targets}) and table.values == values
    for s, row in table.ms.items():
        assert len(row) == 2 and 0 < row[1] <= row[0] == table.dense_ms[s]
        assert len(table.formats[s]) == 2 and all(isinstance(f, str) for f in table.formats[s])


# ------------------------------------------------------------------------------------- the command
def _cli(*argv):
    from hf_sparsity.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import GPT2TokenizerFast

    from .conftest import shared_data_dir

    data = shared_data_dir()
    root = tmp_path_factory.mktemp("spdy")
    model_dir = root / "dense"
    tiny_model("llama", vocab=50257, layers=2).save_pretrained(model_dir)
    GPT2TokenizerFast.from_pretrained(data / "tokenizer/gpt2").save_pretrained(model_dir)
    return model_dir, data / "corpus/openwebtext-1000.jsonl"


def test_cli_target_speedup_writes_levels_and_both_speedups(llama_dir, tmp_path, monkeypatch, capsys):
    from hf_sparsity.storage.masks_file import load_masks

    monkeypatch.setenv("HF_SPARSITY_PLAN_CACHE", str(tmp_path / "plans.json"))
    model_dir, calib = llama_dir
    out = tmp_path / "out"
    rc = _cli(
        "prune", model_dir, out, "--method", "sparsegpt", "--target-speedup", 1, "--calib-data", calib,
        "--nsamples", 2, "--seqlen", 16, "--spdy-levels", "0,0.5", "--threads", 1, "--measure-rounds", 1,
        "--refit", "--no-progress",
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert rc == 0
    assert "predicted" in printed and "measured" in printed
    record = json.loads((out / "config.json").read_text())["sparsity"]["_state"]["oneshot"]["spdy"]
    masks, _ = load_masks(out)
    assert set(record["levels"]) == set(masks)
    for name, level in record["levels"].items():
        assert int((masks[name] == 0).sum()) == round(level * masks[name].numel())
        assert f"`{name}` | {level:.2f}" in (out / "README.md").read_text()
    card = (out / "README.md").read_text()
    assert "predicted speed-up" in card and "measured speed-up: " in card and "not measured" not in card
    assert record["time_table"]["levels"] == [0.0, 0.5] and record["time_table"]["threads"] == 1


def test_cli_bad_speed_inputs_are_refused_in_one_line_and_write_nothing(
    llama_dir, tmp_path, tmp_path_factory, monkeypatch, capsys
):
    monkeypatch.setenv("HF_SPARSITY_PLAN_CACHE", str(tmp_path_factory.mktemp("cache") / "plans.json"))
    model_dir, calib = llama_dir
    out = tmp_path / "out"
    base = ("--calib-data", calib, "--nsamples", 2, "--seqlen", 16, "--no-progress", "--threads", 1)
    cases = [
        (("--target-speedup", 0.5), "below 1"),
        (("--target-speedup", 1.5, "--spdy-levels", "0,1"), "outside [0, 1)"),
        (("--target-speedup", 1.5, "--spdy-levels", "0,-0.2"), "outside [0, 1)"),
        (("--target-speedup", 1.5, "--spdy-levels", "0,x"), "give numbers"),
        (("--target-speedup", 1.5, "--sparsity", 0.5), "drop --sparsity"),
        (("--target-speedup", 1.5, "--structure", "2:4"), "drop --sparsity / --structure"),
        (("--target-speedup", 1.5, "--method", "magnitude"), "needs a layer error"),
        (("--target-speedup", 1.5, "--owl"), "OWL chooses levels"),
        (("--values", "int8",), "go with --target-speedup"),
        (("--target-speedup", 1000, "--spdy-levels", "0,0.5"), "above what the level grid reaches"),
        (("--target-speedup", 1.5, "--spdy-search-steps", -1), "--spdy-search-steps -1: use 0"),
        (("--target-speedup", 1.5, "--spdy-search-windows", 0), "--spdy-search-windows 0: use at least 1"),
        (("--target-speedup", 1.5, "--spdy-search-moves", -1), "--spdy-search-moves -1: use 0"),
    ]  # fmt: skip
    for extra, message in cases:
        argv = ("prune", model_dir, out, "--method", "sparsegpt", *base, *extra)
        if "--method" in extra:
            argv = ("prune", model_dir, out, *base, *extra)
        assert _cli(*argv) == 2, extra
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (extra, err)
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_int8_values_survive_a_whole_model_check_that_keeps_every_layer_dense(monkeypatch, tmp_path):
    """The int8 LM head's choice has no measured ratios; a slower whole model (every layer back to its dense
    model: with int8 values the int8 dense GEMV) must still convert (a speed target's dense int8 reference of
    a small model goes through it)."""
    from hf_sparsity.backends.auto import backend, planner
    from hf_sparsity.inference import auto_choices, sparsify_for_inference

    monkeypatch.setenv("HF_SPARSITY_PLAN_CACHE", str(tmp_path / "plans.json"))
    monkeypatch.setattr(
        backend, "_time_whole_model", lambda model, swaps, rounds, tokens, base=(): (0.5, 100.0)
    )
    quick = {"dense": 2.0, "native_dense": 1.5, "bitmask": 1.0}  # layers converted: the check runs

    def measured(fns, *args, **kwargs):
        return {f: quick.get(f.split(":")[0], 1.2) for f in fns}

    monkeypatch.setattr(planner, "interleaved_ms", measured)
    model = tiny_model("llama").eval()
    prune_oneshot(model, 0.5, method="magnitude")
    sparsify_for_inference(model, "auto", masks="zeros", values="int8")
    layers = [c for n, c in auto_choices(model).items() if n.startswith("model.layers.")]
    assert layers and all(
        (c["decode"], c["planned"]["decode"]) == ("native_dense", "bitmask") for c in layers
    )
    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3]]))


def test_a_given_time_table_is_used_as_is_and_one_that_does_not_fit_is_refused(
    llama_dir, tmp_path, monkeypatch
):
    """prune_folder(spdy_table=...): nothing is measured again (the plan is the one the given table makes);
    a table of other levels is refused before anything is written."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_sparsity.pruning import pipeline

    model_dir, calib = llama_dir
    meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    targets = [d for d in plan_sparsity(meta, SparsityConfig(sparsity=0.5)) if d.sparsify]
    table = _synthetic_table(targets, (0.0, 0.5))

    def measured(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(pipeline, "step_time_table", measured)
    monkeypatch.setattr(pipeline, "measure_decode_ms", measured)
    common = dict(method="sparsegpt", calib_data=calib, nsamples=2, seqlen=16, spdy_levels=(0.0, 0.5))
    common.update(measure_rounds=0, threads=1)
    res = pipeline.prune_folder(model_dir, tmp_path / "out", target_speedup=1.2, spdy_table=table, **common)
    assert res.spdy.table is table and res.spdy.predicted_speedup >= 1.2
    with pytest.raises(
        SparsityError, match=r"spdy_table: a table of levels \[0\.0, 0\.6\].*folder_time_table"
    ):
        pipeline.prune_folder(
            model_dir,
            tmp_path / "no",
            target_speedup=1.2,
            spdy_table=_synthetic_table(targets, (0.0, 0.6)),
            **common,
        )
    assert not (tmp_path / "no").exists()


def test_the_sparsest_uniform_rows_own_speed_up_is_planned_on_many_layers():
    """A target at the speed-up the table predicts for every layer at the sparsest level (what a uniform row
    at that level asks) on tables of 30 layers, where a running sum and numpy's pairwise sum of the fastest
    times can differ in the last bit: it is planned, every layer at the sparsest level, never refused."""
    g = torch.Generator().manual_seed(7)
    levels = (0.0, 0.5, 0.8)
    for _ in range(24):
        shapes = [f"{i}x{i}" for i in range(1, 31)]
        ms = {s: sorted((0.01 + 0.19 * torch.rand(3, generator=g, dtype=torch.float64)).tolist())[::-1]
              for s in shapes}  # fmt: skip
        table = TimeTable(levels, ms, {s: ms[s][0] for s in shapes}, other_ms=0.37)
        target = table.dense_total(shapes) / (0.37 + math.fsum(ms[s][2] for s in shapes))
        errors = {s: [0.0, 1.0, 2.0] for s in shapes}
        plan = plan_levels(shapes, {s: s for s in shapes}, errors, table, target)
        assert set(plan.levels.values()) == {0.8}


@pytest.mark.parametrize("seed", range(4))
def test_a_budget_at_exactly_the_fastest_total_gets_the_fastest_levels(seed):
    """The target a uniform row at the sparsest level predicts: the budget is the fastest total itself, which
    buckets rounded up never hold; the only assignments that fit take each layer's fastest level (the least
    error among equally fast ones), as brute force says."""
    g = torch.Generator().manual_seed(100 + seed)
    times, errors = _table(g, 4, 3)
    times[0][1] = times[0][2] = min(times[0])  # two equally fast levels: the one of least error is taken
    budget = sum(min(r) for r in times)
    best = _brute(times, errors, budget)
    assert best is not None
    got = solve_levels(times, errors, budget)
    assert sum(times[i][k] for i, k in enumerate(got)) <= budget
    assert sum(errors[i][k] for i, k in enumerate(got)) == pytest.approx(best[0])
