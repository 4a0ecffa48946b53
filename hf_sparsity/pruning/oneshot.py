"""``prune_oneshot``: prune a pretrained model block by block from calibration activations.

As in the Wanda and SparseGPT reference code: the inputs of the first decoder block are
captured once; then, for each block, hooks on its targeted linears collect what the method
needs (Wanda: the squared L2 norm of each input feature; SparseGPT: the input Hessian) in
one forward over the calibration set, every targeted weight of the block is pruned, and the
block is run again with the pruned weights to give the next block its inputs.

Memory: the model (on CPU), two copies of the block activations (``nsamples x seqlen x
hidden`` floats each, in and out), and the statistics of one block's targeted linears (for
SparseGPT one ``in x in`` float32 Hessian per linear). With ``device="cuda"`` only the block
being pruned, its activations and statistics are on the GPU.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..mask_engine.config import SparsityConfig, check_structure
from ..mask_engine.targeting import TargetDecision, plan_sparsity, unwrap_model
from ..masks import MASK_DTYPE
from ..modeling import linear_kind
from ..utils import SparsityError
from . import methods as M
from .algorithms import BlockContext, get_method, needs_calibration
from .blocks import (
    block_targets,
    capture_block_inputs,
    find_blocks,
    home_device,
    linear_view,
    run_all,
    to_device,
)
from .levels import OWLSettings, zero_counts
from .reconstruct import DEFAULT_LR, check_steps, reconstruct_block
from .refit import refit_weights
from .spdy import SpeedTarget, spdy_counts
from .speed import table_for_model
from .statistics import StatsHooks

logger = logging.getLogger(__name__)


@dataclass
class OneShotResult:
    """Masks (name -> uint8, 1 = kept) and what the run did."""

    masks: dict[str, torch.Tensor]
    method: str
    seconds: float
    zeros: dict[str, int] = field(default_factory=dict)
    block_seconds: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    spdy: Any = None  # the speed-target plan (:class:`~.spdy.SpdyPlan`) when levels were chosen for one

    def levels_by_projection(self) -> dict[str, float]:
        """Sparsity per projection type (``self_attn.q_proj``, ``mlp.down_proj``, ...) over all blocks."""
        zeros, numel = defaultdict(int), defaultdict(int)
        for name, m in self.masks.items():
            kind = _projection_kind(name)
            zeros[kind] += int((m == 0).sum())
            numel[kind] += m.numel()
        return {k: zeros[k] / numel[k] for k in sorted(zeros)}

    def summary(self) -> str:
        total = sum(m.numel() for m in self.masks.values())
        zeros = sum(int((m == 0).sum()) for m in self.masks.values())
        lines = [
            f"{self.method}: {len(self.masks)} tensors, {zeros:,} of {total:,} targeted weights zero "
            f"({zeros / max(total, 1):.4%}) in {self.seconds:.1f} s"
        ]
        lines += [f"  {k:<28} {v:.4%}" for k, v in self.levels_by_projection().items()]
        if self.spdy is not None:
            lines += self.spdy.lines()
        return "\n".join(lines)


def _projection_kind(name: str) -> str:
    parts = name.split(".")
    idx = max((i for i, p in enumerate(parts) if p.isdigit()), default=-1)
    return ".".join(parts[idx + 1 : -1]) or name


def _store(param: torch.Tensor, d: TargetDecision, W: torch.Tensor, pruned: torch.Tensor) -> torch.Tensor:
    """Write the pruned (or updated) weight back; return the uint8 mask in the parameter's layout."""
    keep = (~pruned).to(MASK_DTYPE)
    W = W * keep
    if d.input_dim == 0:
        W, keep = W.t(), keep.t()
    with torch.no_grad():
        param.copy_(W.to(param.dtype))
    return keep.contiguous().cpu()


def _nm(d: TargetDecision) -> tuple[int, int] | None:
    return check_structure(d.structure) if d.structure else None


