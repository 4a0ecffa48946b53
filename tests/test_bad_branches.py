"""The retry, revert, fallback, copy-through and resume branches, each driven into and checked for its
documented outcome: refit's conjugate-gradient retry and refusal, a reconstruction that must be undone,
a shard tensor the model class does not hold, token counts across resume and over processes, the
checkpoint to resume from, and DeepSpeed offload refused flag by flag."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_sparsity import SparsityError
from hf_sparsity.pruning import prune_oneshot

from .realistic import realistic_model


# ------------------------------------------------------------------------------------------ refit (CG)
def _ill_conditioned(n=32, rows=8, seed=0):
    """A positive-definite H with eigenvalues from 1e-4 to 1e2 (condition 1e6), weights, a half mask."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    H = (Q * torch.logspace(-4, 2, n, dtype=torch.float64)) @ Q.T
    H = ((H + H.T) / 2).float()
    return torch.randn(rows, n, generator=g), H, torch.rand(rows, n, generator=g) > 0.5


def _exact_refit(W, H, keep, damp):
    """Each row's damped least-squares solution on its kept columns, in float64 (the definition)."""
    Hd = H.double() + damp * H.diagonal().double().mean() * torch.eye(H.shape[0], dtype=torch.float64)
    out = torch.zeros(W.shape, dtype=torch.float64)
    for r in range(W.shape[0]):
        k = keep[r].nonzero().squeeze(1)
        out[r, k] = torch.linalg.solve(Hd[k][:, k], (Hd @ W[r].double())[k])
    return out


def test_refit_retries_a_solve_that_hits_its_iteration_limit_with_more_damping(caplog):
    """8 CG iterations do not solve the system at damping 0.01 nor 0.1 (condition ~1e4): each is retried with
    ten times the damping, and the result is the exact solution at the damping that converged (1.0),
    never the unconverged iterate."""
    from hf_sparsity.pruning.refit import refit_weights

    W, H, keep = _ill_conditioned()
    with caplog.at_level(logging.WARNING, logger="hf_sparsity"):
        got = refit_weights(W, H, keep, percdamp=0.01, name="L", tol=1e-4, max_iter=8, energy_tol=0)
    assert caplog.text.count("retrying with") == 2
    damp = float(re.search(r"needed damping ([0-9.e+-]+)", caplog.text).group(1))
    assert damp == pytest.approx(1.0)
    assert torch.all(got[~keep] == 0)
    want = _exact_refit(W, H, keep, damp)
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3)
    unconverged = _exact_refit(W, H, keep, 0.01)
    assert (got.double() - unconverged).abs().max() > 1e-2  # a different solution: not silently kept


def test_refit_refuses_when_every_try_runs_out_of_iterations(caplog):
    from hf_sparsity.pruning.refit import refit_weights

    W, H, keep = _ill_conditioned()
    with caplog.at_level(logging.WARNING), pytest.raises(SparsityError, match="ill-conditioned.*--percdamp"):
        refit_weights(W, H, keep, percdamp=0.01, name="L", tol=1e-4, max_iter=8, energy_tol=0, max_tries=2)
    with pytest.raises(SparsityError, match="ill-conditioned"):  # one try, one past the limit it needs
        refit_weights(W, H, keep, percdamp=0.1, tol=1e-4, max_iter=8, energy_tol=0, max_tries=1)
    ok = refit_weights(W, H, keep, percdamp=1.0, tol=1e-4, max_iter=8, energy_tol=0, max_tries=1)
    torch.testing.assert_close(ok.double(), _exact_refit(W, H, keep, 1.0), rtol=1e-3, atol=1e-3)


