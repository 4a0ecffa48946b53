"""The native sampling call (``hfs_sample``, through ``sampling._sampler``) against transformers'
processors.

Each case builds transformers' processors as ``generate`` builds them (repetition penalty, temperature,
top-k, then the warpers after it), runs them in torch on a realistic row (a 49,152-token vocabulary with
spread logits, a 37-token one that ends off the vector width, ids seen twice, ids past the row, ties at
top-k's boundary), and compares: the survivors (ids and values, bit for bit before the warpers after
top-k), the processed probabilities, the drawn token (the first id, ascending, whose cumulative probability
exceeds the uniform, computed here in float64), and the row left exactly as it was. Every row the call must
leave to torch (a NaN, fewer than top-k values above ``-inf``, ties past its room, a negative id, ids past
its room) returns -1 with the row untouched; then ``generate`` on the native step runs the processors in
torch and still gives ``generate``'s processed probabilities.
"""

from __future__ import annotations

import pytest
import torch

from hf_sparsity.backends import _native
from hf_sparsity.inference import sampling
from hf_sparsity.inference.decoding import native_generate
from hf_sparsity.inference.sampling import _sampler, _Sequence

from .realistic import realistic_model

pytestmark = pytest.mark.skipif(_native.load() is None, reason="the native kernels are not built here")


def _procs(penalty=None, temperature=None, top_k=50, tail=(), ignore=None):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = []
    if penalty is not None:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=ignore))
    if temperature is not None:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None:
        procs.append(TopKLogitsWarper(top_k))
    kinds = {"temperature": TemperatureLogitsWarper, "top_p": TopPLogitsWarper, "min_p": MinPLogitsWarper}
    for name, value, *keep in tail:
        if name == "top_k":
            procs.append(TopKLogitsWarper(value, min_tokens_to_keep=keep[0] if keep else 1))
        elif name == "temperature":
            procs.append(TemperatureLogitsWarper(value))
        else:
            procs.append(kinds[name](value, min_tokens_to_keep=keep[0] if keep else 1))
    return LogitsProcessorList(procs)


def _row(vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=g) * 4 - 3  # mostly negative: the penalty multiplies and divides
    row[torch.randint(0, vocab, (8,), generator=g)] += 12  # a few likely tokens
    return row


def _seen(vocab: int, n: int, seed: int) -> torch.Tensor:
    """[1, n] ids: each of the row's 8 largest twice, the rest random, two past the row (ids of a larger
    embedding)."""
    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(0, vocab, (n,), generator=g)
    top = _row(vocab, seed).topk(min(8, vocab)).indices
    ids[: 2 * len(top)] = top.repeat(2)
    ids[-2:] = torch.tensor([vocab, vocab + 5])
    return ids[None]


def _expected_token(probs: torch.Tensor, u: float) -> int | None:
    """The first id (ascending) whose float64 cumulative probability exceeds u; None where u is within
    1e-9 of a boundary (rounding may fall either side)."""
    ids = probs.nonzero()[:, 0]
    cum = probs[ids].cumsum(0)
    if bool(((cum - u).abs() < 1e-9).any()):
        return None
    return int(ids[int((cum <= u).sum())])


CASES = {
    "penalty+temperature+top-k": dict(penalty=1.3, temperature=0.7, top_k=50),
    "penalty-below-1": dict(penalty=0.8, top_k=20),
    "temperature+top-k+top-p": dict(temperature=1.4, top_k=64, tail=[("top_p", 0.9)]),
    "generate's defaults": dict(penalty=1.1, temperature=0.7, top_k=50, tail=[("top_p", 0.9)]),
    "top-p keeps 5": dict(top_k=40, tail=[("top_p", 0.3, 5)]),
    "min-p": dict(penalty=1.2, top_k=30, tail=[("min_p", 0.05)]),
    "min-p keeps 4": dict(temperature=0.5, top_k=30, tail=[("min_p", 0.6, 4)]),
    "warpers after": dict(
        top_k=100, tail=[("temperature", 2.5), ("top_k", 12), ("top_p", 0.8), ("min_p", 0.01)]
    ),
    "top-k only": dict(top_k=7),
    "top-k 1": dict(penalty=1.5, top_k=1),
    "prompt ignored": dict(penalty=2.0, top_k=16, ignore=20),
}


