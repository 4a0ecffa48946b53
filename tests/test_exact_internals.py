"""Internals that decide things, checked against values computed by hand in the test (not inequalities):
auto's plan-cache key (one test per part), its predicted whole-model ratio, decode timing's token count,
the packing of tensors that share memory in whole or in part, two LoRA adapters on masked layers, the
reconstruction's learning rate at every step, and the mask file's checksum from its definition."""

from __future__ import annotations

import hashlib
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from hf_sparsity.backends import _native, auto

from .realistic import early_eos, prompt, realistic_model

needs_native = pytest.mark.skipif(_native.load() is None, reason="native kernels unavailable")


# ------------------------------------------------------------------------------------------ plan cache key
DECISION = {
    "decode": "dense", "prefill": "dense", "prefill_large": "dense",
    "decode_vs_dense": 1.0, "prefill_vs_dense": 1.0, "prefill_large_vs_dense": 1.0,
}  # fmt: skip


def _layer(dtype=torch.float32, density=0.5, is24=False, shape=(16, 32), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g).to(dtype)
    if is24:
        keep = torch.zeros(shape[0] * shape[1] // 4, 4, dtype=torch.uint8)
        keep[:, :2] = 1
        m = keep.reshape(shape)
    else:
        flat = torch.zeros(shape[0] * shape[1], dtype=torch.uint8)
        flat[torch.randperm(flat.numel(), generator=g)[: round(density * flat.numel())]] = 1
        m = flat.reshape(shape)
        m[0, :4] = torch.tensor([1, 1, 1, 0], dtype=torch.uint8)  # 3 of 4: never 2:4
    return {"layers.0.proj": (w, m)}


@pytest.fixture
def decisions(monkeypatch):
    calls = []

    def decide(layers, names, cands, *args):
        calls.append((names, tuple(cands)))
        return dict(DECISION)

    monkeypatch.setattr(auto.planner, "_decide_group", decide)
    return calls


BASE = dict(dtype=torch.float32, density=0.5, is24=False)
VARIANTS = {
    "dtype": (dict(BASE, dtype=torch.bfloat16), {}),
    "2:4": (dict(BASE, is24=True), {}),
    "density": (dict(BASE, density=0.7), {}),
    "shape": (dict(BASE, shape=(16, 48)), {}),
    "threads": (BASE, {"threads": 1}),
    "values": (BASE, {"values": "int8"}),
    "options": (BASE, {"margin": 0.05}),
}


@needs_native
@pytest.mark.parametrize("part", sorted(VARIANTS))
def test_a_group_differing_in_one_key_part_is_measured_again(part, decisions):
    """The same group twice: measured once (the second from the cache); the group with one part changed
    (dtype, 2:4-ness, density, shape, threads, values, options): measured again."""
    auto.plan_layers(_layer(**BASE), formats=("bitmask",))
    assert len(decisions) == 1
    auto.plan_layers(_layer(**BASE, seed=1), formats=("bitmask",))  # other values, same group
    assert len(decisions) == 1
    layer_kw, opts = VARIANTS[part]
    auto.plan_layers(_layer(**layer_kw), formats=("bitmask",), **opts)
    assert len(decisions) == 2, part
    auto.plan_layers(_layer(**layer_kw), formats=("bitmask",), **opts)
    assert len(decisions) == 2, part


@needs_native
def test_torch_threads_are_part_of_the_key(decisions):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        auto.plan_layers(_layer(**BASE), formats=("bitmask",))
        torch.set_num_threads(2)
        auto.plan_layers(_layer(**BASE), formats=("bitmask",))
    finally:
        torch.set_num_threads(before)
    assert len(decisions) == 2


@needs_native
def test_a_plan_made_on_another_kernel_build_is_measured_again(decisions, monkeypatch):
    """The loaded library's file name (its hash: sources, instruction-set level) is part of the key: a plan
    measured with HF_SPARSITY_NATIVE_ISA=avx2 kernels is not the native build's, and back again it is."""
    loaded = _native.build_id()
    assert loaded == os.path.splitext(os.path.basename(_native.load()._name))[0]
    assert loaded.startswith("hfs_spmv_")
    auto.plan_layers(_layer(**BASE), formats=("bitmask",))
    monkeypatch.setattr(_native, "build_id", lambda: "hfs_spmv_0123456789abcdef")
    auto.plan_layers(_layer(**BASE), formats=("bitmask",))
    assert len(decisions) == 2
    monkeypatch.setattr(_native, "build_id", lambda: loaded)
    auto.plan_layers(_layer(**BASE), formats=("bitmask",))
    assert len(decisions) == 2


@needs_native
def test_a_2_4_group_offers_nm24_and_an_unstructured_one_does_not(decisions):
    auto.plan_layers(_layer(**dict(BASE, is24=True)), formats=("bitmask", "nm24"))
    auto.plan_layers(_layer(**BASE), formats=("bitmask", "nm24"))
    assert [c for _, c in decisions] == [("dense", "bitmask", "nm24"), ("dense", "bitmask")]


# ------------------------------------------------------------------------------------------ predicted ratio
def test_predicted_whole_model_ratio_by_hand(monkeypatch):
    """10 ms per dense token. Layer a: one pass over 2 sampled layers x 1 copy took 2.0 ms dense, 1.0 ms
    bitmask -> 0.5 ms saved per layer; b stays dense -> 0; c: 1 layer x 3 copies, 3.0 -> 1.5 ms -> 0.5 ms.
    Predicted: 10 / (10 - 1.0) = 1.1111. The whole model measured 0.9x: below 1 while 1.11 >= 1.1, so it is
    measured again."""

    def c(decode, ms, measured_on, copies):
        return {"decode": decode, "decode_ms": ms, "measured_on": measured_on, "timed_copies": copies}

    choices = {
        "a": c("bitmask", {"dense": 2.0, "bitmask": 1.0}, 2, 1),
        "b": c("dense", {"dense": 2.0, "bitmask": 1.0}, 2, 1),
        "c": c("nm24", {"dense": 3.0, "nm24": 1.5}, 1, 3),
        "d": c("csr", {"csr": 1.0}, 1, 1),  # no dense time: nothing predicted
    }
    for c in choices.values():
        c.update({k: v for k, v in DECISION.items() if k != "decode"})
    calls = []

    def whole(model, swaps, rounds, tokens, base=()):
        calls.append(rounds)
        return 0.9, 100.0

    monkeypatch.setattr(auto.backend, "_time_whole_model", whole)
    model = SimpleNamespace(generate=None, config=SimpleNamespace(vocab_size=11))
    auto.backend._check_whole_model(model, [("x", None)], choices, rounds=3, plan_cache=False)
    verdict = choices["a"]["whole_model_check"]
    assert verdict["predicted"] == round(10 / 9, 3)
    assert verdict["remeasured"] and calls == [3, 5] and not verdict["kept"]
    calls.clear()
    for c in choices.values():  # predicted 10 / 9.5 = 1.053 < 1.1: the first timing counts
        c.pop("whole_model_check"), c.pop("planned", None)
    choices = {k: choices[k] for k in ("a", "b")}
    choices["a"].update(decode="bitmask", decode_ms={"dense": 2.0, "bitmask": 1.0})
    auto.backend._check_whole_model(model, [("x", None)], choices, rounds=3, plan_cache=False)
    assert choices["a"]["whole_model_check"]["predicted"] == round(10 / 9.5, 3) and calls == [3]


# ------------------------------------------------------------------------------------------ decode timing
def test_decode_tok_s_times_exactly_new_tokens_tokens(monkeypatch):
    """Even when the model would stop early (its EOS comes as the 3rd token): 10 forwards for 10 tokens,
    and tok/s = 10 / the clock's elapsed seconds."""
    from hf_sparsity.backends import measure

    model = realistic_model("llama")
    ids = prompt(5)
    eos, k = early_eos(model, ids, after=2)
    model.generation_config.eos_token_id = eos
    calls = []
    model.register_forward_hook(lambda m, a, o: calls.append(1))
    ticks = iter([100.0, 102.5])
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    assert measure.decode_tok_s(model, ids, 10) == 10 / 2.5
    assert len(calls) == 10


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gpt_neox"])
def test_step_tok_s_times_the_new_tokens_from_the_first_to_the_last(arch, monkeypatch):
    """The whole-model check's timer: exactly new_tokens tokens even past the model's EOS (a token before
    the last), the greedy tokens, and tok/s = (new_tokens - 1) / the seconds between the first and the last
    new token's clock readings (the prompt and the set-up are not timed). Llama and GPT-2 run on the native
    step where the kernels are built, GPT-NeoX on the forward loop."""
    from hf_sparsity.backends import measure
    from hf_sparsity.inference.decoding import native_step_reason

    model = realistic_model(arch)
    ids = prompt(5)
    native = native_step_reason(model, 15) is None
    assert native == (arch != "gpt_neox" and _native.load() is not None)
    eos, k = early_eos(model, ids, after=2)
    model.generation_config.eos_token_id = eos
    seq = ids
    with torch.no_grad():  # greedy by definition: the whole sequence's forward, the last position's argmax
        for _ in range(10):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    want = seq[0, 5:]
    seen = []
    clock = iter(100.0 + 0.25 * i for i in range(100))
    monkeypatch.setattr(measure, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    real = measure._greedy_decode
    assert real is not None and real.__name__ == "greedy_decode"  # registered by the inference package

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out[0, 5:])
        return out

    monkeypatch.setattr(measure, "_greedy_decode", spy)
    assert measure.step_tok_s(model, ids, 10) == 9 / (9 * 0.25)
    assert torch.equal(seen[0], want) and int(want[k]) == eos and k < 9
    with pytest.raises(ValueError, match="needs 2"):
        measure.step_tok_s(model, ids, 1)


def test_step_tok_s_times_generate_before_the_inference_package_registers_its_loop(monkeypatch):
    from hf_sparsity.backends import measure

    monkeypatch.setattr(measure, "_greedy_decode", None)
    monkeypatch.setattr(measure, "decode_tok_s", lambda model, ids, n: 7.0 * n)
    assert measure.step_tok_s(None, None, 32) == 224.0


def test_whole_model_ratio_is_the_median_of_the_rounds_ratios(monkeypatch):
    """The converted model decodes 1.2x the dense one in every round, but the machine runs twice as fast
    for the first round's dense timing: the fastest of each would say 120 / 200 = 0.6x; the rounds' ratios
    are 0.6, 1.2, 1.2, 1.2, their median 1.2, and the dense speed the median of 200, 100, 100, 100."""
    model = realistic_model("llama")
    name = "model.layers.0.mlp.down_proj"
    marker = torch.nn.Linear(1, 1)
    calls = []

    def tok_s(m, ids, n):
        converted = m.get_submodule(name) is marker
        calls.append((converted, n))
        burst = 2.0 if len(calls) == 3 else 1.0  # the first timed dense call (after one warm-up each)
        return (120.0 if converted else 100.0) * burst

    monkeypatch.setattr(auto.measure, "step_tok_s", tok_s)
    original = model.get_submodule(name)
    ratio, dense = auto.backend._time_whole_model(model, [(name, marker)], rounds=4, tokens=32)
    assert (ratio, dense) == (pytest.approx(1.2), 100.0)
    assert calls[:2] == [(False, 2), (True, 2)]
    assert calls[2:] == [(False, 32), (True, 32)] * 4
    assert model.get_submodule(name) is original


# ------------------------------------------------------------------------------------------ arena
def _gemv(w):
    from hf_sparsity.backends import get_backend

    return get_backend("native_dense").from_dense(w, torch.ones((), dtype=torch.uint8).expand(w.shape))


def _aligned(nbytes):
    return -(-nbytes // 64) * 64


@needs_native
def test_a_tensor_shared_whole_moves_with_its_holder_and_one_shared_in_part_stays():
    from hf_sparsity.backends.arena import pack_backends

    g = torch.Generator().manual_seed(0)
    whole = torch.nn.Parameter(torch.randn(5, 8, generator=g), requires_grad=False)  # 160 bytes
    big = torch.nn.Parameter(torch.randn(6, 8, generator=g), requires_grad=False)
    head, tail = big[:3], big[3:]  # two gemvs over parts of one parameter
    alone = torch.randn(3, 7, generator=g)  # 84 bytes, owned by its gemv only
    b_whole, b_head, b_tail, b_alone = _gemv(whole), _gemv(head), _gemv(tail), _gemv(alone)
    assert b_whole.values.data_ptr() == whole.data_ptr() and b_head.values.data_ptr() == big.data_ptr()
    ptrs = {"head": b_head.values.data_ptr(), "tail": b_tail.values.data_ptr()}
    want = {n: t.detach().clone() for n, t in {"whole": whole, "big": big, "alone": alone}.items()}
    x = torch.randn(1, 8, generator=g)
    outs = [b.linear(x if b is not b_alone else x[:, :7]) for b in (b_whole, b_head, b_tail, b_alone)]

    total = pack_backends([b_whole, b_head, b_tail, b_alone], held=[whole, big])
    assert total == _aligned(5 * 8 * 4) + _aligned(3 * 7 * 4)  # 192 + 128: the parts stay
    assert whole.data_ptr() == b_whole.values.data_ptr()  # one place for the parameter and the backend
    assert b_alone.values.data_ptr() - b_whole.values.data_ptr() == 192  # module order, 64-byte aligned
    assert b_whole.values.data_ptr() % 64 == 0
    assert {"head": b_head.values.data_ptr(), "tail": b_tail.values.data_ptr()} == ptrs
    assert b_head.values.data_ptr() == big.data_ptr() and big.shape == (6, 8)
    assert torch.equal(whole, want["whole"]) and torch.equal(big, want["big"])
    assert torch.equal(b_alone.values, want["alone"])
    for b, o in zip((b_whole, b_head, b_tail, b_alone), outs):
        assert torch.equal(b.linear(x if b is not b_alone else x[:, :7]), o)


# ------------------------------------------------------------------------------------------ LoRA
def test_two_adapters_on_masked_layers_each_apply_their_own_masked_update():
    """Two adapters, both active: the layer's output is base + sum over adapters of x·((B_a·A_a·s_a)⊙M)ᵀ;
    merging both adds both masked updates and leaves every pruned weight as it was."""
    peft = pytest.importorskip("peft")
    import torch.nn.functional as F

    from hf_sparsity import SparsityConfig, SparsityEngine

    model = realistic_model("llama")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg1 = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    cfg2 = peft.LoraConfig(
        r=2, lora_alpha=6, target_modules=targets, init_lora_weights=False, lora_dropout=0.0
    )
    torch.manual_seed(1)
    model = peft.get_peft_model(model, cfg1)
    model.add_adapter("second", cfg2)
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, lora="masked"))
    eng.build_masks()
    eng.apply()
    model.base_model.set_adapter(["default", "second"])
    for name in [n for n in eng.masks if "mlp.up_proj" in n or "self_attn.k_proj" in n]:
        layer = model.get_submodule("base_model.model." + name.rsplit(".", 1)[0])
        mask = eng.masks[name].float()
        deltas = {}
        for a, r, alpha in (("default", 4, 8), ("second", 2, 6)):
            B, A = layer.lora_B[a].weight.detach(), layer.lora_A[a].weight.detach()
            assert A.shape[0] == r
            deltas[a] = (B @ A) * (alpha / r) * mask
            assert torch.count_nonzero(((B @ A) * (alpha / r))[mask == 0]) > 0
        assert not torch.allclose(deltas["default"], deltas["second"])
        x = torch.randn(3, mask.shape[1], generator=torch.Generator().manual_seed(2))
        model.eval()
        with torch.no_grad():
            want = layer.base_layer(x) + F.linear(x, deltas["default"]) + F.linear(x, deltas["second"])
            torch.testing.assert_close(layer(x), want)
            before = layer.base_layer.weight.detach().clone()
            layer.merge(adapter_names=["default", "second"])
            torch.testing.assert_close(layer.base_layer.weight, before + deltas["default"] + deltas["second"])
            assert torch.equal(layer.base_layer.weight[mask == 0], before[mask == 0])
            layer.unmerge()
            torch.testing.assert_close(layer.base_layer.weight, before)


