"""``emulator``: a reference model of a sparsity-accelerating dataflow machine.

The machine (Cerebras 2022, "Harnessing the Power of Sparsity for Large GPT AI Models": a sparse
GEMM is one AXPY per nonzero weight, and the hardware only does work for nonzero data):

* Weights stream as compressed rows: per nonzero, its value and a 16-bit column
  index (32-bit when ``in_features > 65536``), plus one 32-bit length per row.
  Zero weights are never stored, read, or issued.
* ``Y = X W^T`` is computed as **one AXPY per nonzero** ``w[r, c]``:
  ``Y[:, r] += w[r, c] * X[:, c]``, a vector operation over the batch.
* **Fixed order.** Each output row starts at 0 and accumulates its nonzeros in
  ascending column order: ``Y[:, r] = ((0 + w[r,c1] X[:,c1]) + w[r,c2] X[:,c2]) + ...``.
  Products and sums are done in the accumulator dtype (float32, or float64 with
  ``float64_accumulator=True``; float64 makes the result exactly the float64 sum in
  that order since a float32 x float32 product is exact in float64), then cast to
  the input dtype. The backward passes use the same rule: ``grad X[:, c]`` sums
  ``w[r, c] gY[:, r]`` over ascending ``r`` (one AXPY per nonzero, column-owned), and
  ``grad W[r, c]`` for each nonzero sums ``gY[b, r] X[b, c]`` over ascending ``b``.
* **Cycle model** (:class:`MachineSpec`): ``pes`` processing elements; output row
  ``r`` belongs to PE ``r mod pes`` (columns likewise for ``grad X``). A PE issues one
  AXPY per cycle, ``axpy_width`` lanes wide, so one nonzero costs
  ``ceil(B / axpy_width)`` cycles, plus ``row_overhead`` cycles per row it owns. A
  call takes as long as its busiest PE (no memory stalls, no inter-PE traffic
  modeled). ``dense_cycles`` is the same formula with every weight nonzero, so
  ``dense_cycles / cycles`` is the modeled speedup from sparsity, load imbalance
  included.

The computation is vectorized across rows: rows are sorted by nonzero count, and
step ``k`` performs the ``k``-th AXPY of every row that has one (a prefix of the
sorted rows) as one tensor operation - the same arithmetic, in the same per-row
order, as the scalar description. GPT-2-small layers take well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import BackendCapabilities, SparseBackend, WorkCounters
from .registry import register_backend


@dataclass(frozen=True)
class MachineSpec:
    """The modeled machine: ``pes`` processing elements, each one AXPY of ``axpy_width`` lanes per cycle."""

    pes: int = 64
    axpy_width: int = 8
    row_overhead: int = 0

    def lanes(self, batch: int) -> int:
        """Cycles one AXPY over ``batch`` elements takes on one PE."""
        return max(1, math.ceil(batch / self.axpy_width))


class _Ell:
    """Nonzeros grouped by an owner index (row for Y, column for grad X), ordered for the fixed-order loop.

    ``order`` sorts owners by nonzero count (descending, stable); ``members[i, k]`` is the
    ``k``-th other index of owner ``order[i]`` (ascending); ``flat[i, k]`` the flat position
    in the ``[out, in]`` weight; ``prefix[k]`` how many owners have more than ``k`` nonzeros.
    """

    def __init__(self, owner: torch.Tensor, other: torch.Tensor, flat: torch.Tensor, n_owner: int):
        counts = torch.bincount(owner, minlength=n_owner)
        self.counts = counts
        self.order = torch.sort(counts, descending=True, stable=True).indices
        kmax = int(counts.max()) if owner.numel() else 0
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(n_owner, device=owner.device)
        # position of each nonzero inside its owner's list (owner-major input order assumed)
        start = torch.zeros(n_owner + 1, dtype=torch.int64, device=owner.device)
        torch.cumsum(counts, 0, out=start[1:])
        k = torch.arange(owner.numel(), device=owner.device) - start[owner]
        self.members = torch.zeros(n_owner, kmax, dtype=torch.int64, device=owner.device)
        self.flat = torch.zeros(n_owner, kmax, dtype=torch.int64, device=owner.device)
        self.members[rank[owner], k] = other
        self.flat[rank[owner], k] = flat
        # prefix[k] = owners with more than k nonzeros = n_owner - #(owners with count <= k)
        at_most = torch.cumsum(torch.bincount(counts, minlength=kmax + 1), 0)[:kmax]
        self.prefix = (n_owner - at_most).tolist()


@register_backend
class EmulatorBackend(SparseBackend):
    """Exact reference: one AXPY per nonzero in a fixed order, with work counters and a cycle model.

    Options: ``machine`` (:class:`MachineSpec`), ``float64_accumulator`` (bool, default False).
    Reads the live weight on every call (``capabilities.training``).
    """

    name = "emulator"
    aliases = ("reference", "dataflow")
    capabilities = BackendCapabilities(
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.float64, torch.float16, torch.bfloat16),
        training=True,
        description="reference dataflow machine: one AXPY per nonzero, exact, counts work and cycles",
    )

    def _prepare(self) -> None:
        self.machine: MachineSpec = self.options.get("machine") or MachineSpec()
        self.float64_accumulator = bool(self.options.get("float64_accumulator", False))
        out_f, in_f = self.out_features, self.in_features
        rows, cols = self.mask.bool().nonzero(as_tuple=True)  # row-major: rows ascending, cols ascending
        flat = rows * in_f + cols
        self._rows, self._cols, self._flat = rows, cols, flat
        self._by_row = _Ell(rows, cols, flat, out_f)
        order = torch.argsort(cols * out_f + rows)  # column-major for grad X
        self._by_col = _Ell(cols[order], rows[order], flat[order], in_f)
        self.value_bytes = self.weight.element_size()
        self.index_width = 2 if in_f <= 65536 else 4
        pes = self.machine.pes
        # The modeled machine's figures (read by the cycle model, and by inference/bench for any backend):
        # the busiest PE's nonzeros with rows (forward) or columns (grad X) dealt round-robin.
        self.row_load = self.pe_max_load(self._by_row.counts, pes)
        self.col_load = self.pe_max_load(self._by_col.counts, pes)
        self.rows_per_pe = math.ceil(out_f / pes)
        self.cols_per_pe = math.ceil(in_f / pes)

    @staticmethod
    def pe_max_load(counts: torch.Tensor, pes: int) -> int:
        """Nonzeros of the busiest of ``pes`` PEs when rows with ``counts`` nonzeros are dealt round-robin."""
        if counts.numel() == 0:
            return 0
        owner = torch.arange(counts.numel(), device=counts.device) % pes
        return int(
            torch.zeros(pes, dtype=torch.int64, device=counts.device).index_add_(0, owner, counts).max()
        )

    # ------------------------------------------------------------------ helpers
    def _acc_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if (self.float64_accumulator or dtype == torch.float64) else torch.float32

    def _account(self, phase: str, batch: int, macs: int, load: int, owned: int, owned_dense: int) -> None:
        lanes = self.machine.lanes(batch)
        ov = self.machine.row_overhead
        c = WorkCounters(
            calls=1,
            macs=macs,
            macs_skipped=(self.mask.numel() - self.nnz) * batch,
            weight_bytes=self.nnz * self.value_bytes,
            index_bytes=self.nnz * self.index_width + (self.out_features + 1) * 4,
            cycles=load * lanes + owned * ov,
            dense_cycles=owned * owned_dense * lanes + owned * ov,
        )
        self.counters[phase].add(c)

    def _ell_apply(self, ell: _Ell, values: torch.Tensor, src_t: torch.Tensor, n_owner: int) -> tuple:
        """``out_t[o] = sum_k values[o,k] * src_t[members[o,k]]`` in the fixed order; returns (out_t,
        macs)."""
        batch = src_t.shape[1]
        acc = torch.zeros(n_owner, batch, dtype=src_t.dtype, device=src_t.device)
        macs = 0
        for k, n in enumerate(ell.prefix):
            acc[:n] += values[:n, k, None] * src_t.index_select(0, ell.members[:n, k])
            macs += n * batch
        out = torch.empty_like(acc)
        out[ell.order] = acc
        return out, macs

    def _values(self, ell: _Ell, acc: torch.dtype) -> torch.Tensor:
        return self.weight.detach().reshape(-1)[ell.flat].to(acc)

    # ------------------------------------------------------------------ kernels
    def _forward(self, x2d: torch.Tensor) -> torch.Tensor:
        acc = self._acc_dtype(x2d.dtype)
        yt, macs = self._ell_apply(
            self._by_row, self._values(self._by_row, acc), x2d.t().to(acc), self.out_features
        )
        self._account("forward", x2d.shape[0], macs, self.row_load, self.rows_per_pe, self.in_features)
        return yt.t().to(x2d.dtype)

    def _grad_input(self, gy: torch.Tensor) -> torch.Tensor:
        acc = self._acc_dtype(gy.dtype)
        gxt, macs = self._ell_apply(
            self._by_col, self._values(self._by_col, acc), gy.t().to(acc), self.in_features
        )
        self._account("backward_input", gy.shape[0], macs, self.col_load, self.cols_per_pe, self.out_features)
        return gxt.t().to(gy.dtype)

    def _grad_weight(self, gy: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        acc = self._acc_dtype(gy.dtype)
        g = torch.zeros(self.nnz, dtype=acc, device=gy.device)
        gyr = gy.to(acc).index_select(1, self._rows)
        xc = x2d.to(acc).index_select(1, self._cols)
        for b in range(gy.shape[0]):  # ascending batch order, one multiply-add per nonzero per sample
            g += gyr[b] * xc[b]
        out = torch.zeros(self.out_features * self.in_features, dtype=acc, device=gy.device)
        out[self._flat] = g
        self._account(
            "backward_weight",
            gy.shape[0],
            self.nnz * gy.shape[0],
            self.row_load,
            self.rows_per_pe,
            self.in_features,
        )
        return out.view(self.out_features, self.in_features).to(self.weight.dtype)

    # ------------------------------------------------------------------ reporting
    def modeled_speedup(self, phase: str = "forward") -> float:
        """``dense_cycles / cycles`` accumulated for ``phase`` (nan before the first call)."""
        c = self.counters[phase]
        return c.dense_cycles / c.cycles if c.cycles else float("nan")