@pytest.mark.parametrize("vocab", [49152, 37, 200])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_native_call_computes_transformers_processors_and_draws_by_the_cumulative_probability(
    case, vocab
):
    cfg = CASES[case]
    if cfg["top_k"] > vocab:
        cfg = {**cfg, "top_k": vocab}
    procs = _procs(**cfg)
    ids = _seen(vocab, 40, seed=vocab)
    row = _row(vocab, vocab)
    before = row.clone()
    sampler = _sampler(list(procs), vocab, seen_room=64)
    assert sampler is not None
    seq = _Sequence(ids, 64)

    # transformers in torch, float32; top-k's survivors before the warpers after it
    from transformers.generation.logits_process import LogitsProcessorList

    head = LogitsProcessorList(procs[: [type(p).__name__ for p in procs].index("TopKLogitsWarper") + 1])
    after_top_k = head(ids, row[None].clone())[0]
    want = procs(ids, row[None].clone())[0]
    probs = torch.softmax(want.double(), -1)

    g = torch.Generator().manual_seed(5)
    checked = 0
    for u in [0.0, 0.999999, *torch.rand(40, generator=g, dtype=torch.float64).tolist()]:
        tok = sampler(seq, row, u)
        assert torch.equal(row, before)  # the penalty written in place is put back
        m = sampler.survivors.value
        keep = sampler.idx[:m]
        assert torch.equal(keep, (after_top_k > -float("inf")).nonzero()[:, 0])
        if len(procs) == len(head):  # no warper after top-k: the values bit for bit
            assert torch.equal(sampler.val[:m], want[keep])
        got = torch.full((vocab,), -float("inf"))
        got[keep] = sampler.val[:m]
        assert torch.equal(got == -float("inf"), want == -float("inf"))
        torch.testing.assert_close(torch.softmax(got.double(), -1), probs, rtol=0, atol=1e-6)
        expected = _expected_token(probs, u)
        if expected is not None:
            assert tok == expected, (u, tok, expected)
            checked += 1
    assert checked >= 35


def _peaked(vocab: int, likely: int, seed: int) -> torch.Tensor:
    """A row whose ``likely`` largest logits hold most of the probability (top-p then keeps up to that many;
    the more there are, the closer their values)."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(vocab, generator=g) * 2 - 3
    spread = 1.0 if likely <= 8 else 0.05
    row[torch.randperm(vocab, generator=g)[:likely]] = 9 + spread * torch.randn(likely, generator=g)
    return row


NUCLEUS = {  # no top-k: top-p over the whole row first
    "top-p": (dict(tail=[("top_p", 0.9)]), 8),
    "penalty+temperature+top-p": (dict(penalty=1.3, temperature=0.7, tail=[("top_p", 0.8)]), 8),
    "top-p keeps 3": (dict(tail=[("top_p", 0.05, 3)]), 8),
    "top-p then min-p": (dict(temperature=0.9, tail=[("top_p", 0.9), ("min_p", 0.3)]), 8),
    "top-p past 64 candidates": (dict(tail=[("top_p", 0.9)]), 150),  # the candidates grow to 256
}


@pytest.mark.parametrize("vocab", [49152, 37])
@pytest.mark.parametrize("case", sorted(NUCLEUS))
def test_top_p_without_top_k_keeps_transformers_nucleus(case, vocab):
    cfg, likely = NUCLEUS[case]
    procs = _procs(top_k=None, **cfg)
    ids = _seen(vocab, 30, seed=3)
    row = _peaked(vocab, min(likely, vocab // 2), seed=vocab + likely)
    before = row.clone()
    sampler = _sampler(list(procs), vocab, seen_room=64)
    assert sampler is not None and sampler.struct.top_k == 0
    want = procs(ids, row[None].clone())[0]
    probs = torch.softmax(want.double(), -1)
    for u in (0.0, 0.25, 0.5, 0.75, 0.999):
        tok = sampler(_Sequence(ids, 64), row, u)
        assert tok >= 0 and torch.equal(row, before)
        m = sampler.survivors.value
        got = torch.full((vocab,), -float("inf"))
        got[sampler.idx[:m]] = sampler.val[:m]
        assert torch.equal(got == -float("inf"), want == -float("inf")), case
        torch.testing.assert_close(torch.softmax(got.double(), -1), probs, rtol=0, atol=1e-6)
        expected = _expected_token(probs, u)
        assert expected is None or tok == expected
    if case == "top-p past 64 candidates" and vocab > 1000:
        assert int((want > -float("inf")).sum()) > 64


def test_top_p_on_a_flat_row_is_left_to_torch():
    """Top-p 0.9 over 49,152 nearly equal logits keeps some 44,000 tokens: more than the candidates' room."""
    row = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 0.1
    sampler = _sampler(list(_procs(top_k=None, tail=[("top_p", 0.9)])), 49152, seen_room=8)
    before = row.clone()
    assert sampler(_Sequence(torch.tensor([[1, 2]]), 8), row, 0.5) == -1 and torch.equal(row, before)


