"""``auto``: per layer, the fastest of dense and each sparse format on this machine; never slower than dense.

Decoding (batch 1) and prefill (``prefill_batch`` rows, default 128, and four times as many) are decided
separately, with the current thread count:

1. **Groups.** Layers of one shape, dtype, density (to 0.05) and 2:4-ness compute alike: one decision per
   group, measured on up to ``sample_layers`` of its layers.
2. **Cost model.** Each candidate format (``dense`` = ``F.linear``, ``native_dense``, ``bitmask``,
   ``nm24`` for 2:4 masks, ``csr``; with ``values="int8"`` the sparse formats store int8 values and
   ``csr``, which has none, is left out) reads a known number of bytes per decoding call: values, indices,
   row offsets, scales (:func:`decode_bytes`). Decoding is memory-bound, so the model's time is those
   bytes over the machine's read bandwidth (:func:`~hf_sparsity.backends.measure.read_bandwidth_gbs`),
   plus a fixed cost per call (:data:`CALL_MS`).
3. **Measurement.** Every candidate runs one pass over the sample, copied until the pass streams
   ``stream_bytes`` (64 MiB) of dense weights, so that weights come from memory as in a decoding step
   rather than from the caches; the candidates are timed round-robin for ``rounds`` rounds and the
   fastest round counts (other work on the machine only ever adds time).
4. **Sanity.** A candidate that measures more than ``model_tolerance`` (default 3x) faster against
   dense than the cost model allows (a gain no byte count explains: a disturbed dense timing) is
   measured again, and every candidate keeps the faster of its two measurements (other work only adds
   time); if it still disagrees, the measurement is rejected and the format is not chosen for the group
   (``choice["rejected"]``). Slower than modeled is believed: falling back to dense is safe.
5. **Decision.** The fastest sparse format, unless it is slower than the fastest dense variant by more
   than ``-margin`` (``margin=-0.03``: 3% slower is a tie, which goes to the format holding fewer bytes);
   a positive ``margin`` asks a sparse format to win by that much.
6. **Prefill.** For the chosen format, its own batched path (from 17 rows the blocked sparse kernel) and
   "unpack" (rebuild the dense weight, one GEMM) are timed against dense at ``prefill_batch`` rows and at
   four times as many; the faster (its own kernel only when faster by :data:`PREFILL_TIE`, 5%) runs
   batches up to twice ``prefill_batch`` (``prefill``) and above (``prefill_large``). With
   ``keep_dense_for_prefill=True`` a regime where both lose to dense keeps the dense weight for it (more
   memory).
7. **Whole model** (:meth:`AutoBackend.plan_model`): the LM head gets the native GEMV when that is faster;
   then greedy decoding of the converted model, as ``hf_sparsity generate`` runs it (the native step where
   it runs the model), is timed against the dense model it would otherwise be, 32 tokens each in turn for 8
   rounds, the median of the rounds' ratios: the model as it was, or with ``values="int8"`` every layer on
   the int8 dense GEMV (``native_dense``; a sparse int8 product that ties with it one layer at a time can
   still decode slower in the whole step, as the 256-bit bitmask expansion does on AVX2). A converted model
   that decodes slower (with int8 values: less than 5% faster, ``backend.INT8_GEMV_MARGIN``: a near tie
   goes to the GEMV) is not kept: every layer is that dense model's. A verdict that contradicts the layer
   measurements (they predict a clear gain) is measured again first.
8. **Plan cache.** Each group's decision and the whole-model verdict are stored per CPU model, kernel
   build (its sources and instruction-set level: ``HF_SPARSITY_NATIVE_ISA=avx2`` plans apart from the
   native build's), thread count, layer group and options in a JSON file (``$HF_SPARSITY_PLAN_CACHE``,
   default ``plans.json`` next to the compiled kernels) and reused: a later conversion on the same machine
   and build measures nothing and makes the same plan. ``plan_cache=False`` neither reads nor writes it,
   ``plan_cache="refresh"`` measures again and overwrites.

The choice per layer, with every measured and modeled time, is in :attr:`AutoBackend.choice`; for a
whole model, :func:`hf_sparsity.inference.auto_report` prints the per-layer table.


Modules: :mod:`.cost` (candidates, the cost model, building a candidate), :mod:`.planner` (groups,
measurement, decisions), :mod:`.cache` (the plan cache) and :mod:`.backend` (:class:`AutoBackend`,
the LM head and the whole-model check).
"""

from .. import measure  # noqa: F401  (auto.measure: the timings auto runs on)
from . import cost, planner  # noqa: F401  (auto.planner: where a test replaces a timing)
from .backend import AutoBackend
from .cache import PlanCache
from .cost import CALL_MS, CANDIDATES, DENSE, PLAN_KEYS, PLAN_VERSION, decode_bytes
from .planner import PREFILL_TIE, plan_layers

__all__ = [
    "CALL_MS",
    "CANDIDATES",
    "DENSE",
    "PLAN_KEYS",
    "PLAN_VERSION",
    "PREFILL_TIE",
    "AutoBackend",
    "PlanCache",
    "decode_bytes",
    "plan_layers",
]
