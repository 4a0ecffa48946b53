"""SPDY's coefficient search: every loss it scores is the model's own loss with each weight pruned alone
at its level (computed here), the least loss is kept, each assignment is scored once, the budget holds,
the model is left as it was, and every branch that turns the search off says why."""

from __future__ import annotations

import copy
import itertools
import logging

import numpy as np
import pytest
import torch

from hf_sparsity import SparsityConfig, SparsityError
from hf_sparsity.mask_engine.targeting import plan_sparsity
from hf_sparsity.pruning import methods as M
from hf_sparsity.pruning import prune_oneshot, spdy_search
from hf_sparsity.pruning.spdy import SpeedTarget, TimeTable, solve_levels
from hf_sparsity.pruning.spdy_search import final_layers, level_move, search_coefficients

from .conftest import tiny_model
from .test_spdy import _dense_inputs

LEVELS = (0.0, 0.25, 0.5, 0.75)


def _calib(n=6, seqlen=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (n, seqlen), generator=g)


def _targets(model):
    return [d for d in plan_sparsity(model, SparsityConfig(sparsity=0.5)) if d.sparsify]


def _shape(d):
    return (d.shape[1], d.shape[0]) if d.input_dim == 0 else tuple(d.shape)


def _table(targets, levels=LEVELS, other=0.5):
    """Time falls with the level, more for bigger shapes: the program has to trade."""
    base = {f"{o}x{i}": o * i / 1000 for o, i in map(_shape, targets)}
    ms = {s: [b * (1 - 0.8 * lv) for lv in levels] for s, b in base.items()}
    return TimeTable(tuple(levels), ms, dict(base), other_ms=other)


def _hf_loss(model, ids):
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def _pruned_alone(dense, d, X, level, method, n):
    """The weight ``d`` pruned at ``level`` from its dense inputs ``X`` (float64 rows), in float16 as the
    database keeps it, in the parameter's layout."""
    w = dense.get_parameter(d.name).detach().double()
    W = w.t() if d.input_dim == 0 else w
    k = round(level * W.numel())
    if method == "sparsegpt":
        W_new, _ = M.sparsegpt_prune(W.float(), (2 * X.t() @ X / n).float(), k)
    else:
        score = W.abs() * ((X**2).sum(0) / n).sqrt()
        rows, cols = W.shape
        W_new = W.clone()
        for r in range(rows):
            take = k // rows + (1 if r < k % rows else 0)
            order = sorted(range(cols), key=lambda c: (float(score[r, c]), c))
            W_new[r, order[:take]] = 0
    W_new = W_new.half().double()
    return W_new.t() if d.input_dim == 0 else W_new


@pytest.mark.parametrize(
    "arch,method",
    [("llama", "sparsegpt"), ("gpt2", "sparsegpt"), ("gpt_neox", "wanda"), ("opt", "sparsegpt")],
)
def test_every_scored_loss_is_the_models_own_loss_at_those_levels(arch, method, monkeypatch):
    """The dense loss and the kept loss against the model's own ``labels=`` loss (the chosen weights
    pruned here, each alone from its dense inputs); the kept loss is the least scored and no worse than
    either start; the budget, recomputed here, holds; each scoring leaves the model's weights as they were."""
    model = tiny_model(arch).eval()
    dense = copy.deepcopy(model)
    calib = _calib()
    targets = _targets(model)
    table = _table(targets)
    unchanged = []
    score = spdy_search.CalibrationLoss.__call__

    def checked(self, pick):
        before = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        out = score(self, pick)
        unchanged.append(all(torch.equal(p, before[n]) for n, p in self.model.named_parameters()))
        return out

    monkeypatch.setattr(spdy_search.CalibrationLoss, "__call__", checked)
    speed = SpeedTarget(1.6, LEVELS, table=table, search_steps=6, search_windows=4, search_moves=5)
    res = prune_oneshot(model, SparsityConfig(sparsity=0.5), calib, method, speed=speed, batch_size=2)
    rec = res.spdy.search
    assert rec["windows"] == 4 and rec["steps"] == 6 and rec["moves"] == 5
    assert f"{rec['moves_kept']} of 5 level moves kept" in "\n".join(res.spdy.lines())
    assert unchanged and all(unchanged)
    ids = calib[:4]
    assert rec["loss_dense"] == pytest.approx(_hf_loss(dense, ids), rel=1e-5)
    xs = _dense_inputs(dense, [d.name for d in targets], calib)
    stitched = copy.deepcopy(dense)
    with torch.no_grad():
        for d in targets:
            p = stitched.get_parameter(d.name)
            p.copy_(_pruned_alone(dense, d, xs[d.name], res.spdy.levels[d.name], method, calib.shape[0]))
    assert rec["loss"] == pytest.approx(_hf_loss(stitched, ids), rel=2e-4)
    assert rec["loss"] == pytest.approx(min(rec["history"]), abs=1e-6)
    assert rec["evaluations"] == len(rec["history"]) >= 2
    assert rec["loss"] <= rec["loss_plain"] and rec["loss"] <= rec.get("loss_uniform", float("inf"))
    dense_ms = table.other_ms + sum(table.dense_ms["{}x{}".format(*_shape(d))] for d in targets)
    used = table.other_ms + sum(
        table.ms["{}x{}".format(*_shape(d))][LEVELS.index(res.spdy.levels[d.name])] for d in targets
    )
    assert dense_ms / used >= 1.6 * (1 - 1e-12)
    for d in targets:  # the final masks are the chosen levels exactly
        assert int((res.masks[d.name] == 0).sum()) == round(
            res.spdy.levels[d.name] * res.masks[d.name].numel()
        )


