"""The ``wikitext2`` suite: the Wanda / SparseGPT perplexity protocol, against a hand computation."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_sparsity import SparsityError
from hf_sparsity.evaluation.wikitext2 import wikitext2_rows, wikitext2_windows

from .conftest import tiny_model


def test_rows_are_the_hf_builder_rows(tmp_path):
    f = tmp_path / "wiki.test.raw"
    f.write_text(" \n = Title = \n \n Some text .\n", encoding="utf-8")
    assert wikitext2_rows(f) == ["", " = Title = \n", "", " Some text .\n"]
    with pytest.raises(SparsityError, match="No WikiText-2 file"):
        wikitext2_rows(tmp_path / "missing.raw")


def test_cli_perplexity_equals_a_hand_computation(shared_data, tmp_path, capsys):
    from transformers import GPT2TokenizerFast

    from hf_sparsity.cli import main

    tok = GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")
    model = tiny_model("gpt2", vocab=50257).eval()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    seqlen, k = 16, 3
    rc = main(["eval", str(tmp_path / "m"), "--suite", "wikitext2", "--data-dir", str(shared_data),
               "--seqlen", str(seqlen), "--max-windows", str(k), "--json", "--device", "cpu"])  # fmt: skip
    assert rc == 0
    got = json.loads(capsys.readouterr().out)

    # By hand: the builder's rows, joined with "\n\n", tokenized once, cut into seqlen windows.
    text = (shared_data / "text/wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8")
    rows = [line if line.strip() else "" for line in text.splitlines(keepends=True)]
    ids = tok("\n\n".join(rows))["input_ids"]
    assert got["windows_available"] == len(ids) // seqlen and got["windows"] == k
    losses = []
    with torch.no_grad():
        for w in range(k):
            window = torch.tensor(ids[w * seqlen : (w + 1) * seqlen])
            logp = torch.log_softmax(model(window[None]).logits[0].double(), -1)
            nll = [-float(logp[t, window[t + 1]]) for t in range(seqlen - 1)]
            losses.append(sum(nll) / len(nll))
    assert got["perplexity"] == pytest.approx(math.exp(sum(losses) / k), rel=1e-5)
    assert got["seqlen"] == seqlen


def test_windows_drop_the_tail():
    class Tok:
        def __call__(self, text, return_tensors=None):
            return {"input_ids": torch.arange(len(text))[None]}

    w = wikitext2_windows(Tok(), ["abcdefg", "hij"], 4)  # 12 characters -> 3 windows
    assert w.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(SparsityError, match="fewer than one window"):
        wikitext2_windows(Tok(), ["ab"], 4)


class _CharTok:
    """One token per character (ids 2..127), as ``tokenizer(text, return_tensors="pt")`` returns them."""

    def __call__(self, text, return_tensors=None):
        return {"input_ids": torch.tensor([[2 + ord(c) % 126 for c in text]])}


def test_evaluate_runs_wikitext2_from_python(tmp_path):
    from hf_sparsity.evaluation import evaluate
    from hf_sparsity.evaluation.wikitext2 import wikitext2_perplexity

    f = tmp_path / "wiki.test.raw"
    text = " = Title = \n\n Some text about a thing , with words .\n\n More text here .\n"
    f.write_text(text, encoding="utf-8")
    model = tiny_model("gpt2").eval()
    res = evaluate(model, ["wikitext2"], tokenizer=_CharTok(), wikitext2_file=f, seqlen=8, max_windows=4)
    got = res["metrics"]["wikitext2"]
    want = wikitext2_perplexity(model, _CharTok(), f, seqlen=8, max_windows=4)
    assert got == want and got["windows"] == 4 and res["data"]["wikitext2"] == str(f)
    with pytest.raises(SparsityError, match="--data-dir"):
        evaluate(model, "wikitext2", tokenizer=_CharTok())
