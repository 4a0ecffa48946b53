"""The greedy step's screened LM head (``NativeDecoder.step(greedy=True)``): the same token as the whole
head's ``argmax`` (first largest first) on every step, near ties included, and every branch where the whole
head runs instead."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_sparsity.inference import native_step
from hf_sparsity.inference.conversion import SparseLinear
from hf_sparsity.inference.decoding import greedy_decode
from hf_sparsity.inference.native_step import NativeDecoder

from .conftest import tiny_config

VOCAB = 512


def _model(arch: str, seed: int = 0, tied: bool = False):
    """A tiny model with a 512-token vocabulary, random norms and weights large enough for decisive logits."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, vocab=VOCAB, hidden=64)
    cfg.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0, 0.3)
            elif "norm" in name or "ln" in name:
                p.uniform_(0.5, 2.0)
    return model


def _pairs(model, seed: int = 0) -> None:
    """Make the head's odd rows near copies of the even ones: row 2k + 1 is row 2k with one weight moved by
    far less than an int8 step (either way, or not at all: an exact tie), so the int8 copy cannot tell the
    two apart and the pair is the largest logit's neighbourhood on many steps."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = model.get_output_embeddings().weight
        even = w[0::2]
        odd = even.clone()
        cols = torch.randint(0, w.shape[1], (odd.shape[0],), generator=g)
        step = even.abs().amax(dim=1) / 127
        move = (torch.randint(0, 3, (odd.shape[0],), generator=g) - 1) * step * 1e-3
        odd[torch.arange(odd.shape[0]), cols] += move
        w[1::2] = odd


def _steps(model, n: int = 24, prompt: int = 5):
    """Teacher-forced steps of two decoders, one screened (greedy=True) and one running the whole head:
    per step (screened id, whole-head id, torch.argmax of the whole head's logits, rows computed exactly,
    the screened decoder's logit of its id, the whole head's logit of that id)."""
    ids = torch.randint(2, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(1))
    a, b = NativeDecoder(model), NativeDecoder(model, screen_head=False)
    a.start(ids, 64)
    tok = int(b.start(ids, 64).argmax())
    out = []
    with torch.inference_mode():
        for i in range(n):
            got = a.step(tok, greedy=True)
            whole = b.step(tok)
            out.append(
                (
                    got,
                    whole,
                    int(torch.argmax(b.logits)),
                    a.screened,
                    float(a.logits[got]),
                    float(b.logits[got]),
                )
            )
            tok = (whole + 37 * i) % VOCAB  # teacher-forced: many different hidden states
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("pairs", [False, True])
def test_screened_greedy_step_is_the_whole_heads_argmax(arch, pairs):
    model = _model(arch)
    if pairs:
        _pairs(model)
    rows = []
    for got, whole, first_max, screened, mine, theirs in _steps(model):
        assert got == whole == first_max
        assert mine == theirs  # the id's logit is the head kernel's own, bit for bit
        assert 1 <= screened < VOCAB // 4
        rows.append(screened)
    if pairs:  # the near ties were exercised: both rows of a pair computed exactly
        assert min(rows) >= 2


def test_screen_picks_the_first_of_an_exact_tie_and_the_larger_of_a_near_one():
    """Pairs whose int8 codes are the same: the id must follow the float32 logits, not the copy's."""
    model = _model("llama")
    _pairs(model)
    head = model.get_output_embeddings().weight
    seen = set()
    for got, whole, _, _, _, _ in _steps(model, n=40):
        assert got == whole
        pair = head[got - got % 2 : got - got % 2 + 2]
        seen.add("tie" if torch.equal(pair[0], pair[1]) else "odd" if got % 2 else "even")
    assert {"tie", "odd", "even"} <= seen, seen


def test_screen_bound_holds_against_its_definition(monkeypatch):
    """err[r] covers the row's int8 quantization error (absmax / 127 codes, rounded half to even) and both
    products' float32 rounding: |A_r - w_r . x| <= err[r] ||x||_2 for x of every size, with outliers (the
    bound computed in blocks of 64 rows, the last one short)."""
    monkeypatch.setattr(native_step, "_SCREEN_CHUNK", 64)
    torch.manual_seed(0)
    w = torch.randn(300, 96) * torch.rand(300, 1) * 2
    copy, err = native_step._make_screen(w)
    w64 = w.double()
    scale = w64.abs().amax(dim=1, keepdim=True) / 127
    q = torch.round(w64 / scale).clamp(-127, 127) * scale
    quant = (w64 - q).norm(dim=1)
    assert torch.all(err.double() >= quant)
    assert torch.all(err.double() <= quant + 1e-4 * w64.norm(dim=1))
    for size in (1e-3, 1.0, 1e3):
        x = torch.randn(1, 96) * size
        x[0, 7] *= 50  # an outlier dimension
        a = copy.linear(x).double()[0]
        exact = w64 @ x.double()[0]
        assert torch.all((a - exact).abs() <= err.double() * x.double().norm())


