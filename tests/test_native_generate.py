"""``model.generate(custom_generate=native_generate)`` and the text-generation pipeline on the native step:
generate's greedy tokens, sampling from the same processed probabilities, streamers, stopping criteria, and
generate's own loop (with one line saying why) where the native step does not run the call."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_sparsity.inference import sparsify_for_inference
from hf_sparsity.inference.decoding import native_generate, native_generate_kwargs
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine
from hf_sparsity.utils import SparsityError

from .conftest import tiny_model

LAYOUTS = {  # hidden, heads, kv heads, head_dim (None: hidden / heads)
    "gqa": (32, 4, 2, None),
    "mqa-wide-heads": (64, 4, 1, 16),
    "mha-hd32": (64, 2, 2, 32),
}


def _model(arch: str = "llama", layout: str = "gqa", vocab: int = 128, **kw):
    """A tiny Llama-family model with realistic random weights: norms away from 1, large attention logits."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    hidden, heads, kv, hd = LAYOUTS[layout]
    klass = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    extra = {"sliding_window": None} if arch == "mistral" else {}
    cfg = klass(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 8, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd or hidden // heads,
        max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=1, **extra, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:  # biases (Qwen2's q / k / v)
                p.normal_(0, 0.1)
    return model


GPT2_LAYOUTS = {"h4-hd16": (64, 4), "h2-hd32": (64, 2), "h8-hd4": (32, 8)}  # hidden, heads


def _gpt2(layout: str = "h4-hd16", act: str = "gelu_new", vocab: int = 128):
    """A tiny GPT-2 with realistic random weights: LayerNorm weights away from 1, random biases."""
    from transformers import AutoModelForCausalLM, GPT2Config

    hidden, heads = GPT2_LAYOUTS[layout]
    cfg = GPT2Config(
        n_layer=2, n_embd=hidden, n_head=heads, n_positions=256, vocab_size=vocab, bos_token_id=0,
        eos_token_id=1, pad_token_id=1, activation_function=act,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
            elif ".ln_" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    return model


def _sparse(model, backend: str = "bitmask", **options):
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, init_method="topk"))
    eng.build_masks()
    eng.apply()
    sparsify_for_inference(model, backend, masks=eng.masks, **options)
    return model


def _ids(n: int, seed: int = 0, vocab: int = 128) -> torch.Tensor:
    return torch.randint(2, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3)


@pytest.mark.parametrize("backend", [None, "bitmask"])
@pytest.mark.parametrize(
    "arch,layout",
    [
        ("llama", "gqa"),
        ("mistral", "mqa-wide-heads"),
        ("qwen2", "mha-hd32"),
        ("qwen3", "gqa"),
        ("qwen3", "mqa-wide-heads"),
    ],
)
def test_greedy_is_token_identical_to_generate(arch, layout, backend):
    model = _model(arch, layout)
    if backend:
        _sparse(model, backend)
    model.generation_config.eos_token_id = None
    for seed, n in enumerate((5, 21)):  # the prompt token by token, and through the model's forward
        ids = _ids(n, seed)
        want = model.generate(ids, max_new_tokens=30, do_sample=False)
        got = model.generate(ids, max_new_tokens=30, do_sample=False, **native_generate_kwargs("native"))
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "backend,options",
    [(None, {}), ("bitmask", {}), ("csr", {}), ("bitmask", {"values": "int8"}), ("native_dense", {})],
)
@pytest.mark.parametrize("layout,act", [("h4-hd16", "gelu_new"), ("h2-hd32", "gelu"), ("h8-hd4", "gelu_new")])
def test_gpt2_greedy_is_token_identical_to_generate(layout, act, backend, options):
    """GPT-2 on the native step (learned positions, LayerNorm with a bias, fused Conv1D q / k / v, GELU,
    biases): plain Conv1D layers and every native format give generate's greedy tokens (int8 values:
    the forward loop's, on the same kernels)."""
    from hf_sparsity.inference.decoding import greedy_decode, native_step_reason

    model = _gpt2(layout, act)
    if backend:
        _sparse(model, backend, **options)
    assert native_step_reason(model) is None
    model.generation_config.eos_token_id = None
    for seed, n in enumerate((4, 19)):  # the prompt token by token, and through the model's forward
        ids = _ids(n, seed)
        want = model.generate(ids, max_new_tokens=40, do_sample=False)
        got = model.generate(ids, max_new_tokens=40, do_sample=False, **native_generate_kwargs("native"))
        assert torch.equal(got, want)
        assert torch.equal(greedy_decode(model, ids, 40, step="native"), want)


