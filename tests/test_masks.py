"""Mask construction: exact counts, determinism, topk semantics, N:M, prune/regrow, bit packing."""

import math

import pytest
import torch

from hf_sparsity import masks as M
from hf_sparsity.storage.masks_file import load_masks, pack_mask, save_masks, unpack_mask


@pytest.mark.parametrize("shape", [(7, 13), (64, 32), (1, 5), (33,), (3, 4, 5)])
@pytest.mark.parametrize("level", [0.0, 0.1, 0.3, 0.5, 0.75, 0.838, 0.99])
def test_exact_zero_count(shape, level):
    numel = math.prod(shape)
    r = M.random_mask(shape, level, 1234, "w")
    t = M.topk_mask(torch.randn(shape), level)
    for m in (r, t):
        assert m.dtype == torch.uint8 and tuple(m.shape) == shape
        assert int((m == 0).sum()) == round(level * numel)


def test_random_mask_is_deterministic_per_seed_and_name():
    a = M.random_mask((64, 64), 0.5, 1, "layers.0.q.weight")
    assert torch.equal(a, M.random_mask((64, 64), 0.5, 1, "layers.0.q.weight"))
    assert not torch.equal(a, M.random_mask((64, 64), 0.5, 1, "layers.1.q.weight"))
    assert not torch.equal(a, M.random_mask((64, 64), 0.5, 2, "layers.0.q.weight"))
    # Independent of global RNG state.
    torch.manual_seed(99)
    assert torch.equal(a, M.random_mask((64, 64), 0.5, 1, "layers.0.q.weight"))


def test_topk_prunes_lowest_magnitude_with_ties():
    w = torch.tensor([[0.5, -0.1, 0.3, 0.1], [-0.9, 0.1, 0.0, 2.0]])
    m = M.topk_mask(w, 0.5)  # 4 zeros: 0.0, three tied at |0.1| -> all pruned
    assert m.tolist() == [[1, 0, 1, 0], [1, 0, 0, 1]]
    m = M.topk_mask(w, 0.25)  # 2 zeros: 0.0 and the first |0.1| by position
    assert m.tolist() == [[1, 0, 1, 1], [1, 1, 0, 1]]


def test_prune_keeps_masked_and_adds_lowest_survivors():
    w = torch.randn(32, 32)
    m1 = M.random_mask(w.shape, 0.5, 0, "w")
    m2 = M.change_level(m1, w * m1, 0.8, 0, "w")
    assert int((m2 == 0).sum()) == round(0.8 * w.numel())
    assert bool(((m1 == 0) <= (m2 == 0)).all())  # previously masked stay masked
    newly = (m1 == 1) & (m2 == 0)
    survivors = m2 == 1
    assert w.abs()[newly].max() <= w.abs()[survivors].min()


def test_regrow_only_unmasks_and_is_seeded():
    m1 = M.random_mask((40, 40), 0.9, 0, "w")
    m2 = M.change_level(m1, torch.zeros(40, 40), 0.6, 0, "w")
    assert int((m2 == 0).sum()) == round(0.6 * 1600)
    assert bool(((m2 == 0) <= (m1 == 0)).all())  # nothing newly pruned
    assert torch.equal(m2, M.change_level(m1, torch.zeros(40, 40), 0.6, 0, "w"))


def test_nm_mask():
    w = torch.randn(8, 16)
    m = M.nm_mask(w.abs(), 2, 4, dim=1)
    groups = m.view(8, 4, 4)
    assert bool((groups.sum(-1) == 2).all())
    kept = (w.abs() * m).view(8, 4, 4)
    dropped = (w.abs() * (1 - m)).view(8, 4, 4)
    assert bool((kept.max(-1).values >= dropped.max(-1).values).all())
    m0 = M.nm_mask(w.t().abs(), 2, 4, dim=0)  # Conv1D orientation
    assert torch.equal(m0, m.t())
    with pytest.raises(ValueError, match="multiple of 4"):
        M.nm_mask(torch.randn(3, 6), 2, 4)


@pytest.mark.parametrize("shape", [(5, 3), (7, 13), (16, 64), (1, 1), (9,), (2, 3, 17)])
def test_pack_unpack_round_trip(shape):
    m = (torch.rand(shape) > 0.4).to(torch.uint8)
    p = pack_mask(m)
    rows = shape[0] if len(shape) > 1 else 1
    cols = math.prod(shape) // rows
    assert tuple(p.shape) == (rows, (cols + 7) // 8) and p.dtype == torch.uint8
    assert torch.equal(unpack_mask(p, shape), m)


def test_little_bit_order():
    m = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 0, 1]], dtype=torch.uint8)
    assert pack_mask(m).tolist() == [[1, 1]]


def test_disk_bytes_per_parameter(tmp_path):
    m = {f"layer{i}": M.random_mask((512, 2048), 0.75, 0, f"layer{i}") for i in range(4)}
    path = save_masks(tmp_path, m)
    import os

    assert os.path.getsize(path) / sum(x.numel() for x in m.values()) <= 0.13
    loaded, meta = load_masks(tmp_path)
    assert all(torch.equal(loaded[k], m[k]) for k in m)
    assert meta["format_version"] == "1" and meta["tensors"]["layer0"]["level"] == 0.75