def _check_nm(model: nn.Module, targets: list[TargetDecision]) -> None:
    for d in targets:
        nm = _nm(d)
        cols = d.shape[d.input_dim] if len(d.shape) == 2 else None
        if nm and cols is not None and cols % nm[1]:
            raise SparsityError(
                f"N:M structure {d.structure} on {d.name}: its input dimension ({cols}) is not a multiple "
                f"of {nm[1]}. Exclude it with `param_name_patterns`, or use unstructured sparsity."
            )


def _check_args(method, calibration, targets, model, refit=False, reconstruct_steps=0, masks=None) -> None:
    get_method(method)  # an unknown name: a one-line error listing the known ones
    check_steps(reconstruct_steps or None)
    if not targets:
        raise SparsityError(
            f"The sparsity config selects no weight of {type(model).__name__}; nothing to prune. "
            "Check `param_name_patterns` (`hf_sparsity validate` lists the parameter names)."
        )
    if needs_calibration(method, refit, reconstruct_steps, masks):
        if calibration is None or calibration.dim() != 2 or calibration.shape[0] == 0:
            what = method if masks is None and get_method(method).calibrated else "--refit / --reconstruct"
            raise SparsityError(
                f"{what} needs calibration token ids of shape (nsamples, seqlen) with nsamples >= 1; "
                "build them with hf_sparsity.pruning.sample_calibration (--nsamples 128 is the reference)."
            )


def check_speed_args(method: str, owl, masks, targets) -> None:
    """A speed target chooses levels from a calibrated method's errors, for unstructured sparsity."""
    if masks is not None or owl is not None:
        what = "--masks gives the levels" if masks is not None else "OWL chooses levels too"
        raise SparsityError(f"--target-speedup chooses the levels, {what}: use one or the other.")
    if method not in ("sparsegpt", "wanda"):
        raise SparsityError(
            f"--target-speedup needs a layer error from calibration: use --method sparsegpt or wanda, not "
            f"{method}."
        )
    if any(d.structure for d in targets):
        raise SparsityError("--target-speedup chooses unstructured levels; drop `structure` (N:M).")


def mask_targets(
    model: nn.Module, masks: dict[str, torch.Tensor], source: str = "--masks"
) -> list[TargetDecision]:
    """The targets a given mask set defines; refuses names the model lacks, wrong shapes, non-0/1 values."""
    params = dict(model.named_parameters())
    missing = sorted(set(masks) - set(params))
    if missing:
        raise SparsityError(
            f"{source}: masks for {len(missing)} parameter(s) the model does not have (e.g. {missing[0]!r}): "
            "the mask file belongs to another model. Give the mask file made for this model."
        )
    out = []
    for name in sorted(masks, key=list(params).index):
        p, m = params[name], masks[name]
        if tuple(m.shape) != tuple(p.shape):
            raise SparsityError(
                f"{source}: mask {name!r} has shape {list(m.shape)} but the weight has {list(p.shape)}: the "
                "mask file belongs to another model size. Give the mask file made for this model."
            )
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        zeros = int((m == 0).sum())
        out.append(
            TargetDecision(
                name, tuple(p.shape), True, source, sparsity=zeros / max(m.numel(), 1),
                input_dim=0 if linear_kind(owner) == "Conv1D" else 1,
            )
        )  # fmt: skip
    return out


class InMemoryBlocks:
    """The blocks of a model already in memory: nothing to load or write; the masks stay as they
    are (a streaming source, :class:`~.streaming.StreamingModel`, writes each block and packs its masks)."""

    def __init__(self):
        self.masks: dict[str, torch.Tensor] = {}

    def begin(self, prefix: str, blocks: nn.ModuleList) -> None:
        pass

    def load(self, i: int) -> None:
        pass

    def release(self, i: int, masks: dict[str, torch.Tensor] | None = None) -> None:
        self.masks.update(masks or {})


