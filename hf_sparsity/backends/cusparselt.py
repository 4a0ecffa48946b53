"""``cusparselt``: 2:4 sparsity on a CUDA GPU through cuSPARSELt, called directly, with its set-up paid once.

torch's semi-structured tensor (the ``semi_structured`` backend, kept as the reference this one is
tested against) reaches the same cuSPARSELt kernels, but its matmul builds and destroys the matmul
descriptors and plan on every call, a fixed host cost (about 0.5 ms) that is larger than the whole
dense ``F.linear`` of a decoding step. This backend:

* compresses the masked weight once, at conversion (``torch._cslt_compress``);
* picks the kernel algorithm once per layer shape, dtype and token bucket
  (``torch._cslt_sparse_mm_search``), cached for the process (:data:`ALG_CACHE`);
* calls ``torch._cslt_sparse_mm(packed, x^T, alg_id=..., transpose_result=True)`` directly: ``y = x W^T``
  comes out row-major, with no transpose copy;
* pads the token count to the multiple cuSPARSELt needs for the dtype (:func:`token_multiple`);
* and, since each call still sets up cuSPARSELt on the host, offers :class:`GraphedForward`: the
  model's whole forward captured in a CUDA graph for one input shape, replayed without host work.

The per-layer choice against dense (cuSPARSELt loses at a few tokens, where dense is one read of the
weight) is :func:`plan_cuda`, what ``sparsify_for_inference(model, "auto")`` runs when the model is on
a CUDA device: per layer group (shape, dtype), dense and ``cusparselt`` are timed with CUDA events at
decoding (1 token) and prefill sizes, and each regime keeps the faster.

Every call into CUDA-only torch functions goes through one small function of this module
(:func:`compress`, :func:`search`, :func:`sparse_mm`, :func:`cuda_time`, :func:`unavailable_reason`),
so that the CPU test suite can drive every branch around them.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..hooks import cslt_compress, cslt_mm, cslt_ops_missing, cslt_search
from ..utils import SparsityError
from .base import BackendCapabilities, LayerTarget, ModelPlan, SparseBackend, Wrap, _new_counters, check_nm
from .registry import register_backend

logger = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16)
ALG_CACHE: dict[tuple, int] = {}
"""``(out, in, dtype, token bucket, device index) -> alg_id``: one search per key, for the process."""
SMALL_TOKENS = 16
"""Up to this many tokens a call is a decoding call (``auto``'s decode regime)."""


# ---------------------------------------------------------------------------- the CUDA-only calls
def unavailable_reason() -> str | None:
    """Why cuSPARSELt cannot run here (no CUDA, an older GPU, a torch built without it), or ``None``."""
    missing = cslt_ops_missing()
    if missing is not None:
        return f"torch {torch.__version__} has no torch.{missing} (needs torch >= 2.3)."
    if not torch.cuda.is_available():
        return "cuSPARSELt needs a CUDA GPU; none is visible (CPU-only torch or no device)."
    if not torch.backends.cusparselt.is_available():
        return "this torch build has no cuSPARSELt (torch.backends.cusparselt.is_available() is False)."
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        return f"2:4 sparsity needs compute capability >= 8.0; this GPU has {major}.{minor}."
    return None


def compress(dense: torch.Tensor) -> torch.Tensor:
    """The 2:4 weight ``[out, in]`` (zeros where pruned) packed for cuSPARSELt (values and metadata)."""
    return cslt_compress(dense)


def search(packed: torch.Tensor, xt: torch.Tensor) -> int:
    """cuSPARSELt's fastest algorithm id for ``packed @ xt`` (``xt``: ``[in, tokens]``), result transposed."""
    return cslt_search(packed, xt)


def sparse_mm(packed: torch.Tensor, xt: torch.Tensor, alg_id: int) -> torch.Tensor:
    """``(W @ xt)^T`` = ``x W^T``, ``[tokens, out]``, row-major (``transpose_result``)."""
    return cslt_mm(packed, xt, alg_id)


def runs_on_cuda(targets: list[LayerTarget]) -> bool:
    """Whether a model's layers are on a CUDA device (``auto`` then plans with :func:`plan_cuda`)."""
    return bool(targets) and targets[0].weight.device.type == "cuda"


def cuda_time(fn, calls: int, rounds: int = 5) -> float:
    """Median seconds per call of ``fn()`` over ``rounds`` rounds of ``calls`` calls, CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------- shapes
def token_multiple(dtype: torch.dtype) -> int:
    """The multiple cuSPARSELt needs for the dense operand's columns (tokens): 8 for 16-bit types, 16
    for 8-bit ones (torch's ``SparseSemiStructuredTensorCUSPARSELT`` table)."""
    return 8 if dtype in (torch.float16, torch.bfloat16) else 16


def token_bucket(tokens: int) -> int:
    """Token counts that share one algorithm search: each power of two (1, 2, 4, ..., 512, 1024, ...)."""
    return 1 << max(0, math.ceil(math.log2(max(tokens, 1))))


# ---------------------------------------------------------------------------- the backend
@register_backend
class CuSparseLtBackend(SparseBackend):
    """2:4 weight compressed once for cuSPARSELt, called directly with a cached algorithm per shape."""

    name = "cusparselt"
    aliases = ("2:4-cusparselt", "cslt")
    capabilities = BackendCapabilities(
        devices=("cuda",),
        dtypes=DTYPES,
        training=False,
        structure="2:4",
        description="2:4 through cuSPARSELt called directly (compressed once, algorithm searched once per "
        "shape; CUDA, Ampere+)",
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return unavailable_reason()

    def _prepare(self) -> None:
        w = self.weight.detach()
        self._dense = (w * self.mask.to(w.dtype)).contiguous()
        self._packed = compress(self._dense)
        self._multiple = token_multiple(w.dtype)
        self._device = w.device.index if w.device.index is not None else 0

    def storage_tensors(self) -> list[torch.Tensor]:
        return [self._packed, self._dense]

    def alg_id(self, xt: torch.Tensor) -> int:
        """The cached algorithm for this layer's shape and ``xt``'s token bucket (searched on a miss)."""
        shape = (self.out_features, self.in_features)
        key = (*shape, self._dense.dtype, token_bucket(xt.shape[1]), self._device)
        alg = ALG_CACHE.get(key)
        if alg is None:
            alg = ALG_CACHE[key] = search(self._packed, xt)
        return alg

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        self._count("forward", x2d.shape[0])
        x = x2d.to(self._dense.dtype)
        tokens = x.shape[0]
        pad = (-tokens) % self._multiple
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        xt = x.t()  # [in, tokens]: column-major view, what cuSPARSELt takes as its dense operand
        y = sparse_mm(self._packed, xt, self.alg_id(xt))
        return y[:tokens] if pad else y

    def to_dense(self) -> torch.Tensor:
        return self._dense


# ---------------------------------------------------------------------------- auto on CUDA
class CudaAutoLayer(SparseBackend):
    """One layer as ``auto`` planned it on CUDA: ``cusparselt`` or dense ``F.linear`` for decoding calls (up
    to :data:`SMALL_TOKENS` tokens) and for prefill calls, each the faster of the two as measured."""

    name = "auto"
    capabilities = BackendCapabilities(devices=("cuda",), dtypes=DTYPES, structure="2:4")

    def __init__(self, sparse: CuSparseLtBackend | None, dense: torch.Tensor, choice: dict):
        self.sparse, self._dense, self.choice = sparse, dense, choice
        self.out_features, self.in_features = (int(s) for s in dense.shape)
        self.options = {}
        self.counters = _new_counters()
        self.mask = (dense != 0).to(torch.uint8)
        self.nnz = int(self.mask.sum())
        self.weight = dense

    def storage_tensors(self) -> list[torch.Tensor]:
        return ([self.sparse._packed] if self.sparse is not None else []) + [self._dense]

    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        regime = "decode" if x2d.shape[0] <= SMALL_TOKENS else "prefill"
        if self.choice[regime] == "cusparselt":
            return self.sparse._forward(x2d)
        self._count("forward", x2d.shape[0])
        return F.linear(x2d.to(self._dense.dtype), self._dense)

    def to_dense(self) -> torch.Tensor:
        return self._dense

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, decode={self.choice['decode']}, prefill={self.choice['prefill']}"


def measure_group(sparse: CuSparseLtBackend, tokens: int, calls: int, rounds: int) -> dict[str, float]:
    """Seconds per call of dense ``F.linear`` and of ``cusparselt`` for one layer at ``tokens`` tokens."""
    dense = sparse.to_dense()
    gen = torch.Generator(device=dense.device).manual_seed(tokens)
    x = torch.randn(tokens, sparse.in_features, device=dense.device, dtype=dense.dtype, generator=gen)
    with torch.no_grad():
        return {
            "dense": cuda_time(lambda: F.linear(x, dense), calls, rounds),
            "cusparselt": cuda_time(lambda: sparse._forward(x), calls, rounds),
        }


def decide(times: dict[str, dict[str, float]], margin: float = 0.0) -> dict[str, str]:
    """Per regime, ``cusparselt`` when it is faster than dense by more than ``margin`` (a share), else
    ``dense``. ``times``: ``{"decode": {"dense": s, "cusparselt": s}, "prefill": {...}}``."""
    return {
        regime: "cusparselt" if t["cusparselt"] < t["dense"] * (1.0 - margin) else "dense"
        for regime, t in times.items()
    }


def plan_cuda(
    targets: list[LayerTarget],
    wrap: Wrap,
    *,
    decode_tokens: int = 1,
    prefill_tokens: int = 512,
    calls: int = 20,
    rounds: int = 5,
    margin: float = 0.0,
    **ignored: Any,
) -> ModelPlan:
    """``auto`` for a model on CUDA: per group of layers of one shape and dtype, dense ``F.linear`` and
    ``cusparselt`` timed (:func:`measure_group`) on the group's first layer at ``decode_tokens`` and
    ``prefill_tokens`` tokens; each regime keeps the faster (:func:`decide`). Layers whose masks are not 2:4
    or whose dtype cuSPARSELt does not take stay dense (left out of the plan). A group where dense wins both
    regimes is left as it was."""

    groups: dict[tuple, list[LayerTarget]] = {}
    choices: dict[str, dict] = {}
    for t in targets:
        reason = None
        if t.weight.dtype not in DTYPES:
            reason = f"dtype {t.weight.dtype} (cuSPARSELt takes float16 / bfloat16)"
        else:
            try:
                check_nm(t.mask, 2, 4, backend="cusparselt")
            except SparsityError:
                reason = "mask is not 2:4"
        if reason is not None:
            choices[t.module_name] = {"decode": "dense", "prefill": "dense", "reason": reason}
            continue
        groups.setdefault((tuple(t.weight.shape), t.weight.dtype), []).append(t)
    swaps = []
    for (shape, dtype), members in groups.items():
        first = members[0]
        sparse = _prepared(first)
        times = {
            regime: measure_group(sparse, n, calls, rounds)
            for regime, n in (("decode", decode_tokens), ("prefill", prefill_tokens))
        }
        choice = decide(times, margin)
        record = {
            **choice,
            "group": f"{shape[0]}x{shape[1]} {str(dtype).replace('torch.', '')}",
            "tokens": {"decode": decode_tokens, "prefill": prefill_tokens},
            "ms": {r: {k: round(v * 1e3, 4) for k, v in t.items()} for r, t in times.items()},
            "measured_on": first.module_name,
        }
        for t in members:
            choices[t.module_name] = dict(record)
            if "cusparselt" not in choice.values():
                continue
            b = sparse if t is first else _prepared(t)
            swaps.append((t.module_name, wrap(t.module, CudaAutoLayer(b, b.to_dense(), record))))
    return ModelPlan(swaps, choices)


def _prepared(t: LayerTarget) -> CuSparseLtBackend:
    """``t``'s layer compressed (its dtype and 2:4 mask checked by :func:`plan_cuda`)."""
    return CuSparseLtBackend(t.weight, t.mask.detach().to(device=t.weight.device, dtype=torch.uint8))


# ---------------------------------------------------------------------------- CUDA graphs
class GraphedForward:
    """A model's forward captured in a CUDA graph for one input shape (``torch.cuda.CUDAGraph``): a call
    copies the input into the captured buffer and replays every kernel, with none of the per-call host
    work (cuSPARSELt's descriptors and plans, Python, launches).

    ``GraphedForward(model, input_ids)`` warms up on a side stream, then captures
    ``model(input_ids=...).logits``; ``graphed(ids)`` takes ids of the same shape and returns the logits
    (the captured output buffer, overwritten by the next call: copy it to keep it). A model whose forward
    cannot be captured (host synchronization, allocations outside torch's allocator) raises the capture's
    error: run it without the graph.
    """

    def __init__(self, model: torch.nn.Module, input_ids: torch.Tensor, warmup: int = 2):
        if input_ids.device.type != "cuda":
            raise SparsityError(f"GraphedForward needs the inputs on a CUDA device, got {input_ids.device}.")
        self.model = model
        self.static_in = input_ids.clone()
        self.graph, self.static_out = capture(lambda: model(input_ids=self.static_in).logits, warmup)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.shape != self.static_in.shape:
            raise SparsityError(
                f"GraphedForward was captured for inputs of shape {list(self.static_in.shape)}, got "
                f"{list(input_ids.shape)}: capture one per shape (pad the batch to the captured shape)."
            )
        self.static_in.copy_(input_ids)
        self.graph.replay()
        return self.static_out


def capture(fn, warmup: int = 2):
    """``(graph, output)``: ``fn()`` warmed up on a side stream and captured (no autograd)."""
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
    return graph, out


__all__ = [
    "ALG_CACHE",
    "CuSparseLtBackend",
    "CudaAutoLayer",
    "GraphedForward",
    "decide",
    "plan_cuda",
    "runs_on_cuda",
    "token_bucket",
    "token_multiple",
]
