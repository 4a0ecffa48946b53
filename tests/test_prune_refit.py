"""Refit of the kept weights, block reconstruction, given masks and streaming one block at a time."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from hf_sparsity import SparsityConfig, SparsityError
from hf_sparsity.mask_engine.targeting import plan_sparsity
from hf_sparsity.pruning import methods as M
from hf_sparsity.pruning import prune_oneshot
from hf_sparsity.pruning.blocks import find_blocks
from hf_sparsity.pruning.refit import reconstruction_error, refit_weights

from .conftest import tiny_model


def _calib(n=6, seqlen=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 128, (n, seqlen), generator=g)


def _problem(rows=12, cols=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g)
    X = torch.randn(300, cols, generator=g) * torch.linspace(0.1, 4, cols)
    X[:, 3] = X[:, 5] * 0.5 + 0.01 * X[:, 3]  # correlated inputs: where SparseGPT's update is approximate
    return W, 2 * X.t() @ X / 300


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_refit_is_the_exact_least_squares_solution_and_beats_sparsegpt(nm):
    W, H = _problem()
    Wsg, pruned = M.sparsegpt_prune(W, H, W.numel() // 2, nm=nm, blocksize=8)
    got = refit_weights(W, H, ~pruned, percdamp=0.01, start=Wsg, tol=1e-6, max_iter=500, energy_tol=0)
    assert torch.all(got[pruned] == 0)
    Hd = H.double() + 0.01 * H.diagonal().mean().double() * torch.eye(32, dtype=torch.float64)
    for r in range(W.shape[0]):  # each row from its normal equations on the kept columns, in float64
        k = (~pruned[r]).nonzero().squeeze(1)
        want = torch.linalg.solve(Hd[k][:, k], (Hd @ W[r].double())[k])
        torch.testing.assert_close(got[r, k].double(), want, rtol=1e-4, atol=1e-4)
    assert reconstruction_error(W, got, H) < reconstruction_error(W, Wsg, H)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_layer_refit_error_is_never_worse_than_sparsegpts_for_the_same_mask(arch):
    """Block 0 sees the dense inputs in both runs: same Hessians, same SparseGPT masks."""
    calib = _calib(8, 32)
    dense = tiny_model(arch)
    targets = [d for d in plan_sparsity(dense, SparsityConfig(sparsity=0.5)) if d.sparsify]
    prefix, _ = find_blocks(dense, [d.name for d in targets])
    first = [d for d in targets if d.name.startswith(f"{prefix}.0.")]
    xs, handles = {}, []
    for d in first:
        mod = dense.get_submodule(d.name.rsplit(".", 1)[0])
        handles.append(mod.register_forward_hook(lambda m, i, o, n=d.name: xs.update({n: i[0]}) and None))
    with torch.no_grad():
        dense.eval()(input_ids=calib, use_cache=False)
    for h in handles:
        h.remove()

    def lin(model, d):
        w = model.get_parameter(d.name).detach().double()
        return w.t() if d.input_dim == 0 else w

    plain, refit = tiny_model(arch), tiny_model(arch)
    r1 = prune_oneshot(plain, 0.5, calib, method="sparsegpt", batch_size=8)
    r2 = prune_oneshot(refit, 0.5, calib, method="sparsegpt", batch_size=8, refit=True)
    for d in first:
        assert torch.equal(r1.masks[d.name], r2.masks[d.name]), d.name
        X = xs[d.name].reshape(-1, xs[d.name].shape[-1]).double()
        W0 = lin(dense, d)
        e_sgpt = float(torch.linalg.norm(X @ (W0 - lin(plain, d)).t()))
        e_refit = float(torch.linalg.norm(X @ (W0 - lin(refit, d)).t()))
        assert e_refit <= e_sgpt * (1 + 1e-6), (d.name, e_refit, e_sgpt)
    assert r2.info["refit"] == {"percdamp": 0.01}


@pytest.mark.slow  # a whole prune with refit and reconstruction per method
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_refit_and_reconstruct_keep_exact_levels_and_nm(method):
    for config in (SparsityConfig(sparsity=0.6), SparsityConfig(sparsity=0.5, structure="2:4")):
        model = tiny_model("llama", seed=1)
        ref = prune_oneshot(tiny_model("llama", seed=1), config, _calib(4), method=method, batch_size=2)
        result = prune_oneshot(
            model, config, _calib(4), method=method, batch_size=2, refit=True, reconstruct_steps=3,
            reconstruct_lr=1e-3,
        )  # fmt: skip
        for d in (d for d in plan_sparsity(model, config) if d.sparsify):
            mask, w = result.masks[d.name], model.get_parameter(d.name).detach()
            if method != "wanda" and ".layers.0." in d.name:  # same inputs: the method's masks
                assert torch.equal(mask, ref.masks[d.name]), d.name
            assert torch.all(w[mask == 0] == 0)
            if config.structure:
                assert torch.all(mask.reshape(-1, 4).sum(1) == 2), d.name
            else:
                assert int((mask == 0).sum()) == round(0.6 * d.numel), d.name


@pytest.mark.slow  # two whole prunes with reconstruction
def test_reconstruction_lowers_the_block_error_and_is_deterministic():
    runs = []
    for _ in range(2):
        model = tiny_model("gpt2")
        result = prune_oneshot(model, 0.7, _calib(8, 32), method="wanda", batch_size=4, reconstruct_steps=12,
                               reconstruct_lr=1e-3)  # fmt: skip
        runs.append((result, {n: p.detach().clone() for n, p in model.named_parameters()}))
    errors = runs[0][0].info["reconstruct"]["block_error_before_after"]
    assert all(after < before for before, after in errors), errors
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])


def test_refit_refuses_a_system_more_damping_cannot_fix(caplog):
    W = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    keep = torch.tensor([[1, 0] * 3] * 4, dtype=torch.bool)
    H = torch.full((6, 6), 2.0) - torch.eye(6)  # not positive definite: eigenvalues -1 and 11
    with caplog.at_level(logging.WARNING), pytest.raises(SparsityError, match="singular or ill-conditioned"):
        refit_weights(W, H, keep, percdamp=0.01, name="layer.w", max_tries=3)
    assert "retrying with" in caplog.text and "--nsamples" in str(caplog.text + "--nsamples")
    H = torch.ones(6, 6)  # rank one: the damping makes it solvable
    assert torch.isfinite(refit_weights(W, H, keep)).all()


def test_bad_reconstruct_steps():
    for steps in (-1, 0.5):
        with pytest.raises(SparsityError, match="at least 1 step"):
            prune_oneshot(tiny_model("llama"), 0.5, _calib(), method="wanda", reconstruct_steps=steps)


def test_given_masks_are_kept_exactly_and_refit():
    donor = tiny_model("llama", seed=3)
    given = prune_oneshot(donor, 0.5, _calib(), method="wanda").masks
    model = tiny_model("llama")
    result = prune_oneshot(model, 0.9, _calib(), method="magnitude", masks=given, refit=True)
    assert result.method == "masks"
    dense = tiny_model("llama")
    changed = False
    for n, m in given.items():
        assert torch.equal(result.masks[n], m)
        w = model.get_parameter(n).detach()
        assert torch.all(w[m == 0] == 0)
        changed |= not torch.equal(w, dense.get_parameter(n).detach() * m)
    assert changed, "refit should move the kept weights"
    bad = {"model.layers.0.mlp.up_proj.weight": torch.ones(3, 3, dtype=torch.uint8)}
    with pytest.raises(SparsityError, match="shape .* another model size"):
        prune_oneshot(tiny_model("llama"), 0.5, masks=bad)
    with pytest.raises(SparsityError, match="does not have"):
        prune_oneshot(tiny_model("llama"), 0.5, masks={"nosuch.weight": torch.ones(2, 2)})


# ------------------------------------------------------------------------------------- streaming
def _save(model, path, dtype=None, shard=None):
    if dtype is not None:
        model = model.to(dtype)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kw)
    return path


@pytest.mark.slow  # whole folders pruned twice, streamed and in memory
@pytest.mark.parametrize(
    "arch,dtype", [("gpt2", torch.float32), ("llama", torch.bfloat16), ("llama", torch.float16)]
)
def test_streaming_equals_pruning_in_memory(arch, dtype, tmp_path):
    """Block by block from the shards (several per model), written back in the dtype on disk."""
    from safetensors import safe_open

    from hf_sparsity.pruning.save import save_pruned
    from hf_sparsity.pruning.streaming import StreamingModel

    src = _save(tiny_model(arch), tmp_path / "in", dtype, shard="20KB")
    assert len(list(src.glob("*.safetensors"))) > 1
    calib = _calib(4, 16)
    kw = dict(method="sparsegpt", batch_size=2, refit=True, reconstruct_steps=2, reconstruct_lr=1e-4)
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    ref = prune_oneshot(ref_model, 0.5, calib, **kw)
    save_pruned(ref_model.to(dtype), ref, tmp_path / "ref")
    stream = StreamingModel(src)
    stream.out = tmp_path / "out"
    stream.out.mkdir()
    got = prune_oneshot(stream.model, 0.5, calib, stream=stream, **kw)
    stream.finish()
    assert sorted(got.masks) == sorted(ref.masks)
    for n in ref.masks:
        assert torch.equal(got.masks[n], ref.masks[n]), n
    index = json.loads((stream.out / "model.safetensors.index.json").read_text())
    ref_index = {}
    for f in (tmp_path / "ref").glob("model*.safetensors"):
        with safe_open(f, "pt") as h:
            ref_index.update({k: h.get_tensor(k) for k in h.keys()})
    assert set(index["weight_map"]) == set(ref_index)
    for name, file in index["weight_map"].items():
        with safe_open(stream.out / file, "pt") as h:
            t = h.get_tensor(name)
        assert t.dtype == dtype, name
        torch.testing.assert_close(t.float(), ref_index[name].float(), rtol=0, atol=0), name


def _cli(*argv):
    from hf_sparsity.cli import main

    return main([str(a) for a in argv])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama folder with the GPT-2 tokenizer from ../shared/data, in two shards, and the corpus."""
    from transformers import GPT2TokenizerFast

    from .conftest import shared_data_dir

    data = shared_data_dir()
    root = tmp_path_factory.mktemp("refit")
    model_dir = root / "dense"
    tiny_model("llama", vocab=50257, layers=3).save_pretrained(model_dir, max_shard_size="2MB")
    GPT2TokenizerFast.from_pretrained(data / "tokenizer/gpt2").save_pretrained(model_dir)
    return model_dir, data / "corpus/openwebtext-1000.jsonl"