def test_ties_at_top_ks_boundary_are_kept_as_transformers_keeps_them():
    procs = _procs(top_k=5)
    row = torch.linspace(-5, 5, 300)
    row[[10, 150, 299, 3]] = 7.0  # the 4 largest
    row[[20, 40, 41]] = 6.0  # three share the 5th place: all kept
    sampler = _sampler(list(procs), 300, seen_room=8)
    tok = sampler(_Sequence(torch.tensor([[1, 2]]), 8), row, 0.5)
    keep = sampler.idx[: sampler.survivors.value]
    assert keep.tolist() == [3, 10, 20, 40, 41, 150, 299]
    assert torch.equal(keep, (procs(None, row[None])[0] > -float("inf")).nonzero()[:, 0])
    assert tok in keep.tolist()


def test_a_temperature_above_1_keeps_the_ids_whose_quotient_ties_with_the_kth():
    """Dividing by t > 1 can round two neighbouring floats to one quotient: the id just below the k-th
    largest logit then ties with it after the temperature, and transformers keeps it."""
    import numpy as np

    t = np.float32(3.0)
    floats = (np.float32(12.0).view(np.int32) + np.arange(4096, dtype=np.int32)).view(np.float32)
    below = np.nextafter(floats, np.float32(-np.inf))
    a = floats[below / t == floats / t][0]  # a float whose lower neighbour's quotient ties with its own
    b = np.nextafter(a, np.float32(-np.inf))
    row = torch.linspace(-8, 8, 500)
    row[[400, 100, 7, 250]] = torch.tensor([20.0, 19.0, 18.0, 17.0])
    row[300], row[42] = float(a), float(b)  # the 5th largest, and its lower neighbour
    procs = _procs(temperature=float(t), top_k=5)
    want = (procs(None, row[None].clone())[0] > -float("inf")).nonzero()[:, 0]
    assert want.tolist() == [7, 42, 100, 250, 300, 400]
    sampler = _sampler(list(procs), 500, seen_room=4)
    sampler(_Sequence(torch.tensor([[1]]), 4), row, 0.5)
    assert torch.equal(sampler.idx[: sampler.survivors.value], want)


def _fallback_cases():
    vocab = 3000
    row = _row(vocab, 1)
    nan_vector, nan_tail = row.clone(), row.clone()
    nan_vector[1234] = float("nan")
    nan_tail[vocab - 3] = float("nan")  # past the last full vector of 16
    few = torch.full((vocab,), -float("inf"))
    few[[5, 70, 900]] = torch.tensor([1.0, 2.0, 3.0])  # 3 values above -inf, top-k 50
    ties = torch.zeros(vocab)  # 3000 ties at the boundary: past the room of 1024
    ids = _seen(vocab, 30, 1)
    negative = ids.clone()
    negative[0, 3] = -4
    return {
        "nan in the vectors": (nan_vector, ids, 64),
        "nan in the tail": (nan_tail, ids, 64),
        "fewer than top-k above -inf": (few, ids, 64),
        "ties past the room": (ties, ids, 64),
        "a negative id": (row, negative, 64),
        "ids past the room": (row, ids, 16),
    }