# ------------------------------------------------------------------------------------------ reconstruction LR
def test_reconstruction_learning_rate_at_every_step_is_the_cosine(monkeypatch):
    """Step s of S runs at lr·(1 + cos(π s / S)) / 2: the peak at step 0, never 0 (no wasted last step)."""
    from hf_sparsity.pruning import prune_oneshot

    seen = []
    real_step = torch.optim.Adam.step

    def step(self, *a, **k):
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    steps, lr = 7, 2e-3
    calib = torch.randint(2, 101, (4, 12), generator=torch.Generator().manual_seed(0))
    prune_oneshot(realistic_model("llama", layers=1), 0.5, calib, method="wanda", batch_size=2,
                  reconstruct_steps=steps, reconstruct_lr=lr)  # fmt: skip
    want = [lr * (1 + math.cos(math.pi * s / steps)) / 2 for s in range(steps)]
    assert len(seen) == steps
    for s, (got, w) in enumerate(zip(seen, want)):
        assert got == pytest.approx(w, rel=1e-12), s


# ------------------------------------------------------------------------------------------ mask checksum
def test_mask_checksum_is_sha256_of_names_shapes_and_packed_bits_in_name_order(tmp_path):
    """From the format's definition: sha256 over, per mask in sorted name order, name + NUL, the JSON
    shape + NUL, then the packed bytes (rows x ceil(cols / 8), little bit order)."""
    import numpy as np

    from hf_sparsity.storage.masks_file import load_masks, read_mask_metadata, save_masks

    g = torch.Generator().manual_seed(0)
    masks = {
        "z.weight": (torch.rand(3, 10, generator=g) > 0.5).to(torch.uint8),
        "a.weight": (torch.rand(4, 2, 3, generator=g) > 0.5).to(torch.uint8),
    }
    path = save_masks(tmp_path / "m.safetensors", masks)
    h = hashlib.sha256()
    for name in sorted(masks):
        m = masks[name]
        rows = m.shape[0]
        packed = np.packbits(m.reshape(rows, -1).numpy().astype(bool), axis=1, bitorder="little")
        h.update(name.encode() + b"\0" + json.dumps(list(m.shape)).encode() + b"\0" + packed.tobytes())
    assert read_mask_metadata(path)["checksum"] == "sha256:" + h.hexdigest()
    loaded, _ = load_masks(path)
    assert all(torch.equal(loaded[k], masks[k]) for k in masks)
