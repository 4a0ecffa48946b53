"""Each pruning method owns its calibration statistic; the statistics match their definitions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_sparsity.pruning import methods as M
from hf_sparsity.pruning.algorithms import ALGORITHMS, BlockContext, get_method, needs_calibration
from hf_sparsity.pruning.statistics import InputHessian, InputNorms, StatsHooks
from hf_sparsity.utils import SparsityError


def test_every_method_is_registered_and_an_unknown_one_is_refused():
    assert tuple(ALGORITHMS) == M.METHODS
    with pytest.raises(SparsityError, match="Unknown pruning method 'obs'.*magnitude, wanda, sparsegpt"):
        get_method("obs")


def test_what_each_method_collects():
    assert get_method("magnitude").statistic is None and not get_method("magnitude").calibrated
    assert get_method("wanda").statistic is InputNorms
    assert get_method("sparsegpt").statistic is InputHessian
    assert get_method("wanda").statistic_for(refit=True) is InputHessian  # its norms: the diagonal / 2
    assert not needs_calibration("magnitude", False, 0, None)
    assert needs_calibration("magnitude", True, 0, None) and needs_calibration("magnitude", False, 3, None)
    assert not needs_calibration("wanda", False, 0, masks={"w": torch.ones(1)})


def test_statistics_match_their_definitions_over_batches_and_shared_inputs():
    torch.manual_seed(0)
    q, k = nn.Linear(6, 4), nn.Linear(6, 3)
    batches = [torch.randn(2, 5, 6), torch.randn(3, 5, 6)]
    X = torch.cat([b.reshape(-1, 6) for b in batches]).double()
    n_seq = sum(b.shape[0] for b in batches)
    for statistic, expected in (
        (InputNorms, (X * X).sum(0) / n_seq),
        (InputHessian, 2 * X.t() @ X / n_seq),
    ):
        hooks = StatsHooks({"q": q, "k": k}, statistic)
        for b in batches:
            q(b), k(b)  # the same tensor into both: one accumulator, as Q/K/V share theirs
        stats = hooks.result()
        assert hooks.group == {"q": "q", "k": "q"}
        torch.testing.assert_close(stats["q"].double(), expected, rtol=1e-5, atol=1e-6)
        assert stats["k"] is stats["q"]


def test_wanda_prunes_the_same_from_its_norms_or_from_the_hessian():
    torch.manual_seed(1)
    W, X = torch.randn(8, 16), torch.randn(40, 16)
    norms, H = (X * X).sum(0) / 4, 2 * X.t() @ X / 4
    wanda = get_method("wanda")
    _, from_norms = wanda.prune(W, norms, 50, None, "w", BlockContext())
    _, from_h = wanda.prune(W, H, 50, None, "w", BlockContext())
    assert torch.equal(from_norms, from_h) and int(from_norms.sum()) == 50


def test_sparsegpt_computes_one_inverse_per_shared_hessian():
    torch.manual_seed(2)
    X = torch.randn(64, 16)
    H = 2 * X.t() @ X / 64
    ctx = BlockContext(blocksize=8, groups={"q": "q", "k": "q"})
    sparsegpt = get_method("sparsegpt")
    for name in ("q", "k"):
        W_new, pruned = sparsegpt.prune(torch.randn(4, 16), H, 32, None, name, ctx)
        assert int(pruned.sum()) == 32 and (W_new[pruned] == 0).all()
    assert list(ctx.inverses) == ["q"]


class _OutputDevices(torch.utils._python_dispatch.TorchDispatchMode):
    """Every device an aten op's tensor output lands on."""

    def __init__(self):
        super().__init__()
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.devices.add(t.device.type)
        return out


@pytest.mark.parametrize("rows,cols,k", [(6, 8, 10), (5, 12, 13), (4, 16, 0), (3, 4, 12)])
def test_scores_and_selections_stay_on_the_weights_device(rows, cols, k):
    """On a GPU a weight is scored and selected where it lives: masks kept on the CPU are moved to it,
    and no helper tensor is made on another device (a CPU ``arange`` against CUDA scores raised in
    ``scatter_``). The meta device stands in for the GPU: every op's output must be on it."""
    from hf_sparsity import masks as MK

    w = torch.empty(rows, cols, device="meta")
    cpu_mask = torch.ones(rows, cols, dtype=torch.uint8)  # where the engine keeps its masks
    with _OutputDevices() as seen:
        score = MK.magnitude_score(w, cpu_mask)
        pruned = M.prune_per_row(score, k)
        nm = M.prune_nm(score, 2, 4)
    assert score.device.type == pruned.device.type == nm.device.type == "meta"
    assert pruned.shape == (rows, cols) and pruned.dtype == torch.bool
    assert seen.devices == {"meta"}, seen.devices
