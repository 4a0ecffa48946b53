"""Scheduled events: exact levels, nothing revived, optimizer state zeroed, regrown weights start at 0."""

import pytest
import torch
from transformers import TrainerCallback

from hf_sparsity import SparsityCallback, SparsityConfig, SparsityEngine, SparsityError
from hf_sparsity.logging_utils import arrange_logging
from hf_sparsity.mask_engine.events import rewind_lr

from .conftest import tiny_model
from .trainer_utils import InvariantChecker, make_trainer


def _check_invariants(engine, opt):
    for name, mask in engine.masks.items():
        p = engine.model.get_parameter(name)
        off = mask == 0
        assert torch.count_nonzero(p.detach()[off]) == 0, f"{name}: masked weight revived"
        for v in opt.state.get(p, {}).values():
            if torch.is_tensor(v) and v.shape == p.shape:
                assert torch.count_nonzero(v[off]) == 0, f"{name}: optimizer state nonzero where masked"


def _loop(config, steps, arch="llama", opt_cls=torch.optim.AdamW, sched=False, on_step=None, seed=0):
    model = tiny_model(arch, seed=seed)
    engine = SparsityEngine(model, config, total_steps=steps)
    engine.build_masks()
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if sched else None
    engine.attach(opt, lr_scheduler=lr_sched)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(2, 128, (4, 16), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        before = {n: m.clone() for n, m in engine.masks.items()}
        opt.step()
        opt.zero_grad()
        if lr_sched is not None:
            lr_sched.step()
        _check_invariants(engine, opt)
        if on_step is not None:
            on_step(engine, opt, before)
    return model, engine, opt, lr_sched


def _exact(engine, level):
    for name, m in engine.masks.items():
        assert int((m == 0).sum()) == round(level * m.numel()), name


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD, torch.optim.Adamax])
def test_prune_keeps_old_zeros_adds_lowest_magnitude(opt_cls):
    cfg = SparsityConfig(sparsity=0.5, init_method="random", schedule=[{"step": 3, "sparsity": 0.8}])
    seen = {}

    def probe(engine, opt, before):
        if engine.optimizer_steps == 3:
            for name, m in engine.masks.items():
                old = before[name]
                assert bool(((old == 0) <= (m == 0)).all())  # previously masked stay masked
                w = engine.model.get_parameter(name).detach()
                assert torch.count_nonzero(w[m == 0]) == 0
            seen["ok"] = True

    _, engine, _, _ = _loop(cfg, 6, opt_cls=opt_cls, on_step=probe)
    assert seen["ok"]
    _exact(engine, 0.8)
    assert [e["kind"] for e in engine.events] == ["prune"]
    ev = engine.events[0]
    assert ev["step"] == 3 and all(
        abs(v["before"] - 0.5) < 1e-3 and abs(v["after"] - 0.8) < 1e-3 for v in ev["layers"].values()
    )


def test_prune_chooses_lowest_magnitude_survivors():
    model = tiny_model("llama")
    cfg = SparsityConfig(sparsity=0.25, schedule=[{"step": 1, "sparsity": 0.6}])
    engine = SparsityEngine(model, cfg, total_steps=2)
    engine.build_masks()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    old = {n: m.clone() for n, m in engine.masks.items()}
    weights = {n: model.get_parameter(n).detach().clone() for n in engine.masks}
    x = torch.randint(2, 128, (2, 8))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()  # lr 0: weights unchanged, event fires
    for name, m in engine.masks.items():
        newly = (old[name] == 1) & (m == 0)
        kept = m == 1
        assert weights[name][newly].abs().max() <= weights[name][kept].abs().min()


