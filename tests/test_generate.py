"""``hf_sparsity generate``: streams the same greedy tokens as dense, from a masked or a finalized folder."""

from __future__ import annotations

import pytest
import torch

from .conftest import tiny_model


@pytest.fixture
def folders(tmp_path, shared_data):
    from transformers import GPT2TokenizerFast

    from hf_sparsity.config import SparsityConfig
    from hf_sparsity.engine import SparsityEngine

    tok = GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")
    model = tiny_model("gpt2", vocab=50257).eval()
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    eng.build_masks()
    eng.apply()  # zeros in the weights: the masked and the finalized folder compute the same function
    masked, final = tmp_path / "masked", tmp_path / "final"
    for d in (masked, final):
        model.save_pretrained(d)
        tok.save_pretrained(d)
    eng.save(masked)
    return model, tok, masked, final


def _dense_text(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
    )
    return tok.decode(out[0, ids.shape[1] :])


@pytest.mark.parametrize("backend", ["bitmask", "auto"])
def test_generate_streams_the_dense_tokens_and_reports_speed(folders, capsys, backend):
    from hf_sparsity.cli import main

    model, tok, masked, _ = folders
    prompt = "Sparse models are"
    want = _dense_text(model, tok, prompt, 6)
    rc = main(["generate", str(masked), "--prompt", prompt, "--max-new-tokens", "6", "--backend", backend])
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.startswith(prompt) and want.strip() in out
    assert f"[{backend}:" in err and "tok/s" in err and "dense" in err and "MiB" in err


def test_generate_on_a_finalized_folder_uses_its_zeros(folders, capsys):
    from hf_sparsity.cli import main

    model, tok, _, final = folders
    rc = main(["generate", str(final), "--prompt", "Hello", "--max-new-tokens", "4", "--no-dense"])
    assert rc == 0
    out, err = capsys.readouterr()
    assert "exact zeros" in err and "[auto:" in err
    assert _dense_text(model, tok, "Hello", 4).strip() in out


def test_generate_refuses_bad_input(folders, tmp_path, capsys):
    from hf_sparsity.cli import main
    from hf_sparsity.config import SparsityConfig
    from hf_sparsity.engine import SparsityEngine

    _, _, masked, _ = folders
    other = tiny_model("llama")
    eng = SparsityEngine(other, SparsityConfig(sparsity=0.5))
    eng.build_masks()
    eng.save(tmp_path / "other")
    assert main(["generate", str(masked), "--prompt", "x", "--masks", str(tmp_path / "other")]) == 2
    assert "error: " in capsys.readouterr().err
    assert main(["generate", str(masked), "--prompt", "x", "--backend", "nm24", "--no-dense"]) == 2
    assert "2:4" in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_compiled_streams_the_dense_tokens(folders, capsys):
    # --compile: static cache + inductor for the dense and the sparse run, the same greedy tokens
    from hf_sparsity.cli import main

    model, tok, masked, _ = folders
    prompt = "Sparse models are"
    want = _dense_text(model, tok, prompt, 4)
    torch._dynamo.reset()
    try:
        argv = ["generate", str(masked), "--prompt", prompt, "--max-new-tokens", "4", "--backend", "bitmask"]
        rc = main([*argv, "--compile"])
    finally:
        torch._dynamo.reset()
    assert rc == 0
    out, err = capsys.readouterr()
    assert out.startswith(prompt) and want.strip() in out
    assert "compiled, compile + first run dense" in err and "bitmask" in err
    assert "stock dense (eager)" in err  # the uncompiled baseline is printed beside the compiled one
