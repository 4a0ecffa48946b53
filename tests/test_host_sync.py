"""The per-step enforcement never waits for the device and never copies a mask.

On a GPU, a host read of a tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``,
``nonzero()``, ``torch.equal``, boolean-mask indexing, ``.cpu()``) stalls the step until every queued
kernel has run, and a ``.to(device)`` copies across the bus. The training hooks (gradient hooks,
``before_step`` / ``after_step``, the callback's optimizer-step events) must do neither on a step
without a sparsity event; an event (prune, regrow), logging and saving may.

On the CPU nothing waits, so the tests record the calls instead: a ``TorchFunctionMode`` sees every
tensor operation, and each one that would wait for (or copy to or from) a CUDA device is kept when
the code that issued it is the library's own (the first caller outside torch lives in
``hf_sparsity/``). Torch's optimizers and Trainer's own bookkeeping are not the library's business
here. The ``gpu`` test runs the same steps on CUDA under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

import hf_sparsity
from hf_sparsity import SparsityCallback, SparsityConfig, SparsityEngine

from .realistic import realistic_model
from .trainer_utils import make_trainer

PACKAGE = str(Path(hf_sparsity.__file__).resolve().parent)
TORCH = str(Path(torch.__file__).resolve().parent)

# Tensor operations that read a value on the host: on CUDA each waits for the device.
HOST_READS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "argwhere",
    "is_nonzero",
    "equal",
    "allclose",
    "masked_select",
    "unique",
    "unique_consecutive",
    "repeat_interleave",
    "cpu",
    "cuda",
}
PLACEMENTS = {"to", "tensor", "as_tensor"}  # a copy between devices when given a device
BOOL_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


def _names_a_device(args, kwargs) -> bool:
    values = list(args) + list(kwargs.values())
    return any(isinstance(v, torch.device) or (isinstance(v, str) and _is_device(v)) for v in values)


def _is_device(s: str) -> bool:
    try:
        torch.device(s)
    except (RuntimeError, TypeError):
        return False
    return True


def _has_bool_tensor(obj) -> bool:
    if torch.is_tensor(obj):
        return obj.dtype == torch.bool
    if isinstance(obj, (tuple, list)):
        return any(_has_bool_tensor(o) for o in obj)
    return False


class HostWork(TorchFunctionMode):
    """Records every host read or device placement the library issues, keyed by ``self.step``."""

    def __init__(self):
        super().__init__()
        self.step: object = "setup"
        self.calls: dict[object, list[str]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        syncs = (
            name in HOST_READS
            or (name in PLACEMENTS and _names_a_device(args[1:] if name == "to" else args, kwargs))
            or (name in BOOL_INDEXING and len(args) > 1 and _has_bool_tensor(args[1]))
        )
        if syncs:
            where = _library_caller()
            if where is not None:
                self.calls.setdefault(self.step, []).append(f"{name} at {where}")
        if func is torch.Tensor.backward:  # the library's gradient hooks run inside: watch them too
            return self._backward(*args, **kwargs)
        return func(*args, **kwargs)

    def _backward(self, loss, gradient=None, retain_graph=None, create_graph=False, inputs=None):
        """``loss.backward()`` with this mode on while the autograd engine runs the hooks.

        A mode is off while the call it intercepted runs, and ``Tensor.backward`` /
        ``torch.autograd.backward`` hand themselves to the mode again when it is on, so the
        engine is called the way ``torch.autograd.backward`` calls it (one tensor, no outputs).
        """
        grad = torch.ones_like(loss) if gradient is None else gradient
        keep = create_graph if retain_graph is None else retain_graph
        with self:
            torch.autograd.graph._engine_run_backward(
                (loss,),
                (grad,),
                keep,
                create_graph,
                tuple(inputs or ()),
                allow_unreachable=True,
                accumulate_grad=True,
            )

    def at(self, step) -> list[str]:
        return self.calls.get(step, [])


def _library_caller() -> str | None:
    """``file:line`` of the first caller outside torch (and this file), when it is the library's code."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(TORCH) or path == __file__:
            frame = frame.f_back
            continue
        if path.startswith(PACKAGE):
            return f"{Path(path).relative_to(PACKAGE).as_posix()}:{frame.f_lineno}"
        return None
    return None


