"""After every optimizer step, masked weights and optimizer state are exactly 0.

Checked inside the real Trainer (AdamW with weight decay, SGD with momentum, gradient
accumulation, clipping, bf16 autocast) and in a plain loop with fp16 autocast + GradScaler.
"""

import contextlib
import io

import pytest
import torch
from transformers import TrainerCallback

from hf_sparsity import SparsityCallback, SparsityConfig, SparsityEngine

from .conftest import tiny_model
from .trainer_utils import InvariantChecker, make_trainer


def _train(arch, tmp_path, config, **kw):
    model = tiny_model(arch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cb = SparsityCallback(config)
    checker = InvariantChecker(cb)
    trainer = make_trainer(model, tmp_path, [cb, checker], **kw)
    trainer.train()
    return model, cb, checker, before, trainer


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize(
    "mode",
    ["adamw_wd", "sgd_momentum", "accum_clip", "bf16"],
)
def test_invariants_hold_every_step(arch, mode, tmp_path):
    kw = {}
    if mode == "accum_clip":
        kw = dict(gradient_accumulation_steps=3, max_grad_norm=0.01)
    elif mode == "bf16":
        kw = dict(bf16=True)
    config = SparsityConfig(sparsity=0.75, init_method="random", seed=1)
    if mode == "sgd_momentum":
        model = tiny_model(arch)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
        cb = SparsityCallback(config)
        checker = InvariantChecker(cb)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        make_trainer(model, tmp_path, [cb, checker], optimizers=(opt, None)).train()
    else:
        model, cb, checker, before, _ = _train(arch, tmp_path, config, **kw)
    assert checker.checked == 6
    assert checker.state_tensors_checked >= 6 * len(cb.engine.masks)  # momentum / Adam moments were inspected
    for name, mask in cb.engine.masks.items():
        p = model.get_parameter(name).detach()
        assert int((mask == 0).sum()) == round(0.75 * mask.numel())
        assert torch.count_nonzero(p[mask == 0]) == 0
        # The live weights trained (so the check above is not vacuous).
        assert not torch.equal(p[mask == 1], before[name][mask == 1])


def _dense_grads(model, x):
    """Gradients of an untouched copy of ``model`` on batch ``x``."""
    import copy

    ref = copy.deepcopy(model)
    ref(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def test_gradients_are_masked_before_clipping():
    """Clipping sees masked gradients: its total norm is that of the masked gradients, not the dense ones."""
    model = tiny_model("gpt2").eval()  # no dropout: the reference copy sees the same forward
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5))
    eng.build_masks()
    eng.apply()
    x = torch.randint(0, 128, (2, 8))
    dense = _dense_grads(model, x)  # same (masked) weights, no gradient hooks
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eng.attach(opt)  # the public path: attach registers the gradient hooks
    model(input_ids=x, labels=x).loss.backward()
    for name, mask in eng.masks.items():
        g = model.get_parameter(name).grad
        assert torch.count_nonzero(g[mask == 0]) == 0 and torch.count_nonzero(g[mask == 1]) > 0
    masked = {n: g * eng.masks[n] if n in eng.masks else g for n, g in dense.items()}
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in masked.values()]))
    dense_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in dense.values()]))
    got = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    assert float(dense_norm - want) > 1e-3  # the dense norm is measurably larger: the check can fail


class _GradProbe(TrainerCallback):
    """Runs before SparsityCallback in ``on_pre_optimizer_step``: after Trainer's clipping, before the
    engine."""

    def __init__(self, cb):
        self.cb, self.checked = cb, 0

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        for name, mask in self.cb.engine.masks.items():
            g = self.cb.engine.model.get_parameter(name).grad
            assert torch.count_nonzero(g[mask == 0]) == 0, f"{name}: clipping saw an unmasked gradient"
        self.checked += 1


def test_trainer_clips_masked_gradients(tmp_path):
    model = tiny_model("llama")
    cb = SparsityCallback(SparsityConfig(sparsity=0.6, seed=2))
    probe = _GradProbe(cb)
    make_trainer(
        model, tmp_path, [probe, cb], max_steps=3, gradient_accumulation_steps=2, max_grad_norm=0.01
    ).train()
    assert probe.checked == 3