def test_a_kept_database_is_reused_with_its_errors_and_chooses_the_same(monkeypatch):
    """``SpeedTarget.database``: an empty dict is filled with every targeted weight at every level; given
    back with the plan's errors, the next target runs no error pass and scores the same candidates."""
    from hf_sparsity.pruning import spdy

    model = tiny_model("llama").eval()
    targets = _targets(model)
    table = _table(targets)
    db: dict = {}
    first = SpeedTarget(1.6, LEVELS, table=table, search_steps=4, search_windows=2, database=db)
    cfg = SparsityConfig(sparsity=0.5)
    res = prune_oneshot(copy.deepcopy(model), cfg, _calib(), "sparsegpt", speed=first)
    assert set(db) == {d.name for d in targets} and all(v.shape[0] == len(LEVELS) for v in db.values())

    def no_pass(*a, **k):
        raise AssertionError("the error pass ran again")

    monkeypatch.setattr(spdy, "error_table", no_pass)
    again = SpeedTarget(1.6, LEVELS, table=table, search_steps=4, search_windows=2, errors=res.spdy.errors,
                        database=db)  # fmt: skip
    res2 = prune_oneshot(copy.deepcopy(model), cfg, _calib(), "sparsegpt", speed=again)
    assert res2.spdy.levels == res.spdy.levels and res2.spdy.search["history"] == res.spdy.search["history"]


def _synthetic(seed, layers=6, levels=4):
    g = torch.Generator().manual_seed(seed)
    times = (torch.rand(layers, levels, generator=g, dtype=torch.float64) * 3 + 0.1).sort(1, descending=True)
    errors = torch.rand(layers, levels, generator=g, dtype=torch.float64).sort(1).values
    errors[:, 0] = 0
    sens = torch.logspace(-2, 2, layers, dtype=torch.float64)[torch.randperm(layers, generator=g)]
    t = times.values.tolist()
    budget = sum(r[0] for r in t) * 0.6
    return t, errors.numpy(), sens.numpy(), budget


@pytest.mark.parametrize("seed", range(4))
def test_the_search_keeps_the_least_loss_scores_each_assignment_once_and_keeps_the_budget(seed):
    """Losses that weigh the layers' errors 10⁻² to 10² apart (the plain program weighs them alike):
    the search ends on the least loss it scored, scores no assignment twice, never leaves the budget,
    improves on the plain program where the brute-force optimum does, and the same seed chooses the same."""
    times, errors, sens, budget = _synthetic(seed)
    names = [f"layer{i}" for i in range(len(times))]
    scored = []

    def score(pick):
        ks = tuple(pick[n] for n in names)
        scored.append(ks)
        return float(sum(sens[i] * errors[i, k] for i, k in enumerate(ks)))

    def solve(c):
        return solve_levels(times, errors * np.asarray(c)[:, None], budget, 100_000)

    table = dict(zip(names, errors.tolist()))
    pick, rec = search_coefficients(names, table, solve, score, steps=60, seed_levels=2, seed=seed)
    assert len(scored) == len(set(scored)) == rec["evaluations"]
    losses = [float(sum(sens[i] * errors[i, k] for i, k in enumerate(ks))) for ks in scored]
    assert rec["loss"] == min(losses) == pytest.approx(score(dict(zip(names, pick))))
    assert sum(times[i][k] for i, k in enumerate(pick)) <= budget
    best = min(
        sum(sens[i] * errors[i, k] for i, k in enumerate(ks))
        for ks in itertools.product(range(errors.shape[1]), repeat=len(names))
        if sum(times[i][k] for i, k in enumerate(ks)) <= budget
    )
    assert rec["loss"] >= best - 1e-12
    if rec["loss_plain"] > best + 1e-12:
        assert rec["loss"] < rec["loss_plain"]
    again, _ = search_coefficients(
        names, table, solve, lambda p: score(p), steps=60, seed_levels=2, seed=seed
    )
    assert again == pick