def test_cli_refit_reconstruct_streams_and_stock_transformers_loads(llama_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from hf_sparsity.storage.masks_file import load_masks

    model_dir, calib = llama_dir
    out = tmp_path / "out"
    rc = _cli(
        "prune", model_dir, out, "--method", "wanda", "--structure", "2:4", "--calib-data", calib,
        "--nsamples", 4, "--seqlen", 32, "--refit", "--reconstruct", "--reconstruct-steps", 2,
        "--no-progress",
    )  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    model = AutoModelForCausalLM.from_pretrained(out)
    masks, _ = load_masks(out)
    for name, mask in masks.items():
        assert torch.all(model.get_parameter(name).detach()[mask == 0] == 0)
        assert torch.all(mask.reshape(-1, 4).sum(1) == 2)
    oneshot = json.loads((out / "config.json").read_text())["sparsity"]["_state"]["oneshot"]
    assert oneshot["reconstruct"]["steps"] == 2 and oneshot["refit"]["percdamp"] == 0.01
    # the same masks, given back with --masks, refit again: masks unchanged
    out2 = tmp_path / "again"
    rc = _cli(
        "prune", model_dir, out2, "--masks", out, "--calib-data", calib, "--nsamples", 2, "--seqlen", 32,
        "--refit", "--no-progress",
    )  # fmt: skip
    assert rc == 0
    again, _ = load_masks(out2)
    assert all(torch.equal(again[n], masks[n]) for n in masks)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "out"]


