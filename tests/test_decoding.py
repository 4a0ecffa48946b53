"""The lean greedy loop (``hf_sparsity.inference.decoding``) gives generate's greedy tokens, dense and
sparse."""

from __future__ import annotations

import pytest
import torch

from hf_sparsity.inference import sparsify_for_inference
from hf_sparsity.inference.decoding import greedy_decode
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine
from hf_sparsity.utils import SparsityError

from .conftest import tiny_model


def _generate(model, ids, n):
    with torch.inference_mode():
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=1
        )


@pytest.mark.parametrize("backend", [None, "bitmask"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_lean_loop_is_token_identical_to_generate(arch, backend):
    model = tiny_model(arch).eval()
    if backend:
        eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
        eng.build_masks()
        eng.apply()
        sparsify_for_inference(model, backend, masks=eng.masks)
    for seed in range(3):
        ids = torch.randint(2, 128, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        model.generation_config.eos_token_id = None  # run the full length in both
        want = _generate(model, ids, 24)
        seen = []
        got = greedy_decode(model, ids, 24, on_token=seen.append)
        assert torch.equal(got, want)
        assert seen == got[0, ids.shape[1] :].tolist()


def test_lean_loop_stops_at_eos_like_generate():
    model = tiny_model("llama").eval()
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    free = greedy_decode(model, ids, 12, eos_token_id=[])
    eos = int(free[0, ids.shape[1] + 3])  # make the 4th new token the end of sequence
    model.generation_config.eos_token_id = eos
    got = greedy_decode(model, ids, 12)
    want = _generate(model, ids, 12)
    assert int(got[0, -1]) == eos and torch.equal(got, want[:, : got.shape[1]])


def test_lean_loop_refuses_bad_input():
    model = tiny_model("gpt2").eval()
    with pytest.raises(SparsityError, match="one prompt"):
        greedy_decode(model, torch.ones(2, 3, dtype=torch.long), 4)
    with pytest.raises(SparsityError, match="at least 1"):
        greedy_decode(model, torch.ones(1, 3, dtype=torch.long), 0)


# ---------------------------------------------------------------------------- the native step
def _llama_family(arch: str, **kw):
    """Tiny Llama / Mistral / Qwen2 (Qwen2: biased q/k/v), weights large enough for decisive argmaxes."""
    from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=128, hidden_size=32, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    common.update(kw)
    if arch == "llama":
        from .conftest import tiny_config

        cfg = tiny_config("llama")
        cfg.update(kw)
    elif arch == "mistral":
        cfg = MistralConfig(**{"sliding_window": None, **common})
    else:
        cfg = Qwen2Config(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
    return model


def _sparse(model, backend, structure=None, **options):
    cfg = SparsityConfig(sparsity=0.5, structure=structure, init_method="topk")
    eng = SparsityEngine(model, cfg)
    eng.build_masks()
    eng.apply()
    sparsify_for_inference(model, backend, masks=eng.masks, **options)
    return model


@pytest.mark.parametrize(
    "backend,structure",
    [(None, None), ("bitmask", None), ("csr", None), ("nm24", "2:4"), ("native_dense", None), ("auto", None)],
)
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_native_step_is_token_identical_to_generate(arch, backend, structure):
    """One native call per token (norms, rotary, attention, MLP, LM head, argmax in C) gives generate's
    greedy tokens, on every native format and on the dense model (its nn.Linear layers on the GEMV)."""
    from hf_sparsity.inference.decoding import native_step_reason

    model = _llama_family(arch)
    if backend:
        opts = {"plan_cache": False, "check": False, "rounds": 3} if backend == "auto" else {}
        _sparse(model, backend, structure, **opts)
    assert native_step_reason(model) is None
    model.generation_config.eos_token_id = None
    for seed in range(2):
        ids = torch.randint(2, 128, (1, 4 + 3 * seed), generator=torch.Generator().manual_seed(seed))
        want = _generate(model, ids, 30)
        seen = []
        got = greedy_decode(model, ids, 30, on_token=seen.append, step="native")
        assert torch.equal(got, want), (got, want)
        assert seen == got[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("backend", [None, "bitmask"])
def test_native_step_prompt_paths_and_long_generations_match_generate(backend):
    """A prompt up to PROMPT_STEPS tokens goes through the native step token by token, a longer one through
    the model's forward; heads of 32 take the vectorized attention, and past ~60 positions its heads are split
    between two threads. Both prompt paths and the long tail give generate's greedy tokens."""
    from hf_sparsity.inference.decoding import PROMPT_STEPS

    model = _llama_family(
        "llama", hidden_size=128, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
    )  # fmt: skip
    if backend:
        _sparse(model, backend)
    model.generation_config.eos_token_id = None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for seed, n in enumerate((PROMPT_STEPS, PROMPT_STEPS + 5)):
            ids = torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(seed))
            want = _generate(model, ids, 110)
            assert torch.equal(greedy_decode(model, ids, 110, step="native"), want)
    finally:
        torch.set_num_threads(threads)


def test_native_step_refuses_prompt_ids_outside_the_embedding():
    model = _llama_family("llama")
    with pytest.raises(SparsityError, match="Prompt token ids"):
        greedy_decode(model, torch.tensor([[3, 500]]), 4, step="native")
    with pytest.raises(SparsityError, match="one prompt"):  # empty: no token to decode from
        greedy_decode(model, torch.zeros(1, 0, dtype=torch.long), 4, step="native")


@pytest.mark.parametrize("backend,structure", [("bitmask", None), ("nm24", "2:4"), ("auto", None)])
def test_native_step_with_int8_values_matches_the_forward_loop(backend, structure):
    """int8 values (and, with auto, the int8 LM head): the native step computes what the model's own forward
    computes on the same kernels, token for token."""
    model = _llama_family("llama")
    opts = {"plan_cache": False, "check": False, "rounds": 3} if backend == "auto" else {}
    _sparse(model, backend, structure, values="int8", **opts)
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(3))
    want = greedy_decode(model, ids, 24, eos_token_id=[], step="model")
    assert torch.equal(greedy_decode(model, ids, 24, eos_token_id=[], step="native"), want)


def test_native_step_stops_at_eos_and_falls_back_where_it_does_not_apply():
    model = _llama_family("llama")
    ids = torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    free = greedy_decode(model, ids, 12, eos_token_id=[], step="native")
    eos = int(free[0, ids.shape[1] + 2])
    got = greedy_decode(model, ids, 12, eos_token_id=eos, step="native")
    assert int(got[0, -1]) == eos and torch.equal(got, free[:, : got.shape[1]])
    neox = tiny_model("gpt_neox").eval()  # an architecture it does not run: auto takes the forward loop
    neox.generation_config.eos_token_id = None
    assert torch.equal(greedy_decode(neox, ids, 8), _generate(neox, ids, 8))
    with pytest.raises(SparsityError, match="model type 'gpt_neox'.*step='model'"):
        greedy_decode(neox, ids, 8, step="native")
    with pytest.raises(SparsityError, match="step='fast'"):
        greedy_decode(model, ids, 8, step="fast")


def test_native_step_says_why_it_does_not_run():
    from hf_sparsity.inference.decoding import native_step_reason

    masked = _sparse(_llama_family("llama"), "masked_dense")
    assert "no native batch-1 call" in native_step_reason(masked)
    window = _llama_family("mistral", sliding_window=8)
    assert native_step_reason(window) is None and "sliding window of 8" in native_step_reason(window, 20)
    ids = torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    want = greedy_decode(window, ids, 15, eos_token_id=[], step="model")
    assert torch.equal(greedy_decode(window, ids, 15, eos_token_id=[]), want)  # auto: the forward loop
    assert "float32" in native_step_reason(_llama_family("llama").to(torch.bfloat16))
    assert "training mode" in native_step_reason(_llama_family("qwen2").train())


def test_native_dense_int8_values_against_the_dequantized_weight():
    from hf_sparsity.backends import get_backend
    from hf_sparsity.backends.formats import quantize_activations, quantize_rows

    w = torch.randn(37, 53, generator=torch.Generator().manual_seed(0))
    b = get_backend("native_dense").from_dense(w, torch.ones_like(w, dtype=torch.uint8), values="int8")
    scales, codes = quantize_rows(w)
    deq = scales[:, None] * codes.float()
    assert torch.equal(b.to_dense(), deq)
    assert b.storage_bytes < w.numel() * 4 / 3.5  # int8 codes + row scales
    for rows in (1, 5):  # int8 activations (the default): on the dequantized activations too
        x = torch.randn(rows, 53, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(b.linear(x), quantize_activations(x) @ deq.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("step", ["model", "native"])
def test_every_loop_ends_a_sequence_by_the_same_rule_as_generate(step):
    """One end-of-sequence rule: the sequence ends after the first token that is any of the eos ids, or
    after exactly max_new_tokens; greedy_decode (either step), native_generate and generate agree."""
    from hf_sparsity.inference.decoding import native_generate

    model = _llama_family("llama")
    ids = torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    n = ids.shape[1]
    free = greedy_decode(model, ids, 10, eos_token_id=[], step=step)
    assert free.shape[1] == n + 10  # no end-of-sequence token: exactly max_new_tokens
    assert torch.equal(greedy_decode(model, ids, 1, eos_token_id=[], step=step), free[:, : n + 1])
    new = free[0, n:].tolist()
    for eos in ([127, new[4], new[2]], (new[5],), new[0], new[9]):
        ends = {eos} if isinstance(eos, int) else set(eos)
        first = next((i for i, t in enumerate(new) if t in ends), 9)  # the definition, on the free run
        want = free[:, : n + first + 1]
        assert torch.equal(greedy_decode(model, ids, 10, eos_token_id=eos, step=step), want), eos
        model.generation_config.eos_token_id = list(ends)
        assert torch.equal(_generate(model, ids, 10), want), eos
        got = model.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=native_generate)
        assert torch.equal(got, want), eos
    model.generation_config.eos_token_id = None
