"""Training FLOPs under ``transformers.Trainer``: the tokens trained per step, :class:`FlopCallback`
for dense runs, and the FLOP count saved in every checkpoint (``flop_state.json``).

:class:`~hf_sparsity.callback.SparsityCallback` counts a sparse run with the same token counter and
the same checkpoint file, so a dense baseline and a sparse run are counted the same way. This module
imports transformers' Trainer machinery; :mod:`hf_sparsity.flops` does not load it until it is used.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..mask_engine.targeting import unwrap_model
from ..modeling import context_length
from ..utils import atomic_write_text
from .accounting import FlopAccountant

logger = logging.getLogger("hf_sparsity")


FLOP_STATE_NAME = "flop_state.json"  # the file save_flop_state writes into a checkpoint


class TokenCounter:
    """Tokens trained per optimizer step, for both callbacks' FLOP accounting.

    Sources, in order (the one used is logged once):

    1. Trainer's own count, when it keeps one (``include_num_input_tokens_seen``);
    2. ``seq_len`` when the user gives it: every sample counted as ``seq_len`` tokens
       (batch x accumulation x processes x ``seq_len``);
    3. the batches themselves: a forward pre-hook on the model counts, while it is in training
       mode (evaluation forwards are left out), the nonzero entries of a 2-D ``attention_mask``
       (padding excluded) or, without one, the entries of ``input_ids`` (packed batches carry
       ``position_ids`` and no padding). Micro-batches of one optimizer step are summed
       (gradient accumulation); under ``torch.distributed`` the per-process counts are
       all-reduced, so processes whose batches pad differently are each counted exactly.
    """

    def __init__(self, seq_len: int | None = None):
        self.seq_len = seq_len
        self.seen = 0
        self.pending: Any = 0  # tokens of the micro-batches since the last optimizer step
        self.batch_source: str | None = None
        self.logged: str | None = None
        self._hook = None

    def start(self, model, state) -> None:
        """Begin counting for a run (or a resumed one) of ``model``."""
        self.stop()
        self.seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        self.pending = 0
        if self.seq_len is None:
            self._hook = model.register_forward_pre_hook(self._count_batch, with_kwargs=True)

    def stop(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _count_batch(self, module, args, kwargs) -> None:
        if not module.training:
            return
        mask = kwargs.get("attention_mask")
        ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
        if torch.is_tensor(mask) and mask.dim() == 2:
            n, source = torch.count_nonzero(mask), "nonzero attention_mask entries (padding excluded)"
        elif torch.is_tensor(ids):
            n, source = ids.numel(), "input_ids entries (no 2-D attention_mask: unpadded or packed)"
        elif torch.is_tensor(kwargs.get("inputs_embeds")):
            n, source = kwargs["inputs_embeds"].shape[:-1].numel(), "inputs_embeds positions"
        else:
            return
        self.pending = self.pending + n  # a tensor stays on its device: no sync per micro-batch
        self.batch_source = self.batch_source or source

    def step(self, args, state) -> int | torch.Tensor:
        """Tokens trained since the previous call (call once per optimizer step, on every process).

        A count taken from the batches stays a tensor on their device: reading it on the host waits for
        the device, so the callbacks read it only when a number is needed (:class:`PendingTokens`).
        """
        pending, self.pending = self.pending, 0
        seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)
        if seen > self.seen:
            n, self.seen = seen - self.seen, seen
            self._log("Trainer's count (include_num_input_tokens_seen)")
            return n
        if self.seq_len is not None:
            self._log(f"seq_len={self.seq_len} per sample (batch x accumulation x processes x seq_len)")
            return (
                args.per_device_train_batch_size
                * args.gradient_accumulation_steps
                * args.world_size
                * self.seq_len
            )
        self._log(f"the training batches: {self.batch_source or 'none seen yet'}, summed over processes")
        return _sum_over_processes(pending)

    def _log(self, source: str) -> None:
        if self.logged is None:
            logger.info("FLOPs: tokens per step from %s.", source)
            self.logged = source


def _sum_over_processes(n: Any) -> int | torch.Tensor:
    """``n`` summed over the processes of ``torch.distributed`` (just ``n`` without it), left where the
    sum is: the all-reduce is queued, nothing waits for it."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return n
    # NCCL reduces CUDA tensors only; gloo is given CPU ones.
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    total = torch.as_tensor(n).detach().to(device=device, dtype=torch.int64).clone()
    dist.all_reduce(total)
    return total