# ------------------------------------------------------------------------------------------ reconstruction
def _calib(n=4, seqlen=12, vocab=101, seed=0):
    return torch.randint(2, vocab, (n, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_reconstruction_that_raises_the_error_is_undone(arch, caplog):
    """A learning rate of 10 wrecks every block: each is put back, so the weights, masks and the next
    blocks' inputs equal the run without reconstruction, bit for bit, and the recorded error is unchanged."""
    calib = _calib()
    plain = realistic_model(arch, layers=2)
    ref = prune_oneshot(plain, 0.5, calib, method="wanda", batch_size=2)
    model = realistic_model(arch, layers=2)
    with caplog.at_level(logging.WARNING, logger="hf_sparsity"):
        got = prune_oneshot(
            model, 0.5, calib, method="wanda", batch_size=2, reconstruct_steps=3, reconstruct_lr=10.0
        )
    assert caplog.text.count("raised") == 2 and "kept the weights before" in caplog.text
    for before, after in got.info["reconstruct"]["block_error_before_after"]:
        assert before == after
    for n in ref.masks:
        assert torch.equal(got.masks[n], ref.masks[n]), n
    want = dict(plain.named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, want[n]), n


def test_a_reconstruction_that_helps_is_kept():
    calib = _calib(8, 16)
    model = realistic_model("llama", layers=2)
    got = prune_oneshot(
        model, 0.6, calib, method="wanda", batch_size=4, reconstruct_steps=6, reconstruct_lr=3e-3
    )
    errors = got.info["reconstruct"]["block_error_before_after"]
    assert all(after < before for before, after in errors), errors


def test_reconstruct_steps_boundary():
    calib = _calib()
    prune_oneshot(realistic_model("llama", layers=1), 0.5, calib, method="wanda", reconstruct_steps=1)
    with pytest.raises(SparsityError, match="at least 1 step"):
        prune_oneshot(realistic_model("llama", layers=1), 0.5, calib, method="wanda", reconstruct_steps=0.9)


# ------------------------------------------------------------------------------------------ streaming
def test_a_shard_tensor_the_model_does_not_hold_is_copied_through_byte_for_byte(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_sparsity.pruning.streaming import StreamingModel

    src = tmp_path / "in"
    realistic_model("llama", layers=2).to(torch.bfloat16).save_pretrained(src, max_shard_size="20KB")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    tensors = load_file(src / shard)
    extra = {
        "model.rotary_emb.legacy_table": torch.randn(5, 3).to(torch.bfloat16),
        "model.vision_tower.patch_ids": torch.arange(7, dtype=torch.int32) * 3 - 4,
    }
    save_file({**tensors, **extra}, str(src / shard), metadata={"format": "pt"})
    for k in extra:
        index["weight_map"][k] = shard
    (src / "model.safetensors.index.json").write_text(json.dumps(index))

    stream = StreamingModel(src)
    stream.out = tmp_path / "out"
    stream.out.mkdir()
    prune_oneshot(stream.model, 0.5, _calib(), method="wanda", batch_size=2, stream=stream)
    stream.finish()
    out_index = json.loads((stream.out / "model.safetensors.index.json").read_text())
    assert set(out_index["weight_map"]) == set(index["weight_map"])
    for k, t in extra.items():
        with safe_open(stream.out / out_index["weight_map"][k], "pt") as f:
            got = f.get_tensor(k)
        assert got.dtype == t.dtype and got.shape == t.shape
        assert torch.equal(
            got.view(torch.uint8) if got.dtype.is_floating_point else got,
            t.view(torch.uint8) if t.dtype.is_floating_point else t,
        )


# ------------------------------------------------------------------------------------------ token counts
def _counter(seq_len=None):
    from hf_sparsity.flops.callback import TokenCounter

    return TokenCounter(seq_len)


def _args(batch=2, accum=1, world=1):
    return SimpleNamespace(
        per_device_train_batch_size=batch, gradient_accumulation_steps=accum, world_size=world
    )


def test_a_resumed_run_with_trainers_count_counts_only_new_tokens():
    """Trainer's num_input_tokens_seen already holds the tokens before the checkpoint: the first step after
    resuming counts only its own."""
    model = torch.nn.Linear(2, 2)
    c = _counter()
    c.start(model, SimpleNamespace(num_input_tokens_seen=1000))
    assert c.step(_args(), SimpleNamespace(num_input_tokens_seen=1096)) == 96
    assert c.step(_args(), SimpleNamespace(num_input_tokens_seen=1150)) == 54
    c.stop()
    fresh = _counter()  # an uninterrupted run: the same steps sum to the same total
    fresh.start(model, SimpleNamespace(num_input_tokens_seen=0))
    assert fresh.step(_args(), SimpleNamespace(num_input_tokens_seen=1000)) == 1000
    fresh.stop()


class _Rec(torch.nn.Module):
    def forward(self, input_ids=None, attention_mask=None):
        return input_ids


def test_batch_counts_sum_micro_batches_and_skip_padding_and_evaluation():
    model = _Rec().train()
    c = _counter()
    c.start(model, SimpleNamespace(num_input_tokens_seen=0))
    mask1 = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    mask2 = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]])
    model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=mask1)  # 8 real tokens
    model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=mask2)  # 3: accumulation of 2
    model.eval()
    model(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 5))  # evaluation
    model.train()
    assert c.step(_args(accum=2), SimpleNamespace(num_input_tokens_seen=0)) == 11
    model(input_ids=torch.ones(3, 4, dtype=torch.long))  # no attention mask: every entry
    assert c.step(_args(), SimpleNamespace(num_input_tokens_seen=0)) == 12
    c.stop()


