"""int8 values (``values="int8"``): whole models against their dequantized weights, and bad input refused."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_sparsity.backends import _native, get_backend
from hf_sparsity.backends.formats import ACT_GROUPS, quantize_activations
from hf_sparsity.inference import restore_dense, sparse_layers, sparsify_for_inference
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine
from hf_sparsity.utils import SparsityError

from .conftest import tiny_model


def _masked(arch, level=0.5):
    model = tiny_model(arch, hidden=64).eval()
    eng = SparsityEngine(model, SparsityConfig(sparsity=level, init_method="topk"))
    eng.build_masks()
    eng.apply()
    return model, eng


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("kernel", ["torch"] + (["native"] if _native.load() is not None else []))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_int8_model_matches_its_dequantized_weights_and_restores(arch, kernel, activations):
    """int8 values compute the dense model on the dequantized weights, and (int8 activations, the default) on
    the dequantized activations of every sparse layer; generation (batch-1 steps: the int8 dot products
    where the CPU has them) gives the same tokens."""
    model, eng = _masked(arch)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids).logits
    opts = {"activations": activations} if activations == "float32" else {}
    sparsify_for_inference(model, "bitmask", masks=eng.masks, values="int8", kernel=kernel, **opts)
    layers = sparse_layers(model)
    assert layers and all(m.backend.int8 for m in layers.values())
    assert all(m.backend.int8_activations == (activations == "int8") for m in layers.values())
    with torch.no_grad():
        got = model(ids).logits
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    restore_dense(model)  # the dequantized weights, dense: the same function
    if activations == "int8":  # ... on the activations the int8 products see
        for name in layers:
            model.get_submodule(name).register_forward_pre_hook(lambda m, a: (quantize_activations(a[0]),))
    with torch.no_grad():
        want = model(ids).logits
        gen_want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    # int8 activations: a float32 rounding difference upstream can move an activation across a rounding
    # boundary of its code (one step of its group's scale), hence the looser tolerance
    tol = 2e-3 if activations == "int8" else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(gen, gen_want)
    assert (got - dense).abs().max() < 0.1 * dense.abs().max()  # int8 is close to the fp32 model


@pytest.mark.slow  # whole-model auto planning
def test_auto_int8_prefill_sees_the_int8_activations_too():
    """A prompt long enough for auto's prefill path (a GEMM on the unpacked weight) computes on the same
    dequantized activations as the batch-1 products."""
    model, eng = _masked("llama")
    ids = torch.randint(2, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    opts = {"check": False, "rounds": 1, "stream_bytes": 1, "plan_cache": False, "lm_head": False}
    opts.update(formats=("bitmask",), margin=-100.0)  # bitmask whatever the timings (ties: fewer bytes)
    sparsify_for_inference(model, "auto", masks=eng.masks, values="int8", head="float32", **opts)
    layers = sparse_layers(model)
    assert any(getattr(m.backend.decode, "int8_activations", False) for m in layers.values())
    with torch.no_grad():
        got = model(ids).logits
    restore_dense(model)
    for name, m in layers.items():
        if getattr(m.backend.decode, "int8_activations", False):
            model.get_submodule(name).register_forward_pre_hook(lambda mod, a: (quantize_activations(a[0]),))
    with torch.no_grad():
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


# the whole model's tok/s with every layer on the bitmask (the int8 GEMV model: 3.0)
PLAN_TOK_S = {"slower": 2.0, "faster": 4.0, "a tie": 3.14, "just past the margin": 3.16, "the same": 2.0}


@pytest.mark.skipif(_native.load() is None, reason="native kernels unavailable")
@pytest.mark.parametrize("case", list(PLAN_TOK_S))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_auto_int8_whole_model_check_is_against_the_int8_dense_gemv(arch, case, monkeypatch):
    """With int8 values the whole-model check times the plan against every layer on the int8 dense GEMV (the
    float32 model as it was is never timed): a plan that decodes slower, or faster by less than 5% (1.047x),
    ends on that model, its logits those of the model converted with formats=("native_dense",) alone; a plan
    5% faster or more (1.053x) is kept, its logits those of formats=("bitmask",) alone; a plan that is that
    model already is not timed at all."""
    from hf_sparsity.backends import measure as timing
    from hf_sparsity.backends.auto import planner
    from hf_sparsity.inference import auto_choices

    # per layer: bitmask planned, the int8 GEMV next (for "the same": the int8 GEMV planned)
    quick = {"dense": 2.0, "native_dense": 1.5, "bitmask": 3.0 if case == "the same" else 1.0}
    monkeypatch.setattr(
        planner, "interleaved_ms", lambda fns, *a, **k: {f: quick[f.split(":")[0]] for f in fns}
    )
    timed = []

    def tok_s(m, ids, n):  # the whole model: plan 2 (or 4) tok/s, every layer on the int8 GEMV 3
        kinds = frozenset(x.backend.kernel for x in sparse_layers(m).values() if not x.lm_head)
        timed.append(kinds)
        return {frozenset({"native_dense"}): 3.0, frozenset({"bitmask"}): PLAN_TOK_S[case]}[kinds]

    monkeypatch.setattr(timing, "step_tok_s", tok_s)
    model, eng = _masked(arch)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    refs = {}
    for fmt in ("native_dense", "bitmask"):
        ref = _masked(arch)[0]
        sparsify_for_inference(ref, "auto", masks=eng.masks, values="int8", formats=(fmt,), check=False)
        with torch.no_grad():
            refs[fmt] = ref(ids).logits
    sparsify_for_inference(model, "auto", masks=eng.masks, values="int8", rounds=2)
    kept = case in ("faster", "just past the margin")
    want = "bitmask" if kept else "native_dense"
    layers = {n: c for n, c in auto_choices(model).items() if f"{n}.weight" in eng.masks}
    assert len(layers) == len(eng.masks) and all(c["decode"] == want for c in layers.values())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, refs[want])
    if case == "the same":
        assert timed == [] and not any("whole_model_check" in c for c in layers.values())
        return
    assert set(timed) == {frozenset({"native_dense"}), frozenset({"bitmask"})}  # never the float32 model
    for c in layers.values():
        check = c["whole_model_check"]
        assert (check["against"], check["kept"]) == ("native_dense", kept)
        assert check["auto_vs_dense"] == round(PLAN_TOK_S[case] / 3.0, 3)
        assert kept or c["planned"]["decode"] == "bitmask"


@pytest.mark.slow  # whole-model auto planning
def test_auto_with_int8_chooses_int8_formats_only_when_asked():
    model, eng = _masked("llama")
    opts = {"check": False, "rounds": 1, "stream_bytes": 1}
    sparsify_for_inference(model, "auto", masks=eng.masks, values="int8", **opts)
    layers = [
        m for m in sparse_layers(model).values() if not m.lm_head
    ]  # the int8 head: tests/test_int8_head
    decode = {type(m.backend.decode).__name__: m.backend.decode for m in layers}
    for b in decode.values():
        if type(b).__name__ in ("BitmaskBackend", "NM24Backend"):
            assert b.int8
    restore_dense(model)
    sparsify_for_inference(model, "auto", masks=eng.masks, **opts)
    assert not any(getattr(m.backend.decode, "int8", False) for m in sparse_layers(model).values())


def test_int8_refused_for_a_backend_without_it_naming_alternatives_model_untouched():
    model, eng = _masked("gpt2")
    before = _weights(model)
    with pytest.raises(SparsityError, match="no int8 values.*bitmask"):
        sparsify_for_inference(model, "csr", masks=eng.masks, values="int8")
    with pytest.raises(SparsityError, match="values='int4'|use 'int8'"):
        sparsify_for_inference(model, "bitmask", masks=eng.masks, values="int4")
    assert not sparse_layers(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with pytest.raises(SparsityError, match="no int8 values"):
        get_backend("masked_dense").from_dense(torch.randn(4, 8), values="int8")


def test_activation_groups_are_four_columns_every_64_times_act_groups():
    """One scale per group: an outlier coarsens its own group's codes only (columns 4g..4g+3 of every
    ``64 * ACT_GROUPS``-column stretch), and a group's codes are round(x / (max|x| / 127))."""
    period = 64 * ACT_GROUPS
    x = torch.linspace(-1, 1, 3 * period + 40)
    x[5] = 100.0  # group 1 of the first accumulator
    q = quantize_activations(x)
    group = torch.tensor([(c // 64 % ACT_GROUPS) * 16 + c % 64 // 4 for c in range(x.numel())])
    for g in range(16 * ACT_GROUPS):
        cols = group == g
        s = x[cols].abs().max() / 127
        torch.testing.assert_close(q[cols], torch.round(x[cols] / s) * s)
    assert (group[:8] == torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])).all() and group[period + 5] == 1
    others = group != 1
    assert (q[others] - x[others]).abs().max() <= 1 / 127  # the outlier did not reach other groups
    assert torch.equal(quantize_activations(torch.zeros(3, 70)), torch.zeros(3, 70))


def test_activations_option_is_checked():
    w, m = torch.randn(8, 64), torch.ones(8, 64, dtype=torch.uint8)
    with pytest.raises(SparsityError, match="goes with values='int8'"):
        get_backend("bitmask").from_dense(w, m, activations="int8")
    with pytest.raises(SparsityError, match="activations must be 'int8' or 'float32'"):
        get_backend("bitmask").from_dense(w, m, values="int8", activations="int4")
    with pytest.raises(SparsityError, match="activations='float32'.*bitmask, nm24 or native_dense"):
        get_backend("auto").from_dense(w, m, values="int8", activations="float32", plan_cache=False)
    b = get_backend("bitmask").from_dense(w, m, values="int8", activations="float32")
    x = torch.randn(1, 64)
    torch.testing.assert_close(b.linear(x), x @ b.to_dense().T, rtol=1e-5, atol=1e-5)


def test_int8_refused_on_an_already_quantized_model():
    model, eng = _masked("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    before = _weights(model)
    with pytest.raises(SparsityError, match="already quantized"):
        sparsify_for_inference(model, "bitmask", masks=eng.masks, values="int8")
    assert not sparse_layers(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_int8_refused_on_int8_weights():
    layer = nn.Module()
    layer.proj = nn.Linear(8, 8)
    layer.register_buffer("unused", torch.zeros(1))
    layer.q = nn.Parameter(torch.zeros(8, dtype=torch.int8), requires_grad=False)
    mask = {"proj.weight": torch.ones(8, 8, dtype=torch.uint8)}
    with pytest.raises(SparsityError, match="already quantized.*int8"):
        sparsify_for_inference(layer, "bitmask", masks=mask, values="int8")


@pytest.fixture
def folder(tmp_path, shared_data):
    from transformers import GPT2TokenizerFast

    tok = GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")
    model = tiny_model("gpt2", vocab=50257).eval()
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    eng.build_masks()
    eng.apply()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    eng.save(tmp_path / "m")
    return tmp_path / "m"


def test_cli_generate_values_int8_and_its_errors(folder, capsys):
    from hf_sparsity.cli import main

    args = ["generate", str(folder), "--prompt", "Sparse models are", "--max-new-tokens", "4", "--no-dense"]
    assert main([*args, "--backend", "bitmask", "--values", "int8"]) == 0
    assert "[bitmask:" in capsys.readouterr().err
    assert main([*args, "--backend", "csr", "--values", "int8"]) != 0
    assert "no int8 values" in capsys.readouterr().err
    assert main([*args, "--backend", "bitmask", "--values", "int8", "--activations", "float32"]) == 0
    capsys.readouterr()
    assert main([*args, "--backend", "bitmask", "--activations", "int8"]) != 0
    assert "--activations goes with --values int8" in capsys.readouterr().err
    assert main([*args, "--values", "int8", "--activations", "float32"]) != 0  # auto
    assert "pick --backend bitmask" in capsys.readouterr().err
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main([*args, "--backend", "bitmask", "--values", "int8"]) != 0
    assert "already quantized (gptq)" in capsys.readouterr().err