@torch.no_grad()
def prune_oneshot(
    model: nn.Module,
    config: SparsityConfig | float,
    calibration: torch.Tensor | None = None,
    method: str = "wanda",
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    owl: OWLSettings | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 8,
    progress: bool = False,
    refit: bool = False,
    reconstruct_steps: int = 0,
    reconstruct_lr: float = DEFAULT_LR,
    masks: dict[str, torch.Tensor] | None = None,
    stream=None,
    speed: SpeedTarget | None = None,
) -> OneShotResult:
    """Prune ``model`` in place, block by block, and return its masks.

    Args:
        model: a causal LM whose decoder blocks are an ``nn.ModuleList`` (every transformers LM).
        config: a :class:`SparsityConfig` (targets, per-pattern levels, ``structure: "2:4"``) or a level.
        calibration: token ids ``(nsamples, seqlen)``, e.g. from :func:`sample_calibration`;
            not needed for ``magnitude`` (nor for given ``masks``) without refit / reconstruction.
        method: ``magnitude``, ``wanda`` or ``sparsegpt``.
        blocksize, percdamp: SparseGPT's lazy-batch width and damping (fraction of the mean Hessian
            diagonal); ``percdamp`` also damps the refit.
        owl: non-uniform per-block levels (:class:`OWLSettings`), holding the total number of zeros exact.
        device: where each block runs (e.g. ``"cuda"``); the model itself stays where it is.
        batch_size: calibration sequences per block forward (and per reconstruction step).
        progress: show a progress bar over blocks.
        refit: after the mask is chosen, solve for the kept weights of each row exactly, in least
            squares against the layer's calibration inputs (:func:`~.refit.refit_weights`).
        reconstruct_steps: after each block is pruned (and re-fit), train its kept weights for this
            many Adam steps (learning rate ``reconstruct_lr``) to match the dense block's outputs
            (:func:`~.reconstruct.reconstruct_block`); 0 = off.
        masks: name -> mask (1 = kept) to use instead of choosing masks: they define the targets
            (``config`` and ``method`` are then ignored); refit / reconstruction apply to them.
        stream: where blocks come from and go to (default: the model in memory); see
            :func:`hf_sparsity.pruning.streaming.prune_streaming`.
        speed: a decoding speed target (:class:`~.spdy.SpeedTarget`): each targeted weight inside the
            blocks gets the grid level the SPDY program chooses (``config``'s levels are ignored for
            them); the plan is in ``result.info["spdy"]``. Its time table is measured when not given.

    Every targeted tensor ends with exactly ``round(level · numel)`` zeros (or the OWL count),
    or exactly N of every M kept along its input dimension, or exactly the given masks.
    """
    if not isinstance(config, SparsityConfig):
        config = SparsityConfig(sparsity=float(config))
    model = unwrap_model(model)
    if masks is not None:
        targets = mask_targets(model, masks)
        method = "masks"
    else:
        targets = [d for d in plan_sparsity(model, config) if d.sparsify]
    _check_args(
        "magnitude" if method == "masks" else method,
        calibration,
        targets,
        model,
        refit,
        reconstruct_steps,
        masks,
    )
    _check_nm(model, targets)
    if owl is not None and masks is not None:
        raise SparsityError("OWL chooses levels, --masks gives them: use one or the other.")
    if speed is not None:  # checked, and the time table measured when not given, before any change
        check_speed_args(method, owl, masks, targets)
        speed.table = speed.table or table_for_model(model, targets, speed, progress)
    was_training = model.training
    model.eval()  # dropout off: statistics must be those of the deployed model
    opts = _Options(method, blocksize, percdamp, owl, device, batch_size, progress, refit, reconstruct_steps,
                    reconstruct_lr, masks, stream or InMemoryBlocks(), speed)  # fmt: skip
    try:
        return _prune(model, targets, calibration, opts)
    finally:
        model.train(was_training)


@dataclass
class _Options:
    method: str  # what the result says: a method's name, or "masks"
    blocksize: int
    percdamp: float
    owl: OWLSettings | None
    device: Any
    batch_size: int
    progress: bool
    refit: bool
    steps: int
    lr: float
    masks: dict[str, torch.Tensor] | None
    stream: Any
    speed: SpeedTarget | None = None

    @property
    def algorithm(self) -> str:
        """The method that chooses masks (given masks are checked as magnitude's: no calibration)."""
        return "magnitude" if self.method == "masks" else self.method