def test_gpt2_plain_conv1d_weights_are_transposed_once_and_follow_changes():
    from hf_sparsity.inference.decoding import greedy_decode

    model = _gpt2()
    model.generation_config.eos_token_id = None
    ids = _ids(5, 8)
    assert torch.equal(greedy_decode(model, ids, 10, step="native"), model.generate(ids, max_new_tokens=10))
    with torch.no_grad():  # a changed weight: the native step sees the change
        model.transformer.h[0].mlp.c_fc.weight.mul_(-1.5)
    assert torch.equal(greedy_decode(model, ids, 10, step="native"), model.generate(ids, max_new_tokens=10))


def test_greedy_stops_at_eos_and_pads_like_generate():
    model = _model()
    ids = _ids(6, 1)
    free = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None)
    eos = int(free[0, ids.shape[1] + 3])  # the 4th new token ends the sequence
    want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=1)
    got = model.generate(
        ids, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=1, **native_generate_kwargs()
    )
    assert int(got[0, -1]) == eos and got.shape[1] == ids.shape[1] + 4 and torch.equal(got, want)


@pytest.fixture(params=["native", "torch"])
def sampling_path(request, monkeypatch):
    """Sampling's processors in the one native call, or in torch (as where the native call is not built)."""
    if request.param == "torch":
        from hf_sparsity.inference import sampling

        monkeypatch.setattr(sampling, "_sampler", lambda *a: None)
    return request.param


