"""hf_sparsity.evaluation: Pile-style loss, WikiText-103 adjusted perplexity, lm-eval harness (offline),
reports."""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_sparsity.evaluation import (
    HARNESS7,
    adjusted_perplexity,
    count_original_tokens,
    evaluate,
    pile_loss,
    sliding_window_nll,
    sparsity_summary,
    wikitext103_perplexity,
    wikitext_detokenize,
    write_offline_tasks,
)
from hf_sparsity.evaluation.perplexity import first_articles, iter_documents
from hf_sparsity.evaluation.runner import parse_limit
from hf_sparsity.utils import SparsityError

from .conftest import tiny_model


# ----------------------------------------------------------------------------- helpers
class CharTokenizer:
    """Byte-level toy tokenizer: one token per character (code point mod vocab), EOS = 1."""

    eos_token_id = 1

    def __init__(self, vocab: int = 128):
        self.vocab = vocab

    def _ids(self, text: str) -> list[int]:
        return [2 + ord(c) % (self.vocab - 2) for c in text]

    def __call__(self, text, add_special_tokens=False, verbose=False):
        if isinstance(text, str):
            return {"input_ids": self._ids(text)}
        return {"input_ids": [self._ids(t) for t in text]}


class UniformLM(nn.Module):
    """Every next-token distribution uniform over ``vocab``: NLL is ln(vocab) per target, by hand."""

    def __init__(self, vocab: int, context: int = 16):
        super().__init__()
        self.vocab = vocab
        self.config = type("C", (), {"max_position_embeddings": context})()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, self.vocab) + 0 * self.w
        return type("O", (), {"logits": logits})()


class BigramLM(UniformLM):
    """Logits depend only on the current token, so a target's NLL does not depend on its window."""

    def __init__(self, vocab: int, context: int = 16):
        super().__init__(vocab, context)
        torch.manual_seed(0)
        self.table = nn.Embedding(vocab, vocab)

    def forward(self, input_ids, use_cache=False):
        return type("O", (), {"logits": self.table(input_ids)})()


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t, "meta": {"i": i}}) + "\n" for i, t in enumerate(texts)))
    return path


DOCS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Sparse models keep only a fraction of their weights.",
    "Pile-format lines carry text and meta.",
    "A fourth, short one.",
]


# ----------------------------------------------------------------------------- WikiText-103 arithmetic
def test_adjusted_perplexity_hand_computed():
    # "x y z w": 4 original tokens; 7 characters -> 7 model tokens; uniform over 10 -> NLL 6 ln 10.
    res = wikitext103_perplexity(UniformLM(10, context=4), CharTokenizer(10), text="x y z w", progress=False)
    assert res["original_tokens"] == 4 and res["model_tokens"] == 7
    assert res["loss"] == pytest.approx(math.log(10))
    assert res["perplexity"] == pytest.approx(10.0)
    # exp(6 ln 10 / (4 - 1)) = 10^2
    assert res["adjusted_perplexity"] == pytest.approx(100.0)
    assert res["token_ratio"] == pytest.approx(2.0)
    assert adjusted_perplexity(6 * math.log(10), 7, 4) == pytest.approx(100.0)
    with pytest.raises(SparsityError):
        adjusted_perplexity(1.0, 1, 4)


def test_original_token_count_and_articles():
    text = " = T = \n \n a b , c \n = = S = = \n d \n = U = \n e \n"
    assert count_original_tokens(text) == len(text.strip().split(" "))
    assert first_articles(text, 1) == " = T = \n \n a b , c \n = = S = = \n d \n"
    assert first_articles(text, 5) == text
    assert wikitext_detokenize(" = = S = = \n a @-@ b , c 's \n") == " == S ==\na-b, c's\n"


@pytest.mark.parametrize("stride", [1, 3, 8])
def test_sliding_window_scores_each_target_once(stride):
    ids = list(torch.randint(0, 20, (41,), generator=torch.Generator().manual_seed(1)).tolist())
    model = BigramLM(20, context=8)
    total, n = sliding_window_nll(model, ids, context=8, stride=stride, batch_size=3, progress=False)
    assert n == len(ids) - 1
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    assert total == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(SparsityError):
        sliding_window_nll(model, ids, context=8, stride=9)