# Where an event's host work may come from: building the new masks and placing them.
EVENT_FILES = (
    "masks.py",
    "mask_engine/events.py",
    "mask_engine/engine.py",
    "mask_engine/enforcement.py",
    "mask_engine/mask_state.py",
)


def _batch(seed: int, batch: int = 3, width: int = 12, vocab: int = 101):
    """A padded batch: real lengths differ per row (and per seed), an attention_mask marks them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (batch, width), generator=g)
    lengths = torch.tensor([width - (seed + 3 * r) % 8 for r in range(batch)])
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, 1)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _check_invariants(engine: SparsityEngine, opt: torch.optim.Optimizer) -> int:
    """Masked weights and weight-shaped optimizer state exactly 0; returns how many state tensors it saw."""
    seen = 0
    for name, mask in engine.masks.items():
        p = engine.model.get_parameter(name)
        off = mask == 0
        assert torch.count_nonzero(p.detach()[off]) == 0, name
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape:
                assert torch.count_nonzero(v[off]) == 0, f"{name}: {k}"
                seen += 1
    return seen


def test_the_recorder_sees_host_reads_of_the_library_inside_hooks_and_not_torchs_own(monkeypatch):
    """The recorder is not blind: a host read planted in the library's gradient hook (run by the
    autograd engine) and in its step hook is caught, with its place; torch's own ``.item()`` is not."""
    import hf_sparsity.mask_engine.enforcement as enforcement

    # A version of the end-of-backward masking that reads a gradient's sum on the host, compiled as
    # library code (it runs inside the autograd engine, as a callback the gradient hooks queue).
    namespace: dict = {"torch": torch}
    src = "def _foreach_mask(gs, ms):\n    gs[0].sum().item()\n    torch._foreach_mul_(gs, ms)\n"
    exec(compile(src, enforcement.__file__, "exec"), namespace)  # noqa: S102  (test-only probe)
    monkeypatch.setattr(enforcement, "_foreach_mask", namespace["_foreach_mask"])

    model = realistic_model("llama").train()
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="random", seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine.start(opt)
    rec = HostWork()
    with rec:
        rec.step = 1
        model(**_batch(0)).loss.backward()
        torch.ones(2).sum().item()  # this file's own read: not the library's
        rec.step = 2
        opt.step()
        hf_sparsity.masks.mask_level(torch.ones(4, dtype=torch.uint8))  # float(tensor) in masks.py
    in_enforcement = [c.startswith("item at mask_engine/enforcement.py:") for c in rec.at(1)]
    assert rec.at(1) and all(in_enforcement), rec.calls
    assert len(rec.at(1)) == 1  # once per backward: one pass over every masked weight's gradient
    assert rec.at(2) == [rec.at(2)[0]] and rec.at(2)[0].startswith("__float__ at masks.py:"), rec.calls