@pytest.mark.parametrize(
    "arch,layout", [("llama", "gqa"), ("qwen2", "mqa-wide-heads"), ("qwen3", "mha-hd32"), ("gpt2", "h4-hd16")]
)
def test_sampling_draws_from_generates_processed_probabilities(arch, layout, sampling_path):
    """At every step of a sampled run (temperature, top-k, top-p, repetition penalty) the processed
    probabilities equal those transformers' own loop computes for the same prefix, within float rounding;
    every drawn token has positive probability there."""
    model = _sparse(_gpt2(layout) if arch == "gpt2" else _model(arch, layout))
    model.generation_config.eos_token_id = None
    ids = _ids(7, 2)
    torch.manual_seed(0)
    out = model.generate(
        ids, max_new_tokens=16, **SAMPLING, custom_generate=native_generate, native_step="native",
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    seq = out.sequences
    assert seq.shape[1] == ids.shape[1] + 16 and len(out.scores) == 16 == len(out.logits)
    for t in range(16):
        prefix = seq[:, : ids.shape[1] + t]
        ref = model.generate(  # a drawn pad token is a token here, not padding
            prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1, **SAMPLING,
            return_dict_in_generate=True, output_scores=True, output_logits=True,
        )  # fmt: skip
        torch.testing.assert_close(out.logits[t], ref.logits[0], rtol=1e-4, atol=1e-4)
        p_ref = torch.softmax(ref.scores[0].double(), -1)
        p_got = torch.softmax(out.scores[t].double(), -1)
        torch.testing.assert_close(p_got, p_ref, rtol=0, atol=1e-5)
        assert p_ref[0, int(seq[0, ids.shape[1] + t])] > 0


def test_sampled_text_is_the_same_whether_or_not_the_scores_are_returned():
    """Without ``output_scores`` the whole processed row is not built (a draw needs top-k's survivors only):
    the same seed draws the same 24 tokens either way."""
    model = _sparse(_model("llama", "gqa"))
    model.generation_config.eos_token_id = None
    ids = _ids(6, 4)
    runs = []
    for want_scores in (True, False):
        torch.manual_seed(11)
        out = model.generate(
            ids, max_new_tokens=24, **SAMPLING, custom_generate=native_generate, native_step="native",
            return_dict_in_generate=True, output_scores=want_scores,
        )  # fmt: skip
        runs.append(out.sequences)
    assert runs[0].shape[1] == ids.shape[1] + 24 and torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "cfg",
    [
        dict(top_k=12, min_p=0.05, temperature=0.8),  # min-p on top-k's survivors
        dict(top_k=12, typical_p=0.9),  # typical-p reads every token: the whole row
        dict(top_k=5),  # top-k alone: nothing after it
        dict(top_k=0, top_p=0.8),  # no top-k: top-p on the whole row
        dict(top_k=12, temperature=1.3, top_p=0.5, min_p=0.2),  # both on the survivors
    ],
    ids=["min-p", "typical-p", "top-k-only", "top-p-only", "top-p-and-min-p"],
)
def test_sampling_configurations_give_generates_processed_probabilities(cfg, sampling_path):
    model = _sparse(_model("llama", "mqa-wide-heads"))
    model.generation_config.eos_token_id = None
    ids = _ids(6, 9)
    torch.manual_seed(1)
    out = model.generate(
        ids, max_new_tokens=10, do_sample=True, **cfg, custom_generate=native_generate,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    for t in range(10):
        prefix = out.sequences[:, : ids.shape[1] + t]
        ref = model.generate(
            prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1, do_sample=True, **cfg,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
        p_ref = torch.softmax(ref.scores[0].double(), -1)
        torch.testing.assert_close(torch.softmax(out.scores[t].double(), -1), p_ref, rtol=0, atol=1e-5)
        assert p_ref[0, int(out.sequences[0, ids.shape[1] + t])] > 0


def test_a_processor_asking_for_more_arguments_fails_as_in_generate():
    from transformers import LogitsProcessor, LogitsProcessorList

    class NeedsMore(LogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            return scores

    model = _model()
    for extra in ({}, {"custom_generate": native_generate}):
        with pytest.raises(ValueError, match="required parameters"):
            model.generate(
                _ids(4), max_new_tokens=3, do_sample=False,
                logits_processor=LogitsProcessorList([NeedsMore()]), **extra,
            )  # fmt: skip


def test_sampled_tokens_follow_generates_processed_distribution():
    """With top-k, the native loop draws among top-k's survivors: the distribution of generate's processed
    scores, from other random numbers (a seed gives other text than generate's loop, and the same text
    twice). A chi-square test of 1,500 one-token draws against softmax(generate's processed scores)."""
    model = _model()
    model.generation_config.eos_token_id = None
    ids = _ids(5, 3)
    cfg = dict(do_sample=True, temperature=1.5, top_k=8, top_p=0.95, repetition_penalty=1.3)
    ref = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, **cfg, return_dict_in_generate=True,
        output_scores=True,
    )  # fmt: skip
    p = torch.softmax(ref.scores[0][0].double(), -1)
    support = p > 0
    assert 4 <= int(support.sum()) <= 8
    torch.manual_seed(0)
    n = 1500
    counts = torch.zeros_like(p)
    for _ in range(n):
        out = model.generate(ids, max_new_tokens=1, **cfg, custom_generate=native_generate)
        counts[int(out[0, -1])] += 1
    assert counts[~support].sum() == 0  # nothing outside top-k / top-p's survivors
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    z = 4.75  # the standard normal's 1 - 1e-6 quantile; Wilson-Hilferty's chi-square quantile from it
    assert chi2 < df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3, (chi2, df)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.generate(ids, max_new_tokens=20, **SAMPLING, custom_generate=native_generate))
    assert torch.equal(runs[0], runs[1])


def test_streamer_and_stopping_criteria_see_what_generate_gives_them():
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Record:
        def __init__(self):
            self.calls = []

        def put(self, x):
            self.calls.append(x.tolist())

        def end(self):
            self.calls.append("end")

    class StopAfter(StoppingCriteria):  # stops once the sequence reaches `n` tokens
        def __init__(self, n):
            self.n = n

        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= self.n, dtype=torch.bool)

    model = _model()
    model.generation_config.eos_token_id = None
    ids = _ids(4, 4)
    runs = []
    for extra in ({}, {"custom_generate": native_generate}):
        rec = Record()
        out = model.generate(
            ids, max_new_tokens=20, do_sample=False, streamer=rec,
            stopping_criteria=StoppingCriteriaList([StopAfter(ids.shape[1] + 7)]), **extra,
        )  # fmt: skip
        runs.append((out, rec.calls))
    assert runs[0][0].shape[1] == ids.shape[1] + 7
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert runs[1][1][0] == ids.tolist() and runs[1][1][-1] == "end" and len(runs[1][1]) == 9


