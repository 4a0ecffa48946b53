"""LoRA (peft) on sparse models: targeting through the wrappers, the two modes, merge_sparse, errors."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_sparsity import SparsityConfig, SparsityEngine, SparsityError, plan_sparsity
from hf_sparsity.constants import SPARSITY_MASKS_NAME
from hf_sparsity.lora import masked_layers
from hf_sparsity.storage.masks_file import load_masks

from .conftest import tiny_model
from .trainer_utils import make_trainer

peft = pytest.importorskip("peft")

LORA_TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


def lora(model, arch, targets=None, **kw):
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=targets or LORA_TARGETS[arch],
        fan_in_fan_out=arch == "gpt2",  # GPT-2's Conv1D stores weights as (in, out)
        init_lora_weights=False,  # B != 0, so the adapter changes the output from step 0
        **{"lora_dropout": 0.0, **kw},
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, cfg)


def sparse_base(tmp_path, arch, level=0.5):
    """A sparse base folder (weights, masks, config section) and its masks."""
    model = tiny_model(arch)
    eng = SparsityEngine(model, SparsityConfig(sparsity=level, seed=3))
    eng.build_masks()
    eng.apply()
    eng.install_save_hook()
    path = tmp_path / f"{arch}-sparse"
    model.save_pretrained(path)
    return str(path), {n: m.clone() for n, m in eng.masks.items()}


def load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def assert_masked_zero(model, masks):
    for name, m in masks.items():
        w = model.get_parameter(name).detach()
        assert torch.count_nonzero(w[m == 0]) == 0, f"{name}: nonzero at a masked position"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_targets_resolve_to_base_weights(arch):
    plain = tiny_model(arch)
    cfg = SparsityConfig(sparsity=0.5)
    want = [d.name for d in plan_sparsity(plain, cfg) if d.sparsify]
    model = lora(tiny_model(arch), arch)
    got = [d.name for d in plan_sparsity(model, cfg) if d.sparsify]
    assert got == want and want  # default rule: plain names, adapters never targeted
    pattern = r"h\.\d+\.mlp\..*weight" if arch == "gpt2" else r"mlp\..*weight"
    explicit = SparsityConfig(sparsity=0.5, param_name_patterns=pattern)
    assert [d.name for d in plan_sparsity(model, explicit) if d.sparsify] == [
        d.name for d in plan_sparsity(plain, explicit) if d.sparsify
    ]
    eng = SparsityEngine(model, cfg)
    eng.build_masks()
    name = want[0]
    real = dict(model.named_parameters())
    base_param = next(p for n, p in real.items() if n.endswith(name.replace(".weight", ".base_layer.weight")))
    assert eng.model.get_parameter(name) is base_param
    assert all("lora_" not in n for n in eng.masks)


@pytest.mark.slow  # Trainer runs
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", ["masked", "merge_then_mask"])
def test_trainer_steps_then_merge_keep_masks_exact(tmp_path, arch, mode):
    from hf_sparsity import SparsityCallback, merge_sparse

    path, masks = sparse_base(tmp_path, arch)
    model = load(path)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = lora(model, arch)
    b_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    cb = SparsityCallback(SparsityConfig(sparsity=0.5, lora=mode))
    trainer = make_trainer(model, tmp_path / "out", [cb], max_steps=4)
    trainer.train()
    assert all(not torch.equal(p, b_before[n]) for n, p in model.named_parameters() if "lora_B" in n)
    assert cb.metrics()["sparsity/effective_sparsity"] == pytest.approx(0.5, abs=0.01)  # FLOPs see the masks
    assert cb.restored_from == path  # masks came from the sparse base folder
    assert set(cb.engine.masks) == set(masks)
    assert all(torch.equal(cb.engine.masks[n], masks[n]) for n in masks)
    view = cb.engine.model
    for name, p in view.named_parameters():  # base weights untouched: frozen, exact zeros kept
        assert torch.equal(p.detach(), before[name]), name
    assert_masked_zero(view, masks)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.requires_grad for p in lora_b)

    # Trainer's save of the PeftModel: adapter files plus the mask file under the base names.
    trainer.save_model(str(tmp_path / "adapter"))
    saved, _ = load_masks(tmp_path / "adapter", expected_shapes={n: tuple(m.shape) for n, m in masks.items()})
    assert set(saved) == set(masks)

    ids = torch.randint(2, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        adapter_logits = model(ids).logits
    first = next(iter(masks))
    wrapper = model.get_submodule("base_model.model." + first.rsplit(".", 1)[0])
    plain_delta = type(wrapper).get_delta_weight(wrapper, "default").detach()
    merged = merge_sparse(model, output_dir=tmp_path / "merged")
    assert_masked_zero(merged, masks)
    with torch.no_grad():
        merged_logits = merged(ids).logits
    if mode == "masked":
        torch.testing.assert_close(merged_logits, adapter_logits, rtol=1e-5, atol=1e-5)
    else:  # a plain merge would have written B·A onto the masked positions
        assert torch.count_nonzero(plain_delta[masks[first] == 0]) > 0
    on_disk, _ = load_masks(tmp_path / "merged")
    assert set(on_disk) == set(masks) and all(torch.equal(on_disk[n], masks[n]) for n in masks)
    # nothing of ours is stored on the merged model; a later save still writes the masks
    assert not any(type(v).__module__.startswith("hf_sparsity") for v in vars(merged).values())
    gc.collect()
    merged.save_pretrained(str(tmp_path / "again"))
    assert set(load_masks(tmp_path / "again")[0]) == set(masks)
    reloaded = load(str(tmp_path / "merged"))
    assert_masked_zero(reloaded, masks)
    assert reloaded.config.sparsity["lora"] == mode


def test_masked_mode_adapter_covering_no_sparse_weight(tmp_path):
    model = lora(tiny_model("gpt2"), "gpt2", targets=["c_attn"])
    cfg = SparsityConfig(sparsity=0.5, param_name_patterns=r"mlp\.c_fc\.weight", lora="masked")
    eng = SparsityEngine(model, cfg)
    with pytest.raises(SparsityError, match="cover no sparse weight"):
        eng.build_masks()
    assert not masked_layers(model)


def test_masked_mode_names_a_layer_type_peft_wraps_differently():
    model = lora(tiny_model("llama"), "llama", targets=["embed_tokens", "q_proj"])
    cfg = SparsityConfig(
        param_name_patterns={r"embed_tokens\.weight": 0.5, r"q_proj\.weight": 0.5}, lora="masked"
    )
    eng = SparsityEngine(model, cfg)
    with pytest.raises(SparsityError, match="Embedding"):
        eng.build_masks()
    assert not masked_layers(model)  # nothing half-applied


def test_merge_without_masks_changes_nothing(tmp_path):
    from hf_sparsity import merge_sparse

    plain = tiny_model("gpt2")
    plain.save_pretrained(tmp_path / "dense")
    model = lora(load(str(tmp_path / "dense")), "gpt2")
    with pytest.raises(SparsityError, match="has no masks"):
        merge_sparse(model, output_dir=tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert any("lora_A" in n for n, _ in model.named_parameters())  # still unmerged
    with pytest.raises(SparsityError, match="PeftModel"):
        merge_sparse(plain)


def test_lora_mode_validated():
    with pytest.raises(SparsityError, match="merge_then_mask"):
        SparsityConfig(sparsity=0.5, lora="masks")
    assert SparsityConfig.from_dict(SparsityConfig(sparsity=0.5, lora="masked").to_dict()).lora == "masked"


def test_engine_masks_file_from_peft_uses_base_names(tmp_path):
    model = lora(tiny_model("llama"), "llama")
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5))
    eng.build_masks()
    eng.save(tmp_path)
    masks, _ = load_masks(tmp_path / SPARSITY_MASKS_NAME)
    plain_names = {n for n, _ in tiny_model("llama").named_parameters()}
    assert masks and set(masks) <= plain_names


def test_trainer_checkpoint_of_peft_model_resumes_with_base_name_masks(tmp_path):
    from hf_sparsity import SparsityCallback

    path, masks = sparse_base(tmp_path, "llama")
    cfg = SparsityConfig(sparsity=0.5, lora="masked")
    model = lora(load(path), "llama")
    trainer = make_trainer(
        model, tmp_path / "out", [SparsityCallback(cfg)], max_steps=2, save_strategy="steps", save_steps=2
    )
    trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-2"
    saved, _ = load_masks(ckpt)
    assert set(saved) == set(masks)
    model2 = lora(load(path), "llama")
    cb2 = SparsityCallback(cfg)
    trainer2 = make_trainer(model2, tmp_path / "out", [cb2], max_steps=4)
    trainer2.train(resume_from_checkpoint=str(ckpt))
    assert cb2.restored_from == str(ckpt)
    assert all(torch.equal(cb2.engine.masks[n], masks[n]) for n in masks)
    assert_masked_zero(cb2.engine.model, masks)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_masked_mode_forward_and_peft_merge_apply_the_masked_update(arch):
    """Forward (dropout on) is base + dropout(x)·((B·A)⊙M)ᵀ; peft's merge and unmerge add, remove (B·A)⊙M."""
    import torch.nn.functional as F

    model = lora(tiny_model(arch), arch, lora_dropout=0.3)
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, lora="masked"))
    eng.build_masks()
    name = next(n for n in eng.masks if "mlp" in n)
    layer = model.get_submodule("base_model.model." + name.rsplit(".", 1)[0])
    mask = eng.masks[name].float()
    plain = type(layer).get_delta_weight(layer, "default").detach()
    assert torch.count_nonzero(plain[mask == 0]) > 0  # the unmasked update would touch pruned weights
    masked = plain * mask
    x = torch.randn(3, mask.shape[0] if arch == "gpt2" else mask.shape[1])
    model.train()
    with torch.no_grad():
        torch.manual_seed(7)
        got = layer(x)
        torch.manual_seed(7)
        want = layer.base_layer(x) + F.linear(
            F.dropout(x, 0.3, training=True), masked.t() if arch == "gpt2" else masked
        )
        torch.testing.assert_close(got, want)
        before = layer.base_layer.weight.detach().clone()
        for safe in (True, False):
            model.merge_adapter() if not safe else layer.merge(safe_merge=True)
            torch.testing.assert_close(layer.base_layer.weight, before + masked)
            assert torch.equal(
                layer.base_layer.weight[mask == 0], before[mask == 0]
            )  # pruned stay as they were
            layer.unmerge()
            torch.testing.assert_close(layer.base_layer.weight, before)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_engine_state_merge_reads_is_not_written_onto_the_peft_model_and_goes_with_it(arch):
    """merge_sparse merges with the masks, steps and events of the engine that ran on the peft model; that
    state is kept beside the model (no attribute on it) and is dropped when the model is."""
    import gc
    import weakref

    from hf_sparsity import merge_sparse
    from hf_sparsity.lora import view as lora_view
    from hf_sparsity.mask_engine.config import get_sparsity_config

    model = lora(tiny_model(arch), arch)
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5))
    eng.build_masks()
    eng.apply()
    eng.optimizer_steps = 7
    eng.events.append({"kind": "probe", "step": 7})
    assert not [k for k in vars(model) if "sparsity" in k.lower()]
    state, config = lora_view.engine_state(model)
    assert state.masks is eng.masks and config is eng.config
    masks = {n: m.clone() for n, m in eng.masks.items()}
    merged = merge_sparse(model)  # no masks argument: the engine's
    found = dict(merged.named_parameters())
    for name, m in masks.items():  # the masked positions are exactly 0 after the merge
        assert not found[name].detach()[m == 0].any(), name
    assert get_sparsity_config(merged.config) is not None
    assert lora_view.engine_state(model) is not None
    ref = weakref.ref(model)
    del model, eng, merged, found, state, config
    gc.collect()
    assert ref() is None  # the kept state does not hold the model alive
