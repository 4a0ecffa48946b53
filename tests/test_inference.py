"""sparsify_for_inference / restore_dense on tiny models of every architecture, and ``bench --model``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_sparsity.config import SparsityConfig
from hf_sparsity.engine import SparsityEngine
from hf_sparsity.inference import SparseLinear, restore_dense, sparse_layers, sparsify_for_inference
from hf_sparsity.utils import SparsityError

from .conftest import ARCHS, tiny_model

BACKENDS = ["csr", "masked_dense", "emulator"]


def _masked(arch, level=0.75, init="random"):
    model = tiny_model(arch).eval()
    eng = SparsityEngine(model, SparsityConfig(sparsity=level, init_method=init))
    eng.build_masks()
    eng.apply()
    return model, eng


def _linear_weights(model):
    return {
        n: m.weight
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_swap_logits_generate_and_restore(arch, backend):
    model, eng = _masked(arch)
    ids = torch.randint(2, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    originals = {n: m for n, m in model.named_modules() if f"{n}.weight" in eng.masks}
    with torch.no_grad():
        want = model(ids).logits
    gen_want = model.generate(
        ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=5, do_sample=False, pad_token_id=1
    )
    sparsify_for_inference(model, backend, masks=eng.masks)
    layers = sparse_layers(model)
    assert set(layers) == set(originals) and len(layers) == len(eng.masks)
    assert all(
        isinstance(m.backend, __import__("hf_sparsity").backends.get_backend(backend))
        for m in layers.values()
    )
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    gen_got = model.generate(
        ids[:1], attention_mask=torch.ones_like(ids[:1]), max_new_tokens=5, do_sample=False, pad_token_id=1
    )
    assert torch.equal(gen_got, gen_want)
    restore_dense(model)
    assert not sparse_layers(model)
    for n, m in originals.items():
        assert model.get_submodule(n) is m
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)


def test_emulator_counts_decoding_work():
    model, eng = _masked("gpt2", level=0.9)
    sparsify_for_inference(model, "emulator", masks=eng.masks)
    ids = torch.tensor([[3, 4, 5]])
    model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=3,
        min_new_tokens=3,
        do_sample=False,
        pad_token_id=1,
    )
    # one prefill of 3 tokens, then 2 decode steps of 1 token (the third token needs no forward)
    for name, layer in sparse_layers(model).items():
        c = layer.backend.counters["forward"]
        assert c.macs == int(eng.masks[f"{name}.weight"].sum()) * (3 + 1 + 1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_keep_dense_false_rebuilds_dense_modules(arch):
    model, eng = _masked(arch)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        want = model(ids).logits
    sparsify_for_inference(model, "csr", masks=eng.masks, keep_dense=False)
    restore_dense(model)
    weights = _linear_weights(model)
    for name, mask in eng.masks.items():
        w = weights[name.rsplit(".", 1)[0]]
        assert w.shape == mask.shape
        assert torch.all(w[mask == 0] == 0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-6, atol=1e-6)


def test_masks_from_model_folder_and_from_zeros(tmp_path):
    from transformers import AutoModelForCausalLM

    model, eng = _masked("gpt2")
    model.save_pretrained(tmp_path / "ckpt")
    eng.save(tmp_path / "ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = loaded(ids).logits
    sparsify_for_inference(loaded, "csr")  # masks=None: the folder's sparsity_masks.safetensors
    assert len(sparse_layers(loaded)) == len(eng.masks)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(SparsityError, match="already sparsified"):
        sparsify_for_inference(loaded, "csr")
    restore_dense(loaded)

    # a finalized checkpoint carries no masks: refuse unless asked for its zeros
    model.save_pretrained(tmp_path / "final")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with pytest.raises(SparsityError, match='masks="zeros"'):
        sparsify_for_inference(final, "csr")
    sparsify_for_inference(final, "csr", masks="zeros")
    layers = sparse_layers(final)
    assert {f"{n}.weight" for n in layers} == set(eng.masks)
    for n, layer in layers.items():
        assert layer.backend.nnz == int(eng.masks[f"{n}.weight"].sum())


def test_bad_masks_are_refused():
    model, eng = _masked("llama")
    with pytest.raises(SparsityError, match="not the weight of an nn.Linear"):
        sparsify_for_inference(model, "csr", masks={"model.embed_tokens.weight": torch.ones(128, 32)})
    with pytest.raises(SparsityError, match="Unknown sparse backend"):
        sparsify_for_inference(model, "fast", masks=eng.masks)
    with pytest.raises(SparsityError, match="masks must be"):
        sparsify_for_inference(model, "csr", masks=3)
    assert not any(isinstance(m, SparseLinear) for m in model.modules())


def test_cli_bench_model_with_emulator(tmp_path, capsys):
    from hf_sparsity.cli import main

    model, eng = _masked("gpt2", level=0.9)
    model.save_pretrained(tmp_path / "m")
    eng.save(tmp_path / "m")
    rc = main(["bench", "--model", str(tmp_path / "m"), "--backend", "emulator", "--new-tokens", "2",
               "--rounds", "1", "--json"])  # fmt: skip
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    assert res["sparsity_of_sparse_layers"] == pytest.approx(0.9, abs=1e-3)
    assert res["max_abs_err"] < 1e-4
    assert res["modeled_speedup_sparse_layers"] > 5
    assert 1 < res["modeled_speedup_all_linear"] < res["modeled_speedup_sparse_layers"]
    assert res["emulated_macs"] > 0 and res["emulated_macs_skipped"] > 8 * res["emulated_macs"]
    rc = main(
        ["bench", "--model", str(tmp_path / "m"), "--backend", "csr", "--new-tokens", "2", "--rounds", "1"]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "backend_tok_s" in out and "dense_breakdown_ms" in out and "bound_layers_free" in out
    model.save_pretrained(tmp_path / "nomask")
    assert main(["bench", "--model", str(tmp_path / "nomask"), "--backend", "csr"]) == 2
    assert "--masks zeros" in capsys.readouterr().err


def test_decode_breakdown_times_the_named_layers_and_leaves_no_hooks():
    from hf_sparsity.backends.bench import decode_breakdown, speedup_bounds

    model, eng = _masked("gpt2", level=0.9)
    names = sorted({n.rpartition(".")[0] for n in eng.masks})
    ids = torch.randint(0, model.config.vocab_size, (1, 4))
    sparsify_for_inference(model, "csr", masks=eng.masks)
    b = decode_breakdown(model, ids, 3, names)
    assert b["layers_ms"] > 0 and b["lm_head_ms"] > 0 and b["rest_ms"] > 0
    assert b["total_ms"] == pytest.approx(b["layers_ms"] + b["lm_head_ms"] + b["rest_ms"])
    none = decode_breakdown(model, ids, 3, [])
    assert none["layers_ms"] == 0 and none["lm_head_ms"] > 0
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks
    restore_dense(model)
    # Amdahl: 40 ms per token, 20 of them in the sparse layers, 10% of their weights kept
    bounds = speedup_bounds({"total_ms": 40.0, "layers_ms": 20.0}, 0.1)
    assert bounds["bound_layers_free"] == pytest.approx(2.0)
    assert bounds["bound_layers_ideal"] == pytest.approx(40 / 22)