def test_cli_bad_inputs_name_the_fix_and_leave_nothing(llama_dir, tmp_path, capsys):
    import shutil

    model_dir, calib = llama_dir
    out = tmp_path / "out"
    other = tmp_path / "other"
    tiny_model("gpt2").save_pretrained(other / "model")
    prune_oneshot(m := tiny_model("gpt2"), 0.5, method="magnitude")
    from hf_sparsity.storage.masks_file import save_masks

    save_masks(other / "masks.safetensors", {n: (p != 0).to(torch.uint8) for n, p in m.named_parameters()
                                             if re.search(r"c_attn\.weight", n)})  # fmt: skip
    missing = tmp_path / "missing"
    shutil.copytree(model_dir, missing)
    next(iter(sorted(missing.glob("model-*.safetensors")))).unlink()
    trunc = tmp_path / "trunc"
    shutil.copytree(model_dir, trunc)
    shard = sorted(trunc.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:1000])
    base = ("--calib-data", calib, "--nsamples", 2, "--seqlen", 32, "--no-progress")
    cases = [
        ((model_dir, out, "--reconstruct-steps", 0, *base), "at least 1 step"),
        ((model_dir, out, "--reconstruct-steps", -3, *base), "at least 1 step"),
        ((model_dir, out, "--masks", other / "masks.safetensors", "--refit", *base), "does not have"),
        ((model_dir, out, "--masks", tmp_path / "nosuch.safetensors", *base), "does not exist"),
        ((missing, out, "--method", "magnitude"), "missing"),
        ((trunc, out, "--method", "magnitude"), "truncated"),
    ]
    for argv, message in cases:
        assert _cli("prune", *argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["missing", "other", "trunc"]


def test_packed_masks_are_saved_as_the_unpacked_ones(tmp_path):
    from hf_sparsity.pruning.streaming import PackedMasks
    from hf_sparsity.storage.masks_file import load_masks, save_masks

    g = torch.Generator().manual_seed(0)
    plain = {f"w{i}": (torch.rand(7, 13 + i, generator=g) > 0.5).to(torch.uint8) for i in range(3)}
    packed = PackedMasks()
    for n, m in plain.items():
        packed[n] = m
    save_masks(tmp_path / "a.safetensors", packed)
    save_masks(tmp_path / "b.safetensors", plain)
    (a, meta_a), (b, meta_b) = load_masks(tmp_path / "a.safetensors"), load_masks(tmp_path / "b.safetensors")
    assert all(torch.equal(a[n], plain[n]) and torch.equal(b[n], plain[n]) for n in plain)
    assert meta_a["checksum"] == meta_b["checksum"] and meta_a["tensors"] == meta_b["tensors"]