class _Drift(torch.optim.Optimizer):
    """Moves every weight by a constant, whatever its gradient: only re-zeroing after the step keeps masks."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"]).add_(group["lr"])


def test_masked_weights_rezeroed_after_an_optimizer_that_moves_them(tmp_path):
    model = tiny_model("gpt2")
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, seed=4))
    eng.build_masks()
    opt = _Drift(model.parameters())
    eng.attach(opt)
    for _ in range(2):
        x = torch.randint(0, 128, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        for name, mask in eng.masks.items():
            assert torch.count_nonzero(model.get_parameter(name).detach()[mask == 0]) == 0, name
    # Through Trainer too (its callback drives before_step / after_step itself).
    model = tiny_model("llama")
    cb = SparsityCallback(SparsityConfig(sparsity=0.5, seed=4))
    checker = InvariantChecker(cb)
    make_trainer(
        model, tmp_path, [cb, checker], optimizers=(_Drift(model.parameters()), None), max_steps=2
    ).train()
    assert checker.checked == 2


def test_plain_loop_fp16_autocast_with_grad_scaler():
    model = tiny_model("llama")
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.6, init_method="topk"))
    eng.build_masks()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.05, amsgrad=True)
    eng.attach(opt)  # step hooks: no callback, no Trainer
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(4):
        x = torch.randint(0, 128, (2, 8))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=x, labels=x).loss
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        for name, mask in eng.masks.items():
            p = model.get_parameter(name)
            assert torch.count_nonzero(p.detach()[mask == 0]) == 0
            for v in opt.state[p].values():
                if v.shape == p.shape:
                    assert torch.count_nonzero(v[mask == 0]) == 0
    assert eng.optimizer_steps >= 1


@pytest.mark.slow  # a fresh interpreter
def test_masks_identical_across_processes_without_communication():
    """This process and a fresh interpreter, with different weights and global seeds (and this one having
    drawn random numbers before), build the same random masks."""
    import subprocess
    import sys

    code = (
        "from tests.conftest import tiny_model; from hf_sparsity import SparsityConfig, SparsityEngine;"
        "import hashlib, torch; torch.manual_seed({s}); m = tiny_model('llama', seed={s});"
        "e = SparsityEngine(m, SparsityConfig(sparsity=0.7, seed=5)); e.build_masks();"
        "print(hashlib.sha256(b''.join(e.masks[k].numpy().tobytes() for k in sorted(e.masks))).hexdigest())"
    )
    other = subprocess.run(
        [sys.executable, "-c", code.format(s=1)], capture_output=True, text=True, check=True
    )
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as here:
        torch.rand(17)  # this process's generator has moved on
        exec(code.format(s=0), namespace)
    assert here.getvalue() == other.stdout and len(other.stdout.strip()) == 64


@pytest.mark.parametrize("opt_name", ["Adamax", "Adam_always"])
def test_optimizers_outside_the_zero_preserving_set_are_masked_every_step(opt_name):
    model = tiny_model("gpt2")
    mode = "always" if opt_name.endswith("always") else "auto"
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5), state_masking=mode)
    eng.build_masks()
    cls = torch.optim.Adamax if opt_name == "Adamax" else torch.optim.Adam
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1)
    eng.attach(opt)
    assert eng.enforcer.needs_per_step_state_masking(opt)
    for _ in range(3):
        x = torch.randint(0, 128, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        for name, mask in eng.masks.items():
            p = model.get_parameter(name)
            assert torch.count_nonzero(p.detach()[mask == 0]) == 0
            for v in opt.state[p].values():
                if v.shape == p.shape:  # Adamax's exp_inf would hold eps here without re-masking
                    assert torch.count_nonzero(v[mask == 0]) == 0


class _WeightMultiplies(torch.overrides.TorchFunctionMode):
    """In-place multiplies of the given parameters by a 0/1 uint8 mask (the after-step re-zeroing pass;
    AdamW's own weight decay multiplies by a float)."""

    def __init__(self, params):
        super().__init__()
        self.ids, self.count = {id(p) for p in params}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        other = args[1] if len(args) > 1 else None
        if (
            func is torch.Tensor.mul_
            and id(args[0]) in self.ids
            and getattr(other, "dtype", None) == torch.uint8
        ):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "make_opt,every_step",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), False),
        (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.1), False),
        (lambda ps: torch.optim.Adamax(ps, lr=1e-2), True),
        (lambda ps: _Drift(ps), True),
    ],
)
def test_weights_are_rezeroed_after_a_step_only_where_the_optimizer_could_move_them(make_opt, every_step):
    """A zero-preserving optimizer (zero weight, zero state, masked gradient: the update is exactly 0)
    gets no pass over the weights after its step; any other optimizer gets one multiply per target.
    Either way the masked weights are exactly 0 after each of 11 steps."""
    model = tiny_model("llama")
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.6, seed=3))
    eng.build_masks()
    opt = make_opt(model.parameters())
    eng.attach(opt)
    targets = [model.get_parameter(n) for n in eng.masks]
    for _ in range(11):
        x = torch.randint(0, 128, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        with _WeightMultiplies(targets) as seen:
            opt.step()
        opt.zero_grad()
        assert seen.count == (len(targets) if every_step else 0)
        for name, mask in eng.masks.items():
            assert torch.count_nonzero(model.get_parameter(name).detach()[mask == 0]) == 0, name