def test_too_many_close_rows_run_the_whole_head(monkeypatch):
    model = _model("llama")
    _pairs(model)
    monkeypatch.setattr(native_step, "SCREEN_ROWS", 1)  # every step keeps a pair: more than one row
    for got, whole, first_max, screened, _, _ in _steps(model, n=12):
        assert got == whole == first_max
        assert screened == -1


def test_a_non_finite_hidden_state_runs_the_whole_head():
    model = _model("llama")
    with torch.no_grad():
        model.model.norm.weight[3] = float("inf")
    for got, whole, first_max, screened, _, _ in _steps(model, n=10):
        assert screened == -1
        assert got == whole == first_max


def test_heads_the_screen_does_not_take_run_whole():
    """A head with a bias, an int8 head, and screen_head=False: no screen (``screened`` stays None)."""
    biased = _model("llama")
    old = biased.lm_head
    biased.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        biased.lm_head.weight.copy_(old.weight)
        biased.lm_head.bias.normal_(0, 1)
    from hf_sparsity.inference import sparsify_for_inference

    int8 = sparsify_for_inference(_model("llama"), "native_dense", masks="zeros", values="int8")
    head = int8.get_output_embeddings()
    assert isinstance(head, SparseLinear) and head.backend.int8
    for model in (biased, int8):
        for got, whole, first_max, screened, _, _ in _steps(model, n=10):
            assert got == whole == first_max
            assert screened is None
    dec = NativeDecoder(_model("gpt2"), screen_head=False)
    dec.start(torch.tensor([[3, 4, 5]]), 16)
    dec.step(7, greedy=True)
    assert dec.screened is None


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_loops_give_the_same_tokens_with_the_screen(arch, monkeypatch):
    """greedy_decode and generate(custom_generate=native_generate) screen the head; the tokens are those of
    the whole head (the screen turned off by a zero row budget, so every step falls back)."""
    from hf_sparsity.inference.decoding import native_generate

    model = _model(arch, tied=True)
    _pairs(model)
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=30, do_sample=False, custom_generate=native_generate)
    got = greedy_decode(model, ids, 30, step="native")
    gen = model.generate(ids, **kw)
    # logits asked for: the whole head on every step, its logits as they are
    out = model.generate(ids, return_dict_in_generate=True, output_logits=True, **kw)
    monkeypatch.setattr(native_step, "SCREEN_ROWS", 0)
    want = greedy_decode(model, ids, 30, step="native")
    ref = model.generate(ids, return_dict_in_generate=True, output_logits=True, **kw)
    assert torch.equal(got, want)
    assert torch.equal(gen, want) and torch.equal(out.sequences, want)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits, strict=True))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_largest_logit_survives_a_copy_that_overshoots_another_row(arch):
    """Built from the step's own hidden state h: row 1's weights sit 0.49 of an int8 step off their codes,
    each the way that makes its copy's logit A_1 overshoot its logit L_1, and row 0 is row 1's codes with one
    code moved down by one step, exactly representable: L_0 > L_1 but A_0 < A_1. Only a screen that lowers
    every A_s by its bound before taking the largest keeps row 0 (every other row is zero)."""
    model = _model(arch)
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    tok = 9
    with torch.no_grad():
        full = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        h = model(full, output_hidden_states=True).hidden_states[-1][0, -1].double()
        s = 2.0**-6
        k = torch.round(60 * h / h.abs().max())
        j0 = int(h.abs().argmin())  # the outlier that sets the row scale: 127 steps
        k[j0] = 127
        w1 = s * (k - 0.49 * torch.sign(h))
        w1[j0] = 127 * s
        w0 = s * k.clone()
        others = [i for i in range(h.numel()) if i != j0]
        i1 = others[int(torch.argsort(h[others].abs())[len(others) // 2])]
        w0[i1] -= s * torch.sign(h[i1])
        head = model.get_output_embeddings().weight
        head.zero_()
        head[0], head[1] = w0.float(), w1.float()
    l0, l1 = float(w0 @ h), float(w1 @ h)
    a0, a1 = float(w0 @ h), float((s * k) @ h)  # the copy's logits: row 0 exact, row 1 its codes
    assert l0 > l1 and a1 > a0  # the trap is set
    dec, whole = NativeDecoder(model), NativeDecoder(model, screen_head=False)
    dec.start(ids, 16)
    whole.start(ids, 16)
    assert dec.step(tok, greedy=True) == whole.step(tok) == 0
    assert dec.screened == 2


@pytest.mark.parametrize("backend", ["native_dense", "bitmask", "nm24"])
def test_a_converted_float_head_is_screened_on_its_own_kernel(backend):
    """A head converted to a native format (pruned: bitmask at 50%, 2:4; or dense): its screen is built from
    the weight the kernel holds (zeros included), and each step's id and its logit are the whole head's."""
    from hf_sparsity.backends import get_backend

    model = _model("llama")
    head = model.lm_head
    w = head.weight.detach()
    if backend == "nm24":  # the two largest of every four
        top = w.abs().reshape(-1, 4).topk(2, dim=1).indices
        mask = torch.zeros(w.numel() // 4, 4, dtype=torch.uint8).scatter_(1, top, 1).reshape(w.shape)
    else:
        mask = (torch.rand(w.shape, generator=torch.Generator().manual_seed(5)) < 0.5).to(torch.uint8)
        if backend == "native_dense":
            mask.fill_(1)
    model.lm_head = SparseLinear(head, get_backend(backend).from_dense(w * mask, mask))
    steps = _steps(model)
    for got, whole, first_max, screened, mine, theirs in steps:
        assert got == whole == first_max
        assert mine == theirs
        assert 1 <= screened < VOCAB // 4


# ---------------------------------------------------------------------------- sampling with top-k first
def _penalized(v: torch.Tensor, p: float, seen: list[int]) -> torch.Tensor:
    """The repetition penalty's definition (each seen id once: v < 0 ? v * p : v / p), in float64."""
    v = v.double().clone()
    for r in set(seen):
        v[r] = v[r] * p if v[r] < 0 else v[r] / p
    return v


def _top_k_steps(model, k: int, penalty: float, n: int = 16, seen_top: bool = False):
    """Teacher-forced top-k steps of a screened decoder against one running the whole head: per step the
    screened logits, the whole head's, the rows computed and the ids seen."""
    ids = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    a, b = NativeDecoder(model), NativeDecoder(model, screen_head=False)
    a.start(ids, 64)
    tok = int(b.start(ids, 64).argmax())
    seen = torch.zeros(128, dtype=torch.int64)
    seen[:5] = ids[0]
    count, out = 5, []
    with torch.inference_mode():
        for i in range(n):
            seen[count] = tok
            count += 1
            if seen_top and i:  # the previous step's largest logits seen: the penalty moves them
                top = out[-1][1].topk(3).indices
                seen[count : count + 3] = top
                count += 3
            a.step(tok, top_k=(k, penalty, seen.data_ptr(), count))
            b.step(tok)
            out.append((a.logits.clone(), b.logits.clone(), a.screened, seen[:count].tolist()))
            tok = (int(b.logits.argmax()) + 29 * i) % VOCAB
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize(
    "k,penalty,seen_top", [(1, 0.0, False), (50, 0.0, False), (50, 1.3, False), (20, 4.0, True)]
)
def test_top_k_screen_keeps_every_survivor_exactly(arch, k, penalty, seen_top):
    """Every row among the k largest penalized logits (ties at the k-th kept) is computed, exactly as the
    whole head computes it; every other row is -inf; far fewer rows than the vocabulary are computed."""
    model = _model(arch)
    _pairs(model)
    for got, whole, screened, seen in _top_k_steps(model, k, penalty, seen_top=seen_top):
        kept = torch.isfinite(got)
        assert int(kept.sum()) == screened and k <= screened < VOCAB // 2
        assert torch.equal(got[kept], whole[kept])
        pen = _penalized(whole, penalty, seen) if penalty else whole.double()
        kth = pen.topk(k).values[-1]
        assert bool(kept[pen >= kth].all())  # top-k's survivors, boundary ties included


def test_top_k_screen_runs_the_whole_head_past_its_room(monkeypatch):
    """k past the room: the whole head; k at the room: screened where the rows fit it, else (a near-tie pair
    at the boundary: more rows than the room) the whole head."""
    model = _model("llama")
    _pairs(model)
    monkeypatch.setattr(native_step, "SCREEN_ROWS", 8)
    for got, whole, screened, _ in _top_k_steps(model, 9, 0.0, n=6):
        assert screened == -1
        assert torch.equal(got, whole)
    seen = set()
    for got, whole, screened, _ in _top_k_steps(model, 8, 0.0, n=16):
        seen.add(screened)
        kept = torch.isfinite(got)
        assert torch.equal(got[kept], whole[kept]) and int(kept.sum()) == (VOCAB if screened == -1 else 8)
    assert seen == {-1, 8}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sampling_draws_the_same_tokens_with_the_screen(arch, monkeypatch):
    """generate(do_sample=True) with top-k first, the penalty, temperature and top-p after: the same seed
    draws the same tokens with the head screened as with the whole head (its logits on every kept row are
    the head's own, and the rows it drops are outside top-k)."""
    from hf_sparsity.inference.decoding import native_generate

    model = _model(arch, tied=True)
    _pairs(model)
    model.generation_config.eos_token_id = None
    ids = torch.randint(2, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=40, do_sample=True, top_k=40, top_p=0.9, temperature=0.7, repetition_penalty=1.3)
    outs, raw = [], []
    for rows in (native_step.SCREEN_ROWS, 0):  # screened, then the whole head on every step
        monkeypatch.setattr(native_step, "SCREEN_ROWS", rows)
        torch.manual_seed(11)
        outs.append(model.generate(ids, custom_generate=native_generate, **kw))
        # the raw logits asked for: the whole head on every step, its logits as they are
        torch.manual_seed(11)
        raw.append(model.generate(ids, custom_generate=native_generate, return_dict_in_generate=True,
                                  output_logits=True, **kw))  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(raw[0].sequences, outs[0])
    assert all(torch.equal(a, b) for a, b in zip(raw[0].logits, raw[1].logits, strict=True))
