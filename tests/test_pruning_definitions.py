"""One-shot pruning checked against the papers' definitions, computed here by brute force.

Wanda N:M (Sun et al. 2024): in every group of ``m`` consecutive inputs of an output row, the
``m - n`` lowest ``|W_ij| · ‖X_j‖₂`` are pruned, ``X`` being the inputs the layer sees with the
earlier blocks already pruned. OWL (Yin et al. 2024): every targeted tensor of a block is pruned
at that block's level; a block's level is the target minus a density shift that grows linearly
with the block's outlier ratio (share of its Wanda scores above ``M`` times their mean, on the
dense model), spanning ``2λ``, re-centred so the total number of zeros is the uniform plan's.
"""

from __future__ import annotations

import pytest
import torch

from hf_sparsity import SparsityConfig
from hf_sparsity.mask_engine.targeting import plan_sparsity
from hf_sparsity.pruning import OWLSettings, prune_oneshot
from hf_sparsity.pruning.blocks import find_blocks

from .conftest import tiny_model

ARCHS = ["gpt2", "llama"]


def _calib(n=6, seqlen=16, seed=0):
    return torch.randint(2, 128, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _targets(model, level=0.5):
    return [d for d in plan_sparsity(model, SparsityConfig(sparsity=level)) if d.sparsify]


def _by_block(model, targets):
    """block index -> the block's targeted weights (the tensors OWL gives one level)."""
    prefix, blocks = find_blocks(model, [d.name for d in targets])
    out = {i: [d for d in targets if d.name.startswith(f"{prefix}.{i}.")] for i in range(len(blocks))}
    return prefix, out


def _input_sq_norms(model, names, calib):
    """Σ_t X_tj² of each named weight's input features over ``calib`` (float64)."""
    model.eval()
    sums, handles = {}, []
    for n in names:
        mod = model.get_submodule(n.rsplit(".", 1)[0])

        def hook(m, inputs, out, n=n):
            x = inputs[0].detach().double().reshape(-1, inputs[0].shape[-1])
            sums[n] = sums.get(n, 0) + (x * x).sum(0)

        handles.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(input_ids=calib, use_cache=False)
    for h in handles:
        h.remove()
    return sums


def _linear_view(model, d):
    w = model.get_parameter(d.name).detach().double()
    return w.t() if d.input_dim == 0 else w


def _scores(model, d, sq_norms):
    """Wanda's score from its definition: |W_ij| · ‖X_j‖₂, in the (out, in) view."""
    return _linear_view(model, d).abs() * sq_norms[d.name].sqrt().reshape(1, -1)


def _brute_nm(score, n, m):
    """Pruned positions: in every row, every group of m consecutive inputs loses its m - n lowest."""
    rows, cols = score.shape
    pruned = torch.zeros(rows, cols, dtype=torch.bool)
    for r in range(rows):
        for g in range(0, cols, m):
            group = sorted((float(score[r, c]), c) for c in range(g, g + m))
            for _, c in group[: m - n]:
                pruned[r, c] = True
    return pruned


@pytest.mark.parametrize("arch", ARCHS)
def test_wanda_nm_mask_is_the_per_group_lowest_weight_times_activation_norm(arch):
    calib = _calib()
    dense, model = tiny_model(arch, layers=2), tiny_model(arch, layers=2)
    result = prune_oneshot(model, SparsityConfig(sparsity=0.5, structure="2:4"), calib, method="wanda")
    targets = _targets(dense)
    prefix, blocks = _by_block(dense, targets)
    activations_matter = False
    for i, ds in blocks.items():
        # Block i's inputs: the earlier blocks pruned as the run pruned them, block i still dense.
        probe = tiny_model(arch, layers=2)
        with torch.no_grad():
            for name, mask in result.masks.items():
                if name.startswith(f"{prefix}.") and int(name[len(prefix) + 1 :].split(".")[0]) < i:
                    probe.get_parameter(name).mul_(mask)
        sq = _input_sq_norms(probe, [d.name for d in ds], calib)
        for d in ds:
            got = result.masks[d.name] == 0
            got = got.t() if d.input_dim == 0 else got
            assert torch.equal(got, _brute_nm(_scores(dense, d, sq), 2, 4)), d.name
            activations_matter |= not torch.equal(got, _brute_nm(_linear_view(dense, d).abs(), 2, 4))
    assert activations_matter, "the tiny model should have a group where |W| alone picks another mask"


def _owl_run(arch, level=0.6, lam=0.08, outlier_m=3.0, layers=4):
    calib = _calib(8)
    dense, model = tiny_model(arch, layers=layers), tiny_model(arch, layers=layers)
    result = prune_oneshot(model, level, calib, method="wanda", owl=OWLSettings(lam=lam, outlier_m=outlier_m))
    targets = _targets(dense, level)
    _, blocks = _by_block(dense, targets)
    sq = _input_sq_norms(dense, [d.name for d in targets], calib)  # OWL's ratios: one dense pass
    ratios = {}
    for i, ds in blocks.items():
        flat = torch.cat([_scores(dense, d, sq).reshape(-1) for d in ds])
        ratios[i] = float((flat > outlier_m * flat.mean()).double().mean())
    zeros = {n: int((m == 0).sum()) for n, m in result.masks.items()}
    return blocks, ratios, zeros


@pytest.mark.parametrize("arch", ARCHS)
def test_owl_every_tensor_of_a_block_is_pruned_at_the_blocks_level(arch):
    blocks, ratios, zeros = _owl_run(arch)
    for i, ds in blocks.items():
        level = sum(zeros[d.name] for d in ds) / sum(d.numel for d in ds)
        for d in ds:  # rounding to whole zeros moves a tensor by less than one zero (plus the mean's own)
            assert abs(zeros[d.name] - level * d.numel) < 2, (i, d.name, zeros[d.name] / d.numel, level)


@pytest.mark.parametrize("arch", ARCHS)
def test_owl_block_levels_fall_as_outlier_ratios_rise(arch):
    blocks, ratios, zeros = _owl_run(arch)
    levels = {i: sum(zeros[d.name] for d in ds) / sum(d.numel for d in ds) for i, ds in blocks.items()}
    order = sorted(blocks, key=lambda i: ratios[i])
    assert len({round(r, 9) for r in ratios.values()}) == len(ratios), f"need distinct ratios: {ratios}"
    assert [levels[i] for i in order] == sorted(levels.values(), reverse=True), (ratios, levels)
    assert levels[order[0]] - levels[order[-1]] == pytest.approx(2 * 0.08, abs=0.01)  # the span is 2λ


@pytest.mark.parametrize("arch", ARCHS)
def test_owl_levels_follow_the_formula_and_keep_the_uniform_total(arch):
    level, lam = 0.6, 0.08
    blocks, ratios, zeros = _owl_run(arch, level=level, lam=lam)
    rmin, rmax = min(ratios.values()), max(ratios.values())
    shift = {i: (r - rmin) / (rmax - rmin) * 2 * lam for i, r in ratios.items()}
    size = {i: sum(d.numel for d in ds) for i, ds in blocks.items()}
    centre = sum(shift[i] * size[i] for i in blocks) / sum(size.values())
    for i, ds in blocks.items():
        want = level - (shift[i] - centre)
        for d in ds:
            assert abs(zeros[d.name] - want * d.numel) <= 1, (i, d.name, zeros[d.name] / d.numel, want)
    assert sum(zeros.values()) == sum(round(level * d.numel) for ds in blocks.values() for d in ds)