@pytest.mark.parametrize(
    "make_opt",
    [
        pytest.param(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), id="adamw-fused"
        ),
        pytest.param(
            lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True), id="adamw-foreach"
        ),
        # Adamax: not zero-preserving, so its state is re-masked on every step (the other branch).
        pytest.param(lambda ps: torch.optim.Adamax(ps, lr=1e-2, foreach=True), id="adamax-every-step"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), id="sgd-momentum"),
    ],
)
def test_steps_without_an_event_do_no_host_work_in_a_plain_loop(make_opt):
    """14 optimizer steps (events at 4 and 11) through the engine's own step hooks: no host read and
    no device copy from the library on the other 12; the events' host work comes from building
    and placing the new masks."""
    model = realistic_model("llama", kv_heads=1, heads=4, head_dim=12).train()
    config = SparsityConfig(
        sparsity=0.5,
        init_method="random",
        seed=3,
        schedule=[{"step": 4, "sparsity": 0.7}, {"step": 11, "sparsity": 0.8}],
    )
    engine = SparsityEngine(model, config, total_steps=14)
    opt = make_opt(model.parameters())
    engine.start(opt)
    rec, states = HostWork(), 0
    with rec:
        for step in range(1, 15):
            rec.step = step
            model(**_batch(step)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            rec.step = "check"
            states += _check_invariants(engine, opt)
    assert engine.optimizer_steps == 14 and [e["step"] for e in engine.events] == [4, 11]
    assert engine.levels and all(abs(v - 0.8) < 0.01 for v in engine.levels.values())
    quiet = {s: rec.at(s) for s in range(1, 15) if s not in (4, 11)}
    assert all(not calls for calls in quiet.values()), {s: c for s, c in quiet.items() if c}
    for s in (4, 11):
        assert rec.at(s), f"the event at step {s} recorded no host work: the recorder missed it"
        assert all(c.split(" at ")[1].split(":")[0] in EVENT_FILES for c in rec.at(s)), rec.at(s)
    if not isinstance(opt, torch.optim.SGD) or opt.defaults["momentum"]:
        assert states >= 14 * len(engine.masks)  # the invariants looked at optimizer state


class _Steps(TrainerCallback):
    """Tells the recorder which optimizer step is running (Trainer's 1-based count)."""

    def __init__(self, rec: HostWork):
        self.rec = rec

    def on_step_begin(self, args, state, control, **kwargs):
        self.rec.step = state.global_step + 1

    def on_step_end(self, args, state, control, **kwargs):
        self.rec.step = f"after {state.global_step}"


class _Padded(torch.utils.data.Dataset):
    """``n`` padded samples: a run of ``n / batch`` steps reads each once, in whatever order."""

    def __init__(self, n: int):
        self.items = []
        for i in range(n):
            b = _batch(i, batch=1)
            self.items.append({k: v[0] for k, v in b.items()})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_steps_without_an_event_do_no_host_work_under_trainer(tmp_path, optim):
    """Trainer + SparsityCallback, counting tokens from padded batches (the default): on the 11 steps
    without an event the callback, its gradient hooks and its token count do no host read and no
    device copy (the token count stays on the device until a number is needed); the FLOP count
    at the end is exact."""
    max_steps, event = 12, 10
    model = realistic_model("llama").train()
    config = SparsityConfig(
        sparsity=0.5, init_method="random", seed=1, schedule=[{"step": event, "sparsity": 0.75}]
    )
    cb = SparsityCallback(config)
    rec = HostWork()
    dataset = _Padded(max_steps * 3)
    trainer = make_trainer(
        model,
        tmp_path,
        [cb, _Steps(rec)],
        dataset=dataset,
        max_steps=max_steps,
        per_device_train_batch_size=3,
        optim=optim,
        max_grad_norm=1.0,
    )
    with rec:
        trainer.train()
    quiet = {s: rec.at(s) for s in range(1, max_steps + 1) if s != event}
    between = {s: rec.at(f"after {s}") for s in range(1, max_steps)}
    assert all(not c for c in quiet.values()), {s: c for s, c in quiet.items() if c}
    assert all(not c for c in between.values()), {s: c for s, c in between.items() if c}
    assert rec.at(event), "the event step recorded no host work: the recorder missed it"
    assert [e["step"] for e in cb.events] == [event]
    # Every real token of the batches Trainer fed, counted once (computed from the dataset here).
    real = sum(int(it["attention_mask"].sum()) for it in dataset.items)
    assert real < max_steps * 3 * 12  # padding was left out
    assert cb.flops.tokens == real


def test_masked_lora_steps_do_no_host_work():
    """``lora: masked`` applies ``(B·A) ⊙ M`` in every forward: the mask sits beside the weight and is
    neither copied nor cast per forward; the adapter trains (its update is masked)."""
    peft = pytest.importorskip("peft")
    base = realistic_model("llama").train()
    model = peft.get_peft_model(
        base,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], init_lora_weights=False
        ),
    )
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="random", seed=6, lora="masked"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, fused=True)
    engine.start(opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    rec = HostWork()
    with rec:
        for step in range(1, 7):
            rec.step = step
            model(**_batch(step)).loss.backward()
            opt.step()
            opt.zero_grad()
    assert not any(rec.at(s) for s in range(1, 7)), rec.calls
    assert all(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters() if n in before)


def test_masks_follow_their_weights_to_another_device():
    """Masks placed on another device than their weights (as after ``model.to(device)``, which keeps
    the parameter objects) are placed again on the weights' device by the next step: the gradient
    hooks, ``before_step`` and ``after_step`` all use masks on the weights' device, and the step's
    gradients, weights and moments are masked. A move after the backward (``Module.to`` moves the
    gradients too) reaches no gradient hook, so the step itself must notice it; and ``apply`` after a
    move zeroes the masked positions of dense weights loaded into the moved model.

    The other device is ``meta``: a CPU weight multiplied in place by a meta mask keeps its values, so
    a mask left behind shows as a masked weight that is not 0, not only as a device that differs."""
    model = realistic_model("llama").train()
    dense = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.6, init_method="random", seed=5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine.start(opt)
    enf = engine.enforcer
    params = {name: model.get_parameter(name) for name in engine.masks}

    def leave_masks_behind():  # as if placed before the weights moved: every device copy on meta
        for name, p in params.items():
            enf._dev_masks[name] = enf._dev_masks[name].to("meta")
            enf._grad_masks[name] = enf._grad_masks[name].to("meta")
            enf._mask_by_param[id(p)] = enf._mask_by_param[id(p)].to("meta")

    def assert_masks_beside_their_weights():
        for name, w in params.items():
            assert model.get_parameter(name) is w, name  # the same objects: only the device moved
            assert enf._dev_masks[name].device == w.device, name
            assert enf._grad_masks[name].device == w.device, name
            assert enf._mask_by_param[id(w)].device == w.device, name

    # Moved before the backward: the gradient hooks see it first.
    leave_masks_behind()
    model(**_batch(0)).loss.backward()
    for name, mask in engine.masks.items():  # the gradient hooks masked on the weights' device
        g = model.get_parameter(name).grad
        assert g.device.type == "cpu" and torch.count_nonzero(g[mask == 0]) == 0, name
    opt.step()
    assert_masks_beside_their_weights()
    assert _check_invariants(engine, opt) >= 2 * len(engine.masks)
    opt.zero_grad()

    # Moved after the backward: no hook runs after the move; the step places the masks again.
    model(**_batch(1)).loss.backward()
    leave_masks_behind()
    opt.step()
    assert_masks_beside_their_weights()
    assert _check_invariants(engine, opt) >= 2 * len(engine.masks)
    opt.zero_grad()

    # Moved with no step at all, then dense weights loaded in place: ``apply`` zeroes the masked ones.
    leave_masks_behind()
    model.load_state_dict(dense)
    assert all(torch.count_nonzero(w.detach()[engine.masks[n] == 0]) > 0 for n, w in params.items())
    engine.apply()
    assert_masks_beside_their_weights()
    for name, w in params.items():  # kept weights untouched, masked ones exactly 0
        keep = engine.masks[name].bool()
        assert torch.equal(w.detach()[keep], dense[name][keep]), name
        assert torch.count_nonzero(w.detach()[~keep]) == 0, name
    assert _check_invariants(engine, opt) >= 2 * len(engine.masks)


def test_masks_follow_a_model_moved_to_the_meta_device():
    """``model.to("meta")`` after the masks were placed: the next step places every mask beside its
    weight (a device the masks were never built on)."""
    model = realistic_model("gpt2").train()
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="random", seed=2))
    engine.start()
    model.to("meta")
    engine.before_step()
    for name in engine.masks:
        w = model.get_parameter(name)
        assert w.device.type == "meta"
        assert engine.enforcer._dev_masks[name].device == w.device, name
        assert engine.enforcer._grad_masks[name].device == w.device, name
    engine.after_step()  # runs on the meta device without a mismatch


