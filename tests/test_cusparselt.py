"""``cusparselt`` (2:4 through cuSPARSELt called directly) and ``auto`` on a CUDA model.

Without a GPU the CUDA-only calls (``compress``, ``search``, ``sparse_mm``, ``measure_group``) are replaced
by stand-ins that check what they are handed (the layout and padding cuSPARSELt needs) and compute the
product in float32, so that every branch around them runs here: padding, the algorithm cache, the per-group
choice, the routing of decoding and prefill calls, a whole model through ``sparsify_for_inference(model,
"auto")``. The reference is the float64 product of the masked weight, computed in the test. The tests marked
``gpu`` run the real calls (the GPU check's check a) against torch's ``semi_structured`` and the reference.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from hf_sparsity import masks as M
from hf_sparsity import sparsify_for_inference
from hf_sparsity.backends import backend_table, cusparselt, get_backend
from hf_sparsity.backends.base import LayerTarget
from hf_sparsity.utils import SparsityError

from .realistic import realistic_model

CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


class StandIn:
    """cuSPARSELt's calls on the CPU: what each was handed, and the float32 product."""

    def __init__(self, monkeypatch):
        self.compressed, self.searches, self.mm = 0, [], []
        monkeypatch.setattr(cusparselt, "compress", self.compress)
        monkeypatch.setattr(cusparselt, "search", self.search)
        monkeypatch.setattr(cusparselt, "sparse_mm", self.sparse_mm)
        monkeypatch.setattr(cusparselt, "ALG_CACHE", {})

    def compress(self, dense):
        self.compressed += 1
        per_group = (dense != 0).reshape(dense.shape[0], -1, 4).sum(-1)
        assert int(per_group.max()) <= 2, "compress handed a weight that is not 2:4"
        return dense.clone()

    def search(self, packed, xt):
        self.searches.append((tuple(packed.shape), xt.shape[1]))
        return 7

    def sparse_mm(self, packed, xt, alg_id):
        assert alg_id == 7
        assert xt.shape[0] == packed.shape[1] and xt.shape[1] % cusparselt.token_multiple(xt.dtype) == 0
        assert xt.stride(0) == 1, "the dense operand is x^T as a column-major view (no copy)"
        self.mm.append(xt.shape[1])
        return (packed.float() @ xt.float()).t().contiguous().to(xt.dtype)