def test_regrow_starts_at_zero_with_zero_state_and_trains():
    cfg = SparsityConfig(sparsity=0.8, schedule=[{"step": 3, "sparsity": 0.4}])
    seen = {}

    def probe(engine, opt, before):
        if engine.optimizer_steps == 3:
            for name, m in engine.masks.items():
                regrown = (before[name] == 0) & (m == 1)
                assert int(regrown.sum()) > 0
                p = engine.model.get_parameter(name)
                assert torch.count_nonzero(p.detach()[regrown]) == 0  # start at 0
                for v in opt.state[p].values():
                    if torch.is_tensor(v) and v.shape == p.shape:
                        assert torch.count_nonzero(v[regrown]) == 0  # zeroed state
            seen["regrown"] = {n: (before[n] == 0) & (m == 1) for n, m in engine.masks.items()}

    model, engine, _, _ = _loop(cfg, 6, on_step=probe)
    _exact(engine, 0.4)
    # ... and then they train: regrown weights moved away from 0.
    name = next(iter(engine.masks))
    assert torch.count_nonzero(model.get_parameter(name).detach()[seen["regrown"][name]]) > 0
    assert engine.events[0]["kind"] == "regrow"


def test_densify_removes_masks_and_previously_masked_start_at_zero():
    cfg = SparsityConfig(sparsity=0.9, schedule=[{"step": 2, "densify": True}])
    masked_at_densify = {}

    def probe(engine, opt, before):
        if engine.optimizer_steps == 2:
            assert engine.masks == {} and engine.densified == set(engine.targets)
            for name, old in before.items():
                p = engine.model.get_parameter(name)
                assert torch.count_nonzero(p.detach()[old == 0]) == 0
                masked_at_densify[name] = old == 0

    model, engine, _, _ = _loop(cfg, 5, on_step=probe)
    name = next(iter(masked_at_densify))
    # Dense training revives them from 0 by gradient, as intended.
    assert torch.count_nonzero(model.get_parameter(name).detach()[masked_at_densify[name]]) > 0
    assert engine.events[-1]["kind"] == "densify"
    assert engine.state()["densified"] == sorted(engine.targets)


def test_gmp_reaches_final_level_exactly_on_last_step():
    cfg = SparsityConfig(sparsity=0.7, algorithm="gmp", update={"freq": 2, "start": 1})
    levels = []
    _, engine, _, _ = _loop(
        cfg, 7, on_step=lambda e, o, b: levels.append(sum(e.levels.values()) / len(e.levels))
    )
    _exact(engine, 0.7)
    assert levels == sorted(levels) and levels[0] < 0.7  # monotone, starts low
    assert engine.events[-1]["step"] == 7


@pytest.mark.parametrize("algorithm", ["set", "rigl"])
def test_dynamic_sparsity_keeps_level_and_moves_masks(algorithm):
    cfg = SparsityConfig(sparsity=0.75, algorithm=algorithm, update={"freq": 2}, drop_fraction=0.3)
    changed = {}

    def probe(engine, opt, before):
        if engine.events and engine.events[-1]["step"] == engine.optimizer_steps:
            for name, m in engine.masks.items():
                regrown = (before[name] == 0) & (m == 1)
                changed[name] = changed.get(name, 0) + int(regrown.sum())
                p = engine.model.get_parameter(name)
                assert torch.count_nonzero(p.detach()[regrown]) == 0

    _, engine, _, _ = _loop(cfg, 6, on_step=probe)
    _exact(engine, 0.75)
    assert {e["kind"] for e in engine.events} == {"update"}
    assert sum(changed.values()) > 0
    # Cosine decay: later updates drop less.
    fr = [e["drop_fraction"] for e in engine.events]
    assert fr == sorted(fr, reverse=True) and fr[0] <= 0.3


def test_rigl_regrows_where_dense_gradient_is_largest():
    model = tiny_model("llama")
    cfg = SparsityConfig(sparsity=0.75, algorithm="rigl", update={"freq": 1, "stop": 3}, drop_fraction=0.2)
    engine = SparsityEngine(model, cfg, total_steps=3)
    engine.build_masks()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine.attach(opt)
    x = torch.randint(2, 128, (4, 16))
    old = {n: m.clone() for n, m in engine.masks.items()}
    model(input_ids=x, labels=x).loss.backward()
    dense = {n: engine.enforcer.captured[n].abs().clone() for n in engine.masks}
    opt.step()
    name = next(iter(engine.masks))
    grown = (old[name] == 0) & (engine.masks[name] == 1)
    still = (old[name] == 0) & (engine.masks[name] == 0)
    assert int(grown.sum()) > 0
    assert dense[name][grown].min() >= dense[name][still].max()


