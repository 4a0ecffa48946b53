"""Gradient masking at the end of each backward pass: one fused multiply over every targeted gradient.

The reference is computed here without the library: the same model's dense gradients (a copy with no
hooks) times the masks, summed over micro-batches by hand. Products by 0 and 1 are exact, so the masked
gradients must equal the reference bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_sparsity.mask_engine.enforcement as enforcement
from hf_sparsity import SparsityConfig, hooks
from hf_sparsity.mask_engine.engine import SparsityEngine

from .realistic import realistic_model


def _batch(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(2, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def _dense_grads(model, batches) -> dict[str, torch.Tensor]:
    """Gradients of a hook-free copy, summed over ``batches`` as accumulation does."""
    ref = copy.deepcopy(model)
    for x in batches:
        ref(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def _engine(model):
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.6, init_method="random", seed=3))
    eng.build_masks()
    eng.apply()
    return eng


def _count_passes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = enforcement._foreach_mask

    def counting(gs, ms):
        calls.append(len(gs))
        real(gs, ms)

    monkeypatch.setattr(enforcement, "_foreach_mask", counting)
    return calls


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_one_pass_per_backward_gives_the_dense_gradients_times_the_masks(arch, monkeypatch):
    model = realistic_model(arch).train()
    for m in model.modules():  # no dropout: the reference copy must see the same forward
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    eng = _engine(model)
    vocab = model.config.vocab_size
    batches = [_batch(vocab, 0), _batch(vocab, 1)]
    want = _dense_grads(model, batches)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eng.attach(opt)
    passes = _count_passes(monkeypatch)
    for x in batches:  # two micro-batches, accumulated
        model(input_ids=x, labels=x).loss.backward()
    assert passes == [len(eng.masks)] * 2  # one pass per backward, over every targeted gradient
    for name, p in model.named_parameters():
        if name in eng.masks:
            assert torch.equal(p.grad, want[name] * eng.masks[name]), name
            assert torch.count_nonzero(p.grad[eng.masks[name] == 1]) > 0, name
        else:  # untargeted gradients (norms, embeddings) untouched
            assert torch.equal(p.grad, want[name]), name


def test_masking_runs_after_callbacks_the_backward_queued_later():
    """DDP queues the copy of its averaged gradients into ``.grad`` late in the backward; the masking must
    come after it. Here a hook on the input embedding (reached last) queues a callback that writes a
    targeted gradient back unmasked, as that copy would."""
    model = realistic_model("llama").train()
    eng = _engine(model)
    eng.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    name = sorted(eng.masks)[0]
    target = model.get_parameter(name)
    unmasked = torch.randn(target.shape, generator=torch.Generator().manual_seed(5)) + 3.0

    def copy_back():
        target.grad.copy_(unmasked)

    emb = model.get_input_embeddings().weight
    emb.register_hook(lambda g: hooks.queue_after_backward(copy_back))
    x = _batch(model.config.vocab_size, 0)
    model(input_ids=x, labels=x).loss.backward()
    assert torch.equal(target.grad, unmasked * eng.masks[name])


def test_a_backward_that_fails_does_not_stop_the_next_one_being_masked():
    model = realistic_model("gpt2").train()
    eng = _engine(model)
    eng.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    x = _batch(model.config.vocab_size, 0)
    boom = model.get_input_embeddings().weight.register_hook(lambda g: (_ for _ in ()).throw(KeyError("x")))
    with pytest.raises(KeyError):  # raised after the targeted gradients' hooks ran (the embedding is last)
        model(input_ids=x, labels=x).loss.backward()
    boom.remove()
    model.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x).loss.backward()
    for name, mask in eng.masks.items():
        g = model.get_parameter(name).grad
        assert torch.count_nonzero(g[mask == 0]) == 0, name


def test_gradients_asked_for_by_autograd_grad_are_left_alone_and_dot_grad_is_masked():
    """``torch.autograd.grad`` hands gradients back without touching ``.grad``: the pass masks ``.grad``
    (here, what an earlier backward left there) and returns what autograd computed."""
    model = realistic_model("gpt2").train()
    eng = _engine(model)
    eng.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    x = _batch(model.config.vocab_size, 0)
    model(input_ids=x, labels=x).loss.backward()
    name = sorted(eng.masks)[0]
    p = model.get_parameter(name)
    before = p.grad.clone()
    (g,) = torch.autograd.grad(model(input_ids=x, labels=x).loss, [p])
    assert torch.count_nonzero(g[eng.masks[name] == 0]) > 0  # the dense gradient, as asked for
    assert torch.equal(p.grad, before)
