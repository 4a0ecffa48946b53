"""Masks in every checkpoint and in save_model; exact resume; resume at a new level; bad files."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainerCallback

from hf_sparsity import SparsityCallback, SparsityConfig, SparsityError
from hf_sparsity.constants import SPARSITY_MASKS_NAME
from hf_sparsity.storage.masks_file import load_masks

from .conftest import tiny_model
from .trainer_utils import InvariantChecker, make_trainer


def _run(arch, out, config, seed=0, resume=None, steps=6, save_steps=3, extra_cbs=()):
    model = tiny_model(arch, seed=seed)
    cb = SparsityCallback(config)
    cbs = [cb, InvariantChecker(cb), *extra_cbs]
    trainer = make_trainer(model, out, cbs, max_steps=steps, save_strategy="steps", save_steps=save_steps)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model, cb


@pytest.mark.slow  # a Trainer run with a checkpoint every step
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_every_checkpoint_and_save_model_carry_masks(arch, tmp_path):
    config = SparsityConfig(sparsity=0.75, init_method="topk")
    trainer, model, cb = _run(arch, tmp_path / "run", config)
    for step in (3, 6):
        ckpt = tmp_path / "run" / f"checkpoint-{step}"
        masks, meta = load_masks(ckpt)
        assert set(masks) == set(cb.engine.masks)
        weights = load_file(ckpt / "model.safetensors")
        for name, m in masks.items():
            assert torch.count_nonzero(weights[name][m == 0]) == 0  # saved after masking
            assert int((m == 0).sum()) == round(0.75 * m.numel())
        cfg = json.loads((ckpt / "config.json").read_text())
        assert cfg["sparsity"]["sparsity"] == 0.75 and cfg["sparsity"]["_state"]["optimizer_steps"] == step
    final = tmp_path / "final"
    trainer.save_model(str(final))
    masks, _ = load_masks(final)
    assert all(torch.equal(masks[n], cb.engine.masks[n]) for n in masks)
    assert "sparsity" in json.loads((final / "config.json").read_text())


@pytest.mark.slow  # Trainer runs: whole, interrupted and resumed
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_resume_is_bit_identical(arch, tmp_path):
    config = SparsityConfig(sparsity=0.6, init_method="topk")
    _, full_model, full_cb = _run(arch, tmp_path / "a", config)
    # A different initialization: fresh topk masks would differ, so equality proves restoration.
    _, resumed, cb = _run(arch, tmp_path / "b", config, seed=7, resume=str(tmp_path / "a" / "checkpoint-3"))
    assert cb.restored_from == str(tmp_path / "a" / "checkpoint-3")
    for name, m in full_cb.engine.masks.items():
        assert torch.equal(cb.engine.masks[name], m)
    for (n, p), (_, q) in zip(full_model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(p, q), n
    assert cb.engine.optimizer_steps == 6


class _Probe(TrainerCallback):
    """Records, right after masks are set up, the regrown weights and their optimizer state."""

    def __init__(self, cb, old_masks):
        self.cb, self.old = cb, old_masks
        self.seen = False

    def on_train_begin(self, args, state, control, optimizer=None, **kw):
        inner = getattr(optimizer, "optimizer", optimizer)
        for name, m in self.cb.engine.masks.items():
            p = self.cb.engine.model.get_parameter(name)
            regrown = (self.old[name] == 0) & (m == 1)
            assert int(regrown.sum()) > 0
            assert torch.count_nonzero(p.detach()[regrown]) == 0  # regrown weights start at 0
            for v in inner.state[p].values():
                if torch.is_tensor(v) and v.shape == p.shape:
                    assert torch.count_nonzero(v[regrown]) == 0  # with zeroed optimizer state
        self.seen = True


def _dirty_masked_positions(ckpt, masks):
    """Nonzero optimizer state at masked positions (the weights there must stay 0: a checkpoint whose
    weights disagree with its masks is refused, see test_mask_file_of_another_model_is_refused)."""
    opt_path = os.path.join(ckpt, "optimizer.pt")
    opt = torch.load(opt_path, weights_only=False)
    dirtied = 0
    for st in opt["state"].values():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == 2:
                st[k] = v + 0.5
                dirtied += 1
    assert dirtied > 0
    torch.save(opt, opt_path)


@pytest.mark.slow  # Trainer runs
def test_resume_at_another_level_prunes_or_regrows(tmp_path):
    _, _, first = _run("llama", tmp_path / "a", SparsityConfig(sparsity=0.5, init_method="topk"))
    old = {n: m.clone() for n, m in first.engine.masks.items()}
    ckpt = str(tmp_path / "a" / "checkpoint-6")
    # Higher level: old zeros stay zeros, the lowest-magnitude survivors join them.
    _, model, cb = _run(
        "llama", tmp_path / "b", SparsityConfig(sparsity=0.8, init_method="topk"), resume=ckpt, steps=9
    )
    for name, m in cb.engine.masks.items():
        assert int((m == 0).sum()) == round(0.8 * m.numel())
        assert bool(((old[name] == 0) <= (m == 0)).all())
    # Lower level: random masked positions regrow from 0 with zeroed optimizer state, then train.
    # The checkpoint is first given nonzero optimizer state at its masked positions (as a
    # hand-edited or foreign checkpoint might have), so the probe can only pass if resume zeroes it.
    _dirty_masked_positions(ckpt, old)
    probe_cb = SparsityCallback(SparsityConfig(sparsity=0.3, init_method="topk"))
    probe = _Probe(probe_cb, old)
    model = tiny_model("llama")
    trainer = make_trainer(model, tmp_path / "c", [probe_cb, probe, InvariantChecker(probe_cb)], max_steps=9)
    trainer.train(resume_from_checkpoint=ckpt)
    assert probe.seen
    for name, m in probe_cb.engine.masks.items():
        assert int((m == 0).sum()) == round(0.3 * m.numel())
        assert bool(((m == 0) <= (old[name] == 0)).all())
        regrown = (old[name] == 0) & (m == 1)
        assert torch.count_nonzero(model.get_parameter(name).detach()[regrown]) > 0  # and they trained


@pytest.mark.slow  # Trainer runs
def test_from_pretrained_of_a_sparse_folder_brings_its_masks(tmp_path):
    trainer, _, cb = _run("gpt2", tmp_path / "a", SparsityConfig(sparsity=0.5, init_method="topk"))
    trainer.save_model(str(tmp_path / "sparse"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sparse")
    cb2 = SparsityCallback(SparsityConfig(sparsity=0.5, init_method="topk"))
    make_trainer(model, tmp_path / "b", [cb2], max_steps=2).train()
    assert cb2.restored_from == str(tmp_path / "sparse")
    assert all(torch.equal(cb2.engine.masks[n], m) for n, m in cb.engine.masks.items())


def test_resume_without_masks_is_a_clear_error(tmp_path):
    _run("gpt2", tmp_path / "a", SparsityConfig(sparsity=0.5))
    os.remove(tmp_path / "a" / "checkpoint-3" / SPARSITY_MASKS_NAME)
    with pytest.raises(SparsityError, match="no sparsity_masks.safetensors was found.*resume_from="):
        _run(
            "gpt2", tmp_path / "b", SparsityConfig(sparsity=0.5), resume=str(tmp_path / "a" / "checkpoint-3")
        )


def test_bad_mask_files_are_refused(tmp_path):
    from hf_sparsity.mask_engine.engine import SparsityEngine

    model = tiny_model("gpt2")
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5))
    eng.build_masks()
    path = eng.save(tmp_path)
    data = open(path, "rb").read()
    (tmp_path / "t").mkdir()
    open(tmp_path / "t" / SPARSITY_MASKS_NAME, "wb").write(data[: len(data) // 2])
    with pytest.raises(SparsityError, match="truncated or corrupt"):
        load_masks(tmp_path / "t")
    (tmp_path / "c").mkdir()
    open(tmp_path / "c" / SPARSITY_MASKS_NAME, "wb").write(b"\x00" * 64)
    with pytest.raises(SparsityError, match="truncated or corrupt"):
        SparsityEngine(model, SparsityConfig(sparsity=0.5)).restore(tmp_path / "c")
    bigger = tiny_model("gpt2", hidden=64)
    with pytest.raises(SparsityError, match=r"has shape \[32, 96\] but the parameter has \[64, 192\]"):
        SparsityEngine(bigger, SparsityConfig(sparsity=0.5)).restore(tmp_path)
    with pytest.raises(SparsityError, match="belongs to another model"):
        SparsityEngine(tiny_model("llama"), SparsityConfig(sparsity=0.5)).restore(tmp_path)
    with pytest.raises(SparsityError, match="No mask file"):
        load_masks(tmp_path / "missing")


def test_the_mask_file_has_one_writer_and_on_save_only_checks_it(tmp_path):
    """save_pretrained writes the mask file (before trainer_state.json); on_save never writes it: a
    checkpoint saved another way (a Trainer.model that is not a PreTrainedModel) is an error naming why."""
    from types import SimpleNamespace

    trainer, _, cb = _run("gpt2", tmp_path, SparsityConfig(sparsity=0.5), steps=3)
    ckpt = tmp_path / "checkpoint-3"
    written = (ckpt / SPARSITY_MASKS_NAME).stat().st_mtime_ns
    args, state = trainer.args, SimpleNamespace(global_step=3, is_world_process_zero=True)
    cb.on_save(args, state, None)
    assert (ckpt / SPARSITY_MASKS_NAME).stat().st_mtime_ns == written
    (ckpt / SPARSITY_MASKS_NAME).unlink()
    with pytest.raises(SparsityError, match=f"saved without {SPARSITY_MASKS_NAME}.*not a PreTrainedModel"):
        cb.on_save(args, state, None)
    assert not (ckpt / SPARSITY_MASKS_NAME).exists()


def test_trainer_still_offers_what_the_two_hooks_rely_on():
    """The library's only frame read and only method replacement depend on these transformers internals;
    if a release changes them, this fails by name (and the resume / save_model tests above fail too)."""
    import inspect

    from transformers import Trainer

    from hf_sparsity.hooks import TRAINER_FRAMES

    for fn in TRAINER_FRAMES:  # resume_dir_from_trainer_frame reads this argument from these frames
        assert "resume_from_checkpoint" in inspect.signature(getattr(Trainer, fn)).parameters, fn
    # carry_masks_in_save_pretrained: save_model (no callback event) must save through model.save_pretrained.
    assert "save_pretrained" in inspect.getsource(Trainer._save)


def test_resume_dir_is_read_from_trainer(tmp_path):
    from hf_sparsity.hooks import resume_dir_from_trainer_frame

    _run("gpt2", tmp_path / "a", SparsityConfig(sparsity=0.5), steps=3)
    seen = []

    class Probe(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen.append(resume_dir_from_trainer_frame())

    ckpt = str(tmp_path / "a" / "checkpoint-3")
    _run("gpt2", tmp_path / "b", SparsityConfig(sparsity=0.5), resume=ckpt, steps=4, extra_cbs=[Probe()])
    assert seen == [ckpt]


def _sparse_folder(path, seed, **save_kw):
    """A saved model with its masks, as save_pretrained writes it (weights exactly 0 where masked)."""
    from hf_sparsity.mask_engine.engine import SparsityEngine

    model = tiny_model("llama", seed=seed)
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, seed=seed))
    eng.build_masks()
    eng.apply()
    eng.install_save_hook()
    model.save_pretrained(path, **save_kw)
    return eng


@pytest.mark.parametrize("sharded", [False, True])
def test_mask_file_of_another_model_is_refused(tmp_path, sharded):
    """A mask file with the same names and shapes, copied from another model into a checkpoint folder:
    the weights there are nonzero where it masks, so restore refuses it, naming file, tensor and count."""
    import shutil

    from hf_sparsity.mask_engine.engine import SparsityEngine

    kw = {"max_shard_size": "20KB"} if sharded else {}
    mine = _sparse_folder(tmp_path / "mine", seed=1, **kw)
    _sparse_folder(tmp_path / "other", seed=2)
    if sharded:
        assert (tmp_path / "mine" / "model.safetensors.index.json").is_file()
    # Its own mask file restores.
    eng = SparsityEngine(tiny_model("llama"), SparsityConfig(sparsity=0.5, seed=1))
    eng.restore(tmp_path / "mine")
    assert all(torch.equal(eng.masks[n], m) for n, m in mine.masks.items())

    shutil.copy(tmp_path / "other" / SPARSITY_MASKS_NAME, tmp_path / "mine" / SPARSITY_MASKS_NAME)
    foreign = load_masks(tmp_path / "mine")[0]  # a valid file: names, shapes and checksum all fine
    first = next(iter(foreign))
    with pytest.raises(SparsityError) as err:
        SparsityEngine(tiny_model("llama"), SparsityConfig(sparsity=0.5, seed=1)).restore(tmp_path / "mine")
    msg = str(err.value)
    assert "model" in msg and ".safetensors" in msg and repr(first) in msg
    assert "was not saved with these weights" in msg and "remove it" in msg
    weights = mine.model.get_parameter(first).detach()
    differ = int(torch.count_nonzero(weights[foreign[first] == 0]))
    assert differ > 0 and f"nonzero at {differ} of the" in msg


def test_weights_check_skips_folders_without_those_weights(tmp_path):
    """No weight file, or a weight file lacking the tensor (weights kept elsewhere): no check, no error."""
    import shutil

    from safetensors.torch import save_file

    from hf_sparsity.mask_engine.engine import SparsityEngine

    src = _sparse_folder(tmp_path / "src", seed=1)
    (tmp_path / "masks_only").mkdir()
    shutil.copy(tmp_path / "src" / SPARSITY_MASKS_NAME, tmp_path / "masks_only")
    SparsityEngine(tiny_model("llama"), SparsityConfig(sparsity=0.5, seed=1)).restore(tmp_path / "masks_only")
    (tmp_path / "other_names").mkdir()
    shutil.copy(tmp_path / "src" / SPARSITY_MASKS_NAME, tmp_path / "other_names")
    save_file({"something.else": torch.ones(3)}, str(tmp_path / "other_names" / "model.safetensors"))
    eng = SparsityEngine(tiny_model("llama"), SparsityConfig(sparsity=0.5, seed=1))
    eng.restore(tmp_path / "other_names")
    assert all(torch.equal(eng.masks[n], m) for n, m in src.masks.items())


def test_resume_from_a_checkpoint_with_revived_weights_is_refused(tmp_path):
    """Trainer resume reads the same check: weights nonzero where the masks prune are refused."""
    from safetensors.torch import save_file

    _, _, first = _run("llama", tmp_path / "a", SparsityConfig(sparsity=0.5))
    ckpt = tmp_path / "a" / "checkpoint-6"
    weights = load_file(ckpt / "model.safetensors")
    name = next(iter(first.engine.masks))
    weights[name] = weights[name] + 0.1 * (first.engine.masks[name] == 0)
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SparsityError, match=f"{name!r} is nonzero at"):
        _run("llama", tmp_path / "b", SparsityConfig(sparsity=0.5), resume=str(ckpt), steps=9)


@pytest.mark.slow  # Trainer runs
def test_resume_under_another_seed_keeps_the_seed_that_made_the_masks(tmp_path, caplog):
    _, _, first = _run("llama", tmp_path / "a", SparsityConfig(sparsity=0.5, seed=1234))
    with caplog.at_level("WARNING", logger="hf_sparsity"):
        _, _, cb = _run(
            "llama",
            tmp_path / "b",
            SparsityConfig(sparsity=0.5, seed=999),
            resume=str(tmp_path / "a" / "checkpoint-3"),
        )
    assert all(torch.equal(cb.engine.masks[n], m) for n, m in first.engine.masks.items())
    section = json.loads((tmp_path / "b" / "checkpoint-6" / "config.json").read_text())["sparsity"]
    assert section["seed"] == 1234 and section["_state"]["mask_seeds"] == {"seed": 1234}
    assert SparsityConfig.from_dict(section).seed == 1234
    told = [r.getMessage() for r in caplog.records if "built with seeds" in r.getMessage()]
    assert len(told) == 1 and "1234" in told[0] and "999" in told[0]
    # A fresh run (masks built now) writes its own seed.
    _run("llama", tmp_path / "c", SparsityConfig(sparsity=0.5, seed=999), steps=3)
    fresh = json.loads((tmp_path / "c" / "checkpoint-3" / "config.json").read_text())["sparsity"]
    assert fresh["seed"] == 999
