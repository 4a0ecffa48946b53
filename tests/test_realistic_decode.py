"""The native decode step against transformers' ``generate`` on models that look trained (``realistic``):
a grid of head layouts, head dims, odd vocabularies, positions past 9 and 99, dtypes and formats; and
every reason ``native_step_reason`` gives, one case each, with the fallback's tokens equal to ``generate``'s.

The reference is always ``model.generate(do_sample=False)``; the tests never call the native step's own
helpers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_sparsity.inference import sparsify_for_inference
from hf_sparsity.inference.decoding import greedy_decode, native_step_reason
from hf_sparsity.mask_engine.config import SparsityConfig
from hf_sparsity.mask_engine.engine import SparsityEngine
from hf_sparsity.utils import SparsityError

from .realistic import ARCHS, LLAMA_FAMILY, early_eos, generate_greedy, prompt, realistic_model


def _sparse(model, backend, structure=None, **options):
    eng = SparsityEngine(model, SparsityConfig(sparsity=0.5, structure=structure, init_method="topk"))
    eng.build_masks()
    eng.apply()
    if backend == "auto":
        options = {"plan_cache": False, "check": False, "rounds": 2, **options}
    sparsify_for_inference(model, backend, masks=eng.masks, **options)
    return model


def _same_as_generate(model, ids, n, step="auto", eos=None):
    want = generate_greedy(model, ids, n, eos=eos)
    seen = []
    stop = eos if eos is not None else []
    got = greedy_decode(model, ids, n, eos_token_id=stop, on_token=seen.append, step=step)
    assert torch.equal(got, want), (got[0, ids.shape[1] :].tolist(), want[0, ids.shape[1] :].tolist())
    assert seen == got[0, ids.shape[1] :].tolist()
    return got


# ------------------------------------------------------------------------------------------ the grid
LAYOUTS = [
    dict(heads=4, kv_heads=2),  # grouped-query attention
    dict(heads=4, kv_heads=1),  # multi-query
    dict(heads=4, kv_heads=4),  # multi-head
    dict(heads=2, kv_heads=1, head_dim=24),  # head_dim != hidden / heads
    dict(heads=8, kv_heads=2, hidden=64, head_dim=8),
    dict(heads=3, kv_heads=3, hidden=48, vocab=97),  # odd head count, prime vocabulary
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_native_step_matches_generate_over_head_layouts(arch, layout):
    """Dense float32 models: every layout runs natively and gives generate's greedy tokens, for a short
    prompt (token by token through the native step) and a long one (the model's forward first)."""
    model = realistic_model(arch, **layout)
    assert native_step_reason(model) is None
    vocab = model.config.vocab_size
    _same_as_generate(model, prompt(5, vocab, seed=1), 12, step="native")
    _same_as_generate(model, prompt(19, vocab, seed=2), 6, step="native")


@pytest.mark.parametrize(
    "backend,structure,values",
    [
        ("bitmask", None, None),
        ("csr", None, None),
        ("nm24", "2:4", None),
        ("native_dense", None, None),
        ("auto", None, None),
        ("bitmask", None, "int8"),
        ("nm24", "2:4", "int8"),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_native_step_matches_the_model_on_every_format(arch, backend, structure, values):
    """Sparse formats: native tokens equal generate's (float32 values) and the forward loop's over the same
    kernels (int8 values: the model's own forward computes on the same dequantized weights)."""
    model = realistic_model(arch, heads=4, kv_heads=2, attention_bias=True, mlp_bias=(arch == "llama"))
    _sparse(model, backend, structure, **({"values": values} if values else {}))
    assert native_step_reason(model) is None
    ids = prompt(6, model.config.vocab_size, seed=3)
    if values is None:
        _same_as_generate(model, ids, 14, step="native")
    else:
        want = greedy_decode(model, ids, 14, eos_token_id=[], step="model")
        assert torch.equal(greedy_decode(model, ids, 14, eos_token_id=[], step="native"), want)


def test_native_step_reaches_positions_past_99_on_both_prompt_paths():
    from hf_sparsity.inference.decoding import PROMPT_STEPS

    model = realistic_model("llama", heads=4, kv_heads=1, positions=160)
    for n in (PROMPT_STEPS, PROMPT_STEPS + 1):  # the last prompt through the native step, the first not
        _same_as_generate(model, prompt(n, seed=n), 110 - n, step="native")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_auto_matches_generate(arch):
    """``step="auto"`` on every architecture: native where it runs, the forward loop elsewhere; tokens
    identical to generate either way, and an early end-of-sequence stops both at the same token."""
    model = realistic_model(arch)
    ids = prompt(7, seed=4)
    _same_as_generate(model, ids, 16)
    eos, k = early_eos(model, ids, after=3)
    got = _same_as_generate(model, ids, 24, eos=eos)
    assert got.shape[1] == ids.shape[1] + k + 1 and int(got[0, -1]) == eos


def test_realistic_models_are_not_at_their_default_initialisation():
    """The point of the helper: norm weights and biases away from 1 and 0, different per layer."""
    model = realistic_model("qwen2")
    n0 = model.model.layers[0].input_layernorm.weight
    n1 = model.model.layers[0].post_attention_layernorm.weight
    n2 = model.model.layers[1].input_layernorm.weight
    assert (n0 - 1).abs().mean() > 0.3 and not torch.equal(n0, n1) and not torch.equal(n0, n2)
    assert model.model.layers[0].self_attn.q_proj.bias.abs().mean() > 0.1
    q = model.model.layers[0].self_attn.q_proj.weight
    hd = model.config.hidden_size // model.config.num_attention_heads
    assert q[:hd].abs().mean() > 2 * q[hd:].abs().mean()  # the outlier head


# ------------------------------------------------------------------------------------------ refusals
def _fallback_equals_generate(model, reason_part, length=None, n_new=10):
    ids = prompt(6, model.config.vocab_size, seed=5)
    reason = native_step_reason(model, length if length is not None else ids.shape[1] + n_new)
    assert reason is not None and reason_part in reason, reason
    with pytest.raises(SparsityError, match="step='model'"):
        greedy_decode(model, ids, n_new, step="native")
    _same_as_generate(model, ids, n_new)  # auto: the forward loop, generate's tokens


@pytest.mark.parametrize("arch", ["gpt_neox", "opt"])
def test_refuses_other_architectures(arch):
    _fallback_equals_generate(realistic_model(arch), arch)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_refuses_other_activations(act):
    _fallback_equals_generate(realistic_model("llama", hidden_act=act), f"activation {act!r}")


def test_refuses_pretraining_tp():
    _fallback_equals_generate(realistic_model("llama", pretraining_tp=2), "pretraining_tp")


def test_refuses_training_mode():
    model = realistic_model("qwen2").train()
    assert "training mode" in native_step_reason(model)
    with pytest.raises(SparsityError, match="training mode"):
        greedy_decode(model, prompt(4), 4, step="native")


def test_refuses_bfloat16_and_float16():
    for dtype in (torch.bfloat16, torch.float16):
        _fallback_equals_generate(realistic_model("llama", dtype=dtype), "float32")


def test_refuses_a_backend_without_a_native_call():
    _fallback_equals_generate(_sparse(realistic_model("llama"), "masked_dense"), "no native batch-1 call")


class _MyLinear(nn.Linear):
    pass


def _strided(t: torch.Tensor) -> nn.Parameter:
    """The same values in a non-contiguous tensor (the native step reads contiguous float32 memory)."""
    if t.ndim == 1:
        buf = torch.zeros(2 * t.numel(), dtype=t.dtype)
        buf[::2] = t.detach()
        return nn.Parameter(buf[::2], requires_grad=False)
    return nn.Parameter(t.detach().t().contiguous().t(), requires_grad=False)


def test_refuses_each_unreadable_tensor_and_the_forward_loop_runs_it():
    """Each tensor the native step reads directly (projection weight and bias, norm weight, LM head, final
    norm), when not contiguous float32: refused by name, the fallback equals generate."""
    cases = []
    m = realistic_model("qwen2")
    m.model.layers[1].self_attn.k_proj.weight = _strided(m.model.layers[1].self_attn.k_proj.weight)
    cases.append((m, "layer 1 k_proj"))
    m = realistic_model("qwen2")
    m.model.layers[0].self_attn.v_proj.bias = _strided(m.model.layers[0].self_attn.v_proj.bias)
    cases.append((m, "layer 0 v_proj: a bias"))
    m = realistic_model("llama")
    norm = m.model.layers[1].post_attention_layernorm
    norm.weight = _strided(norm.weight)
    cases.append((m, "layer 1: a norm"))
    m = realistic_model("llama")
    m.model.norm.weight = _strided(m.model.norm.weight)
    cases.append((m, "final norm"))
    m = realistic_model("llama")
    old = m.lm_head
    m.lm_head = _MyLinear(old.in_features, old.out_features, bias=False)
    m.lm_head.weight = old.weight
    cases.append((m, "LM head _MyLinear"))
    m = realistic_model("llama")
    old = m.model.layers[0].mlp.up_proj
    m.model.layers[0].mlp.up_proj = _MyLinear(old.in_features, old.out_features, bias=False)
    m.model.layers[0].mlp.up_proj.weight = old.weight
    cases.append((m, "layer 0 up_proj: _MyLinear"))
    m = realistic_model("llama")
    ln = nn.LayerNorm(m.config.hidden_size)
    m.model.layers[1].input_layernorm = ln
    cases.append((m, "layer 1 is not a Llama-style block"))
    for model, part in cases:
        _fallback_equals_generate(model.eval(), part)


def test_refuses_when_the_native_library_is_unavailable(monkeypatch):
    from hf_sparsity.backends import _native

    monkeypatch.setattr(_native, "load", lambda: None)
    _fallback_equals_generate(realistic_model("llama"), "native kernel library is unavailable")


# ------------------------------------------------------------------------------------------ boundaries
def test_sliding_window_at_the_limit_runs_natively_and_one_past_falls_back():
    window = 12
    model = realistic_model("mistral", sliding_window=window)
    ids = prompt(5, seed=6)
    n_new = window - ids.shape[1]  # the generation reaches exactly `window` tokens
    assert native_step_reason(model, window) is None
    _same_as_generate(model, ids, n_new, step="native")
    assert f"sliding window of {window}" in native_step_reason(model, window + 1)
    with pytest.raises(SparsityError, match="sliding window"):
        greedy_decode(model, ids, n_new + 1, step="native")
    _same_as_generate(model, ids, n_new + 8)  # auto: the forward loop, which slides the window


def test_qwen2_sliding_window_switched_off_runs_natively_past_it():
    model = realistic_model("qwen2", sliding_window=8, use_sliding_window=False)
    assert native_step_reason(model, 40) is None
    _same_as_generate(model, prompt(5, seed=7), 30, step="native")


def test_generation_up_to_the_models_context_length():
    """The last position the model has (context = its max positions): the native step still matches;
    gpt-style absolute positions (no room past it) through the forward loop too."""
    model = realistic_model("llama", positions=40)
    ids = prompt(10, seed=8)
    _same_as_generate(model, ids, 30, step="native")  # positions 0..39: exactly the model's 40
    gpt2 = realistic_model("gpt2", positions=40)
    _same_as_generate(gpt2, ids, 31)  # the 31st new token is never fed back: 40 positions used


@pytest.mark.parametrize("max_new", [1, 2])
def test_one_and_two_new_tokens(max_new):
    model = realistic_model("llama")
    for n in (1, 16, 17):
        got = _same_as_generate(model, prompt(n, seed=n), max_new, step="native")
        assert got.shape[1] == n + max_new


# ------------------------------------------------------------------------------------------ rope types
ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
}


def _rope_model(params, arch="llama"):
    model = realistic_model(arch, positions=64, heads=4, kv_heads=2, head_dim=8)
    params = {"rope_theta": 10000.0, **params}
    cfg = model.config
    cfg.rope_parameters = params
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    fresh = AutoModelForCausalLM.from_config(cfg)
    fresh.load_state_dict(model.state_dict(), strict=False)
    fresh.generation_config.eos_token_id = None
    return fresh.eval()


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_static_rope_types_run_natively_and_match_generate(rope):
    model = _rope_model(ROPES[rope])
    assert native_step_reason(model, 60) is None
    _same_as_generate(model, prompt(5, seed=9), 40, step="native")  # past original_max_position_embeddings
    _same_as_generate(model, prompt(20, seed=9), 20, step="native")


def test_dynamic_rope_is_refused_and_falls_back():
    model = _rope_model({"rope_type": "dynamic", "factor": 2.0})
    ids = prompt(5, seed=10)
    assert "dynamic" in native_step_reason(model, 60)
    with pytest.raises(SparsityError, match="dynamic"):
        greedy_decode(model, ids, 40, step="native")
    _same_as_generate(model, ids, 40)


def _longrope():
    hd = 8
    return _rope_model(
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(hd // 2)],
            "long_factor": [2.0 + 0.5 * i for i in range(hd // 2)],
            "original_max_position_embeddings": 16,
        }
    )


def test_longrope_within_its_original_length_runs_natively():
    model = _longrope()
    assert native_step_reason(model, 16) is None
    _same_as_generate(model, prompt(5, seed=11), 11, step="native")  # 16 tokens: the short factors


def test_longrope_past_its_original_length_falls_back_to_the_forward_loop():
    """transformers switches longrope from its short to its long factors once a call's positions pass
    original_max_position_embeddings; the native step's tables are built once. One past the limit the
    native step is refused and auto's tokens equal generate's."""
    model = _longrope()
    ids = prompt(5, seed=11)
    assert "longrope" in native_step_reason(model, 17)
    with pytest.raises(SparsityError, match="longrope"):
        greedy_decode(model, ids, 12, step="native")
    _same_as_generate(model, ids, 31)


def test_longrope_tables_built_once_would_give_other_tokens():
    """Why the refusal: tables built once for the whole length (the long factors at every position, as a
    single forward over all 36 tokens has them) predict other tokens than generate, which rotated the first
    16 positions with the short factors."""
    model = _longrope()
    ids = prompt(5, seed=11)
    out = generate_greedy(model, ids, 31)
    with torch.no_grad():
        at_once = model(out[:, :-1]).logits.argmax(-1)[0, ids.shape[1] - 1 :]
    assert not torch.equal(at_once, out[0, ids.shape[1] :])


# ------------------------------------------------------------------------------------------ property sweep
def _drawn_case(seed: int):
    """A random point of the grid: architecture, head layout, head dim, vocabulary, layers, biases, format,
    prompt length (either side of PROMPT_STEPS) and new tokens."""
    import random

    r = random.Random(seed)
    arch = r.choice(LLAMA_FAMILY)
    heads = r.choice((1, 2, 3, 4, 6, 8))
    kv = r.choice([k for k in range(1, heads + 1) if heads % k == 0])
    head_dim = r.choice((4, 6, 8, 12, 16))
    kw = dict(
        heads=heads, kv_heads=kv, head_dim=head_dim, hidden=heads * r.choice((4, 6, 8)),
        vocab=r.choice((61, 97, 101, 127, 203)), layers=r.choice((1, 2, 3)), ffn=r.choice((20, 36, 64)),
    )  # fmt: skip
    if arch == "llama":
        kw.update(attention_bias=r.random() < 0.5, mlp_bias=r.random() < 0.5)
    fmt = r.choice((None, "bitmask", "csr", "native_dense", "nm24"))
    return arch, kw, fmt, r.randint(1, 24), r.randint(1, 30), seed


@pytest.mark.parametrize("case", [_drawn_case(s) for s in range(16)], ids=lambda c: f"seed{c[-1]}")
def test_native_step_equals_generate_on_random_grid_points(case):
    arch, kw, fmt, n, new, seed = case
    model = realistic_model(arch, seed=seed, **kw)
    if fmt is not None:
        if fmt == "nm24" and kw["hidden"] % 4:
            fmt = "bitmask"
        _sparse(model, fmt, "2:4" if fmt == "nm24" else None)
    assert native_step_reason(model) is None
    _same_as_generate(model, prompt(n, kw["vocab"], seed=seed), new, step="native")
