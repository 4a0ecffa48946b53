"""``hf_sparsity generate``: streams the same greedy tokens as dense, from a masked or a finalized folder;
samples with ``generate``'s options."""

from __future__ import annotations

import pytest
import torch

from .conftest import tiny_model


@pytest.fixture
def folders(tmp_path, shared_data):
    from transformers import GPT2TokenizerFast

    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

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
    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

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


@pytest.fixture
def llama_folder(tmp_path, shared_data):
    """A masked Llama-family folder (realistic random weights: norms away from 1, GQA)."""
    from transformers import AutoModelForCausalLM, GPT2TokenizerFast, LlamaConfig

    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    tok = GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.ndim == 2 else p.uniform_(0.5, 1.5)
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    eng.build_masks()
    eng.apply()
    folder = tmp_path / "llama"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    eng.save(folder)
    return model, tok, folder


def test_generate_runs_the_native_step_by_default_and_says_so(llama_folder, capsys):
    """A Llama-family model on a native format: model.generate on the native step (the same text as
    transformers' loop, which --loop generate keeps), the loop and the tok/s definition printed."""
    from hf_sparsity.cli import main

    model, tok, folder = llama_folder
    prompt = "Sparse models are"
    want = _dense_text(model, tok, prompt, 8)
    argv = ["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "8", "--backend", "bitmask"]
    assert main([*argv, "--no-dense"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(prompt) and want.strip() in out
    assert "loop: the native step" in err and "after the first over their time" in err
    assert main([*argv, "--no-dense", "--loop", "generate"]) == 0
    out2, err2 = capsys.readouterr()
    assert out2 == out and "loop: transformers' generate loop (--loop generate)" in err2
    assert main([*argv, "--backend", "masked_dense", "--no-dense"]) == 0  # no native call: said why
    out3, err3 = capsys.readouterr()
    assert want.strip() in out3 and "the native step does not run this model" in err3
    assert main([*argv, "--no-dense", "--loop", "generate", "--lean"]) == 2
    assert "two decoding loops" in capsys.readouterr().err


SAMPLE_ARGS = [
    "--do-sample",
    "--temperature",
    "0.7",
    "--top-k",
    "20",
    "--top-p",
    "0.9",
    "--repetition-penalty",
    "1.1",
]


def test_generate_samples_on_the_native_step_with_generates_options(llama_folder, capsys):
    """--do-sample and its options reach model.generate: the streamed text is what model.generate draws with
    the same options and seed on the native step (the same text twice), and greedy's differs."""
    from transformers import AutoModelForCausalLM, set_seed

    from hf_sparsity.cli import main
    from hf_sparsity.inference import sparsify_for_inference
    from hf_sparsity.inference.decoding import native_generate

    _, tok, folder = llama_folder
    prompt = "Sparse models are"
    argv = ["generate", str(folder), "--prompt", prompt, "--max-new-tokens", "12", "--backend", "bitmask"]
    outs = []
    for _ in range(2):
        assert main([*argv, *SAMPLE_ARGS, "--seed", "3", "--no-dense"]) == 0
        out, err = capsys.readouterr()
        assert "loop: the native step" in err
        outs.append(out)
    assert outs[0] == outs[1]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    sparsify_for_inference(model, "bitmask", masks=str(folder))
    ids = tok(prompt, return_tensors="pt").input_ids
    set_seed(3)
    want = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=True, temperature=0.7,
        top_k=20, top_p=0.9, repetition_penalty=1.1, pad_token_id=0, custom_generate=native_generate,
    )  # fmt: skip
    assert outs[0].strip() == (prompt + tok.decode(want[0, ids.shape[1] :])).strip()
    assert main([*argv, "--no-dense"]) == 0
    assert capsys.readouterr().out != outs[0]  # greedy's text is another


@pytest.mark.parametrize(
    "extra,said",
    [
        (["--do-sample", "--temperature", "0"], "--temperature 0.0: it must be above 0"),
        (["--do-sample", "--temperature", "-1"], "--temperature -1.0: it must be above 0"),
        (["--do-sample", "--top-k", "-1"], "--top-k -1: it must be 0 (none) or more"),
        (["--do-sample", "--top-p", "0"], "--top-p 0.0: it must be in (0, 1]"),
        (["--do-sample", "--top-p", "1.01"], "--top-p 1.01: it must be in (0, 1]"),
        (["--do-sample", "--min-p", "-0.1"], "--min-p -0.1: it must be in [0, 1]"),
        (["--do-sample", "--min-p", "1.5"], "--min-p 1.5: it must be in [0, 1]"),
        (["--repetition-penalty", "0"], "--repetition-penalty 0.0: it must be above 0"),
        (["--temperature", "0.7"], "--temperature shapes sampling: add --do-sample"),
        (["--top-k", "5"], "--top-k shapes sampling: add --do-sample"),
        (["--top-p", "0.9"], "--top-p shapes sampling: add --do-sample"),
        (["--min-p", "0.1"], "--min-p shapes sampling: add --do-sample"),
        (["--do-sample", "--lean"], "--lean decodes greedily"),
        (["--repetition-penalty", "1.2", "--lean"], "--lean decodes greedily"),
    ],
)
def test_generate_refuses_bad_sampling_options(llama_folder, capsys, extra, said):
    from hf_sparsity.cli import main

    _, _, folder = llama_folder
    assert main(["generate", str(folder), "--prompt", "x", "--no-dense", *extra]) == 2
    assert said in capsys.readouterr().err


def test_generate_takes_the_options_at_their_limits(llama_folder, capsys):
    from hf_sparsity.cli import main

    _, _, folder = llama_folder
    limits = ["--do-sample", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--temperature", "1e-3"]
    assert (
        main(["generate", str(folder), "--prompt", "x", "--max-new-tokens", "3", "--no-dense", *limits]) == 0
    )
    assert "loop: the native step" in capsys.readouterr().err
