"""Run a model's sparse layers through a :mod:`~hf_sparsity.backends` backend, and undo it.

::

    model = AutoModelForCausalLM.from_pretrained(ckpt)        # ckpt holds sparsity_masks.safetensors
    sparsify_for_inference(model, backend="csr")              # swaps targeted nn.Linear / Conv1D
    model.generate(**inputs, custom_generate=native_generate) # inference.decoding: the native step
    restore_dense(model)                                      # the original modules are back

Where masks come from (``masks=``):

* ``None`` (default): the ``sparsity_masks.safetensors`` of the folder the model was
  loaded from (``model.config.name_or_path``); an error when there is none.
* a folder or mask file path: read with :func:`hf_sparsity.storage.masks_file.load_masks`.
* a dict ``name -> mask`` (e.g. ``SparsityEngine.masks``).
* ``"zeros"``: the exact zeros of the targeted weights (the default projection / FFN
  rule, or ``config``). Only for finalized checkpoints, which carry no masks: inferring
  masks from ``weight == 0`` is fragile, so it is never done implicitly.

The mask wins over the weight: a masked position computes as 0 even if the weight
holds a value there.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch
from torch import nn

from ..backends import LayerTarget, SparseBackend, available_backends, get_backend, ops
from ..backends.arena import pack_weights
from ..constants import SPARSITY_MASKS_NAME
from ..hooks import compile_generate_on_any_device
from ..mask_engine.config import SparsityConfig
from ..mask_engine.targeting import plan_sparsity, unwrap_model
from ..modeling import is_conv1d as _is_conv1d
from ..modeling import replace_module
from ..storage.masks_file import load_masks_for
from ..utils import SparsityError

logger = logging.getLogger(__name__)

_AUTO_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> what ``auto`` chose per layer (:func:`auto_choices`): kept here, not on the user's model."""


class SparseLinear(nn.Module):
    """Stands in for an ``nn.Linear`` or GPT-2 ``Conv1D``: ``y = backend.linear(x) + bias``.

    Keeps the original module (outside the module tree, so ``parameters()`` and
    ``state_dict()`` hold only the bias) for :func:`restore_dense`, unless built with
    ``keep_dense=False``, in which case the dense layer is rebuilt from the backend.
    """

    def __init__(
        self, original: nn.Module, backend: SparseBackend, keep_dense: bool = True, lm_head: bool = False
    ):
        super().__init__()
        self.backend = backend
        self.lm_head = lm_head  # the model's output embedding, converted though no mask names it
        self.in_features = backend.in_features
        self.out_features = backend.out_features
        self.was_conv1d = _is_conv1d(original)
        self.bias = original.bias
        self._original = [original if keep_dense else None]  # a list: not registered as a submodule
        self._orig_type = type(original)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(x, self.bias)

    def to_dense_module(self) -> nn.Module:
        """The original module, or (without ``keep_dense``) a new one holding the masked dense weight."""
        orig = self._original[0]
        if orig is not None:
            return orig
        w = self.backend.to_dense()
        if self.was_conv1d:
            mod = self._orig_type(self.out_features, self.in_features)
            mod.weight = nn.Parameter(w.t().contiguous())
        else:
            mod = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
            mod.weight = nn.Parameter(w.contiguous())
        mod.bias = self.bias
        return mod.to(device=w.device)

    def extra_repr(self) -> str:
        kind = "Conv1D" if self.was_conv1d else "Linear"
        return f"{kind} -> {self.backend.name}: {self.backend.extra_repr()}"


