"""int8 values (``values="int8"``): whole models against their dequantized weights, and bad input refused."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_sparsity.backends import _native
from hf_sparsity.config import SparsityConfig
from hf_sparsity.engine import SparsityEngine
from hf_sparsity.inference import restore_dense, sparse_layers, sparsify_for_inference
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


@pytest.mark.parametrize("kernel", ["torch"] + (["native"] if _native.load() is not None else []))
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_int8_model_matches_its_dequantized_weights_and_restores(arch, kernel):
    model, eng = _masked(arch)
    ids = torch.randint(2, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids).logits
    sparsify_for_inference(model, "bitmask", masks=eng.masks, values="int8", kernel=kernel)
    layers = sparse_layers(model)
    assert layers and all(m.backend.int8 for m in layers.values())
    with torch.no_grad():
        got = model(ids).logits
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    restore_dense(model)  # the dequantized weights, dense: the same function
    with torch.no_grad():
        want = model(ids).logits
        gen_want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(gen, gen_want)
    assert (got - dense).abs().max() < 0.1 * dense.abs().max()  # int8 is close to the fp32 model


def test_auto_with_int8_chooses_int8_formats_only_when_asked():
    model, eng = _masked("llama")
    opts = {"check": False, "rounds": 1, "stream_bytes": 1}
    sparsify_for_inference(model, "auto", masks=eng.masks, values="int8", **opts)
    decode = {type(m.backend.decode).__name__: m.backend.decode for m in sparse_layers(model).values()}
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
        from hf_sparsity.backends import get_backend

        get_backend("masked_dense").from_dense(torch.randn(4, 8), values="int8")


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
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main([*args, "--backend", "bitmask", "--values", "int8"]) != 0
    assert "already quantized (gptq)" in capsys.readouterr().err