def _prune(model, targets, calibration, o: _Options):
    t0 = time.perf_counter()
    calibrated = needs_calibration(o.algorithm, o.refit, o.steps, o.masks)
    if o.owl is not None and not calibrated:
        raise SparsityError("OWL needs calibration activations; use it with --method wanda or sparsegpt.")
    if not calibrated and isinstance(o.stream, InMemoryBlocks):  # the whole model at once, no blocks needed
        counts = (
            _given_counts(o.masks) if o.masks is not None else zero_counts(model, [], "", targets, [], None)
        )
        masks = _prune_outside(model, targets, counts, o.masks)
        return OneShotResult(masks, o.method, time.perf_counter() - t0, counts)
    prefix, blocks = find_blocks(model, [d.name for d in targets])
    o.stream.begin(prefix, blocks)
    dev = torch.device(o.device) if o.device else home_device(model)
    chunks = []
    if calibrated:
        chunks = capture_block_inputs(model, blocks[0], calibration, o.batch_size)
        chunks = to_device(chunks, dev) if dev != chunks[0].hidden.device else chunks
    counts, plan = _counts(model, blocks, prefix, targets, chunks, dev, o, calibration)
    in_blocks = set()
    block_seconds, info = [], {"blocks": prefix, **({"spdy": plan.to_dict()} if plan else {})}
    hidden = [c.hidden for c in chunks]
    for c in chunks:  # hold the activations once: as this block's inputs, then its outputs
        c.hidden = None
    statistic = get_method(o.algorithm).statistic_for(o.refit) if calibrated else None
    bar = _progress(len(blocks), o.method, o.progress)
    recon = []
    for i, block in enumerate(blocks):
        tb = time.perf_counter()
        o.stream.load(i)
        home = next(block.parameters()).device
        block.to(dev)
        ds = block_targets(model, prefix, i, targets)
        in_blocks.update(d.name for d in ds)
        mods = {d.name: model.get_submodule(d.name.rsplit(".", 1)[0]) for d in ds}
        stats, groups, dense_out = {}, {}, None
        if calibrated:
            hooks = StatsHooks(mods, statistic) if statistic else None
            dense_out = run_all(block, chunks, hidden)  # the dense block's outputs: reconstruction's target
            if hooks is not None:
                stats, groups = hooks.result(), hooks.group
            if not o.steps:
                dense_out = None
        block_masks = _prune_block(model, ds, stats, groups, counts, o)
        if o.steps:
            hidden, errors = _reconstruct(model, block, ds, block_masks, chunks, hidden, dense_out, o)
            recon.append(errors)
            dense_out = None
        elif calibrated and i + 1 < len(blocks):
            hidden = run_all(block, chunks, hidden)
        block.to(home)
        o.stream.release(i, block_masks)
        block_masks = None
        block_seconds.append(time.perf_counter() - tb)
        bar.update(1)
    bar.close()
    masks = o.stream.masks  # every block's masks (packed, when streaming)
    outside = [d for d in targets if d.name not in in_blocks]
    if outside:
        logger.warning(
            "%d targeted weights lie outside the decoder blocks (e.g. %s): %s.",
            len(outside),
            outside[0].name,
            "masked as given" if o.masks is not None else "pruned by magnitude",
        )
        for name, m in _prune_outside(model, outside, counts, o.masks).items():
            masks[name] = m
    if calibrated:
        info.update(nsamples=int(calibration.shape[0]), seqlen=int(calibration.shape[1]))
    if o.refit:
        info["refit"] = {"percdamp": o.percdamp}
    if o.steps:
        info["reconstruct"] = {
            "steps": o.steps, "lr": o.lr,
            "block_error_before_after": [[round(a, 6), round(b, 6)] for a, b in recon],
        }  # fmt: skip
    return OneShotResult(masks, o.method, time.perf_counter() - t0, counts, block_seconds, info, plan)