def test_the_uniform_level_is_scored_as_it_is_and_never_beaten_by_a_worse_profile():
    """The uniform start is the uniform level at ``seed_levels`` itself (whatever the program would pick
    for its coefficients), scored once; where it has the least loss of every assignment, the search ends
    on it, and the plain program's profile (which trades the layers' unequal errors) loses to it."""
    names = ["a", "b", "c"]
    errors = {"a": [0.0, 0.1, 0.2, 0.3], "b": [0.0, 0.01, 0.5, 1.0], "c": [0.0, 0.3, 0.35, 2.0]}
    times = [[4.0, 3.0, 2.0, 1.0]] * 3
    e = np.asarray([errors[n] for n in names])
    scored = []

    def score(pick):
        ks = [pick[n] for n in names]
        scored.append(ks)
        return float(sum(abs(k - 2) for k in ks))  # the least loss: every layer at level 2

    def solve(c):
        return solve_levels(times, e * np.asarray(c)[:, None], 6.5, 1000)

    assert solve(1 / e[:, 2]) != [2, 2, 2]  # its coefficients alone solve to another profile
    pick, rec = search_coefficients(names, errors, solve, score, steps=8, seed_levels=2)
    assert scored[1] == [2, 2, 2] and scored.count([2, 2, 2]) == 1
    assert rec["loss_uniform"] == 0.0 < rec["loss_plain"] and scored[0] != [2, 2, 2]
    assert pick == [2, 2, 2] and rec["loss"] == 0.0


def _moves_search(times, budget, loss, steps=0, moves=0, seed=0):
    """search_coefficients on layers whose program errors are all alike (the program cannot tell them
    apart), the uniform start at level 1 where it fits; (pick, record, every scored assignment)."""
    names = [f"l{i}" for i in range(len(times))]
    errors = {n: [float(k) for k in range(len(times[0]))] for n in names}
    e = np.asarray(list(errors.values()))
    scored = []

    def score(pick):
        ks = tuple(pick[n] for n in names)
        scored.append(ks)
        return loss(ks)

    def within(ks):
        return sum(times[i][k] for i, k in enumerate(ks)) <= budget

    def solve(c):
        return solve_levels(times, e * np.asarray(c)[:, None], budget, 1000)

    pick, rec = search_coefficients(names, errors, solve, score, steps=steps, seed_levels=1, seed=seed,
                                    within=within, moves=moves)  # fmt: skip
    return pick, rec, scored


@pytest.mark.parametrize("seed", range(3))
def test_level_moves_reach_the_least_loss_in_the_budget_by_brute_force(seed):
    """Five layers of one shape (a level denser on one and sparser on another keeps the time) and a loss
    convex in each layer's level with weights 0.1 to 10: from the uniform start, with no coefficient
    step, the moves end on the least loss of every assignment within the budget (enumerated here; on such a
    loss a level traded between two layers reaches it), never score an assignment twice or outside the
    budget, end on the least scored loss, and count the moves they kept."""
    g = torch.Generator().manual_seed(seed)
    sens = torch.logspace(-1, 1, 5, dtype=torch.float64)[torch.randperm(5, generator=g)].tolist()
    times, budget = [[4.0, 3.0, 2.0, 1.0]] * 5, 15.0  # every layer at level 1

    def loss(ks):
        return sum(s * k * k for s, k in zip(sens, ks))

    pick, rec, scored = _moves_search(times, budget, loss, moves=120, seed=seed)
    fit = [ks for ks in itertools.product(range(4), repeat=5) if sum(4 - k for k in ks) <= budget]
    assert rec["loss"] == pytest.approx(min(loss(ks) for ks in fit)) == pytest.approx(loss(pick))
    assert rec["loss"] < rec["loss_uniform"] and rec["moves"] == 120 and rec["moves_kept"] >= 1
    assert len(scored) == len(set(scored)) == rec["evaluations"]
    assert all(sum(4 - k for k in ks) <= budget for ks in scored)
    assert rec["loss"] == min(loss(ks) for ks in scored)
    again, _, _ = _moves_search(times, budget, loss, moves=120, seed=seed)
    assert again == pick
    none, rec0, _ = _moves_search(times, budget, loss, moves=0, seed=seed)
    assert rec0["moves_kept"] == 0 and rec0["loss"] == min(rec0["loss_plain"], rec0["loss_uniform"])


