"""The native decoding step's work between the products against its definitions, at the level this process
built (AVX-512, AVX2 or the scalar loops; ``tests/test_native_kernels.py`` runs this file again at the other
levels): the vector exp (the softmax's numerators; Cephes' expf on 16 or 8 lanes, expf after them) against
float64 over a dense grid up to its clamps at +-88.38 and past them, the SiLU-gated product, and the argmax
against ``torch.argmax`` (the first of tied largest values, the first NaN) at every length around the vector
widths. Then the attention in the step itself: a model whose head size is no multiple of 8 or 16 (the dot
products' tails), decoded one token at a time to positions past 8, 16 and past the length where the heads
go to the thread pool, with attention logits in the hundreds (so the softmax's exponents pass the clamps),
against the float64 forward of the same model.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from hf_sparsity.backends import _native

from .realistic import realistic_model

LIB = _native.load()
pytestmark = pytest.mark.skipif(LIB is None, reason="native kernel did not build (no C compiler)")

CLAMP = float(torch.tensor(88.3762626647949))  # the exp's input clamp (float32), e^CLAMP < the largest float
ULP = 2.0**-23  # float32's spacing at 1: relative error bound unit
SMALLEST_NORMAL, SMALLEST_SUBNORMAL = 2.0**-126, 2.0**-149


def _fn(name: str, args: list, res):
    f = getattr(LIB, name)
    f.argtypes, f.restype = args, res
    return f


if LIB is not None:
    _vp, _i64 = ctypes.c_void_p, ctypes.c_int64
    step_exp = _fn("hfs_step_exp", [_vp, _i64, ctypes.c_float], ctypes.c_double)
    step_silu_mul = _fn("hfs_step_silu_mul", [_vp, _vp, _i64], None)
    step_argmax = _fn("hfs_step_argmax", [_vp, _i64], _i64)

LENGTHS = (*range(1, 41), 63, 64, 65, 127, 128, 129)  # every tail of one and two vectors of 8 and 16


def _exp(x: torch.Tensor, shift: float = 0.0) -> tuple[torch.Tensor, float]:
    y = x.clone()
    return y, step_exp(y.data_ptr(), y.numel(), shift)


def _check_exp(x: torch.Tensor, got: torch.Tensor):
    """got = e^x elementwise: within 2 ulp where e^x is a normal float, within one subnormal step below that,
    and past the clamps e^+-88.38 or the exact limit (inf, 0); NaN stays NaN."""
    x64, g = x.double(), got.double()
    want = torch.exp(x64)
    inside = x64.abs() <= CLAMP
    normal = inside & (want >= SMALLEST_NORMAL)
    rel = ((g - want) / want).abs()
    assert bool((rel[normal] <= 2 * ULP).all()), f"exp off by {rel[normal].max() / ULP:.2f} ulp"
    sub = inside & (want < SMALLEST_NORMAL)
    assert bool(((g - want).abs()[sub] <= SMALLEST_SUBNORMAL).all())
    top, bottom = math.exp(CLAMP), math.exp(-CLAMP)
    above, below = x64 > CLAMP, x64 < -CLAMP
    assert bool((g[above] >= top * (1 - 2 * ULP)).all())  # e^88.38 or inf: never NaN, never less
    assert bool(((g[below] >= 0) & (g[below] <= bottom * (1 + 2 * ULP))).all())
    assert torch.equal(got.isnan(), x.isnan())


def test_exp_is_within_2_ulp_of_float64_over_a_dense_grid():
    grid = torch.linspace(-CLAMP, CLAMP, 1_000_003, dtype=torch.float64).float()  # both clamps included
    near = torch.tensor([CLAMP, -CLAMP, 88.0, -87.33654, -87.5, -88.0, 0.0, -0.0, 1e-30, -1e-30])
    beyond = torch.tensor([88.38, 88.4, 89.0, 100.0, 1e30, math.inf, -88.38, -88.4, -100.0, -1e30, -math.inf])
    x = torch.cat([grid, near, beyond, torch.tensor([math.nan])])
    got, _ = _exp(x)
    _check_exp(x, got)
    assert got[: grid.numel()].isfinite().all() and got[grid.numel()] == pytest.approx(2.4061e38, rel=1e-4)


@pytest.mark.parametrize("n", LENGTHS)
def test_exp_at_the_clamps_in_every_lane(n):
    # the extremes at every position of the vectors and of the scalar tail after them
    pattern = torch.tensor(
        [CLAMP, -CLAMP, -87.9, 88.2, 100.0, -100.0, math.nan, -math.inf, 3.5, -0.25, math.inf]
    )
    for start in range(len(pattern)):
        x = pattern.roll(start).repeat(n // len(pattern) + 1)[:n]
        got, _ = _exp(x)
        _check_exp(x, got)


@pytest.mark.parametrize("n", LENGTHS)
def test_exp_shift_gives_the_softmax_numerators_and_their_sum(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 30 - 10
    shift = float(x.max())
    got, den = _exp(x, shift)
    _check_exp(x - shift, got)  # the difference is taken in float32
    assert den == pytest.approx(got.double().sum().item(), rel=1e-12)


@pytest.mark.parametrize("n", LENGTHS)
def test_silu_mul_is_the_float64_definition(n):
    g = torch.Generator().manual_seed(100 + n)
    gate = torch.randn(n, generator=g) * 4
    gate[::7] = torch.tensor([100.0, -100.0, 88.5, -88.5, 0.0, -20.0, 30.0]).repeat(n)[: len(gate[::7])]
    up = torch.randn(n, generator=g)
    got = gate.clone()
    step_silu_mul(got.data_ptr(), up.data_ptr(), n)
    g64 = gate.double()
    want = g64 / (1 + torch.exp(-g64)) * up.double()
    torch.testing.assert_close(got.double(), want, rtol=8 * ULP, atol=1e-30)


def _argmax(y: torch.Tensor) -> int:
    return int(step_argmax(y.data_ptr(), y.numel()))


@pytest.mark.parametrize("n", (*LENGTHS, 1535, 49152, 49157))
def test_argmax_is_torchs_on_ties_nans_and_infinities(n):
    g = torch.Generator().manual_seed(200 + n)
    rows = [
        torch.randn(n, generator=g),
        torch.randint(0, 3, (n,), generator=g).float(),  # ties of the largest value everywhere
        torch.full((n,), -math.inf),
        torch.full((n,), 7.0),
    ]
    for where in {0, n // 3, n // 2, n - 1}:  # one largest value, then ties of it after, in each part
        y = torch.randn(n, generator=g)
        y[where] = 50.0
        rows.append(y.clone())
        y[where:][torch.rand(n - where, generator=g) < 0.2] = 50.0
        rows.append(y.clone())
        y[where] = math.inf
        rows.append(y.clone())
        for nan_at in {where, n - 1, n // 2}:  # one NaN, two NaNs (the first counts)
            z = y.clone()
            z[nan_at] = math.nan
            rows.append(z.clone())
            z[min(nan_at + 1, n - 1)] = math.nan
            z[max(nan_at - 3, 0)] = math.nan
            rows.append(z)
    for y in rows:
        assert _argmax(y) == int(torch.argmax(y)), (n, y.tolist() if n < 50 else n)


# ---------------------------------------------------------------------------- the attention in the step
LONG = 200  # positions decoded: past 8, 16 and past the thread pool's split (ATTN_SPLIT: (pos + 1) * heads
# * head_dim >= 8192 multiply-adds, at position 101 for 4 heads of 20 and 170 for 4 heads of 12)


def _long_model(head_dim: int):
    """A Llama of `head_dim` (not a multiple of 8) with room for LONG positions; its realistic weights
    (head 0's query and key rows scaled by 3) give attention logits hundreds apart, so the softmax's
    exponents reach far below -88 (its clamp)."""
    return realistic_model("llama", hidden=48, heads=4, kv_heads=2, head_dim=head_dim, positions=LONG + 8)


def _forward64(model, seq: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, float]:
    """The model's logits in float64 (its softmax too), and its attention logits' largest distance below
    their row's maximum (the most negative exponent the softmax meets)."""
    from transformers import DynamicCache

    softmax, gaps = torch.nn.functional.softmax, []

    def spy(x, dim=None, dtype=None, **kw):
        seen = x.masked_fill(x < -1e300, math.inf)  # the causal mask's entries (float64's lowest) left out
        gaps.append(float((x.amax(-1) - seen.amin(-1)).max()))
        return softmax(x, dim=dim)  # in float64 (eager attention asks for float32)

    model.set_attn_implementation("eager")
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(torch.nn.functional, "softmax", spy)
        logits = model.double()(input_ids=seq, cache=DynamicCache(config=model.config)).logits[0]
    model.float()
    assert len(gaps) == model.config.num_hidden_layers
    return logits, max(gaps)


@pytest.mark.parametrize("head_dim", [12, 20, 36])  # 8 + 4, 16 + 4, 32 + 4: every vector loop's tail
def test_step_attention_over_long_caches_matches_the_float64_forward(head_dim, monkeypatch):
    from hf_sparsity.inference.native_step import NativeDecoder

    model = _long_model(head_dim)
    vocab = model.config.vocab_size
    seq = torch.randint(2, vocab, (1, LONG), generator=torch.Generator().manual_seed(head_dim))
    ref, gap = _forward64(model, seq, monkeypatch)
    assert gap > 2 * CLAMP  # exponents past the clamp
    dec = NativeDecoder(model)
    got = [dec.start(seq[:, :3], LONG).clone()]
    for t in range(3, LONG):
        dec.step(int(seq[0, t]))
        got.append(dec.logits.clone())
    dec.close()
    got = torch.stack(got).double()
    want = ref[2:]
    err = ((got - want).abs() / want.abs().amax(1, keepdim=True)).amax(1)
    bad = [(2 + i, round(float(e), 6)) for i, e in enumerate(err) if e >= 4e-4]
    assert not bad, bad[:8]  # (position, error relative to the row's largest logit)