def test_seq_len_counts_batch_times_accumulation_times_processes_times_seq_len():
    c = _counter(seq_len=64)
    c.start(torch.nn.Linear(2, 2), SimpleNamespace(num_input_tokens_seen=0))
    assert c.step(_args(batch=3, accum=5, world=2), SimpleNamespace()) == 3 * 5 * 2 * 64


def test_ranks_with_different_real_tokens_are_summed_not_multiplied(monkeypatch):
    """Two processes: this one trained 7 real tokens, the other 12 (different padding). The step counts 19
    on both (an all-reduce sum), not 7 x 2."""
    import torch.distributed as dist

    from hf_sparsity.flops import callback

    other = {"n": 12}

    def all_reduce(t, *a, **k):
        t += other["n"]

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert callback._sum_over_processes(torch.tensor(7)) == 19
    model = _Rec().train()
    c = _counter()
    c.start(model, SimpleNamespace(num_input_tokens_seen=0))
    model(input_ids=torch.ones(1, 9, dtype=torch.long), attention_mask=torch.tensor([[1] * 7 + [0] * 2]))
    assert c.step(_args(world=2), SimpleNamespace(num_input_tokens_seen=0)) == 19
    other["n"] = 7  # equal counts: 14 either way
    model(input_ids=torch.ones(1, 7, dtype=torch.long))
    assert c.step(_args(world=2), SimpleNamespace(num_input_tokens_seen=0)) == 14
    c.stop()


# ------------------------------------------------------------------------------------------ resume
def _complete_checkpoint(root: Path, step: int) -> Path:
    from safetensors.torch import save_file

    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (d / "config.json").write_text("{}")
    save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))
    return d


def test_resume_takes_the_highest_step_not_the_last_name(tmp_path):
    from hf_sparsity.storage.resume import last_complete_checkpoint

    for step in (2, 9, 10, 100):
        _complete_checkpoint(tmp_path, step)
    assert Path(last_complete_checkpoint(tmp_path)).name == "checkpoint-100"
    (tmp_path / "checkpoint-100" / "trainer_state.json").unlink()  # a run killed while saving step 100
    assert Path(last_complete_checkpoint(tmp_path)).name == "checkpoint-10"
    (tmp_path / "checkpoint-10" / "model.safetensors").write_bytes(b"\0" * 10)
    assert Path(last_complete_checkpoint(tmp_path)).name == "checkpoint-9"
    (tmp_path / "checkpoint-nine").mkdir()  # not a checkpoint name: ignored
    assert Path(last_complete_checkpoint(tmp_path)).name == "checkpoint-9"


def test_resume_true_and_a_partial_path(tmp_path):
    from hf_sparsity.storage.resume import resume_checkpoint

    _complete_checkpoint(tmp_path, 9)
    (_complete_checkpoint(tmp_path, 10) / "trainer_state.json").write_text('{"global_step": 1')  # truncated
    assert Path(resume_checkpoint(tmp_path, True)).name == "checkpoint-9"
    with pytest.raises(SparsityError, match="checkpoint-10.*truncated.*resume from .*checkpoint-9 instead"):
        resume_checkpoint(tmp_path, tmp_path / "checkpoint-10")
    assert resume_checkpoint(tmp_path, False) is None and resume_checkpoint(tmp_path, None) is None


# ------------------------------------------------------------------------------------------ ZeRO offload
def _zero_optimizer(cls_name, **flags):
    return type(cls_name, (), dict(flags))()


@pytest.mark.parametrize(
    "cls_name,flag",
    [
        ("DeepSpeedZeroOptimizer", "cpu_offload"),
        ("DeepSpeedZeroOptimizer_Stage3", "offload_optimizer"),
        ("DeepSpeedZeroOptimizer_Stage3", "offload_param"),
    ],
)
def test_each_deepspeed_offload_flag_is_refused(cls_name, flag):
    from hf_sparsity import zero

    others = {f: False for f in ("cpu_offload", "offload_optimizer", "offload_param")}
    with pytest.raises(SparsityError, match="offload.*without offload are supported"):
        zero.check_supported(_zero_optimizer(cls_name, **{**others, flag: True}))
    wrapped = SimpleNamespace(optimizer=_zero_optimizer(cls_name, **{**others, flag: True}))  # accelerate's
    with pytest.raises(SparsityError, match="offload"):
        zero.check_supported(wrapped)
    zero.check_supported(_zero_optimizer(cls_name, **others))  # no offload: supported
