"""FLOP and parameter accounting: the published GPT-3 XL anchors, Chinchilla App. F term by term, masks, CLI,
and the training-time FlopAccountant."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

from hf_sparsity.cli import main
from hf_sparsity.flops import (
    FlopAccountant,
    chinchilla_forward_flops,
    count_flops,
    count_flops_from_config,
)
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine
from hf_sparsity.utils import SparsityError

from .conftest import tiny_config, tiny_model

GPT3_XL = {
    "model_type": "gpt2",
    "n_layer": 24,
    "n_embd": 2048,
    "n_head": 16,
    "n_inner": 8192,
    "n_positions": 2048,
    "vocab_size": 50257,
}
GPT3_XL_SHAPE = dict(seq_len=2048, vocab_size=50257, d_model=2048, num_layers=24, ffw_size=8192, num_heads=16)


@pytest.fixture(scope="module")
def xl_dense():
    return count_flops_from_config(GPT3_XL)


# ---------------------------------------------------------------------- the published anchors
def test_gpt3_xl_838_inference_and_params(xl_dense):
    """Seed 001: 83.8% sparse GPT-3 XL has 3x fewer inference FLOPs and 4.3x fewer parameters."""
    sparse = count_flops_from_config(GPT3_XL, 0.838)
    assert sparse.params == xl_dense.params  # the same tensors, just masked
    assert xl_dense.params / sparse.nonzero_params == pytest.approx(4.3, abs=0.1)
    assert xl_dense.inference_flops_per_token / sparse.inference_flops_per_token == pytest.approx(
        3.0, abs=0.1
    )


def test_gpt3_xl_75_training(xl_dense):
    """Seeds 000/004: 75% sparse pre-training of GPT-3 XL takes 2.5x fewer FLOPs."""
    sparse = count_flops_from_config(GPT3_XL, 0.75)
    assert xl_dense.training_flops_per_token / sparse.training_flops_per_token == pytest.approx(2.5, abs=0.1)
    assert sparse.training_flops_per_token == 3 * sparse.forward_flops_per_token


@pytest.mark.parametrize("s", [0.0, 0.75, 0.838])
def test_gpt3_xl_matches_chinchilla_closed_form(s):
    """Counting the real modules gives exactly Chinchilla App. F (embeddings excluded)."""
    report = count_flops_from_config(GPT3_XL, s)
    ref = chinchilla_forward_flops(**GPT3_XL_SHAPE, sparsity=s)
    # Per-tensor zero counts are rounded to whole weights, so allow a relative 1e-8.
    assert report.forward_flops_per_sequence == pytest.approx(ref["forward"], rel=1e-8)
    assert report.training_flops_per_sequence == pytest.approx(ref["training"], rel=1e-8)


# ---------------------------------------------------------------------- a hand-computed case
def _hand_gpt2():
    from transformers import GPT2Config

    # 1 block, d=16, 2 heads of 8, FFN 64, vocab 10, seq 8
    return GPT2Config(n_layer=1, n_embd=16, n_head=2, n_inner=64, n_positions=8, vocab_size=10)


def test_hand_computed_every_term():
    report = count_flops_from_config(_hand_gpt2(), 0.5, seq_len=8)
    per = {t.name: t for t in report.layers}
    d, h, k, f, v, L = 16, 2, 8, 64, 10, 8
    # Linear layers, per token: 2 * d_in * d_out, times the density 0.5.
    assert per["transformer.h.0.attn.c_attn.weight"].dense_flops_per_token == 2 * d * 3 * d == 1536
    assert per["transformer.h.0.attn.c_proj.weight"].dense_flops_per_token == 2 * d * d == 512
    assert per["transformer.h.0.mlp.c_fc.weight"].dense_flops_per_token == 2 * d * f == 2048
    assert per["transformer.h.0.mlp.c_proj.weight"].dense_flops_per_token == 2 * f * d == 2048
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        t = per[f"transformer.h.0.{name}.weight"]
        assert t.sparsity == 0.5
        assert t.forward_flops_per_token(L) == t.dense_flops_per_token / 2
    # Attention per token: logits 2*L*h*k + softmax 3*h*L + reduction 2*L*h*k = 256 + 48 + 256.
    attn = per["transformer.h.0.attn"]
    assert attn.forward_flops_per_token(L) == 2 * L * h * k + 3 * h * L + 2 * L * h * k == 560
    # Final logits 2*d*V = 320, dense; the embedding term 2*V*d is reported but excluded.
    assert per["lm_head.weight"].forward_flops_per_token(L) == 2 * d * v == 320
    assert report.embedding_flops_per_token == 320
    assert per["transformer.wte.weight"].forward_flops_per_token(L) == 0
    dense_total = 1536 + 512 + 2048 + 2048 + 560 + 320
    assert report.dense().forward_flops_per_token == dense_total == 7024
    assert report.forward_flops_per_token == (1536 + 512 + 2048 + 2048) / 2 + 560 + 320 == 3952
    assert report.forward_flops_per_sequence == 3952 * L
    assert report.training_flops_per_token == 3 * 3952
    # Parameters: wte 160, wpe 128, 3 LayerNorms 3*32, c_attn 768+48, c_proj 256+16, c_fc 1024+64,
    # mlp.c_proj 1024+16; lm_head is tied to wte and counted once.
    assert report.params == 160 + 128 + 96 + 816 + 272 + 1088 + 1040 == 3600
    assert report.nonzero_params == 3600 - (768 + 256 + 1024 + 1024) // 2 == 2064
    # The closed form agrees term by term (per sequence = per token * L).
    ref = chinchilla_forward_flops(
        seq_len=L, vocab_size=v, d_model=d, num_layers=1, ffw_size=f, num_heads=h, sparsity=0.5
    )
    assert ref["qkv"] == 1536 * L * 0.5 and ref["attn_out"] == 512 * L * 0.5
    assert ref["ffw"] == (2048 + 2048) * L * 0.5
    assert ref["logits_qk"] + ref["softmax"] + ref["reduction"] == 560 * L
    assert ref["final_logits"] == 320 * L and ref["embeddings"] == 320 * L
    assert ref["forward"] == report.forward_flops_per_sequence


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "opt"])
def test_module_count_matches_closed_form(arch):
    """Standard multi-head architectures (2-matrix MLP) count exactly as the formula says."""
    cfg = tiny_config(arch)
    report = count_flops(tiny_model(arch), sparsity=0.75, seq_len=64)
    ref = chinchilla_forward_flops(
        seq_len=64, vocab_size=128, d_model=32, num_layers=2, ffw_size=128, num_heads=4, sparsity=0.75
    )
    assert report.forward_flops_per_sequence == pytest.approx(ref["forward"], rel=1e-12)
    model = tiny_model(arch)
    assert report.params == sum(p.numel() for p in model.parameters()) == count_flops(model).params
    assert cfg.vocab_size == 128


def test_llama_three_mlp_matrices_and_gqa():
    """Llama: q/o are d x d, k/v are d x (kv_heads * head_dim), and gate/up/down are three FFN matrices."""
    report = count_flops(tiny_model("llama"), sparsity=0.5, seq_len=64)
    d, ffn, kv, hd, heads, L, v, layers = 32, 64, 2, 8, 4, 64, 128, 2
    linear_dense = layers * (2 * d * d * 2 + 2 * d * kv * hd * 2 + 3 * 2 * d * ffn)
    attention = layers * (2 * L * heads * hd * 2 + 3 * heads * L)
    logits = 2 * d * v
    assert report.kind_flops_per_token("linear") == linear_dense / 2
    assert report.kind_flops_per_token("attention") == attention
    assert report.kind_flops_per_token("logits") == logits
    mlp = [t for t in report.layers if ".mlp." in t.name]
    assert len(mlp) == 3 * layers


def test_counts_from_masks_and_model_dir(tmp_path):
    """Real masks (exact nonzeros) and a model folder's mask file give the same count as the levels."""
    model = tiny_model("gpt2")
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.75, seed=3))
    engine.build_masks()
    from_masks = count_flops(model, masks=engine.masks)
    from_levels = count_flops(model, levels=engine.levels)
    from_plan = count_flops(model, sparsity=0.75)
    assert from_masks.forward_flops_per_token == pytest.approx(from_plan.forward_flops_per_token, rel=1e-12)
    assert from_masks.nonzero_params == from_levels.nonzero_params == from_plan.nonzero_params
    ones = sum(int(m.sum()) for m in engine.masks.values())
    others = sum(p.numel() for n, p in model.named_parameters() if n not in engine.masks)
    assert from_masks.nonzero_params == ones + others
    engine.save(tmp_path)
    model.config.save_pretrained(tmp_path)
    from_dir = count_flops_from_config(tmp_path)
    assert from_dir.forward_flops_per_token == pytest.approx(from_masks.forward_flops_per_token, rel=1e-12)
    assert from_dir.nonzero_params == from_masks.nonzero_params