class PendingTokens:
    """Tokens trained since the FLOP count was last brought up to date, and the levels they trained at.

    A count taken from the batches is a tensor on their device, and reading it on the host waits
    for the device. The callbacks add each step's count here (a device addition, no wait) and
    account it (:meth:`flush`, the one host read) only when a number is needed: when metrics are
    logged, at a checkpoint, at a sparsity event (the levels change) and at the end of training.
    """

    def __init__(self):
        self.count: int | torch.Tensor = 0
        self.levels: dict[str, float] | None = None  # the levels in force while ``count`` trained

    def add(self, n: int | torch.Tensor, levels: dict[str, float], flops) -> None:
        if self.levels is not None and levels != self.levels:  # changed without an event: account first
            self.flush(flops)
        if self.levels is None:
            self.levels = dict(levels)
        self.count = self.count + n

    def flush(self, flops) -> None:
        """Account the pending tokens in ``flops`` at their levels (host sync: log, save, event, end only)."""
        if flops is not None and self.levels is not None:
            flops.add_tokens(int(self.count), self.levels)
        self.count, self.levels = 0, None


class FlopCallback(TrainerCallback):
    """FLOP accounting for a *dense* run, the same :class:`~hf_sparsity.flops.FlopAccountant` that
    :class:`SparsityCallback` keeps for sparse ones (so a dense baseline is counted the same way).

    Logs ``sparsity/train_flops`` and friends in ``on_log``; its count is saved in every
    checkpoint (``flop_state.json``) and continues when Trainer resumes from one. Tokens are
    counted as :class:`SparsityCallback` counts them (real batch tokens unless ``seq_len`` is given).
    """

    FILE = FLOP_STATE_NAME

    def __init__(self, seq_len: int | None = None):
        self.seq_len = seq_len
        self.flops = None
        self._tokens = TokenCounter(seq_len)
        self._pending = PendingTokens()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model = unwrap_model(model)
        self.flops = FlopAccountant(model, seq_len=self.seq_len or context_length(model.config))
        saved = load_flop_state(checkpoint_dir_of(args, state)) if state.global_step > 0 else None
        if saved:
            self.flops.load_state_dict(saved)
        self._tokens.start(model, state)
        self._pending = PendingTokens()
        return control

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._pending.add(self._tokens.step(args, state), {}, self.flops)  # no host sync
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self._tokens.stop()
        self._pending.flush(self.flops)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and ("loss" in logs or "eval_loss" in logs):
            self._pending.flush(self.flops)
            logs.update(self.flops.log_dict())
        return control

    def on_save(self, args, state, control, **kwargs):
        self._pending.flush(self.flops)  # every process: the count goes into the checkpoint
        ckpt = checkpoint_dir_of(args, state)
        if state.is_world_process_zero and os.path.isdir(ckpt):
            save_flop_state(ckpt, self.flops)
        return control


def checkpoint_dir_of(args, state) -> str:
    """The folder Trainer is saving (or resuming) the checkpoint of ``state.global_step`` in."""
    return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def save_flop_state(checkpoint_dir: str, flops) -> None:
    """The one way both callbacks save their FLOP count with a checkpoint (``flop_state.json``)."""
    if flops is not None:
        atomic_write_text(os.path.join(checkpoint_dir, FLOP_STATE_NAME), json.dumps(flops.state_dict()))


def load_flop_state(checkpoint_dir: str | None) -> dict[str, Any] | None:
    """The FLOP count :func:`save_flop_state` wrote into ``checkpoint_dir`` (``None`` if there is none)."""
    path = os.path.join(str(checkpoint_dir), FLOP_STATE_NAME) if checkpoint_dir else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# Old private names (kept for code that imported them from hf_sparsity.callback).
_TokenCounter = TokenCounter

__all__ = [
    "FLOP_STATE_NAME",
    "FlopCallback",
    "PendingTokens",
    "TokenCounter",
    "checkpoint_dir_of",
    "load_flop_state",
    "save_flop_state",
]