class Int8Embedding(nn.Module):
    """Stands in for the ``nn.Embedding`` tied to an int8 LM head: it reads the head's codes, so the
    weights stay tied and the float table is freed. Looking up token ``t`` returns ``codes[t] * scales[t]``
    (float32 products, then the embedding's dtype): exactly the rows the head multiplies by.

    Keeps the original embedding (outside the module tree) for :func:`restore_dense` when built with
    ``keep_dense=True``; else :meth:`to_dense_module` rebuilds it from the codes, tied to the restored head.
    """

    def __init__(self, original: nn.Embedding, head: SparseLinear, keep_dense: bool = True):
        super().__init__()
        self.head = [head]  # a list: the head is a module of the model already, not a child of this one
        self.num_embeddings, self.embedding_dim = original.num_embeddings, original.embedding_dim
        self.padding_idx = original.padding_idx
        self.dtype = original.weight.dtype
        self._original = [original if keep_dense else None]

    def int8_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes int8 [rows, dim], scales float32 [rows])`` of the head (views, no copy)."""
        return self.head[0].backend.int8_rows()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes, scales = self.int8_rows()
        flat = ids.reshape(-1)
        rows = codes.index_select(0, flat).float().mul_(scales.index_select(0, flat)[:, None])
        return rows.to(self.dtype).view(*ids.shape, self.embedding_dim)

    def to_dense_module(self, head: nn.Module | None = None) -> nn.Module:
        """The original embedding, or a new one holding the dequantized rows (the weight of ``head``, the
        restored LM head, when it has this shape: tied again)."""
        orig = self._original[0]
        if orig is not None:
            return orig
        emb = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx)
        w = getattr(head, "weight", None)
        if isinstance(w, nn.Parameter) and tuple(w.shape) == (self.num_embeddings, self.embedding_dim):
            emb.weight = w
        else:
            codes, scales = self.int8_rows()
            emb.weight = nn.Parameter(codes.float().mul_(scales[:, None]).to(self.dtype))
        return emb

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim} -> the int8 LM head's codes"


HEADS = ("int8", "float32")
"""``head=`` of :func:`sparsify_for_inference`: the LM head's values when the model's values are int8."""


def _head_option(head: Any, values: Any) -> str | None:
    """``head`` checked against ``values``: ``"int8"`` by default with ``values="int8"``; None without."""
    if head is not None and head not in HEADS:
        raise SparsityError(f"head={head!r}: use 'int8' or 'float32' (the LM head's values).")
    if values != "int8":
        if head == "int8":
            raise SparsityError(
                "head='int8' goes with values='int8' (the int8 LM head of an int8 model); add values='int8', "
                "or drop head."
            )
        return None
    return head or "int8"


def _int8_head(model_u: nn.Module, taken: set[str], keep_dense: bool, options: dict) -> tuple | None:
    """``(head name, SparseLinear, (embedding name, Int8Embedding) or None)``: the output embedding on
    ``native_dense`` with int8 values, and the input embedding tied to it reading the same codes. None
    when the model has no float ``nn.Linear`` head or a mask names it (it converts as a sparse layer)."""
    head = model_u.get_output_embeddings() if hasattr(model_u, "get_output_embeddings") else None
    name = next((n for n, m in model_u.named_modules() if m is head), None) if head is not None else None
    if type(head) is not nn.Linear or name is None or name in taken:
        return None
    opts = {k: options[k] for k in ("threads", "activations", "kernel") if options.get(k) is not None}
    w = head.weight.detach()
    b = get_backend("native_dense").from_dense(
        w, torch.ones((), dtype=torch.uint8).expand(w.shape), values="int8", **opts
    )
    layer = SparseLinear(head, b, keep_dense=keep_dense, lm_head=True)
    emb = model_u.get_input_embeddings() if hasattr(model_u, "get_input_embeddings") else None
    tied = isinstance(emb, nn.Embedding) and emb.weight is head.weight
    if not tied:
        return name, layer, None
    emb_name = next(n for n, m in model_u.named_modules() if m is emb)
    return name, layer, (emb_name, Int8Embedding(emb, layer, keep_dense=keep_dense))


def _resolve_masks(model: nn.Module, masks: Any, config: Any) -> dict[str, torch.Tensor]:
    if isinstance(masks, dict):
        return dict(masks)
    if isinstance(masks, str) and masks == "zeros":
        cfg = config if config is not None else SparsityConfig(sparsity=0.5)  # level unused: targets only
        names = [d.name for d in plan_sparsity(model, cfg) if d.sparsify]
        return {n: (model.get_parameter(n).detach() != 0).to(torch.uint8).cpu() for n in names}
    if masks is None:
        src = getattr(getattr(model, "config", None), "name_or_path", None) or ""
        loaded = load_masks_for(model, src) if src else None
        if loaded is not None:
            return loaded
        raise SparsityError(
            f"No masks for sparsify_for_inference: the model's folder ({src or 'unknown'}) holds no "
            f"{SPARSITY_MASKS_NAME}. Pass masks=<folder or mask file>, masks=engine.masks, or, for a "
            'finalized checkpoint, masks="zeros" to use the exact zeros of the targeted weights.'
        )
    if isinstance(masks, (str, os.PathLike)):
        return load_masks_for(model, masks, required=True)
    raise SparsityError(f"masks must be None, a path, a dict or 'zeros', not {type(masks).__name__}.")


def resolve_masks(model: nn.Module, masks: Any = None, config: Any = None) -> dict[str, torch.Tensor]:
    """The masks ``sparsify_for_inference(model, masks=masks, config=config)`` would use, by parameter name.

    ``masks`` as in the module docstring (``None``: the model folder's mask file; a path; a dict;
    ``"zeros"``). Raises :class:`~hf_sparsity.utils.SparsityError` when there are none or they do
    not match the model.
    """
    return _resolve_masks(unwrap_model(model), masks, config)


def _sparse_targets(model_u: nn.Module, found: dict[str, torch.Tensor]) -> list[tuple]:
    """``(name, module_name, owner, weight [out, in], mask [out, in])`` per mask; checks everything first."""
    params = dict(model_u.named_parameters(remove_duplicate=False))
    out = []
    for name, mask in found.items():
        module_name, _, attr = name.rpartition(".")
        if name not in params:
            raise SparsityError(
                f"Mask {name!r} names no parameter of this {type(model_u).__name__}: the mask file belongs "
                "to "
                "another model. Pass the masks saved with this model (or masks='zeros' for a finalized one)."
            )
        owner = model_u.get_submodule(module_name) if module_name else model_u
        if attr != "weight" or not (isinstance(owner, nn.Linear) or _is_conv1d(owner)):
            raise SparsityError(
                f"Mask {name!r} is not the weight of an nn.Linear or Conv1D ({type(owner).__name__}); "
                "sparsify_for_inference only swaps linear layers."
            )
        weight = owner.weight
        if not torch.is_tensor(mask) or tuple(mask.shape) != tuple(weight.shape):
            got = list(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
            raise SparsityError(
                f"Mask {name!r} has shape {got}, the weight {list(weight.shape)}: the masks do not match "
                "this model. Pass the masks saved with this model."
            )
        mask = mask.to(weight.device)
        if _is_conv1d(owner):  # Conv1D stores [in, out]; backends take [out, in]
            w2, m2 = weight.detach().t().contiguous(), mask.t().contiguous()
        else:
            w2, m2 = weight.detach(), mask
        out.append((name, module_name, owner, w2, m2))
    return out


@torch.no_grad()
def sparsify_for_inference(
    model: nn.Module,
    backend: str | type[SparseBackend] = "csr",
    masks: Any = None,
    *,
    config: Any = None,
    keep_dense: bool | None = None,
    head: str | None = None,
    verbose: bool = False,
    **backend_options: Any,
) -> nn.Module:
    """Swap every masked ``nn.Linear`` / ``Conv1D`` of ``model`` for a :class:`SparseLinear` on ``backend``.

    Args:
        model: a transformers model (DDP / accelerate wrappers are unwrapped).
        backend: a registered backend name (``auto``, ``bitmask``, ``nm24``, ``csr``,
            ``masked_dense``, ``semi_structured``, ``emulator``, ...) or class. ``auto`` measures,
            per group of like layers, dense and every sparse format for decoding and prefill and
            keeps the fastest (never slower than dense); it also gives the LM head the native
            multi-threaded GEMV when that is faster (``lm_head=False`` to skip). The choices are
            in :func:`auto_choices` / :func:`auto_report`.
        masks: where the masks come from; see the module docstring (default: the
            model folder's ``sparsity_masks.safetensors``).
        config: a :class:`~hf_sparsity.SparsityConfig` choosing the targets for ``masks="zeros"``.
        keep_dense: keep the original modules so :func:`restore_dense` puts them back
            unchanged. ``False`` frees the dense weights; restoring then rebuilds them from
            the sparse ones (masked positions exactly 0). Default: ``False`` for backends whose
            ``capabilities.frees_dense`` is set (``auto``, ``bitmask``, ``nm24``, ``native_dense``:
            the point is memory), ``True`` otherwise.
        head: the LM head's values with ``values="int8"``: ``"int8"`` (default) stores the output embedding
            as int8 codes with one scale per row (``scale = max|w_row| / 127``), multiplied by
            ``native_dense``'s GEMV with the layers' activation quantization, on every backend; an input
            embedding tied to it reads the same codes (:class:`Int8Embedding`: ``codes[t] * scales[t]``),
            so the weights stay tied and the float table is freed (``keep_dense=False``). ``"float32"``
            keeps the head as it is (``auto`` may still put it on the float native GEMV). An untied head
            converts alone. ``head="int8"`` without ``values="int8"`` is refused. A head a mask names
            converts as a sparse layer instead.
        verbose: print the per-layer choice of ``auto``.
        **backend_options: passed to the backend's :meth:`~hf_sparsity.backends.SparseBackend.plan_model`,
            which by default passes them to ``from_dense`` (e.g. ``kernel="torch"``,
            ``values="int8"`` for int8 values with per-row scales in ``bitmask`` / ``nm24`` / ``auto``);
            for ``auto`` see :func:`hf_sparsity.backends.auto.plan_layers`.

    Nothing is changed unless every layer converts: a bad mask file, dtype, device or
    structure raises a :class:`~hf_sparsity.utils.SparsityError` with the model untouched.
    Returns the same model, modified in place. ``model.generate`` works as before; batch-1 decoding
    (greedy or sampled) runs one native call per token with
    ``model.generate(**inputs, custom_generate=hf_sparsity.inference.decoding.native_generate)`` (the
    same argument for a text-generation ``pipeline``; :mod:`hf_sparsity.inference.decoding`).
    """
    # Long by design: the docstring documents every option; the body (56 lines) is the one conversion.
    model_u = unwrap_model(model)
    klass = get_backend(backend)
    if keep_dense is None:
        keep_dense = not klass.capabilities.frees_dense
    if any(isinstance(m, SparseLinear) for m in model_u.modules()):
        raise SparsityError("The model is already sparsified for inference; call restore_dense(model) first.")
    _check_values(model_u, klass, backend_options.get("values"))
    head = _head_option(head, backend_options.get("values"))
    found = _resolve_masks(model_u, masks, config)
    targets = [LayerTarget(*t) for t in _sparse_targets(model_u, found)]
    out_emb = model_u.get_output_embeddings() if hasattr(model_u, "get_output_embeddings") else None
    if any(t.module is out_emb for t in targets):  # a head a mask names converts as a sparse layer
        out_emb = None

    def wrap(module: nn.Module, prepared: SparseBackend, keep_dense: bool = keep_dense) -> SparseLinear:
        return SparseLinear(module, prepared, keep_dense=keep_dense, lm_head=module is out_emb)

    plan_options = dict(backend_options, head=head) if head else backend_options
    plan = klass.plan_model(model_u, targets, wrap, **plan_options)
    swaps, choices = plan.swaps, plan.choices
    if head == "int8":  # the int8 LM head (and the embedding tied to it), whatever the backend
        int8_head = _int8_head(model_u, {t.module_name for t in targets}, keep_dense, backend_options)
        if int8_head is not None:
            swaps = [s for s in swaps if s[0] != int8_head[0]] + [int8_head[:2]]
            if int8_head[2] is not None:
                swaps.append(int8_head[2])
            if choices:
                choices[int8_head[0]] = dict(
                    decode="native_dense",
                    values="int8",
                    prefill="unpack",
                    prefill_large="unpack",
                    lm_head=True,
                )
    for module_name, new in swaps:  # every layer prepared: now swap them all
        replace_module(model_u, module_name, new)
    n_swapped = len(swaps)
    # the dense weights the targets and the plan still reference go before the packed tensors are copied
    # into one huge-page buffer in reading order (each original freed as its copy lands: no second model)
    del plan, swaps, targets, found
    out_emb = None
    pack_weights(model_u)
    if choices:
        _AUTO_CHOICES[model_u] = choices
        if verbose:
            print(auto_report(model_u))
    logger.info("sparsify_for_inference: %d layers now run on %s.", n_swapped, klass.name)
    return model


def _check_values(model_u: nn.Module, klass: type[SparseBackend], values: Any) -> None:
    """``values="int8"``: refuse a backend without int8 values and an already-quantized model."""
    if values is None:
        return
    if values != "int8":
        raise SparsityError(f"values={values!r}: use 'int8', or leave it unset to keep the weight's dtype.")
    if not klass.capabilities.int8_values:
        have = [n for n in available_backends() if get_backend(n).capabilities.int8_values]
        raise SparsityError(
            f"Backend {klass.name!r} has no int8 values; backends that do: {', '.join(have) or 'none'}. "
            "Or leave values unset to keep the weight's dtype."
        )
    config = getattr(model_u, "config", None)
    quantized = (
        getattr(model_u, "is_quantized", False)
        or getattr(model_u, "hf_quantizer", None) is not None
        or getattr(config, "quantization_config", None) is not None
    )
    low = sorted({str(p.dtype)[6:] for p in model_u.parameters() if not p.is_floating_point()})
    if quantized or low:
        what = f"its weights are {', '.join(low)}" if low else "it was loaded with a quantization_config"
        raise SparsityError(
            f"values='int8' needs a model with float weights, but this one is already quantized ({what}). "
            "Load the unquantized model (float32 or bfloat16), or leave values unset."
        )


def auto_choices(model: nn.Module) -> dict[str, dict]:
    """What ``auto`` chose per layer (module name -> decode / prefill format and measured times)."""
    return dict(_AUTO_CHOICES.get(unwrap_model(model), {}))


def auto_report(model: nn.Module) -> str:
    """A per-layer table of ``auto``'s choices (one line per layer, grouped layers share timings)."""
    rows = auto_choices(model)
    if not rows:
        return "(no auto choices recorded)"
    lines = [
        f"{'layer':<44} {'group':<32} {'decode':>12} {'x dense':>7} {'prefill':>8} {'x dense':>7} "
        f"{'long':>7} {'x dense':>7}"
    ]

    def ratio(v: Any) -> str:  # "-": not measured (the int8 LM head is not timed)
        return f"{v:>7.2f}" if isinstance(v, (int, float)) else f"{'-':>7}"

    for name, c in rows.items():
        group = c.get("group") or ("LM head, int8 values" if c.get("lm_head") else "-")
        lines.append(
            f"{name:<44} {group:<32} {c.get('decode', '-'):>12} {ratio(c.get('decode_vs_dense'))} "
            f"{c.get('prefill', '-'):>8} {ratio(c.get('prefill_vs_dense'))} {c.get('prefill_large', '-'):>7} "
            f"{ratio(c.get('prefill_large_vs_dense'))}"
        )
    return "\n".join(lines)


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct tensor storage the model holds: parameters, buffers and sparse formats.

    Tied weights count once. For a sparsified model the packed formats count (values, bit masks,
    indices) and the dense copies only where they are still held (``keep_dense=True``); an
    :class:`Int8Embedding` holds nothing of its own (the int8 head's codes count with the head).
    """
    model_u = unwrap_model(model)
    seen: dict[int, int] = {}

    def add(t: torch.Tensor | None) -> None:
        if t is None or not torch.is_tensor(t) or t.device.type == "meta":
            return
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())

    for t in model_u.parameters():
        add(t)
    for t in model_u.buffers():
        add(t)
    for m in model_u.modules():
        if isinstance(m, SparseLinear):
            for t in _layer_storage(m):
                add(t)
    return sum(seen.values())


def _layer_storage(m: SparseLinear) -> list[torch.Tensor]:
    """The tensors a converted layer holds: its backend's storage, plus a kept dense weight."""
    ts = list(m.backend.storage_tensors())
    if m._original[0] is not None:
        ts.append(m._original[0].weight)
    return ts


def sparse_layer_bytes(model: nn.Module) -> dict[str, float]:
    """Resident bytes of the converted (sparse-able) layers' weights against the same weights dense.

    What the formats themselves save, without the parts that stay dense (embeddings, norms, a
    tied LM head), which bound :func:`resident_weight_bytes`'s whole-model ratio. An LM head converted
    without a mask (``auto``'s ``native_dense``, the int8 head) is not a sparse layer and is left out.
    Returns ``{"sparse": bytes, "dense": bytes, "ratio": sparse / dense, "layers": count}``.
    """
    sparse = dense = n = 0
    for m in unwrap_model(model).modules():
        if not isinstance(m, SparseLinear) or m.lm_head:
            continue
        b = m.backend
        sparse += sum(t.numel() * t.element_size() for t in _layer_storage(m))
        dtype = getattr(b, "dtype", None) or b.weight.dtype
        dense += b.out_features * b.in_features * torch.empty((), dtype=dtype).element_size()
        n += 1
    return {"sparse": sparse, "dense": dense, "ratio": sparse / dense if dense else float("nan"), "layers": n}


def compiled_generate_kwargs(fullgraph: bool = True, backend: str = "inductor") -> dict[str, Any]:
    """Keyword arguments for ``model.generate`` that decode with the model's forward compiled.

    A static KV cache (``cache_implementation="static"``) and a transformers ``CompileConfig``
    (inductor, static shapes, ``mode="default"``) flagged to compile on CPU too (transformers
    compiles automatically only on accelerators). The native sparse kernels are torch custom ops,
    so the graph does not break at sparse layers (``fullgraph=True`` checks it). The first call
    compiles (tens of seconds on 2 cores; the inductor cache makes later processes faster) and
    every new prompt length or ``max_new_tokens`` compiles again (the static cache's length is
    part of the graph): compile pays for long or repeated generations of one shape. It also builds
    the C++ variants of the custom ops once (``hf_sparsity.backends.ops.build_cpp_ops``: needs
    ninja; ~10 s, cached; the Python ops serve otherwise). Figures: docs/results/backends.md.
    """
    from transformers import CompileConfig

    ops.build_cpp_ops()  # the sparse layers' custom ops with a C++ body, when they can be built
    cc = CompileConfig(fullgraph=fullgraph, dynamic=False, backend=backend, mode="default")
    return {"cache_implementation": "static", "compile_config": compile_generate_on_any_device(cc)}


def restore_dense(model: nn.Module) -> nn.Module:
    """Undo :func:`sparsify_for_inference`: put the dense modules back. Returns the model."""
    model_u = unwrap_model(model)
    for name, module in list(model_u.named_modules()):
        if isinstance(module, SparseLinear):
            replace_module(model_u, name, module.to_dense_module())
    for name, module in list(model_u.named_modules()):  # tied to the restored head again
        if isinstance(module, Int8Embedding):
            replace_module(model_u, name, module.to_dense_module(model_u.get_output_embeddings()))
    return model


def sparse_layers(model: nn.Module) -> dict[str, SparseLinear]:
    """The :class:`SparseLinear` modules of a sparsified model, by module name."""
    return {n: m for n, m in unwrap_model(model).named_modules() if isinstance(m, SparseLinear)}