def test_lr_rewind_restarts_schedule():
    cfg = SparsityConfig(sparsity=0.5, schedule=[{"step": 4, "sparsity": 0.7, "rewind_to": 1}])
    lrs = []
    _, engine, opt, sched = _loop(
        cfg, 6, sched=True, on_step=lambda e, o, b: lrs.append(o.param_groups[0]["lr"])
    )
    # Steps 1..4 use lr(0..3); the rewind makes step 5 use lr(1), step 6 lr(2).
    assert engine.events[0]["rewind_to"] == 1
    assert sched.last_epoch == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 4)


def test_rewind_lr_refuses_schedulers_without_closed_form():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(SparsityError, match="closed form"):
        rewind_lr(sched, 3)


class _LogRecorder(TrainerCallback):
    """Sees the logs as reporters after the sparsity callback do (TensorBoard, ...)."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.logs.append(dict(logs))


def test_trainer_events_invariants_listeners_and_logs(tmp_path):
    cfg = SparsityConfig(
        sparsity=0.5,
        schedule=[
            {"step": 2, "sparsity": 0.8, "rewind_to": 0},
            {"step": 4, "sparsity": 0.6},
            {"step": 6, "densify": True},
        ],
    )
    cb = SparsityCallback(cfg)
    heard = []
    cb.add_listener(heard.append)
    checker = InvariantChecker(cb)
    recorder = _LogRecorder()
    model = tiny_model("gpt2")
    trainer = make_trainer(
        model, tmp_path, [cb, checker, recorder], max_steps=8, gradient_accumulation_steps=2, logging_steps=1
    )
    arrange_logging(trainer, cb)  # per-layer values are logged once the callback runs ahead of the reporters
    trainer.train()
    assert [e["kind"] for e in heard] == ["prune", "regrow", "densify"]
    assert cb.events == heard and checker.checked == 8
    logs = [h for h in recorder.logs if "loss" in h]
    assert logs[0]["sparsity/total"] == pytest.approx(0.5, abs=1e-3)
    assert logs[2]["sparsity/total"] == pytest.approx(0.8, abs=1e-3)
    assert logs[-1]["sparsity/train_flops"] < logs[-1]["sparsity/dense_equivalent_flops"]
    assert 0 < logs[-1]["sparsity/effective_sparsity"] < 0.8
    assert any(k.startswith("sparsity/layer/") for k in logs[0])


@pytest.mark.slow  # Trainer runs: whole, interrupted and resumed
def test_trainer_resume_mid_schedule_is_bit_identical(tmp_path):
    cfg = SparsityConfig(
        sparsity=0.5, schedule=[{"step": 2, "sparsity": 0.8, "rewind_to": 1}, {"step": 5, "densify": True}]
    )

    def run(out, resume=None, seed=0):
        cb = SparsityCallback(cfg)
        model = tiny_model("llama", seed=seed)
        t = make_trainer(
            model, out, [cb, InvariantChecker(cb)], max_steps=7, save_strategy="steps", save_steps=3
        )
        t.train(resume_from_checkpoint=resume)
        return model, cb

    full, fcb = run(tmp_path / "a")
    resumed, rcb = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-3"), seed=5)
    for (n, p), (_, q) in zip(full.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n
    assert rcb.events == fcb.events
    assert rcb.flops.training_flops == pytest.approx(fcb.flops.training_flops)
    # Resuming after the densify: no masks come back.
    _, dcb = run(tmp_path / "c", resume=str(tmp_path / "a" / "checkpoint-6"), seed=5)
    assert dcb.engine.masks == {}


def test_schedule_beyond_run_is_refused(tmp_path):
    cfg = SparsityConfig(sparsity=0.5, schedule=[{"step": 50, "sparsity": 0.8}])
    trainer = make_trainer(tiny_model("llama"), tmp_path, [SparsityCallback(cfg)], max_steps=4)
    with pytest.raises(SparsityError, match="after the run's last optimizer step"):
        trainer.train()
