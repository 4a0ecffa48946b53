"""The :class:`SparseBackend` interface: one sparse weight, prepared once, used as ``linear(x)``.

Lifecycle (torchao-style)::

    b = get_backend("csr").from_dense(weight, mask)   # prepare once: weight [out, in], uint8 mask
    y = b.linear(x, bias)                             # Y = X W^T (+ bias), any leading dims
    y.sum().backward()                                # grad of x, and of weight at kept positions
    b.counters["forward"].macs                        # work counters (multiply-adds, bytes, cycles)
    w = b.to_dense()                                  # the masked dense weight, [out, in]

Conventions shared by every backend:

* ``weight`` is ``[out_features, in_features]`` (``nn.Linear``); callers transpose
  GPT-2's ``Conv1D`` weight (``[in, out]``) and its mask before preparing.
* ``mask`` is a ``uint8`` (or bool) tensor of the weight's shape, 1 = keep, 0 = pruned.
  The mask wins: a pruned position computes as 0 whatever the weight holds there.
  Without a mask, the weight's exact zeros are the pruned positions.
* ``linear`` is differentiable: ``grad x = gY W`` and ``grad W = (gY^T X) * mask``
  (zero at pruned positions, so a pruned weight can never receive an update).
  Backends whose ``capabilities.training`` is ``True`` read the live weight tensor on
  every call; the others compute from the values captured by ``from_dense`` (call
  :meth:`SparseBackend.refresh` after changing the weight).
* Work counters are per phase (``forward``, ``backward_input``, ``backward_weight``);
  every backend counts multiply-adds performed / skipped and calls, the emulator
  also bytes read and modeled cycles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from ..checks import check_structure
from ..utils import SparsityError
from .table import alternatives, int8_backends

PHASES = ("forward", "backward_input", "backward_weight")


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do; checked by :meth:`SparseBackend.from_dense` and printed by the CLI."""

    devices: tuple[str, ...] = ("cpu",)
    """Device types it runs on (``"cpu"``, ``"cuda"``)."""
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    """Weight / activation dtypes it accepts."""
    training: bool = False
    """True when it reads the live weight on every call (usable while the weight trains)."""
    structure: str | None = None
    """Mask structure it requires (``"2:4"``), or None for any unstructured mask."""
    int8_values: bool = False
    """True when it can store the kept values as int8 with one scale per output row (``values="int8"``)."""
    frees_dense: bool = False
    """True when it keeps no dense copy of the weight (the point is memory): a converted model then drops
    the dense modules by default (``sparsify_for_inference(keep_dense=None)``)."""
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtypes"] = [str(t).replace("torch.", "") for t in self.dtypes]
        d["devices"] = list(self.devices)
        return d


@dataclass
class WorkCounters:
    """Work done by one phase of one backend, summed over calls.

    ``macs`` are the multiply-adds performed and ``macs_skipped`` those a dense
    kernel would have done on pruned weights. ``weight_bytes`` / ``index_bytes``
    are the bytes of weight values and of sparse indices read, ``cycles`` the modeled
    cycle count (emulator only; 0 elsewhere).
    """

    calls: int = 0
    macs: int = 0
    macs_skipped: int = 0
    weight_bytes: int = 0
    index_bytes: int = 0
    cycles: int = 0
    dense_cycles: int = 0

    def add(self, other: WorkCounters) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class LayerTarget(NamedTuple):
    """One layer a model-level plan converts: parameter and module names, the module, and its weight and
    mask as ``[out, in]`` (GPT-2 ``Conv1D`` transposed)."""

    name: str
    module_name: str
    module: Any
    weight: torch.Tensor
    mask: torch.Tensor


@dataclass
class ModelPlan:
    """What :meth:`SparseBackend.plan_model` decided for a model: the module swaps (module name ->
    replacement module; layers absent stay as they are) and, per module, a JSON-simple record of the
    decision (empty for backends that decide nothing)."""

    swaps: list[tuple[str, Any]] = field(default_factory=list)
    choices: dict[str, dict] = field(default_factory=dict)


Wrap = Callable[..., Any]
"""``wrap(module, backend, keep_dense=None) -> module``: the caller's layer wrapper (a ``SparseLinear``)."""


def _new_counters() -> dict[str, WorkCounters]:
    return {p: WorkCounters() for p in PHASES}