@pytest.mark.parametrize("case", sorted(_fallback_cases()))
def test_rows_the_call_leaves_to_torch_return_minus_one_and_stay_as_they_were(case):
    row, ids, room = _fallback_cases()[case]
    sampler = _sampler(list(_procs(penalty=1.3, temperature=0.7, top_k=50)), row.numel(), seen_room=room)
    before = row.clone()
    assert sampler(_Sequence(ids, max(room, ids.shape[1])), row, 0.3) == -1
    assert torch.equal(row.isnan(), before.isnan()) and torch.equal(row.nan_to_num(), before.nan_to_num())


def test_other_processor_lists_take_the_torch_path():
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
        TypicalLogitsWarper,
    )

    top_k = TopKLogitsWarper(10)
    t = TemperatureLogitsWarper(0.5)
    for procs in (
        [TypicalLogitsWarper(0.9)],  # neither top-k nor top-p
        [top_k, TypicalLogitsWarper(0.9)],  # a warper not run on survivors
        [t, _procs(penalty=1.2)[0], top_k],  # the penalty after the temperature: not generate's order
        [TopKLogitsWarper(10, filter_value=-100.0)],  # another filter value
        [TopKLogitsWarper(2000)],  # top-k past the room
        [top_k, *[TemperatureLogitsWarper(2.0)] * 5],  # more than 4 warpers after it
    ):
        assert _sampler(LogitsProcessorList(procs), 4000, seen_room=8) is None
    assert _sampler([t, top_k, TopPLogitsWarper(0.9)], 4000, seen_room=8) is not None
    assert _sampler([t, TopPLogitsWarper(0.9)], 4000, seen_room=8).struct.top_k == 0


# ---- through model.generate ------------------------------------------------------------------------------
def _llama(vocab: int = 128, positions: int = 512):
    """A tiny Llama with trained-looking weights (tests/realistic.py), no end-of-sequence token."""
    return realistic_model("llama", vocab=vocab, positions=positions)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 128, (1, n), generator=torch.Generator().manual_seed(seed))


SAMPLING = dict(do_sample=True, temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3)