def test_config_only_path_for_a_70b_model():
    """A Llama-2-70B-shaped config counts on the meta device without allocating 140 GB."""
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    }
    report = count_flops_from_config(cfg, 0.5)
    assert report.params == pytest.approx(68.98e9, rel=0.01)
    assert report.seq_len == 4096


def test_bad_input_is_refused(tmp_path):
    model = tiny_model("gpt2")
    with pytest.raises(SparsityError, match="does not have"):
        count_flops(model, levels={"nope.weight": 0.5})
    with pytest.raises(SparsityError, match="No config"):
        count_flops_from_config(tmp_path / "missing")
    with pytest.raises(SparsityError, match="model_type"):
        count_flops_from_config({"n_layer": 2})
    with pytest.raises(SparsityError, match="outside"):
        count_flops_from_config(GPT3_XL, 1.0)


# ---------------------------------------------------------------------- CLI
def test_cli_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT3_XL))
    assert main(["flops", "--config", str(path), "--sparsity", "0.838", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"dense", "sparse"}
    for side in out.values():
        assert {"params", "nonzero_params", "inference_flops_per_token", "training_flops_per_token"} <= set(
            side
        )
    assert out["dense"]["params"] / out["sparse"]["nonzero_params"] == pytest.approx(4.3, abs=0.1)
    ratio = out["dense"]["inference_flops_per_token"] / out["sparse"]["inference_flops_per_token"]
    assert ratio == pytest.approx(3.0, abs=0.1)


def test_cli_text_and_errors(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT3_XL))
    assert (
        main(["flops", "--config", str(tmp_path), "--sparsity", "0.75", "--seq-len", "1024", "--per-layer"])
        == 0
    )
    text = capsys.readouterr().out
    assert "training FLOPs / token" in text and "seq_len 1024" in text and "c_attn" in text
    assert main(["flops", "--config", str(path), "--sparsity", "1.5"]) == 2
    assert "outside [0, 1)" in capsys.readouterr().err
    assert main(["flops", "--config", str(tmp_path / "none.json")]) == 2
    assert "no config.json there" in capsys.readouterr().err


