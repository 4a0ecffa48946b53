"""Sparse-IFT: every transform is iso-FLOP per transformed layer, builds a model that trains, keeps targeting
right."""

from __future__ import annotations

import json
import re

import pytest
import torch

from hf_sparsity.cli import main
from hf_sparsity.flops import count_flops, count_flops_from_config
from hf_sparsity.ift import TRANSFORMS, DopedLinear, build_ift_model, sparse_ift, wide_width
from hf_sparsity.mask_engine.config import SparsityConfig, get_sparsity_config
from hf_sparsity.mask_engine.engine import SparsityEngine
from hf_sparsity.mask_engine.targeting import plan_sparsity
from hf_sparsity.utils import SparsityError

from .conftest import ARCHS, tiny_config

GPT3_SMALL = {
    "model_type": "gpt2",
    "n_layer": 12,
    "n_embd": 768,
    "n_head": 12,
    "n_positions": 2048,
    "vocab_size": 50257,
}


def _expected_targets(result) -> set[str]:
    """The sparse tensors the transform introduced (never a doped low-rank factor)."""
    return {n for layer in result.layers for n, _, lv in layer.tensors if lv > 0}


@pytest.mark.slow  # a training run per transform and architecture
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_transform_iso_flop_builds_trains_and_targets(arch, transform):
    s = 0.75
    result = sparse_ift(tiny_config(arch), s, transform)
    assert result.layers, "nothing transformed"
    # 1. Iso-FLOP per transformed layer, as reported ...
    for layer in result.layers:
        assert layer.ratio == pytest.approx(1.0, abs=0.01), layer.name

    # 2. ... and as counted independently on the real model with its real masks.
    torch.manual_seed(0)
    model = build_ift_model(result.config)
    section = get_sparsity_config(model.config)
    engine = SparsityEngine(model, section)
    engine.build_masks()
    measured = count_flops(model, masks=engine.masks, seq_len=result.original.seq_len)
    per = {t.name: t.forward_flops_per_token(measured.seq_len) for t in measured.layers if t.kind == "linear"}
    for layer in result.layers:
        spent = sum(per[n] for n, _, _ in layer.tensors)
        assert spent == pytest.approx(layer.original_flops, rel=0.01), layer.name

    # 3. The config's sparsity section selects exactly the transformed sparse tensors, at their levels.
    assert set(engine.targets) == _expected_targets(result)
    for name, mask in engine.masks.items():
        assert engine.levels[name] == pytest.approx(result.levels[name], abs=1.0 / mask.numel())

    # 4. The default rule, with no patterns, still picks exactly those tensors: never embeddings,
    #    norms, lm_head, biases or the doped dense low-rank factors.
    default = {d.name for d in plan_sparsity(model, SparsityConfig(sparsity=s)) if d.sparsify}
    assert default == _expected_targets(result)
    assert not any(("embed" in n or "wte" in n or "lm_head" in n or "low_rank" in n) for n in default)

    # 5. Forward and backward run, with masked weights at 0 and finite gradients.
    engine.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, model.config.vocab_size, (2, 12))
    out = model(input_ids=x, labels=x)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    for name, mask in engine.masks.items():
        g = model.get_parameter(name).grad
        assert g is not None and (g[mask == 0] == 0).all()
    engine.detach()


def test_gpt3_small_wide_matches_cerebras_width():
    """Cerebras trained GPT-3 Small Sparse-Wide at 50% with d_model 1092 (768 * sqrt(2) = 1086, 12 heads)."""
    r = sparse_ift(GPT3_SMALL, 0.5, "wide")
    assert r.config.n_embd == 1092 and r.config.n_inner == 4 * 1092
    assert r.config_changes["hidden_size"] == (768, 1092)
    assert sparse_ift(GPT3_SMALL, 0.75, "wide").config.n_embd == 1536
    assert r.max_layer_deviation < 1e-5
    # The whole-model increase is exactly what the untransformed terms add: attention and the LM head.
    w = r.whole_model()
    delta = w["total"]["transformed"] - w["total"]["original"]
    explained = sum(
        w[k]["transformed"] - w[k]["original"] for k in ("attention", "logits", "transformed_layers")
    )
    assert delta == pytest.approx(explained, rel=1e-9)
    assert w["attention"]["transformed"] > w["attention"]["original"]
    assert "LM head" in r.format() and "1092" in r.format()


def test_wide_width_respects_heads_and_rotary():
    cfg = tiny_config("gpt_neox")  # rotary on 25% of each head: its size must keep an even rotary part
    d = wide_width(cfg, 0.5)
    hd = d // cfg.num_attention_heads
    assert d % cfg.num_attention_heads == 0 and int(hd * 0.25) % 2 == 0
    assert wide_width(tiny_config("gpt2"), 0.0) == 32  # identity at s = 0