def test_gradients_of_replaced_parameters_are_masked_before_the_step():
    """Parameters replaced after the masks were placed (a wrapper re-creating them): the hooks of this
    step's backward sat on the old objects, so ``before_step`` masks every new gradient itself."""
    model = realistic_model("llama").train()
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="random", seed=4))
    engine.start()
    for name in engine.masks:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        setattr(module, attr, torch.nn.Parameter(getattr(module, attr).detach().clone()))
    model(**_batch(1)).loss.backward()
    engine.before_step()
    for name, mask in engine.masks.items():
        g = model.get_parameter(name).grad
        assert torch.count_nonzero(g) > 0 and torch.count_nonzero(g[mask == 0]) == 0, name


def test_packing_on_the_device_writes_numpys_little_bit_order():
    """The device packer gives the bytes of ``numpy.packbits(bitorder="little")`` (computed here bit
    by bit): bit j of byte b is column 8b + j, trailing bits 0."""
    from hf_sparsity.storage.masks_file import pack_bits, pack_mask

    g = torch.Generator().manual_seed(0)
    for rows, cols in [(1, 1), (3, 5), (4, 16), (5, 33), (2, 8), (6, 0)]:
        mask = (torch.rand(rows, cols, generator=g) > 0.4).to(torch.uint8)
        want = torch.zeros(rows, (cols + 7) // 8, dtype=torch.uint8)
        for r in range(rows):
            for c in range(cols):
                if mask[r, c]:
                    want[r, c // 8] += 1 << (c % 8)
        assert torch.equal(pack_bits(mask), want), (rows, cols)
        assert torch.equal(pack_mask(mask), want), (rows, cols)


# ------------------------------------------------------------------------------------------ on a GPU
class _DeviceInvariants(TrainerCallback):
    """After every optimizer step (outside the strict hooks): masked weights and AdamW moments exactly 0,
    compared on the weights' device."""

    def __init__(self, cb: SparsityCallback):
        self.cb, self.checked, self.moments = cb, 0, 0

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)
        for name, mask in self.cb.engine.masks.items():
            p = self.cb.engine.model.get_parameter(name)
            off = mask.to(p.device) == 0
            assert int(torch.count_nonzero(p.detach()[off])) == 0, name
            for k, v in inner.state.get(p, {}).items():
                if torch.is_tensor(v) and v.shape == p.shape:
                    assert int(torch.count_nonzero(v[off])) == 0, f"{name}: {k}"
                    self.moments += 1
        self.checked += 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_cuda_steps_without_an_event_never_synchronize(tmp_path, optim, monkeypatch):
    """bf16 on CUDA through Trainer: every call the library makes in a step (gradient hooks, token
    count, ``on_pre_optimizer_step``, ``on_optimizer_step``, ``on_step_end``) runs under
    ``torch.cuda.set_sync_debug_mode("error")`` (any synchronizing CUDA call raises), except on the
    event step; masks sit on the weights' device and masked weights and moments stay exactly 0."""
    from hf_sparsity.flops.callback import TokenCounter
    from hf_sparsity.mask_engine.enforcement import MaskEnforcer

    event, max_steps = 6, 10
    state = {"strict": False}

    def strict(fn):
        def run(*args, **kwargs):
            if not state["strict"]:
                return fn(*args, **kwargs)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        return run

    monkeypatch.setattr(MaskEnforcer, "_on_grad", strict(MaskEnforcer._on_grad))
    monkeypatch.setattr(TokenCounter, "_count_batch", strict(TokenCounter._count_batch))
    for hook in ("on_pre_optimizer_step", "on_optimizer_step", "on_step_end"):
        monkeypatch.setattr(SparsityCallback, hook, strict(getattr(SparsityCallback, hook)))

    class Strictness(TrainerCallback):  # strict on every step but the event's
        def on_step_begin(self, args, st, control, **kwargs):
            state["strict"] = st.global_step + 1 != event

        def on_step_end(self, args, st, control, **kwargs):
            state["strict"] = False

    model = realistic_model("llama", hidden=64, heads=4, kv_heads=2)
    config = SparsityConfig(
        sparsity=0.5, init_method="random", seed=1, schedule=[{"step": event, "sparsity": 0.75}]
    )
    cb = SparsityCallback(config)
    checker = _DeviceInvariants(cb)
    trainer = make_trainer(
        model,
        tmp_path,
        [cb, Strictness(), checker],
        dataset=_Padded(max_steps * 3),
        max_steps=max_steps,
        per_device_train_batch_size=3,
        optim=optim,
        bf16=True,
        use_cpu=False,
        max_grad_norm=1.0,
    )
    trainer.train()
    assert checker.checked == max_steps and [e["step"] for e in cb.events] == [event]
    assert checker.moments >= 2 * (max_steps - 1) * len(cb.engine.masks)  # exp_avg, exp_avg_sq were seen
    for name in cb.engine.masks:
        w = cb.engine.model.get_parameter(name)
        assert w.device.type == "cuda" and cb.engine.enforcer._dev_masks[name].device == w.device
    real = sum(int(it["attention_mask"].sum()) for it in trainer.train_dataset.items)
    assert cb.flops.tokens == real