def test_a_layer_made_denser_is_paid_for_by_up_to_three_sparser_ones():
    """A layer three times the others' time per level, whose level costs the loss 100 times theirs: one
    level denser on it fits the budget only with three small layers a level sparser each; the moves find
    exactly the least loss of the budget (brute force: the big layer dense, three of the four small ones at
    the sparsest level)."""
    times = [[6.0, 3.0, 0.0]] + [[2.0, 1.0, 0.0]] * 4  # every layer at level 1: 7 ms, the budget

    def loss(ks):
        return 100 * ks[0] + sum(ks[1:])

    pick, rec, scored = _moves_search(times, 7.0, loss, moves=16)
    fit = [ks for ks in itertools.product(range(3), repeat=5) if sum(t[k] for t, k in zip(times, ks)) <= 7.0]
    assert rec["loss"] == min(loss(ks) for ks in fit) == loss(pick) == 7
    assert pick[0] == 0 and sorted(pick[1:]) == [1, 2, 2, 2]
    rng = np.random.default_rng(0)
    assert level_move([1, 1, 1], 3, lambda ks: False, rng) is None  # no move keeps the budget
    assert level_move([0, 0, 0], 3, lambda ks: True, rng) is None  # no layer can be made denser


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox", "opt"])
def test_the_final_layers_are_the_models_final_norm_and_head(arch):
    model = tiny_model(arch)
    expected = {
        "llama": lambda m: [m.model.norm, m.lm_head],
        "gpt2": lambda m: [m.transformer.ln_f, m.lm_head],
        "gpt_neox": lambda m: [m.gpt_neox.final_layer_norm, m.lm_head],
        "opt": lambda m: [m.model.decoder.final_layer_norm, m.lm_head],
    }[arch](model)
    prefix = {"llama": "model.layers", "gpt2": "transformer.h", "gpt_neox": "gpt_neox.layers",
              "opt": "model.decoder.layers"}[arch]  # fmt: skip
    got = final_layers(model, prefix)
    assert len(got) == len(expected) and all(a is b for a, b in zip(got, expected))


def _plain_levels(model, calib, table, steps=0):
    speed = SpeedTarget(1.6, LEVELS, table=table, search_steps=steps)
    return prune_oneshot(model, SparsityConfig(sparsity=0.5), calib, "wanda", speed=speed, batch_size=2).spdy


def test_every_branch_that_turns_the_search_off_runs_the_plain_program_and_says_why(monkeypatch, caplog):
    calib = _calib()
    table = _table(_targets(tiny_model("llama")))
    plain = _plain_levels(tiny_model("llama"), calib, table, steps=0)
    assert plain.search is None
    monkeypatch.setattr(spdy_search, "available_bytes", lambda: 1000)  # the database needs more than half
    with caplog.at_level(logging.WARNING, logger="hf_sparsity.pruning.spdy_search"):
        low = _plain_levels(tiny_model("llama"), calib, table, steps=2)
    assert low.search is None and low.levels == plain.levels
    assert "more than half the free memory" in caplog.text
    monkeypatch.setattr(spdy_search, "available_bytes", lambda: None)  # no /proc/meminfo: the search runs
    assert _plain_levels(tiny_model("llama"), calib, table, steps=2).search is not None
    monkeypatch.setattr(spdy_search, "final_layers", lambda model, prefix: None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_sparsity.pruning.spdy_search"):
        nohead = _plain_levels(tiny_model("llama"), calib, table, steps=2)
    assert nohead.search is None and nohead.levels == plain.levels
    assert "no final norm" in caplog.text


def test_the_plain_start_is_the_plain_programs_choice():
    """The search's ``loss_plain`` is the loss of the levels the program chooses with no search."""
    calib = _calib()
    table = _table(_targets(tiny_model("gpt2")))
    plain = _plain_levels(tiny_model("gpt2"), calib, table, steps=0)
    searched = _plain_levels(tiny_model("gpt2"), calib, table, steps=1)
    dense = tiny_model("gpt2").eval()
    xs = _dense_inputs(dense, list(plain.levels), calib)
    stitched = copy.deepcopy(dense)
    with torch.no_grad():
        for d in _targets(dense):
            stitched.get_parameter(d.name).copy_(
                _pruned_alone(dense, d, xs[d.name], plain.levels[d.name], "wanda", calib.shape[0])
            )
    assert searched.search["loss_plain"] == pytest.approx(_hf_loss(stitched, calib[:6]), rel=2e-4)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(search_steps=-1), "--spdy-search-steps -1: use 0"),
        (dict(search_windows=0), "--spdy-search-windows 0: use at least 1"),
        (dict(search_moves=-1), "--spdy-search-moves -1: use 0"),
    ],
)
def test_bad_search_settings_are_refused_in_one_line(kw, match):
    with pytest.raises(SparsityError, match=match):
        SpeedTarget(1.5, LEVELS, **kw)
