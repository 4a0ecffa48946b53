"""Every place hf_sparsity reaches into another library where there is no public way in.

Each reach is one named function here, and each has a test that fails by name when a release
of the library moves what it relies on:

* transformers (``tests/test_checkpoints.py::test_trainer_still_offers_what_the_two_hooks_rely_on``,
  ``tests/test_checkpoints.py::test_resume_dir_is_read_from_trainer``, ``tests/test_hooks.py``):

  - :func:`carry_masks_in_save_pretrained`: ``Trainer.save_model()`` fires no callback event, so
    the masks and the config section ride on ``model.save_pretrained``.
  - :func:`resume_dir_from_trainer_frame`: Trainer passes the ``resume_from_checkpoint`` folder
    to no callback event, so it is read from ``Trainer.train``'s frame.

  - :func:`compile_generate_on_any_device` and :func:`forget_compiled_forward`: ``generate``
    compiles a model's forward only on accelerators unless its ``CompileConfig`` carries a private
    switch, and caches the compiled forward on the model; a sparsified model (another graph)
    must drop that cache to be compiled again.
  - :func:`generate_streamer`: ``generate`` hands a callable ``custom_generate`` (``native_generate``)
    the prompt, the prepared processors, criteria and config, and only those keywords its signature
    adds to ``_sample``'s: the ``streamer`` it was given is not passed on, so it is read from
    ``generate``'s frame (the library's one frame read outside Trainer's).
  - :func:`own_generate_loop`: where the native step does not run a ``generate`` call,
    ``native_generate`` runs ``generate``'s own loop for the mode (its private ``_sample`` /
    ``_beam_search``, named in ``GENERATION_MODES_MAPPING``); ``generate`` offers no public loop to
    hand a prepared call back to.
  - :func:`logits_processor_fields` and :func:`stopping_criterion_fields`: the native sampling call
    (``backends/csrc/sample.c``) reimplements the repetition penalty, temperature, top-k, top-p and
    min-p processors, and ``_Stops`` the length and end-of-sequence criteria, from these classes'
    attributes (their constructor arguments, kept as instance attributes without documentation).
    ``tests/test_hooks.py`` checks the attributes and, against definitions computed in the test,
    what each processor computes.

* torch (``tests/test_hooks.py``):

  - :func:`tensor_version`: the native step keeps a transposed copy of a ``Conv1D`` weight while the
    weight is unchanged; torch counts in-place changes of a tensor only in its private ``_version``.
  - :func:`queue_after_backward` and :func:`backward_task_id`: the gradients are masked in one fused
    multiply when a backward pass ends (after the callbacks it queued, DDP's copy-back included); torch
    offers a hook per tensor and per module, but the end of a whole backward only through the autograd
    engine's ``queue_callback``, and which backward a hook runs in only through
    ``torch._C._current_graph_task_id``.
  - :func:`cslt_compress`, :func:`cslt_search` and :func:`cslt_mm`: the ``cusparselt`` backend calls
    cuSPARSELt through the ATen ops torch's own semi-structured tensor calls (``torch._cslt_compress``,
    ``torch._cslt_sparse_mm_search``, ``torch._cslt_sparse_mm``), which have no public name; the
    public tensor sets cuSPARSELt up again on every product.

  - :func:`closed_form_lr` and :func:`set_last_lr`: an LR rewind (IMP) restarts a scheduler at
    a given step; torch schedulers offer no public way to jump to a step or to set the LR that
    ``get_last_lr()`` reports.
  - :func:`dtensor_local_shape_and_offset`: which slice of a full mask an FSDP2 (DTensor) shard
    holds; torch exposes no public function for a DTensor's local shape and global offset.

* DeepSpeed (``tests/test_hooks.py``):

  - :func:`zero12_fragment` and :func:`zero3_optimizer`: the masks must reach DeepSpeed's fp32
    master weights and moments; ZeRO-1/2 links a parameter to its piece of them only through the
    ``_hp_mapping`` attribute, and ZeRO-3 marks its parameters with their optimizer through
    ``_z3_optimizer`` (the public ``safe_get_local_*`` functions need it to exist).

* peft (``tests/test_hooks.py``):

  - :func:`set_lora_variant` / :func:`drop_lora_variant`: ``lora: masked`` applies the adapter's
    update as ``(B·A) ⊙ M`` through peft's own :class:`peft.tuners.lora.layer.LoraVariant`
    interface (forward, merge, unmerge), so no peft method is replaced and no private peft
    method is called. peft chooses a variant from ``LoraConfig`` fields when a layer is built
    and has no public call to attach one to an existing layer: the variant is written into the
    layer's ``lora_variant`` table, which peft's ``Linear`` consults on every forward and merge.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

TRAINER_FRAMES = ("_inner_training_loop", "train")


def resume_dir_from_trainer_frame() -> str | None:
    """The ``resume_from_checkpoint`` folder given to ``Trainer.train``, read from its frame.

    The one frame read in the library, because there is no public way in: Trainer passes the
    path to no callback event and keeps it nowhere on ``state`` or ``args``. It is an argument
    of ``Trainer.train`` and ``Trainer._inner_training_loop`` (:data:`TRAINER_FRAMES`).
    ``tests/test_checkpoints.py::test_resume_dir_is_read_from_trainer`` fails loudly when a
    transformers release moves it. Without it, resuming still works when the checkpoint is
    ``output_dir/checkpoint-<step>`` or is passed as ``SparsityCallback(resume_from=...)``.
    """
    value = _trainer_frame_local(
        "resume_from_checkpoint", lambda v: isinstance(v, (str, os.PathLike)) and os.path.isdir(v)
    )
    return None if value is None else str(value)


def _trainer_frame_local(key: str, accept: Callable[[Any], bool]) -> Any:
    """The first local ``key`` that ``accept``s, in a :data:`TRAINER_FRAMES` frame up the stack."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name in TRAINER_FRAMES:
                value = frame.f_locals.get(key)
                if value is not None and accept(value):
                    return value
            frame = frame.f_back
    finally:
        del frame
    return None