# ---------------------------------------------------------------------- training-time accounting
@pytest.fixture(scope="module")
def accountant_parts():
    model = tiny_model("gpt2")
    targets = [d.name for d in SparsityEngine(model, SparsityConfig(sparsity=0.75)).plan if d.sparsify]
    return model, targets


def test_accountant_half_sparse_half_dense(accountant_parts):
    model, targets = accountant_parts
    acc = FlopAccountant(model, targets=targets, seq_len=64)
    sparse_levels = dict.fromkeys(targets, 0.75)
    acc.add_tokens(1000, sparse_levels)
    acc.add_tokens(1000, {})  # densified: no masks left
    assert acc.effective_sparsity == pytest.approx(0.375)
    sparse = count_flops(model, levels=sparse_levels, seq_len=64)
    dense = sparse.dense()
    assert acc.training_flops == pytest.approx(
        1000 * (sparse.training_flops_per_token + dense.training_flops_per_token)
    )
    assert acc.dense_training_flops == pytest.approx(2000 * dense.training_flops_per_token)
    assert acc.tokens == 2000
    assert acc.flop_savings == pytest.approx(1 - acc.training_flops / acc.dense_training_flops)


def test_accountant_variable_spdf_effective_75(accountant_parts):
    """Seed 004: 90% sparse Stage-1 then dense Stage-2, sized so the effective sparsity is 75%."""
    model, targets = accountant_parts
    acc = FlopAccountant(model, targets=targets, seq_len=64)
    for _ in range(5):
        acc.add_tokens(600, dict.fromkeys(targets, 0.9))
    acc.add_tokens(600, {})
    assert acc.effective_sparsity == pytest.approx(0.75)
    logs = acc.log_dict()
    assert logs["sparsity/effective_sparsity"] == pytest.approx(0.75)
    assert logs["sparsity/train_flops"] < logs["sparsity/dense_equivalent_flops"]