def test_long_generations_grow_the_native_cache(monkeypatch):
    from hf_sparsity.inference import decoding

    monkeypatch.setattr(decoding, "_CACHE_STEP", 8)  # the cache is reallocated several times
    model = _sparse(_model("llama", "mqa-wide-heads"))
    model.generation_config.eos_token_id = None
    ids = _ids(5, 5)
    want = model.generate(ids, max_new_tokens=60, do_sample=False)
    got = model.generate(ids, max_new_tokens=60, do_sample=False, custom_generate=native_generate)
    assert torch.equal(got, want)
    gpt2 = tiny_model("gpt2").eval()  # 64 learned positions: the cache grows up to them, not past
    gpt2.generation_config.eos_token_id = None
    want = gpt2.generate(ids, max_new_tokens=59, do_sample=False)
    assert torch.equal(
        gpt2.generate(ids, max_new_tokens=59, do_sample=False, **native_generate_kwargs("native")), want
    )


def test_per_token_work_runs_on_one_torch_thread_and_the_step_keeps_the_callers(monkeypatch):
    """Between native steps transformers' processors run on one torch thread (an OpenMP team left spinning
    slows the step's own pool); every build of the step's structures, the cache's growth included, takes
    the caller's thread count, and the caller's count is back after the call, also when it raises."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from hf_sparsity.inference import decoding
    from hf_sparsity.inference.native_step import NativeDecoder

    seen: dict[str, list[int]] = {"build": [], "struct": [], "processor": []}
    build_at = NativeDecoder._build_at

    def recording_build(self, *a):
        seen["build"].append(torch.get_num_threads())
        build_at(self, *a)
        seen["struct"].append(int(self._dec.threads))

    class Threads(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen["processor"].append(torch.get_num_threads())
            return scores

    class Raises:
        def __init__(self):
            self.n = 0

        def put(self, x):
            self.n += 1
            if self.n == 6:
                raise RuntimeError("streamer failed")

        def end(self):
            pass

    monkeypatch.setattr(NativeDecoder, "_build_at", recording_build)
    monkeypatch.setattr(decoding, "_CACHE_STEP", 8)  # the cache grows twice inside the loop
    model = _sparse(_model("llama", "gqa"))
    model.generation_config.eos_token_id = None
    ids = _ids(5, 6)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        want = model.generate(ids, max_new_tokens=24, do_sample=False)
        got = model.generate(
            ids, max_new_tokens=24, do_sample=False, logits_processor=LogitsProcessorList([Threads()]),
            custom_generate=native_generate,
        )  # fmt: skip
        assert torch.equal(got, want)
        assert len(seen["build"]) == 3 and seen["build"] == seen["struct"] == [3, 3, 3]
        assert seen["processor"] == [1] * 24
        assert torch.get_num_threads() == 3
        with pytest.raises(RuntimeError, match="streamer failed"):
            model.generate(
                ids, max_new_tokens=24, do_sample=False, streamer=Raises(), **native_generate_kwargs()
            )
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(old)


def test_pipeline_forwards_it(shared_data):
    from transformers import GPT2TokenizerFast, pipeline

    tok = GPT2TokenizerFast.from_pretrained(shared_data / "tokenizer/gpt2")
    model = _sparse(_model(vocab=len(tok)))
    model.generation_config.eos_token_id = None
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    want = pipe("Sparse models are", max_new_tokens=10, do_sample=False)
    fast = native_generate_kwargs("native")
    assert pipe("Sparse models are", max_new_tokens=10, do_sample=False, **fast) == want
    fast = pipeline("text-generation", model=model, tokenizer=tok, custom_generate=native_generate)
    assert fast("Sparse models are", max_new_tokens=10, do_sample=False) == want


@pytest.mark.parametrize(
    "case,match",
    [
        ("beam", "beam search"),
        ("batch", "batch of 2"),
        ("padding", "padding"),
        ("gpt_neox", "model type 'gpt_neox'"),
        ("bf16", "float32"),
        ("masked_dense", "no native batch-1 call"),
        ("train", "training mode"),
        ("dynamic_rope", "dynamic rotary"),
    ],
)
def test_what_the_native_step_does_not_run_takes_generates_loop(case, match, caplog):
    """The standard loop runs (the same output as without custom_generate) and one line names why;
    native_step='native' raises a one-line error naming the reason and the alternative."""
    model = _model()
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=1)
    ids = _ids(5, 6)
    if case == "beam":
        kw["num_beams"] = 2
    elif case == "batch":
        ids = torch.cat([ids, _ids(5, 7)])
    elif case == "padding":
        kw["attention_mask"] = torch.tensor([[0, 1, 1, 1, 1]])
    elif case == "gpt_neox":
        model = tiny_model("gpt_neox").eval()
    elif case == "bf16":
        model = model.to(torch.bfloat16)
    elif case == "masked_dense":
        _sparse(model, "masked_dense")
    elif case == "train":
        model.train()
    elif case == "dynamic_rope":
        model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.generation_config.eos_token_id = None
    want = model.generate(ids, **kw)  # (training mode: dropout is 0, the same tokens)
    with caplog.at_level(logging.WARNING, logger="hf_sparsity.inference.decoding"):
        got = model.generate(ids, **kw, custom_generate=native_generate)
    assert torch.equal(got, want)
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_sparsity.inference.decoding"]
    assert len(lines) == 1 and match in lines[0] and "\n" not in lines[0]
    with pytest.raises(SparsityError, match=match) as err:
        model.generate(ids, **kw, custom_generate=native_generate, native_step="native")
    assert "\n" not in str(err.value) and "custom_generate" in str(err.value)


def test_gpt2_reasons():
    from hf_sparsity.inference.decoding import native_step_reason

    gpt2 = tiny_model("gpt2").eval()  # 64 learned positions
    assert native_step_reason(gpt2, 64) is None
    assert "beyond its 64 positions" in native_step_reason(gpt2, 65)
    gpt2.config.activation_function = "relu"
    assert "activation 'relu'" in native_step_reason(gpt2)
    gpt2.config.activation_function = "gelu_new"
    gpt2.config.scale_attn_by_inverse_layer_idx = True
    assert "scale_attn_by_inverse_layer_idx" in native_step_reason(gpt2)


def test_bad_native_step_value():
    with pytest.raises(SparsityError, match="native_step='fast'"):
        native_generate_kwargs("fast")
    model = _model()
    with pytest.raises(SparsityError, match="native_step='fast'"):
        model.generate(_ids(3), max_new_tokens=2, custom_generate=native_generate, native_step="fast")