def carry_masks_in_save_pretrained(model: nn.Module, engine: Any) -> Callable:
    """Make ``model.save_pretrained(dir)`` also stamp the config and write the masks; returns the original.

    The one place the library replaces a method on an instance, because there is no public
    way in: ``Trainer.save_model()`` fires no callback event, and both it and every
    checkpoint save go through ``model.save_pretrained``. ``tests/test_checkpoints.py``
    fails loudly if Trainer stops calling it. Under a peft view (:mod:`hf_sparsity.lora`) the
    ``PeftModel`` is the module that saves.
    """
    model = getattr(model, "peft_model", model)
    orig = model.save_pretrained

    def save_pretrained(save_directory, *args, **kwargs):
        engine.stamp_config()
        out = orig(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            engine.save(save_directory)
        return out

    save_pretrained.__doc__ = orig.__doc__
    model.save_pretrained = save_pretrained
    return orig


def release_save_pretrained(model: nn.Module) -> None:
    """Undo :func:`carry_masks_in_save_pretrained`: the class's own ``save_pretrained`` again."""
    getattr(model, "peft_model", model).__dict__.pop("save_pretrained", None)


# ---------------------------------------------------------------------------- torch LR schedulers
def closed_form_lr(scheduler: Any, step: int) -> list[float] | None:
    """The learning rates a torch scheduler's closed form gives at ``step``; ``None`` if it has none.

    Uses ``LRScheduler._get_closed_form_lr`` (StepLR, ExponentialLR, CosineAnnealingLR, ...),
    which reads ``last_epoch``: the only way to ask a torch scheduler for the LR of an
    arbitrary step. Sets ``scheduler.last_epoch = step``.
    """
    if not hasattr(scheduler, "_get_closed_form_lr"):
        return None
    scheduler.last_epoch = step
    return list(scheduler._get_closed_form_lr())


def set_last_lr(scheduler: Any, lrs: list[float]) -> None:
    """Make ``scheduler.get_last_lr()`` report ``lrs`` after its LR was set by hand.

    ``get_last_lr()`` returns ``_last_lr``, written only inside ``step()``; Trainer logs it, so
    after a rewind it must show the rewound LR and not the one before.
    """
    scheduler._last_lr = list(lrs)


# ---------------------------------------------------------------------------- torch DTensor
def dtensor_local_shape_and_offset(param: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's shard of the DTensor ``param``.

    From ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, the
    function DTensor itself uses to place shards; nothing public gives the offset.
    """
    # Lazy: a private torch module, read only when a DTensor is sharded.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(shape), tuple(offset)


# ---------------------------------------------------------------------------- peft LoRA variants
def set_lora_variant(layer: nn.Module, adapter: str, variant: Any) -> None:
    """Attach a :class:`peft.tuners.lora.layer.LoraVariant` to ``adapter`` of a peft LoRA layer.

    peft's ``Linear.forward``, ``merge`` and ``unmerge`` call ``layer.lora_variant[adapter]``
    when present; peft fills that table only from ``LoraConfig`` fields when it builds the
    layer, so an existing layer is given its variant by writing the table.
    """
    layer.lora_variant[adapter] = variant


def drop_lora_variant(layer: nn.Module, adapter: str) -> None:
    """Undo :func:`set_lora_variant`: the adapter is plain LoRA again."""
    layer.lora_variant.pop(adapter, None)


# ---------------------------------------------------------------------------- transformers generate
def compile_generate_on_any_device(compile_config: Any) -> Any:
    """Flag a transformers ``CompileConfig`` so ``generate`` compiles the forward on CPU too; returns it.

    ``generate`` compiles automatically only on accelerators, unless the config's
    ``_compile_all_devices`` is set (transformers' own switch, with no public setter).
    """
    compile_config._compile_all_devices = True
    return compile_config


def forget_compiled_forward(model: nn.Module) -> None:
    """Drop the compiled forward ``generate`` cached on ``model`` (compiled again on its next use).

    ``PreTrainedModel.get_compiled_call`` keeps it in ``model._compiled_call`` and recompiles only
    when the ``CompileConfig`` changes; after its layers are swapped (``sparsify_for_inference``)
    the model is another graph. Also resets torch's compiler caches (``torch.compiler.reset``).
    """
    torch.compiler.reset()
    model.__dict__.pop("_compiled_call", None)


def generate_streamer() -> Any:
    """The ``streamer`` given to the running ``GenerationMixin.generate`` (``None``: none, or not inside it).

    For a callable ``custom_generate``, ``generate`` (``_extract_generation_mode_kwargs``) passes on only
    the keywords the callable's signature adds to ``_sample``'s; ``streamer`` is one of ``_sample``'s, so
    the callable never receives it (``generate`` only puts the prompt in it). It is read from the nearest
    frame up the stack that runs ``generate``'s own code. ``tests/test_hooks.py`` fails by name when
    transformers passes the streamer on (then this hook goes) or renames the argument.
    """
    from transformers.generation.utils import GenerationMixin

    code = inspect.unwrap(GenerationMixin.generate).__code__
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get("streamer")
            frame = frame.f_back
    finally:
        del frame
    return None


GENERATE_LOOPS = {"_sample": True, "_beam_search": False}  # generate's loops native_generate hands back to
# (the value: whether the loop takes the streamer)


def own_generate_loop(model: nn.Module, generation_config: Any) -> Callable | None:
    """``generate``'s own decoding loop for ``generation_config``'s mode, as a callable
    ``loop(input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer,
    **model_kwargs)``; ``None`` for a mode whose loop is not in :data:`GENERATE_LOOPS`.

    The loops are ``GenerationMixin``'s private ``_sample`` / ``_beam_search``, found the way
    ``generate`` finds them (``GENERATION_MODES_MAPPING``).
    """
    from transformers.generation.utils import GENERATION_MODES_MAPPING

    name = GENERATION_MODES_MAPPING.get(generation_config.get_generation_mode())
    if name not in GENERATE_LOOPS:
        return None
    method = getattr(type(model), name)

    def loop(input_ids, logits_processor, stopping_criteria, config, synced_gpus, streamer, **model_kwargs):
        extra = {"streamer": streamer} if GENERATE_LOOPS[name] else {}
        return method(
            model, input_ids, logits_processor, stopping_criteria, config,
            synced_gpus=synced_gpus, **extra, **model_kwargs,
        )  # fmt: skip

    return loop


# ---------------------------------------------------------------------------- transformers processors
def logits_processor_fields(proc: Any) -> tuple[str, dict[str, Any]] | None:
    """``(kind, fields)`` of one of the logits processors the native sampling call reimplements, read
    from its attributes; ``None`` for any other processor (an exact class match: a subclass may change
    what it computes).

    ``repetition_penalty``: ``penalty``, ``prompt_ignore_length``, ``logits_indices``;
    ``temperature``: ``temperature``; ``top_k``: ``top_k`` (already ``max(top_k, min_tokens_to_keep)``),
    ``filter_value``; ``top_p`` / ``min_p``: ``top_p`` / ``min_p``, ``min_tokens_to_keep``,
    ``filter_value``.
    """
    from transformers.generation import logits_process as lp

    kind = type(proc)
    if kind is lp.RepetitionPenaltyLogitsProcessor:
        keys = ("penalty", "prompt_ignore_length", "logits_indices")
        return "repetition_penalty", {k: getattr(proc, k) for k in keys}
    if kind is lp.TemperatureLogitsWarper:
        return "temperature", {"temperature": proc.temperature}
    if kind is lp.TopKLogitsWarper:
        return "top_k", {"top_k": proc.top_k, "filter_value": proc.filter_value}
    if kind in (lp.TopPLogitsWarper, lp.MinPLogitsWarper):
        name = "top_p" if kind is lp.TopPLogitsWarper else "min_p"
        keys = (name, "min_tokens_to_keep", "filter_value")
        return name, {k: getattr(proc, k) for k in keys}
    return None


def stopping_criterion_fields(criterion: Any) -> tuple[str, dict[str, Any]] | None:
    """``(kind, fields)`` of a stopping criterion decided without calling it: ``max_length``
    (``max_length``, ``max_position_embeddings``) or ``eos`` (``eos_token_id``); ``None`` for any other."""
    from transformers.generation import stopping_criteria as sc

    kind = type(criterion)
    if kind is sc.MaxLengthCriteria:
        keys = ("max_length", "max_position_embeddings")
        return "max_length", {k: getattr(criterion, k) for k in keys}
    if kind is sc.EosTokenCriteria:
        return "eos", {"eos_token_id": criterion.eos_token_id}
    return None


# ---------------------------------------------------------------------------- torch tensors
def tensor_version(t: torch.Tensor) -> int:
    """torch's count of in-place changes of ``t`` (``t._version``): a cache built from a tensor is current
    while the tensor (the same storage) has the same version."""
    return int(t._version)


def queue_after_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward pass ends (called from a hook inside it), after the callbacks
    queued before it: the autograd engine's ``queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def backward_task_id() -> int:
    """Which backward pass is running (an id the autograd engine gives each one; ``-1`` outside any)."""
    return int(torch._C._current_graph_task_id())


# ---------------------------------------------------------------------------- torch cuSPARSELt ops
CSLT_OPS = ("_cslt_compress", "_cslt_sparse_mm_search", "_cslt_sparse_mm")


def cslt_ops_missing() -> str | None:
    """The first cuSPARSELt op this torch lacks (before 2.3: all of them), or ``None``."""
    return next((name for name in CSLT_OPS if not hasattr(torch, name)), None)


def cslt_compress(dense: torch.Tensor) -> torch.Tensor:
    """The 2:4 weight ``[out, in]`` packed for cuSPARSELt (values and metadata): ``torch._cslt_compress``."""
    return torch._cslt_compress(dense)


def cslt_search(packed: torch.Tensor, xt: torch.Tensor) -> int:
    """cuSPARSELt's fastest algorithm id for ``packed @ xt``, transposed: ``_cslt_sparse_mm_search``."""
    return int(torch._cslt_sparse_mm_search(packed, xt, transpose_result=True))


def cslt_mm(packed: torch.Tensor, xt: torch.Tensor, alg_id: int) -> torch.Tensor:
    """``(W @ xt)^T``, row-major, with algorithm ``alg_id``: ``torch._cslt_sparse_mm``."""
    return torch._cslt_sparse_mm(packed, xt, transpose_result=True, alg_id=alg_id)


# ---------------------------------------------------------------------------- DeepSpeed ZeRO
ZERO12_LINK = "_hp_mapping"  # set on every parameter by deepspeed.utils.mixed_precision_linkage
ZERO3_OPTIMIZER = "_z3_optimizer"  # set on trainable parameters by DeepSpeedZeroOptimizer_Stage3


def is_zero12_linked(param: Any) -> bool:
    """ZeRO-1/2 linked ``param`` to its fp32 master partitions (the link is ``None`` on a rank whose
    partition holds none of it)."""
    return hasattr(param, ZERO12_LINK)


def zero12_fragment(param: Any) -> Any:
    """DeepSpeed's ``tensor_fragment`` of ``param`` on this rank (``None``: no piece here).

    Its ``lp_fragment_address`` (``start``, ``numel`` in the flattened parameter), its
    ``hp_fragment`` (a view of the fp32 master) and, after the first step, ``optim_fragment``
    (views of the moments) are public fields of that dataclass; the link itself is private.
    """
    return getattr(param, ZERO12_LINK, None)


def zero3_optimizer(param: Any) -> Any:
    """The ZeRO-3 optimizer that holds ``param``'s fp32 master and moments (``None``: none)."""
    return getattr(param, ZERO3_OPTIMIZER, None)