def _check_against_generate(model, ids, out, steps, cfg):
    for t in range(steps):
        prefix = out.sequences[:, : ids.shape[1] + t]
        ref = model.generate(
            prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1, **cfg,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
        p_ref = torch.softmax(ref.scores[0].double(), -1)
        torch.testing.assert_close(torch.softmax(out.scores[t].double(), -1), p_ref, rtol=0, atol=1e-5)
        assert p_ref[0, int(out.sequences[0, ids.shape[1] + t])] > 0


def test_ties_past_the_room_run_transformers_processors_in_torch(monkeypatch):
    """Every logit equal (the LM head's rows all alike): top-k keeps every tied token the penalty left, more
    than the room (set to 24 here): each token's processors run in torch, and give generate's probabilities.
    (No top-p: which of exactly tied tokens it drops depends on the order a sort leaves ties in.)"""
    monkeypatch.setattr(sampling, "_CANDIDATES", 24)
    model = _llama()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.copy_(head[:1].expand_as(head))
    calls = []
    monkeypatch.setattr(sampling._Processing, "__call__", _counting(sampling._Processing.__call__, calls))
    ids = _ids(6, 1)
    cfg = dict(do_sample=True, temperature=0.7, top_k=20, repetition_penalty=1.3, min_p=0.1)
    torch.manual_seed(0)
    out = model.generate(
        ids, max_new_tokens=6, **cfg, custom_generate=native_generate, native_step="native",
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    assert len(calls) == 6 and int((out.scores[0] > -float("inf")).sum()) > 24
    _check_against_generate(model, ids, out, 6, cfg)


def _counting(f, calls):
    def wrapped(*a, **k):
        calls.append(1)
        return f(*a, **k)

    return wrapped


def test_a_seed_gives_the_same_text_on_the_native_call_and_on_the_torch_path(monkeypatch):
    model = _llama()
    ids = _ids(5, 2)
    cfg = dict(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.2, min_p=0.02)
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(sampling, "_sampler", lambda *a: None)
        torch.manual_seed(3)
        runs.append(model.generate(ids, max_new_tokens=30, **cfg, custom_generate=native_generate))
    assert runs[0].shape[1] == ids.shape[1] + 30 and torch.equal(runs[0], runs[1])


GREEDY_POISON = {  # vocab: ((the largest multiple's rows, the smallest's), the NaN rows)
    128: (([9, 40], [60, 70]), [77, 50]),  # in different vectors of 16
    37: (([33, 35], [32, 36]), [36, 34]),  # in the 5 logits after the last vector of 16
    40: (([3, 7], [1, 12]), [38, 5]),  # in one vector; a NaN in the vectors and one after them
    12: (([3, 7], [1, 10]), [9, 4]),  # fewer than 16: the scalar loop alone
}


def _poisoned(vocab: int, poison: str):
    """Ties: the LM head's rows are multiples of one vector, two rows the largest multiple and two the
    smallest, so every position's largest logit is a tie (between the first pair or the second, by the sign
    of the hidden state's product with the vector). NaN: a NaN weight in two rows."""
    (top, bottom), nans = GREEDY_POISON[vocab]
    model = _llama(vocab)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        if poison == "tie":
            scale = torch.full((vocab, 1), 0.5)
            scale[top], scale[bottom] = 1.0, -1.0
            head.copy_(scale * head[:1])
        else:
            head[nans, 3] = float("nan")
    return model


@pytest.mark.parametrize("poison", ["tie", "nan"])
@pytest.mark.parametrize("vocab", sorted(GREEDY_POISON))
def test_the_native_steps_argmax_is_torchs_on_ties_and_nans(vocab, poison):
    """The token the native step returns is torch.argmax of the logits it leaves: the first of tied largest
    logits, the first NaN where there is one (in the vectors of 16 and after the last)."""
    from hf_sparsity.inference.native_step import NativeDecoder

    (top, bottom), nans = GREEDY_POISON[vocab]
    dec = NativeDecoder(_poisoned(vocab, poison))
    logits = dec.start(_ids(5, 3) % vocab, 32)
    tok = int(torch.argmax(logits))
    for _ in range(12):
        tok = dec.step(tok)
        logits = dec.logits
        assert tok == int(torch.argmax(logits))
        if poison == "tie":
            assert tok in (top[0], bottom[0]) and int((logits == logits.max()).sum()) == 2
        else:
            assert tok == min(nans)
    dec.close()


@pytest.mark.parametrize("poison", ["tie", "nan"])
def test_greedy_gives_generates_tokens_on_ties_and_nans(poison):
    """Greedy through generate on the native step, and greedy_decode, give generate's tokens where the
    largest logits tie or a logit is NaN (torch's own product gives the tied rows equal sums here)."""
    from hf_sparsity.inference.decoding import greedy_decode

    model = _poisoned(128, poison)
    ids = _ids(5, 3)
    want = model.generate(ids, max_new_tokens=8, do_sample=False)
    (top, bottom), nans = GREEDY_POISON[128]
    new = set(want[0, 5:].tolist())
    assert new <= {top[0], bottom[0]} if poison == "tie" else new == {min(nans)}
    got = model.generate(ids, max_new_tokens=8, do_sample=False, custom_generate=native_generate)
    assert torch.equal(got, want)
    assert torch.equal(greedy_decode(model, ids, 8, step="native"), want)


def test_a_generation_past_the_models_positions_stops_as_generate_does():
    """Past ``max_position_embeddings`` the length criterion runs itself (it logs transformers' warning):
    the tokens are generate's."""
    model = _llama(positions=16)
    ids = _ids(6, 4)
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    got = model.generate(ids, max_new_tokens=20, do_sample=False, custom_generate=native_generate)
    assert got.shape[1] == 26 and torch.equal(got, want)


def test_several_end_of_sequence_tokens_each_stop_a_sampled_run():
    model = _llama()
    ids = _ids(6, 5)
    torch.manual_seed(0)
    free = model.generate(ids, max_new_tokens=12, **SAMPLING, custom_generate=native_generate)
    eos = [int(free[0, ids.shape[1] + 5]), 127 if int(free[0, ids.shape[1] + 5]) != 127 else 126]
    torch.manual_seed(0)
    got = model.generate(
        ids, max_new_tokens=12, **SAMPLING, eos_token_id=eos, custom_generate=native_generate
    )
    first = min(i for i, t in enumerate(free[0, ids.shape[1] :].tolist()) if t in eos)
    assert torch.equal(got, free[:, : ids.shape[1] + first + 1])
