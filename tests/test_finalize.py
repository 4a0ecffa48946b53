"""convert --finalize / --to-sentinel / --from-sentinel, and inspect."""

import json
import logging
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from hf_sparsity import SparsityConfig, SparsityEngine, load_sparse_model
from hf_sparsity.cli import main as cli
from hf_sparsity.constants import SPARSITY_MASKS_NAME
from hf_sparsity.storage.masks_file import load_masks

from .conftest import tiny_model


def _sparse_dir(arch, path, level=0.7, shard=None):
    model = tiny_model(arch)
    eng = SparsityEngine(model, SparsityConfig(sparsity=level, init_method="topk"))
    eng.build_masks()
    eng.apply()
    eng.install_save_hook()
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model, eng


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(input_ids=x).logits


@pytest.mark.parametrize("arch,shard", [("gpt2", None), ("llama", None), ("llama", "20KB"), ("opt", None)])
def test_finalize_gives_a_vanilla_checkpoint_with_identical_logits(arch, shard, tmp_path, caplog):
    src, out = tmp_path / "sparse", tmp_path / "final"
    model, eng = _sparse_dir(arch, src, shard=shard)
    x = torch.randint(0, 128, (2, 12))
    masked, _ = load_sparse_model(src)
    assert cli(["convert", "--finalize", str(src), str(out)]) == 0
    assert not (out / SPARSITY_MASKS_NAME).exists()
    assert "sparsity" not in json.loads((out / "config.json").read_text())
    if shard:
        assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    transformers.utils.logging.enable_propagation()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with caplog.at_level(logging.WARNING):
                vanilla, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    finally:
        transformers.utils.logging.disable_propagation()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert torch.equal(_logits(vanilla, x), _logits(masked, x))
    assert torch.equal(_logits(vanilla, x), _logits(model, x))
    for name, m in eng.masks.items():
        assert torch.count_nonzero(vanilla.get_parameter(name).detach()[m == 0]) == 0


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_finalize_zeroes_masked_weights_that_are_nonzero_on_disk(shard, tmp_path):
    """A folder whose masked weights are still dense (masks written beside untouched weights)."""
    src, out = tmp_path / "sparse", tmp_path / "final"
    model = tiny_model("llama")
    model.save_pretrained(src, **({"max_shard_size": shard} if shard else {}))
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.6, init_method="random", seed=3))
    eng.build_masks()  # no apply(): the weights on disk keep their values at masked positions
    eng.save(src)
    for name, m in eng.masks.items():
        assert torch.count_nonzero(model.get_parameter(name).detach()[m == 0]) > 0
    assert cli(["convert", "--finalize", str(src), str(out)]) == 0
    vanilla = AutoModelForCausalLM.from_pretrained(out)
    masked, _ = load_sparse_model(src)
    for name, m in eng.masks.items():
        w = vanilla.get_parameter(name).detach()
        assert torch.count_nonzero(w[m == 0]) == 0
        assert torch.equal(w[m == 1], model.get_parameter(name).detach()[m == 1])
    x = torch.randint(0, 128, (2, 12))
    assert torch.equal(_logits(vanilla, x), _logits(masked, x))


def test_finalize_refuses_existing_output_and_is_atomic(tmp_path, capsys):
    src, out = tmp_path / "sparse", tmp_path / "final"
    _sparse_dir("gpt2", src)
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert cli(["convert", "--finalize", str(src), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"
    # A corrupt input fails midway: OUT is left exactly as it was.
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert cli(["convert", "--finalize", str(bad), str(out), "--overwrite"]) == 2
    assert "truncated or corrupt" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp folders left
    assert cli(["convert", "--finalize", str(src), str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").exists()


def test_nan_sentinel_round_trip(tmp_path):
    src = tmp_path / "sparse"
    model, eng = _sparse_dir("llama", src)
    assert cli(["convert", "--to-sentinel", str(src), str(tmp_path / "cb")]) == 0
    from safetensors.torch import load_file

    w = load_file(tmp_path / "cb" / "model.safetensors")
    for name, m in eng.masks.items():
        assert torch.equal(torch.isnan(w[name]), m == 0)
    assert not (tmp_path / "cb" / SPARSITY_MASKS_NAME).exists()
    assert cli(["convert", "--from-sentinel", str(tmp_path / "cb"), str(tmp_path / "back")]) == 0
    masks, _ = load_masks(tmp_path / "back")
    assert set(masks) == set(eng.masks) and all(torch.equal(masks[n], eng.masks[n]) for n in masks)
    back, _ = load_sparse_model(tmp_path / "back")
    for (n, p), (_, q) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(p, q), n
    # A dense checkpoint has no sentinel: refused, nothing written.
    model.save_pretrained(tmp_path / "dense")
    (tmp_path / "dense" / SPARSITY_MASKS_NAME).unlink()
    assert cli(["convert", "--from-sentinel", str(tmp_path / "dense"), str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_inspect_table_and_json(tmp_path, capsys):
    src = tmp_path / "sparse"
    model, eng = _sparse_dir("gpt2", src, level=0.6)
    assert cli(["inspect", str(src), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {r["name"]: r for r in report["layers"]}
    for name, m in eng.masks.items():
        assert rows[name]["masked"] and rows[name]["nonzeros"] == int(m.sum())
        assert rows[name]["level"] == pytest.approx(round(0.6 * m.numel()) / m.numel())
    total = sum(p.numel() for p in model.parameters())
    assert report["totals"]["params"] == total
    assert report["totals"]["nonzero_params"] == sum(int(torch.count_nonzero(p)) for p in model.parameters())
    assert cli(["inspect", str(src)]) == 0
    table = capsys.readouterr().out
    assert "transformer.h.1.mlp.c_fc.weight" in table and "masked tensors" in table