def _layer(out_f, in_f, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
    return w, M.nm_mask(w.abs().float(), 2, 4, dim=1)


def test_unavailable_without_cuda_is_clear_and_listed():
    rows = {r["name"]: r for r in backend_table()}
    assert rows["cusparselt"]["structure"] == "2:4" and rows["cusparselt"]["devices"] == ["cuda"]
    if CUDA:
        pytest.skip("a CUDA device is visible")
    assert not rows["cusparselt"]["available"] and "CUDA" in rows["cusparselt"]["reason"]
    with pytest.raises(SparsityError, match="cusparselt.*CUDA GPU"):
        get_backend("cusparselt")
    with pytest.raises(SparsityError, match="cusparselt.*CUDA GPU"):
        klass = get_backend("2:4-cusparselt", check_available=False)
        klass.from_dense(torch.ones(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tokens_are_padded_and_the_algorithm_is_searched_once_per_shape_and_bucket(dtype, monkeypatch):
    cs = StandIn(monkeypatch)
    w, mask = _layer(48, 64, dtype)
    b = cusparselt.CuSparseLtBackend(w, mask)
    twin = cusparselt.CuSparseLtBackend(*_layer(48, 64, dtype, seed=1))  # same shape: shares the searches
    other = cusparselt.CuSparseLtBackend(*_layer(32, 64, dtype, seed=2))
    assert cs.compressed == 3
    ref_w = w.double() * mask.double()
    for tokens in (1, 3, 8, 13, 16, 17, 64, 100):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
        y = b.linear(x)
        want = x.double() @ ref_w.t()
        assert y.shape == (tokens, 48) and y.dtype == dtype
        torch.testing.assert_close(y.double(), want, rtol=2e-2, atol=2e-2)
        twin.linear(x)
        other.linear(x)
    assert cs.mm[:3] == [8, 8, 8] and cs.mm[-1] == 104  # padded to multiples of 8, never below
    buckets = {cusparselt.token_bucket(t + (-t) % 8) for t in (1, 3, 8, 13, 16, 17, 64, 100)}
    assert sorted(buckets) == [8, 16, 32, 64, 128]
    # one search per (shape, bucket): the twin layer reuses the first one's, the other shape searches its own
    assert sorted(n for s, n in cs.searches if s == (48, 64)) == [8, 16, 24, 64, 104]
    assert len([s for s, _ in cs.searches if s == (32, 64)]) == len(buckets)
    # the leading dimensions of a model's activations, and the mask winning over the weight
    x3 = torch.randn(2, 5, 64).to(dtype)
    torch.testing.assert_close(b.linear(x3).double(), x3.double() @ ref_w.t(), rtol=2e-2, atol=2e-2)
    assert torch.equal(b.to_dense(), (w * mask.to(dtype)))


def test_token_bucket_and_multiple():
    assert [cusparselt.token_bucket(n) for n in (1, 2, 3, 8, 9, 512, 513)] == [1, 2, 4, 8, 16, 512, 1024]
    assert cusparselt.token_multiple(torch.bfloat16) == cusparselt.token_multiple(torch.float16) == 8
    assert cusparselt.token_multiple(torch.int8) == 16


def test_decide_keeps_dense_unless_2_4_is_faster_by_the_margin():
    times = {"decode": {"dense": 1.0, "cusparselt": 3.0}, "prefill": {"dense": 2.0, "cusparselt": 1.0}}
    assert cusparselt.decide(times) == {"decode": "dense", "prefill": "cusparselt"}
    assert cusparselt.decide(times, margin=0.6) == {"decode": "dense", "prefill": "dense"}
    tie = {"decode": {"dense": 1.0, "cusparselt": 1.0}}
    assert cusparselt.decide(tie) == {"decode": "dense"}


def _fake_timing(monkeypatch, table):
    """``measure_group`` from a table: (out, in, tokens) -> (dense s, cusparselt s)."""
    seen = []

    def measure(sparse, tokens, calls, rounds):
        seen.append((sparse.out_features, sparse.in_features, tokens))
        dense, sp = table[(sparse.out_features, sparse.in_features, tokens)]
        return {"dense": dense, "cusparselt": sp}

    monkeypatch.setattr(cusparselt, "measure_group", measure)
    return seen


def _targets(model, masks):
    from hf_sparsity.inference.conversion import _sparse_targets

    return [LayerTarget(*t) for t in _sparse_targets(model, masks)]


def _llama_and_masks(dtype=torch.bfloat16):
    model = realistic_model("llama", dtype=dtype)
    names = [n for n, p in model.named_parameters() if p.ndim == 2 and "layers." in n]
    masks = {n: M.nm_mask(model.get_parameter(n).detach().abs().float(), 2, 4, dim=1) for n in names}
    return model, masks


def test_auto_on_cuda_groups_layers_and_keeps_dense_where_2_4_loses(monkeypatch):
    StandIn(monkeypatch)
    model, masks = _llama_and_masks()
    shapes = {tuple(model.get_parameter(n).shape) for n in masks}
    # decoding: dense faster everywhere; prefill: 2:4 faster except for one shape, which stays dense
    loser = sorted(shapes)[0]
    table = {}
    for o, i in shapes:
        table[(o, i, 1)] = (1.0, 2.0)
        table[(o, i, 512)] = (2.0, 3.0) if (o, i) == loser else (2.0, 1.0)
    seen = _fake_timing(monkeypatch, table)
    unstructured = sorted(masks)[-1]
    masks[unstructured] = M.random_mask(masks[unstructured].shape, 0.5, 0, unstructured)
    targets = _targets(model, masks)
    plan = cusparselt.plan_cuda(targets, lambda module, b: b)
    assert sorted(seen) == sorted([(o, i, t) for o, i in shapes for t in (1, 512)])  # one timing per group
    by_module = dict(plan.swaps)
    for t in targets:
        c = plan.choices[t.module_name]
        if t.name == unstructured:
            assert c["reason"] == "mask is not 2:4" and t.module_name not in by_module
        elif tuple(t.weight.shape) == loser:
            assert (c["decode"], c["prefill"]) == ("dense", "dense") and t.module_name not in by_module
        else:
            assert (c["decode"], c["prefill"]) == ("dense", "cusparselt")
            assert isinstance(by_module[t.module_name], cusparselt.CudaAutoLayer)
    f32 = _targets(*_llama_and_masks(torch.float32))[:1]
    assert cusparselt.plan_cuda(f32, lambda m, b: b).choices[f32[0].module_name]["reason"].startswith("dtype")


def test_sparsify_for_inference_auto_on_a_cuda_model_matches_the_masked_dense_model(monkeypatch):
    """The whole path of ``sparsify_for_inference(model, "auto")`` for a model on CUDA (its device test
    answered yes): prefill runs the 2:4 product, decoding the dense one; logits as the masked dense
    model's."""
    cs = StandIn(monkeypatch)
    monkeypatch.setattr(cusparselt, "runs_on_cuda", lambda targets: True)
    model, masks = _llama_and_masks()
    table = {}
    for n in masks:
        o, i = model.get_parameter(n).shape
        table[(o, i, 1)], table[(o, i, 512)] = (1.0, 2.0), (2.0, 1.0)
    _fake_timing(monkeypatch, table)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for n, m in masks.items():
            ref.get_parameter(n).mul_(m.to(torch.bfloat16))
    sparsify_for_inference(model, "auto", masks=masks)
    layers = [m.backend for m in model.modules() if hasattr(m, "backend")]
    assert len(layers) == len(masks) and all(isinstance(b, cusparselt.CudaAutoLayer) for b in layers)
    vocab = model.config.vocab_size
    for tokens in (1, 40):  # 1 token: the decode regime (dense); 40: prefill (2:4)
        ids = torch.randint(2, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        cs.mm.clear()
        with torch.no_grad():
            got, want = model(input_ids=ids).logits.float(), ref(input_ids=ids).logits.float()
        assert (len(cs.mm) == len(masks)) == (tokens > cusparselt.SMALL_TOKENS)
        assert not cs.mm or set(cs.mm) == {40}
        assert (got - want).abs().max() / want.abs().max() < 5e-2


def test_graphed_forward_refuses_inputs_off_cuda():
    with pytest.raises(SparsityError, match="CUDA device"):
        cusparselt.GraphedForward(torch.nn.Identity(), torch.zeros(1, 4, dtype=torch.long))


# ---------------------------------------------------------------------------- on a GPU (check a)
@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,out_f,in_f", [(1, 768, 768), (13, 256, 512), (64, 3072, 768)])
def test_cusparselt_matches_semi_structured_and_the_reference_gpu(dtype, tokens, out_f, in_f):
    if not get_backend("cusparselt", check_available=False).is_available():
        pytest.skip(f"cusparselt unavailable on this GPU: {cusparselt.unavailable_reason()}")
    w, mask = _layer(out_f, in_f, dtype)
    x = torch.randn(tokens, in_f, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = x.double() @ (w.double() * mask.double()).t()
    with torch.no_grad():
        got = get_backend("cusparselt").from_dense(w.cuda(), mask.cuda()).linear(x.cuda()).cpu()
        semi = get_backend("semi_structured").from_dense(w.cuda(), mask.cuda()).linear(x.cuda()).cpu()
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, semi, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA")
def test_graphed_forward_replays_the_eager_logits_gpu():
    if not get_backend("cusparselt", check_available=False).is_available():
        pytest.skip(f"cusparselt unavailable on this GPU: {cusparselt.unavailable_reason()}")
    model, masks = _llama_and_masks()
    model = model.cuda()
    sparsify_for_inference(model, "cusparselt", masks=masks)
    ids = torch.randint(2, model.config.vocab_size, (1, 32), device="cuda")
    with torch.no_grad():
        eager = model(input_ids=ids).logits.clone()
    graphed = cusparselt.GraphedForward(model, ids)
    torch.testing.assert_close(graphed(ids), eager, rtol=0, atol=0)
    other = torch.randint(2, model.config.vocab_size, (1, 32), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(graphed(other), model(input_ids=other).logits, rtol=0, atol=0)
    with pytest.raises(SparsityError, match="captured for inputs of shape"):
        graphed(ids[:, :8])