@pytest.mark.parametrize("transform", ["parallel", "factorized", "doped"])
def test_module_transforms_are_whole_model_iso(transform):
    r = sparse_ift(GPT3_SMALL, 0.5, transform)
    w = r.whole_model()
    assert w["total"]["transformed"] == pytest.approx(w["total"]["original"], rel=1e-3)
    assert w["attention"]["transformed"] == w["attention"]["original"]
    assert w["logits"]["transformed"] == w["logits"]["original"]


def test_shapes_follow_the_paper_formulas():
    d_in, d_out = 768, 3072
    fac = sparse_ift(GPT3_SMALL, 0.75, "factorized").config.sparse_ift["modules"]["transformer.h.0.mlp.c_fc"]
    assert fac["rank"] == round(d_in * d_out / (0.25 * (d_in + d_out)))
    par = sparse_ift(GPT3_SMALL, 0.75, "parallel").config.sparse_ift["modules"]["transformer.h.0.mlp.c_fc"]
    assert par["k"] == 4
    dop = sparse_ift(GPT3_SMALL, 0.75, "doped")
    assert dop.config.sparse_ift["modules"]["transformer.h.0.mlp.c_fc"]["rank"] == round(
        0.75 * d_in * d_out / (d_in + d_out)
    )
    fc = next(layer for layer in dop.layers if layer.name == "transformer.h.0.mlp.c_fc.weight")
    assert [(n.rsplit(".", 1)[-1], lv) for n, _, lv in fc.tensors[1:]] == [
        ("low_rank_a", 0.0),
        ("low_rank_b", 0.0),
    ]
    patterns = dop.sparsity_config.param_name_patterns
    assert not any(re.search(p, "transformer.h.0.mlp.c_fc.low_rank_a") for p in patterns)
    assert any(re.search(p, "transformer.h.0.mlp.c_fc.sparse.weight") for p in patterns)


def test_doped_layer_is_dense_low_rank_plus_sparse():
    layer = DopedLinear(6, 5, rank=2)
    with torch.no_grad():
        layer.low_rank_b.normal_()
    x = torch.randn(3, 6)
    ref = x @ layer.sparse.weight.T + layer.sparse.bias + x @ layer.low_rank_a.T @ layer.low_rank_b.T
    torch.testing.assert_close(layer(x), ref)


def test_save_and_load_with_remote_code(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    r = sparse_ift(tiny_config("gpt2"), 0.5, "factorized")
    out = tmp_path / "fac"
    r.save(out)
    assert (out / "modeling_sparse_ift.py").is_file() and (out / "config.json").is_file()
    cfg = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=True)
    assert type(model.transformer.h[0].mlp.c_fc).__name__ == "FactorizedLinear"
    assert get_sparsity_config(cfg) == get_sparsity_config(r.config)
    with pytest.raises(SparsityError, match="already exists"):
        r.save(out)
    # The flops command counts the transformed config at its own levels.
    again = count_flops_from_config(out)
    assert again.forward_flops_per_token == pytest.approx(r.transformed.forward_flops_per_token, rel=1e-12)


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(SparsityError, match="transform"):
        sparse_ift(tiny_config("gpt2"), 0.5, "deep")
    with pytest.raises(SparsityError, match="outside"):
        sparse_ift(tiny_config("gpt2"), 1.0, "wide")
    done = sparse_ift(tiny_config("gpt2"), 0.5, "parallel")
    with pytest.raises(SparsityError, match="already"):
        sparse_ift(done.config, 0.5, "parallel")


def test_cli_ift(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GPT3_SMALL))
    out = tmp_path / "wide"
    assert (
        main(["ift", "--config", str(cfg), "--sparsity", "0.5", "--transform", "wide", "--out", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "hidden_size 768 -> 1092" in text and "difference explained" in text
    written = json.loads((out / "config.json").read_text())
    assert written["n_embd"] == 1092 and "sparsity" in written
    assert main(["ift", "--config", str(cfg), "--sparsity", "0.75", "--transform", "doped", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["max_layer_deviation"] < 0.01 and report["transform"] == "doped"
    assert (
        main(["ift", "--config", str(cfg), "--sparsity", "0.5", "--transform", "wide", "--out", str(out)])
        == 2
    )
    assert "already exists" in capsys.readouterr().err


def test_transformed_model_trains_with_the_callback(tmp_path):
    """The transformed config's own sparsity section drives SparsityCallback inside Trainer."""
    from transformers import Trainer, TrainingArguments

    from hf_sparsity.callback import SparsityCallback

    r = sparse_ift(tiny_config("llama"), 0.75, "doped")
    torch.manual_seed(0)
    model = r.build_model()
    ids = torch.randint(0, 128, (8, 16))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = SparsityCallback(get_sparsity_config(model.config))
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert set(callback.engine.masks) == _expected_targets(r)
    for name, mask in callback.engine.masks.items():
        assert (model.get_parameter(name).detach()[mask == 0] == 0).all()
    low_rank = model.model.layers[0].mlp.up_proj.low_rank_b
    assert (low_rank != 0).any()  # the dense low-rank factor trained (it starts at 0)