class _SparseLinearFunction(torch.autograd.Function):
    """Routes forward / backward of ``Y = X W^T`` to a backend's kernels."""

    @staticmethod
    def forward(ctx, x2d, weight, backend):  # weight: the dense tensor grads flow to (may be a dummy)
        ctx.backend = backend
        ctx.save_for_backward(x2d)
        return backend._forward(x2d)

    @staticmethod
    def backward(ctx, gy):
        (x2d,) = ctx.saved_tensors
        b = ctx.backend
        gy = gy.contiguous()
        gx = b._grad_input(gy) if ctx.needs_input_grad[0] else None
        gw = b._grad_weight(gy, x2d) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class SparseBackend:
    """Base class: a sparse ``[out, in]`` weight prepared for one compute path.

    Subclasses set ``name`` (registry key), optional ``aliases`` and ``capabilities``,
    and implement ``_prepare`` and ``_forward`` (``[B, in] -> [B, out]``, no autograd);
    ``_grad_input`` / ``_grad_weight`` default to dense math on :meth:`to_dense`.
    Optional backends override :meth:`unavailable_reason`.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities()

    # ------------------------------------------------------------------ availability
    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run on this machine, or ``None`` when it can."""
        return None

    @classmethod
    def is_available(cls) -> bool:
        """True when the backend can run here (see :meth:`unavailable_reason`)."""
        return cls.unavailable_reason() is None

    # ------------------------------------------------------------------ model-level planning
    @classmethod
    def plan_model(cls, model: Any, targets: list[LayerTarget], wrap: Wrap, **options: Any) -> ModelPlan:
        """Prepare every target layer of ``model``; nothing is swapped yet (the caller swaps them all once
        every layer converted, so a failure leaves the model untouched).

        The default converts each layer with :meth:`from_dense` (``options`` passed through). A backend
        that decides per layer or looks at the whole model (``auto``) overrides this: it may leave layers
        out, convert modules that are not targets (an LM head) and record its choices. ``head``
        (``"int8"`` / ``"float32"``, from ``sparsify_for_inference``) is a model-level option: the int8 LM
        head is converted by the caller, after the plan.
        """
        options.pop("head", None)
        return ModelPlan(
            [(t.module_name, wrap(t.module, cls.from_dense(t.weight, t.mask, **options))) for t in targets]
        )

    # ------------------------------------------------------------------ construction
    def __init__(self, weight: torch.Tensor, mask: torch.Tensor, **options: Any):
        self.weight = weight
        self.mask = mask
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.options = options
        self.counters: dict[str, WorkCounters] = _new_counters()
        self.nnz = int(mask.sum(dtype=torch.int64))
        self._prepare()

    def storage_tensors(self) -> list[torch.Tensor]:
        """The tensors this backend holds for its weight: what resident memory counts."""
        return [self.weight, self.mask]

    @classmethod
    def from_dense(
        cls, weight: torch.Tensor, mask: torch.Tensor | None = None, **options: Any
    ) -> SparseBackend:
        """Prepare ``weight`` (``[out, in]``) under ``mask`` (uint8/bool, same shape; default: ``weight !=
        0``).

        Raises :class:`~hf_sparsity.utils.SparsityError` when the backend is unavailable
        here, or the weight's device / dtype / mask structure is not supported.
        """
        reason = cls.unavailable_reason()
        if reason is not None:
            raise SparsityError(f"Backend {cls.name!r} is not available: {reason}")
        if not torch.is_tensor(weight) or weight.ndim != 2:
            raise SparsityError(f"Backend {cls.name!r} needs a 2-D [out, in] weight, got {_shape(weight)}.")
        caps = cls.capabilities
        if weight.device.type not in caps.devices:
            raise SparsityError(
                f"Backend {cls.name!r} runs on {', '.join(caps.devices)}, but the weight is on "
                f"{weight.device}. Move the model (model.to(...)) or pick a backend that runs there: "
                f"{alternatives(weight.device.type, weight.dtype)}."
            )
        if weight.dtype not in caps.dtypes:
            names = ", ".join(str(t).replace("torch.", "") for t in caps.dtypes)
            raise SparsityError(
                f"Backend {cls.name!r} supports dtypes {names}, not {weight.dtype}. Cast the model "
                f"(model.to(dtype)) or pick a backend that takes it: "
                f"{alternatives(weight.device.type, weight.dtype)}."
            )
        values = options.get("values")
        if values not in (None, "int8"):
            raise SparsityError(f"values={values!r}: use None (the weight's dtype) or 'int8'.")
        if values == "int8" and not caps.int8_values:
            raise SparsityError(
                f"Backend {cls.name!r} has no int8 values; backends that do: {int8_backends()}. Or "
                "leave values unset to keep the weight's dtype."
            )
        if mask is None:
            mask = weight.detach() != 0
        if tuple(mask.shape) != tuple(weight.shape):
            raise SparsityError(
                f"Mask shape {list(mask.shape)} does not match weight shape {list(weight.shape)} "
                f"(backend {cls.name!r}). Transpose Conv1D masks to [out, in] together with the weight."
            )
        mask = mask.detach().to(device=weight.device, dtype=torch.uint8)
        if caps.structure is not None:
            n, m = check_structure(caps.structure)
            check_nm(mask, n, m, backend=cls.name)
        return cls(weight, mask, **options)

    def _prepare(self) -> None:
        """Build the backend's storage from ``self.weight`` / ``self.mask`` (called by ``__init__``)."""

    def refresh(self) -> None:
        """Re-read the weight's values (after the weight changed); the mask stays as prepared."""
        self._prepare()

    # ------------------------------------------------------------------ compute
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W_masked^T (+ bias)`` for ``x`` of shape ``[..., in]``; differentiable."""
        if x.shape[-1] != self.in_features:
            raise SparsityError(
                f"Input has {x.shape[-1]} features; the sparse weight expects {self.in_features}."
            )
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        w = self.weight
        needs_w = torch.is_tensor(w) and w.requires_grad and torch.is_grad_enabled()
        if (x2d.requires_grad or needs_w) and torch.is_grad_enabled():
            dummy = w if needs_w else torch.empty(0, device=x.device)
            y = _SparseLinearFunction.apply(x2d, dummy, self)
        else:
            y = self._forward(x2d)
        y = y.reshape(*lead, self.out_features)
        if bias is not None:
            y = y + bias
        return y

    __call__ = linear

    def decode_call(self) -> tuple[Any, int] | None:
        """The native batch-1 kernel call of this weight with its fixed arguments prepared (a
        ``(structure, address)`` pair for ``hfs_run_prepared``: float32 ``x`` in, float32 ``y`` out), or
        ``None`` when the weight has no native batch-1 path. Used by the one-call decoding step
        (:class:`hf_sparsity.inference.native_step.NativeDecoder`); the structure must be kept alive
        while its address is used, and holds raw pointers into this backend's tensors."""
        return None

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _grad_input(self, gy: torch.Tensor) -> torch.Tensor:
        self._count("backward_input", gy.shape[0])
        return gy.to(self.to_dense().dtype) @ self.to_dense()

    def _grad_weight(self, gy: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        self._count("backward_weight", gy.shape[0])
        acc = torch.float32 if gy.dtype in (torch.float16, torch.bfloat16) else gy.dtype
        g = gy.to(acc).t() @ x2d.to(acc)
        return (g * self.mask).to(self.weight.dtype)

    def _count(self, phase: str, batch: int) -> None:
        c = self.counters[phase]
        c.calls += 1
        c.macs += self.nnz * batch
        c.macs_skipped += (self.mask.numel() - self.nnz) * batch

    def reset_counters(self) -> None:
        """Zero every phase's counters."""
        self.counters = _new_counters()

    # ------------------------------------------------------------------ conversion
    def to_dense(self) -> torch.Tensor:
        """The masked dense weight ``[out, in]`` this backend computes with."""
        w = self.weight.detach()
        return w * self.mask.to(w.dtype)

    @property
    def density(self) -> float:
        """Fraction of weights kept."""
        return self.nnz / max(self.mask.numel(), 1)

    def extra_repr(self) -> str:
        return f"{self.out_features}x{self.in_features}, nnz={self.nnz} ({1 - self.density:.2%} sparse)"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def check_nm(mask: torch.Tensor, n: int, m: int, dim: int = 1, backend: str = "") -> None:
    """Raise unless ``mask`` keeps at most ``n`` of every ``m`` consecutive entries along ``dim``."""
    x = mask.movedim(dim, -1)
    if x.shape[-1] % m:
        raise SparsityError(
            f"Backend {backend!r} needs {n}:{m} masks, but the input dimension ({x.shape[-1]}) is not a "
            f"multiple of {m}."
        )
    per_group = x.reshape(*x.shape[:-1], x.shape[-1] // m, m).sum(-1, dtype=torch.int32)
    if bool((per_group > n).any()):
        raise SparsityError(
            f"Backend {backend!r} needs {n}:{m} masks (keep at most {n} of every {m} weights along the input "
            f'dimension); this mask is unstructured. Build masks with SparsityConfig(structure="{n}:{m}") '
            "or hf_sparsity.masks.nm_mask."
        )


def _shape(t: Any) -> str:
    return str(list(t.shape)) if torch.is_tensor(t) else type(t).__name__


__all__ = [
    "PHASES",
    "BackendCapabilities",
    "LayerTarget",
    "ModelPlan",
    "SparseBackend",
    "WorkCounters",
    "check_nm",
]