def _counts(model, blocks, prefix, targets, chunks, dev, o: _Options, calibration=None):
    """Zeros per targeted tensor: the given masks', the speed target's (and its plan), or the config's
    (OWL's) levels."""
    if o.masks is not None:
        return _given_counts(o.masks), None
    if o.speed is not None:
        return spdy_counts(
            model, blocks, prefix, targets, chunks, o.speed, o.algorithm,
            lambda groups: BlockContext(o.blocksize, o.percdamp, groups), dev, o.stream, o.progress,
            calibration,
        )  # fmt: skip
    return zero_counts(model, blocks, prefix, targets, chunks, o.owl, dev, o.stream), None


def _block_error(outs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """``Σ‖out − target‖² / Σ‖target‖²`` over the calibration chunks."""
    num = sum(float((o.float() - t.float()).pow(2).sum()) for o, t in zip(outs, targets))
    return num / max(sum(float(t.float().pow(2).sum()) for t in targets), 1e-30)


def _reconstruct(model, block, ds, block_masks, chunks, hidden, dense_out, o: _Options):
    """Reconstruct a pruned block; keep the result only if it lowers the block's error on the first
    calibration chunk (a cheap check: one extra forward of one chunk).

    Returns the block's outputs (the next block's inputs) and the error before and after.
    """
    err_before = _block_error(run_all(block, chunks[:1], hidden[:1]), dense_out[:1])
    weights = {d.name: (model.get_parameter(d.name), block_masks[d.name]) for d in ds}
    saved = {n: p.detach().clone() for n, (p, _) in weights.items()}
    reconstruct_block(block, chunks, hidden, dense_out, weights, o.steps, o.lr)
    after = run_all(block, chunks, hidden)
    err_after = _block_error(after[:1], dense_out[:1])
    if err_after >= err_before:  # a learning rate too high for this block: the refit weights stand
        where = ds[0].name.rsplit(".", 2)[0] if ds else "a block"
        logger.warning(
            "block reconstruction raised %s's calibration error (%.4g -> %.4g); kept the weights before "
            "it (lower --reconstruct-lr).", where, err_before, err_after,
        )  # fmt: skip
        for n, (p, _) in weights.items():
            p.copy_(saved[n])
        return run_all(block, chunks, hidden), (err_before, err_before)
    return after, (err_before, err_after)


def _given_counts(masks: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: int((m == 0).sum()) for n, m in masks.items()}


def _prune_block(model, ds, stats, groups, counts, o: _Options) -> dict[str, torch.Tensor]:
    """Choose (or take) each targeted weight's mask, update and re-fit the kept weights, store them."""
    masks = {}
    method = get_method(o.algorithm)
    ctx = BlockContext(o.blocksize, o.percdamp, groups)
    for d in ds:
        param = model.get_parameter(d.name)
        W = linear_view(param, d)
        H = stats.pop(d.name, None)
        if o.masks is not None:
            keep = o.masks[d.name].to(W.device)
            pruned = (keep.t() if d.input_dim == 0 else keep) == 0
            W_new = W
        else:
            W_new, pruned = method.prune(W, H, counts[d.name], _nm(d), d.name, ctx)
        if o.refit and H is not None:
            W_new = refit_weights(W, H, ~pruned, o.percdamp, d.name, start=W_new)
        masks[d.name] = _store(param, d, W_new, pruned)
    return masks


def _prune_outside(model, targets, counts, given=None) -> dict[str, torch.Tensor]:
    """Magnitude pruning (or the given masks) of whole tensors, no calibration."""
    masks = {}
    for d in targets:
        param = model.get_parameter(d.name)
        W = linear_view(param, d)
        if given is not None:
            keep = given[d.name].to(W.device)
            pruned = (keep.t() if d.input_dim == 0 else keep) == 0
        else:
            pruned = M.magnitude_prune(W, counts[d.name], _nm(d))
        masks[d.name] = _store(param, d, W, pruned)
    return masks


def _progress(total: int, method: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{method} blocks", unit="block", disable=not enabled)