def test_accountant_static_run_matches_report_and_resumes(accountant_parts):
    model, targets = accountant_parts
    levels = dict.fromkeys(targets, 0.75)
    acc = FlopAccountant(model, seq_len=64)  # targets learned from the levels
    acc.add_tokens(512, levels)
    report = count_flops(model, levels=levels, seq_len=64)
    assert acc.flop_reduction == pytest.approx(
        report.dense().training_flops_per_token / report.training_flops_per_token
    )
    assert acc.effective_sparsity == pytest.approx(0.75)
    state = json.loads(json.dumps(acc.state_dict()))  # JSON-simple, for a checkpoint
    resumed = FlopAccountant(model, seq_len=64)
    resumed.load_state_dict(state)
    resumed.add_tokens(512, {})  # densified after resume: the targets are remembered
    assert resumed.effective_sparsity == pytest.approx(0.375)
    before = acc.training_flops
    acc.add_tokens(1, {"transformer.wte.weight": 0.5})  # not a matmul: warned about, counted dense
    assert acc.training_flops - before == pytest.approx(report.dense().training_flops_per_token)
    with pytest.raises(SparsityError):
        acc.add_tokens(-1, {})


def test_accountant_with_real_engine_levels():
    model = tiny_model("llama")
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5))
    engine.build_masks()
    acc = FlopAccountant(model, targets=engine.targets, seq_len=32)
    spent = acc.add_tokens(100, engine.levels)
    assert spent == pytest.approx(
        100 * count_flops(model, masks=engine.masks, seq_len=32).training_flops_per_token
    )
    assert torch.isfinite(torch.tensor(acc.effective_sparsity))


@pytest.mark.slow  # Trainer runs
@pytest.mark.parametrize("count_tokens", [True, False])
def test_dense_and_sparse_callbacks_count_the_same_tokens(tmp_path, count_tokens):
    """FlopCallback (dense baseline) and SparsityCallback count tokens the same way, with Trainer's
    own count (include_num_input_tokens_seen) or without it (batch x accumulation x seq_len)."""
    from hf_sparsity import SparsityCallback
    from hf_sparsity.flops.callback import FlopCallback

    from .trainer_utils import make_trainer

    tokens = {}
    for name, cb in (("dense", FlopCallback(seq_len=16)), ("sparse", SparsityCallback(0.5, seq_len=16))):
        trainer = make_trainer(
            tiny_model("llama"),
            tmp_path / name,
            [cb],
            max_steps=3,
            include_num_input_tokens_seen=count_tokens,
        )
        trainer.train()
        tokens[name] = cb.flops.tokens
    assert tokens["dense"] == tokens["sparse"] == 3 * 4 * 16  # steps x batch x block length