def test_detokenizer_matches_lm_eval(shared_data):
    pre = pytest.importorskip("lm_eval.tasks.wikitext.preprocess_wikitext")
    text = (shared_data / "text/wikitext-103/wiki.test.tokens").read_text(encoding="utf-8")[:200_000]
    assert wikitext_detokenize(text) == pre.wikitext_detokenizer({"page": text})


# ----------------------------------------------------------------------------- Pile-style loss
def _manual_pile_loss(model, tok, docs, context):
    ids = []
    for d in docs:
        ids += tok(d)["input_ids"] + [tok.eos_token_id]
    total, n = 0.0, 0
    for s in range(0, len(ids) - 1, context):
        w = torch.tensor([ids[s : s + context + 1]])
        if w.shape[1] < 2:
            break
        with torch.no_grad():
            logits = model(input_ids=w[:, :-1]).logits
        total += float(torch.nn.functional.cross_entropy(logits[0].float(), w[0, 1:], reduction="sum"))
        n += w.shape[1] - 1
    return total / n, n


def test_pile_loss_matches_manual_and_zst(tmp_path):
    zstd = pytest.importorskip("zstandard")
    model = tiny_model("llama").eval()
    tok = CharTokenizer(128)
    f = write_jsonl(tmp_path / "val.jsonl", DOCS)
    res = pile_loss(model, tok, f, context=32, batch_size=3, progress=False)
    loss, n = _manual_pile_loss(model, tok, DOCS, 32)
    assert res["tokens"] == n == sum(len(d) + 1 for d in DOCS) - 1
    assert res["loss"] == pytest.approx(loss, rel=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
    assert res["documents"] == len(DOCS)
    (tmp_path / "val.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress(f.read_bytes()))
    res_zst = pile_loss(model, tok, tmp_path / "val.jsonl.zst", context=32, batch_size=2, progress=False)
    assert res_zst["loss"] == pytest.approx(res["loss"], rel=1e-6) and res_zst["tokens"] == res["tokens"]
    limited = pile_loss(model, tok, f, context=32, limit=2, progress=False)
    assert limited["documents"] == 2 and limited["tokens"] == len(DOCS[0]) + len(DOCS[1]) + 1


def test_pile_bad_input(tmp_path):
    with pytest.raises(SparsityError, match="No Pile-format corpus"):
        list(iter_documents(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"meta": 1}\n')
    with pytest.raises(SparsityError, match="bad.jsonl:1"):
        list(iter_documents(tmp_path / "bad.jsonl"))


def test_parse_limit():
    assert parse_limit(None) == {}
    assert parse_limit(5) == {"default": 5}
    assert parse_limit("7") == {"default": 7}
    assert parse_limit("harness7=100,pile=3") == {"harness7": 100, "pile": 3}
    with pytest.raises(SparsityError, match="--limit"):
        parse_limit("pile=lots")


# ----------------------------------------------------------------------------- sparse model folders
@pytest.fixture
def gpt2_tokenizer(shared_data):
    from transformers import GPT2TokenizerFast

    return GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")


@pytest.fixture
def model_dirs(tmp_path, gpt2_tokenizer):
    """A dense tiny GPT-2 folder and the same weights with 50% topk masks (weights left dense on disk)."""
    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    model = tiny_model("gpt2", vocab=50257)
    dense, sparse = tmp_path / "dense", tmp_path / "sparse"
    for d in (dense, sparse):
        model.save_pretrained(d)
        gpt2_tokenizer.save_pretrained(d)
    engine = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    engine.build_masks()
    engine.save(sparse)
    return dense, sparse


def test_masks_applied_on_load_and_reported(model_dirs, tmp_path):
    from hf_sparsity.evaluation import load_model_for_eval

    dense, sparse = model_dirs
    m_dense, _, none = load_model_for_eval(dense, device="cpu")
    m_sparse, _, masks = load_model_for_eval(sparse, device="cpu")
    assert none is None and masks
    for name, mask in masks.items():
        w = m_sparse.get_parameter(name)
        assert torch.all(w[mask == 0] == 0)
    s = sparsity_summary(m_sparse, masks)
    assert s["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert all(r["mask_sparsity"] == pytest.approx(0.5, abs=1e-3) for r in s["layers"])
    assert s["nonzero_params"] == s["total_params"] - s["targeted_zeros"]
    d = sparsity_summary(m_dense)
    assert d["sparsity"] < 0.01 and {r["name"] for r in d["layers"]} == set(masks)
    with pytest.raises(SparsityError, match="config.json"):
        load_model_for_eval(tmp_path)


# ----------------------------------------------------------------------------- lm-eval: offline == stock, ==
# CLI
def test_offline_yaml_mirrors_stock(shared_data, tmp_path):
    from lm_eval.tasks._yaml_loader import load_yaml

    from hf_sparsity.evaluation.harness import find_stock_yaml

    out = write_offline_tasks(shared_data / "tasks", tmp_path / "tasks")
    data_keys = {"dataset_path", "dataset_name", "dataset_kwargs", "training_split", "validation_split"}
    data_keys |= {"test_split", "fewshot_split"}
    for task in HARNESS7:
        ours = load_yaml(out / task / f"{task}.yaml")
        stock = load_yaml(find_stock_yaml(task))
        assert ours["dataset_path"] == "json"
        files = ours["dataset_kwargs"]["data_files"]
        assert all(Path(p).is_absolute() and Path(p).is_file() for p in files.values())
        eval_split = stock.get("test_split") or stock.get("validation_split")
        assert (ours.get("test_split") or ours.get("validation_split")) == eval_split
        assert set(ours) - data_keys == set(stock) - data_keys, task
        for key in set(stock) - data_keys:
            a, b = ours[key], stock[key]
            if callable(b):  # same stock function (`!function` re-rooted into lm_eval.tasks)
                assert (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)
                assert inspect.getsource(a) == inspect.getsource(b)
            else:
                assert a == b, (task, key)


def _tiny_gpt2_dir(tmp_path, tok) -> Path:
    d = tmp_path / "tiny"
    tiny_model("gpt2", vocab=50257).save_pretrained(d)
    tok.save_pretrained(d)
    return d


# lm-eval estimates these by bootstrap resampling (random, per process); every other metric is exact.
BOOTSTRAP_STDERRS = {"perplexity_stderr"}


@pytest.mark.slow  # lm-eval's own CLI in a subprocess
def test_offline_harness_equals_lm_eval_cli(shared_data, tmp_path, model_dirs):
    """The in-process offline suite, on a sparse folder (masks beside dense weights, applied on load),
    gives exactly the numbers of lm-eval's own CLI on the finalized folder: every metric it reports."""
    from hf_sparsity.export.finalize import finalize_checkpoint

    _, sparse = model_dirs
    final = tmp_path / "final"
    finalize_checkpoint(sparse, final)
    limit = 10  # accuracies on a 0.1 grid, and stderrs that depend on every answer
    write_offline_tasks(shared_data / "tasks", tmp_path / "tasks")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        sys.executable, "-m", "lm_eval", "run", "--model", "hf",
        "--model_args", f"pretrained={final},dtype=float32",
        "--tasks", ",".join(HARNESS7), "--include_path", str(tmp_path / "tasks"),
        "--num_fewshot", "0", "--limit", str(limit), "--batch_size", "4", "--device", "cpu",
        "--output_path", str(tmp_path / "cli"),
    ]  # fmt: skip
    # lm-eval's CLI runs in a subprocess while the same evaluation runs in-process.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        ours = evaluate(
            sparse, "harness7", data_dir=shared_data, limit=limit, batch_size=4, device="cpu",
            tasks_out=tmp_path / "ours_tasks", progress=False,
        )  # fmt: skip
        _, err = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert (tmp_path / "ours_tasks/piqa/piqa.yaml").read_text() == (
        tmp_path / "tasks/piqa/piqa.yaml"
    ).read_text()
    (out_file,) = list((tmp_path / "cli").rglob("results_*.json"))
    cli = json.loads(out_file.read_text())["results"]
    per_task = ours["metrics"]["harness"]
    compared = 0
    for task in HARNESS7:
        metrics = {k.split(",")[0]: v for k, v in cli[task].items() if k.endswith(",none")}
        assert {"acc", "acc_stderr"} <= set(metrics), (task, sorted(metrics))
        for metric, value in metrics.items():
            if metric in BOOTSTRAP_STDERRS:  # lm-eval resamples these at random: equal in law only
                continue
            want = float(value) if value not in (None, "N/A") else None
            got = per_task[task].get(metric)
            assert (got is None) == (want is None), (task, metric, got, value)
            if want is not None:
                assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (task, metric)
            compared += 1
        assert per_task[task]["samples"] == limit
    assert compared >= 2 * len(HARNESS7)
    avg = ours["metrics"]["harness7"]["average_acc"]
    assert avg == pytest.approx(sum(cli[t]["acc,none"] for t in HARNESS7) / 7)


def test_offline_task_missing_data(tmp_path):
    from hf_sparsity.evaluation.harness import offline_task_config

    with pytest.raises(SparsityError, match="No local data"):
        offline_task_config("piqa", tmp_path)
    (tmp_path / "piqa").mkdir()
    (tmp_path / "piqa" / "train.jsonl").write_text("{}\n")
    with pytest.raises(SparsityError, match="validation"):
        offline_task_config("piqa", tmp_path)


# ----------------------------------------------------------------------------- CLI, reports, callback
def test_cli_eval_report_and_compare(model_dirs, tmp_path):
    from hf_sparsity.cli import main

    dense, sparse = model_dirs
    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    text = tmp_path / "wiki.test.tokens"
    text.write_text(
        " = Title = \n \n The cat sat on the mat @-@ like , a cat . \n = Other = \n Dogs 's too . \n"
    )
    for d in (dense, sparse):
        rc = main(
            ["eval", str(d), "--suite", "pile,wikitext103", "--pile-data", str(corpus),
             "--wikitext", str(text),
             "--context", "16", "--out", str(tmp_path / f"r_{d.name}"), "--no-progress"]
        )  # fmt: skip
        assert rc == 0
    r = json.loads((tmp_path / "r_sparse/results.json").read_text())
    assert r["sparsity"]["sparsity"] == pytest.approx(0.5, abs=1e-3)
    assert r["sparsity"]["flops"]["inference_flop_reduction"] > 1.0
    assert {"pile", "wikitext103"} <= set(r["metrics"])
    assert r["metrics"]["wikitext103"]["original_tokens"] == count_original_tokens(text.read_text())
    assert {"torch", "transformers", "hf_sparsity"} <= set(r["versions"])
    assert "Pile-style loss" in (tmp_path / "r_sparse/results.md").read_text()
    rc = main(
        [
            "eval",
            "--compare",
            str(tmp_path / "r_dense"),
            str(tmp_path / "r_sparse"),
            "--out",
            str(tmp_path / "cmp"),
        ]
    )
    assert rc == 0
    md = (tmp_path / "cmp/compare.md").read_text()
    assert "r_dense" in md and "r_sparse" in md and "50.0%" in md
    png = tmp_path / "cmp/compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size < 200_000
    assert main(["eval", "--compare", str(tmp_path / "r_dense")]) == 2  # no --out
    assert main(["eval", str(dense), "--suite", "pile"]) == 2  # no corpus


def test_eval_callback_logs_metrics(tmp_path, model_dirs, gpt2_tokenizer):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_sparsity.evaluation import EvalCallback

    corpus = write_jsonl(tmp_path / "c.jsonl", DOCS)
    model = tiny_model("gpt2", vocab=50257)
    ids = gpt2_tokenizer(" ".join(DOCS))["input_ids"][:64]
    ds = Dataset.from_dict({"input_ids": [ids[:16]] * 4, "labels": [ids[:16]] * 4})
    cb = EvalCallback("pile", pile_data=str(corpus), limit=2, context=16)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=2, eval_strategy="steps", eval_steps=1,
        per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ds,
        eval_dataset=ds,
        processing_class=gpt2_tokenizer,
        callbacks=[cb],
        data_collator=default_data_collator,
    )
    cb.bind(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "eval_pile_loss" in h]
    assert [h["step"] for h in logged] == [1, 2]
    assert math.isfinite(logged[-1]["eval_pile_loss"]) and "eval_pile_perplexity" in logged[-1]
    metrics = trainer.evaluate()
    assert "eval_pile_loss" in metrics and "eval_loss" in metrics
