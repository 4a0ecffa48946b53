"""The int8 LM head of ``values="int8"`` (``head="int8"``, the default) against its float64 definition, the
tied input embedding reading the same codes, ``head="float32"``, and the ``hf_sparsity generate`` options.

Definition (computed here, not with the library's helpers): per row ``scale = max|w_r| / 127``, codes
``q = round_half_even(w / scale)`` clipped to [-127, 127], the head's weight ``q * scale`` and its logits
``x @ (q * scale).T``. The head weights are drawn so that every ``w / scale`` is either well clear of a
rounding boundary or exactly on one (powers of two as scales), so the codes are the same in any precision
and the half-to-even ties are tested exactly.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from hf_sparsity.backends import _native
from hf_sparsity.backends.formats import ACT_GROUPS
from hf_sparsity.inference import (
    Int8Embedding,
    SparseLinear,
    resident_weight_bytes,
    restore_dense,
    sparsify_for_inference,
)
from hf_sparsity.inference.decoding import NativeDecoder, greedy_decode, native_step_reason
from hf_sparsity.utils import SparsityError

from .realistic import prompt, realistic_model

needs_native = pytest.mark.skipif(_native.load() is None, reason=f"native kernel: {_native.error()}")

MODELS = {  # name -> (arch, config overrides); GPT-2 ties its head to wte
    "gpt2": ("gpt2", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True, "heads": 4, "kv_heads": 2}),
    "llama-untied": ("llama", {"heads": 8, "kv_heads": 2, "head_dim": 16}),
}


@torch.no_grad()
def _quantizable_head(model, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Overwrite the LM head's weight (and so a tied embedding) with rows whose codes are unambiguous:
    ``(q0 + u) * 2**-e`` with one entry at +-127 (the row's max), ``u`` in [-0.45, 0.45] or exactly +-0.5
    (ties), and row 3 all zero. Returns ``(expected codes float64, expected scales float64)``."""
    w = model.get_output_embeddings().weight
    rows, cols = w.shape
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(4, 10, (rows, 1), generator=g).double()
    s = torch.pow(2.0, -e)
    q0 = torch.randint(-126, 127, (rows, cols), generator=g).double()
    u = torch.round((torch.rand(rows, cols, generator=g, dtype=torch.float64) - 0.5) * 0.9 * 1024) / 1024
    ties = torch.rand(rows, cols, generator=g) < 0.2
    u = torch.where(ties, torch.where(q0 >= 0, 0.5, -0.5).double(), u)
    v = q0 + u
    v[:, 0] = torch.where(torch.rand(rows, generator=g) < 0.5, 127.0, -127.0).double()
    v[3] = 0
    ties[:, 0] = ties[3] = False
    w.copy_((v * s).float())
    assert torch.equal(w.double(), v * s)  # exact in float32: the definition below sees the same numbers
    # the definition, in float64
    wd = w.double()
    scale = wd.abs().amax(1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(wd / safe[:, None]).clamp(-127, 127)
    assert bool((q[ties] % 2 == 0).all())  # ties went to the even code
    return q, scale


def _model(name: str):
    arch, kw = MODELS[name]
    model = realistic_model(arch, hidden=64, **kw)
    q, scale = _quantizable_head(model)
    return model, q, scale


def _head_input(model, ids) -> torch.Tensor:
    """The LM head's input (the final norm's output) for ``ids``, ``[1, n, hidden]`` float32."""
    seen = []
    h = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model(ids)
    h.remove()
    return seen[0].clone()


def _quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x as the int8 products see it, the step of each entry's group)`` in float64, from the layout's
    definition: column ``c`` in group ``(c // 64 % ACT_GROUPS) * 16 + c % 64 // 4`` of its row, scale
    ``s = max|x_group| / 127``, codes ``round_half_even(x / s)``."""
    xd = x.double()
    c = torch.arange(xd.shape[-1])
    group = (c // 64 % ACT_GROUPS) * 16 + c % 64 // 4
    step = torch.zeros_like(xd)
    for gid in group.unique():
        cols = group == gid
        step[:, cols] = xd[:, cols].abs().amax(-1, keepdim=True) / 127
    codes = torch.where(step > 0, torch.round(xd / torch.where(step > 0, step, 1.0)), 0.0)
    return codes * step, step


def _excess(got, x, q, scale, activations: str) -> float:
    """How far ``got`` (``[rows, vocab]``) is outside ``xq @ (q * scale).T`` (float64; ``xq``: ``x``, or with
    int8 activations :func:`_quantized_activations`), and the rounding tolerance (<= 0: inside): float32
    accumulation, and with int8 activations one step for an entry within 1e-4 steps of a rounding boundary
    (float32 may put it on either side)."""
    wq = q * scale[:, None]
    xq = x.double()
    slack = 1e-5 * (xq.abs() @ wq.abs().T) + 1e-6
    if activations == "int8":
        xq, step = _quantized_activations(x)
        frac = (x.double() / torch.where(step > 0, step, 1.0)).abs() % 1
        near = ((frac - 0.5).abs() < 1e-4).double()
        slack = slack + (near * step) @ wq.abs().T
    return ((got.double() - xq @ wq.T).abs() - slack).max().item()


@needs_native
@pytest.mark.parametrize("activations", ["int8", "float32"])
@pytest.mark.parametrize("name", list(MODELS))
def test_int8_head_logits_match_their_float64_definition(name, activations):
    """Batch 1 (the native fast path), a small batch (native) and a prefill batch (a GEMM on the dequantized
    weight) all compute the definition's logits, within the activation quantization's bound."""
    model, q, scale = _model(name)
    ids = prompt(20, model.config.vocab_size)
    x = _head_input(model, ids)[0]
    w0 = model.get_output_embeddings().weight.detach().clone()
    opts = {"activations": activations} if activations == "float32" else {}
    sparsify_for_inference(model, "bitmask", masks="zeros", values="int8", **opts)
    head = model.get_output_embeddings()
    assert isinstance(head, SparseLinear) and head.lm_head and head.backend.int8
    with torch.no_grad():
        for rows in (x[-1:], x[:3], x):  # 1, 3 and 20 rows
            assert _excess(head(rows[None])[0], rows, q, scale, activations) <= 0
    # the tolerance is narrow enough to tell a 1% scale error, the float head or float activations apart
    assert _excess(x.double() @ (q * scale[:, None] * 1.001).T, x, q, scale, activations) > 0
    assert _excess(x.double() @ w0.double().T, x, q, scale, activations) > 0
    if activations == "int8":
        assert _excess(x.double() @ (q * scale[:, None]).T, x, q, scale, activations) > 0


@pytest.mark.parametrize("name", ["gpt2", "llama-tied"])
def test_tied_embedding_reads_the_dequantized_codes_exactly_and_frees_the_float_table(name):
    model, q, scale = _model(name)
    vocab, dim = model.get_output_embeddings().weight.shape
    same, _, _ = _model(name)  # the same model with the float head, for the bytes
    sparsify_for_inference(same, "bitmask", masks="zeros", values="int8", kernel="torch", head="float32")
    sparsify_for_inference(model, "bitmask", masks="zeros", values="int8", kernel="torch")
    emb = model.get_input_embeddings()
    assert isinstance(emb, Int8Embedding)
    ids = torch.tensor([[3, 0, 5, vocab - 1], [2, 2, 7, 3]])
    with torch.no_grad():
        got = emb(ids)
    want = (q.float() * scale.float()[:, None])[ids]  # float32 products, one rounding each: exact
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not got[0, 0].any()  # the all-zero row
    # no float [vocab, dim] table is held any more: the float table's bytes went, the codes' came
    assert all(tuple(p.shape) != (vocab, dim) for p in model.parameters())
    saved = resident_weight_bytes(same) - resident_weight_bytes(model)
    codes_bytes = vocab * dim + 4 * vocab  # codes and scales, with at most 128 bytes of padding
    assert 4 * vocab * dim - codes_bytes - 128 <= saved <= 4 * vocab * dim - codes_bytes
    # restore: a dense head and embedding, tied again, holding the dequantized codes
    restore_dense(model)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    assert type(emb) is nn.Embedding and emb.weight is head.weight
    assert torch.equal(head.weight, q.float() * scale.float()[:, None])


def test_keep_dense_restores_the_original_tied_modules():
    model, _, _ = _model("gpt2")
    emb0, head0 = model.get_input_embeddings(), model.get_output_embeddings()
    w0 = emb0.weight.detach().clone()
    sparsify_for_inference(model, "bitmask", masks="zeros", values="int8", kernel="torch", keep_dense=True)
    assert isinstance(model.get_input_embeddings(), Int8Embedding)
    restore_dense(model)
    assert model.get_input_embeddings() is emb0 and model.get_output_embeddings() is head0
    assert emb0.weight is head0.weight and torch.equal(emb0.weight, w0)


def test_untied_head_converts_alone():
    model, q, scale = _model("llama-untied")
    emb = model.get_input_embeddings()
    table = emb.weight.detach().clone()
    sparsify_for_inference(model, "bitmask", masks="zeros", values="int8", kernel="torch")
    assert model.get_input_embeddings() is emb and torch.equal(emb.weight, table)
    head = model.get_output_embeddings()
    assert isinstance(head, SparseLinear) and head.backend.int8
    assert torch.equal(head.backend.to_dense(), q.float() * scale.float()[:, None])


@pytest.mark.parametrize("backend", ["bitmask", "nm24"])
def test_head_float32_keeps_the_float_head_and_embedding_bit_exact(backend):
    model, _, _ = _model("gpt2")
    emb0, head0 = model.get_input_embeddings(), model.get_output_embeddings()
    w0 = head0.weight.detach().clone()
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = head0(x)
    masks = "zeros"
    if backend == "nm24":  # 2:4 along the input of every block projection (GPT-2's Conv1D: [in, out])
        from hf_sparsity import masks as M
        from hf_sparsity.inference import resolve_masks

        full = resolve_masks(model, "zeros")
        masks = {n: M.nm_mask(model.get_parameter(n).detach().abs(), 2, 4, dim=0) for n in full}
    sparsify_for_inference(model, backend, masks=masks, values="int8", head="float32", kernel="torch")
    assert model.get_output_embeddings() is head0 and model.get_input_embeddings() is emb0
    assert head0.weight is emb0.weight and torch.equal(head0.weight, w0)
    with torch.no_grad():
        assert torch.equal(model.get_output_embeddings()(x), want)


def test_head_option_refusals_leave_the_model_untouched():
    model, _, _ = _model("gpt2")
    head0 = model.get_output_embeddings()
    with pytest.raises(SparsityError, match="head='int4': use 'int8' or 'float32'"):
        sparsify_for_inference(model, "bitmask", masks="zeros", values="int8", head="int4")
    with pytest.raises(SparsityError, match="head='int8' goes with values='int8'"):
        sparsify_for_inference(model, "bitmask", masks="zeros", head="int8")
    assert model.get_output_embeddings() is head0 and not any(
        isinstance(m, (SparseLinear, Int8Embedding)) for m in model.modules()
    )
    # head="float32" without int8 values: the head as it is, nothing to refuse
    sparsify_for_inference(model, "bitmask", masks="zeros", head="float32", kernel="torch")
    assert model.get_output_embeddings() is head0


@needs_native
@pytest.mark.parametrize("name", list(MODELS))
def test_native_step_reads_the_int8_embedding_and_head(name):
    """The native step (one call per token, the embedding looked up in C from the head's codes) gives the
    logits and tokens of the converted model's own forward."""
    model, _, _ = _model(name)
    ids = prompt(5, model.config.vocab_size)
    sparsify_for_inference(model, "bitmask", masks="zeros", values="int8")
    assert native_step_reason(model) is None
    with torch.no_grad():
        want = model(ids).logits[0, -1]
    dec = NativeDecoder(model)
    got = dec.start(ids, 12).clone()
    dec.close()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    assert torch.equal(greedy_decode(model, ids, 6), greedy_decode(model, ids, 6, step="model"))


# ---------------------------------------------------------------------------- hf_sparsity generate
@pytest.fixture(params=["gpt2", "llama"])
def folder(request, tmp_path, shared_data):
    """A saved tiny model with the GPT-2 tokenizer (Llama with its head tied, as SmolLM2's) and its masks."""
    from transformers import GPT2TokenizerFast

    from hf_sparsity.mask_engine.config import SparsityConfig
    from hf_sparsity.mask_engine.engine import SparsityEngine

    tok = GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")
    kw = {"tie_word_embeddings": True} if request.param == "llama" else {}
    model = realistic_model(request.param, vocab=len(tok), hidden=64, **kw)
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    eng.build_masks()
    eng.apply()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    eng.save(tmp_path / "m")
    return tmp_path / "m", tok


def _reference_text(path, tok, text: str, n: int, **options) -> str:
    """The folder's model converted in this process, greedy: the text ``hf_sparsity generate`` streams."""
    from hf_sparsity.loading import load_model_folder

    model, _ = load_model_folder(str(path), masks=False)
    sparsify_for_inference(model.eval(), "bitmask", masks=str(path), **options)
    ids = tok(text, return_tensors="pt").input_ids
    return tok.decode(greedy_decode(model, ids, n, step="model")[0, ids.shape[1] :])


@needs_native
def test_cli_generate_int8_head_by_default_and_head_float32(folder, capsys):
    from hf_sparsity.cli import main

    path, tok = folder
    text = "Sparse models are"
    args = [
        "generate",
        str(path),
        "--prompt",
        text,
        "--max-new-tokens",
        "5",
        "--no-dense",
        "--backend",
        "bitmask",
    ]
    mib = {}
    for head in (None, "float32"):
        extra = ["--head", head] if head else []
        assert main([*args, "--values", "int8", *extra]) == 0
        out, err = capsys.readouterr()
        want = _reference_text(path, tok, text, 5, values="int8", **({"head": head} if head else {}))
        assert out.startswith(text) and want.strip() in out and "[bitmask:" in err
        mib[head] = float(re.search(r"weights ([0-9.]+) MiB", err).group(1))
    vocab, dim = len(tok), 64  # the float table gone, its int8 codes and scales in its place
    assert mib["float32"] - mib[None] == pytest.approx(
        (4 * vocab * dim - (vocab * dim + 4 * vocab)) / 2**20, abs=0.1
    )


@needs_native
@pytest.mark.parametrize("folder", ["llama"], indirect=True)
def test_cli_show_choices_with_int8_values_lists_the_int8_head(folder, capsys):
    """``--backend auto --values int8 --show-choices`` printed the table until the LM head's row, which has no
    group or timings, ended in a KeyError."""
    from hf_sparsity.cli import main

    path, _ = folder
    args = ["generate", str(path), "--prompt", "Hello", "--max-new-tokens", "3", "--no-dense"]
    assert main([*args, "--values", "int8", "--show-choices"]) == 0
    err = capsys.readouterr().err
    head = next(line for line in err.splitlines() if line.startswith("lm_head"))
    assert "LM head, int8 values" in head and "native_dense" in head and "[auto:" in err


def test_cli_head_refusals(tmp_path, capsys):
    from hf_sparsity.cli import main

    args = ["generate", str(tmp_path), "--prompt", "x"]
    assert main([*args, "--head", "int8"]) == 2  # before anything loads: no model needed
    assert "--head int8 goes with --values int8" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*args, "--values", "int8", "--head", "int4"])
    assert e.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