class _PaddedBlocks:
    """Samples padded to ``width`` with an attention_mask: real lengths ``lengths``."""

    def __init__(self, lengths, width=16, pad=1, vocab=128):
        g = torch.Generator().manual_seed(0)
        self.items = []
        for n in lengths:
            ids = torch.full((width,), pad, dtype=torch.long)
            ids[:n] = torch.randint(2, vocab, (n,), generator=g)
            mask = (torch.arange(width) < n).long()
            self.items.append(
                {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class _LoggedTokens(TrainerCallback):
    """The ``sparsity/tokens`` of every training log line (runs after the callback that adds it)."""

    def __init__(self):
        self.values = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and "sparsity/tokens" in logs:
            self.values.append(logs["sparsity/tokens"])


@pytest.mark.slow  # Trainer runs
@pytest.mark.parametrize("which", ["sparse", "dense"])
def test_padded_batches_count_their_real_tokens(tmp_path, caplog, which):
    """Padding is not counted, gradient accumulation sums micro-batches, evaluation is left out."""
    from hf_sparsity import SparsityCallback
    from hf_sparsity.flops.callback import FlopCallback

    from .trainer_utils import make_trainer

    lengths = [3 + (7 * i) % 13 for i in range(24)]  # 3..15 real tokens, padded to 16
    data = _PaddedBlocks(lengths)
    cb = SparsityCallback(0.5) if which == "sparse" else FlopCallback()
    rec = _LoggedTokens()
    trainer = make_trainer(
        tiny_model("llama"),
        tmp_path,
        [cb, rec],
        dataset=data,
        eval_dataset=_PaddedBlocks([16] * 8),
        eval_strategy="steps",
        eval_steps=1,
        max_steps=3,  # 3 steps x 4 samples x 2 micro-batches: exactly one pass over the 24 samples
        gradient_accumulation_steps=2,
        logging_steps=1,
    )
    with caplog.at_level("INFO", logger="hf_sparsity"):
        trainer.train()
    assert cb.flops.tokens == sum(lengths) < 24 * 16
    assert rec.values[-1] == sum(lengths) and len(rec.values) == 3
    assert rec.values == sorted(rec.values) and rec.values[0] < rec.values[-1]
    sources = [r.getMessage() for r in caplog.records if "tokens per step from" in r.getMessage()]
    assert sources == [
        "FLOPs: tokens per step from the training batches: nonzero attention_mask entries "
        "(padding excluded), summed over processes."
    ]
    assert cb._tokens._hook is None  # removed at train end: later forwards count nothing


@pytest.mark.parametrize("which", ["sparse", "dense"])
def test_samples_shorter_than_the_context_are_not_counted_as_the_context(tmp_path, which):
    from hf_sparsity import SparsityCallback
    from hf_sparsity.flops.callback import FlopCallback

    from .trainer_utils import make_trainer, random_blocks

    model = tiny_model("llama")
    assert model.config.max_position_embeddings == 64
    cb = SparsityCallback(0.5) if which == "sparse" else FlopCallback()
    make_trainer(model, tmp_path, [cb], dataset=random_blocks(length=16), max_steps=3).train()
    assert cb.flops.tokens == 3 * 4 * 16  # steps x batch x sample length, not x 64


@pytest.mark.slow  # a Trainer run
def test_packed_batches_without_attention_mask_count_every_token(tmp_path):
    """A packed (padding-free) batch: one row, position_ids restarting per sample, no attention_mask."""
    from hf_sparsity import SparsityCallback

    from .trainer_utils import make_trainer

    lengths = [5, 11, 7, 9, 3, 13, 6, 10]

    class Packed:
        def __len__(self):
            return 6

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(2, 128, (sum(lengths),), generator=g)
            pos = torch.cat([torch.arange(n) for n in lengths])
            return {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}

    cb = SparsityCallback(0.5)
    make_trainer(
        tiny_model("llama"),
        tmp_path,
        [cb],
        dataset=Packed(),
        per_device_train_batch_size=1,
        max_steps=3,
        gradient_accumulation_steps=2,
    ).train()
    assert cb.flops.tokens == 3 * 2 * sum(lengths)


@pytest.mark.slow  # a trl SFTTrainer run
def test_trl_sft_packing_counts_the_packed_tokens(tmp_path):
    """TRL's SFTTrainer with packing: the tokens counted are those of the packed rows, not rows x context."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from hf_sparsity import SparsityCallback

    words = [f"w{i}" for i in range(100)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    g = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[j] for j in torch.randint(0, 100, (int(n),), generator=g).tolist())
        for n in torch.randint(3, 20, (40,), generator=g)
    ]
    model = tiny_model("llama", vocab=len(vocab))
    cb = SparsityCallback(0.5)
    trainer = trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(
            output_dir=str(tmp_path),
            packing=True,
            max_length=48,
            per_device_train_batch_size=2,
            num_train_epochs=1,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        callbacks=[cb],
    )
    packed = trainer.train_dataset
    real = sum(len(r) for r in packed["input_ids"])
    trainer.train()
    assert trainer.state.global_step == (len(packed) + 1) // 2
    assert cb.flops.tokens == real < trainer.state.global_step * 2 * 64  # 64: the model's context
