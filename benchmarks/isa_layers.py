"""One decoding step's products (batch 1) at SmolLM2-135M's layer shapes, the kernel library built at several
instruction-set levels (``HF_SPARSITY_NATIVE_ISA``) side by side in one process.

    python benchmarks/isa_layers.py --threads 2                      # avx2 vs native
    python benchmarks/isa_layers.py --isa avx2,avx2-vnni,native --rounds 9
    python benchmarks/isa_layers.py --lib base=/path/hfs_spmv.so     # + a library built elsewhere

Shapes (OUTxIN): q / o 576x576, k / v 192x576, gate / up 1536x576, down 576x1536, the LM head 49152x576;
each as bitmask at 50% and 70% (random masks) and dense (``native_dense``), with fp32 values and with int8
values and int8 activations (value type 3: the int8 x int8 products); with ``--gather``, the bitmask rows
with fp32 values again on the gathered layout (``layout="gather"``, op ``bitmask_gather``). Each library's
``hfs_run`` is called on the same packed tensors (one packing serves every level); the weights are cycled
through copies filling 64 MB, so every call reads them from memory (past a 32 MB last-level cache), as a
decoding step does. Rounds
are interleaved (every row on every library in eight short turns per round, libraries alternating); the
table gives the median microseconds per product, the GB/s of weight bytes that reads, and each library's
time over the first one's. Every library's output is checked against the first's before timing. Timings on a
shared machine are noisy: compare ratios within a run. A second table sets each sparse row against the dense
row of its shape and values: its bytes over the dense bytes, and per library its time over the dense time and
that over the bytes ratio (1.00: it reads its bytes as fast as the dense kernel, bound by memory as it).
``--copy-mb 1`` keeps the copies in cache instead (what the kernel's instructions cost).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time

import torch

from hf_sparsity.backends import _native, get_backend
from hf_sparsity.import_utils import c_compiler

SHAPES = {
    "q/o": (576, 576),
    "k/v": (192, 576),
    "gate/up": (1536, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}
OPS = {"bitmask": 0, "dense": 2, "gather": 5}
COPY_BYTES = 64 << 20
BURSTS = 8  # turns per library per row per round


def build(level: str) -> str:
    """The library's path built at ``level`` (cached as :func:`_native.load` caches it)."""
    old = os.environ.get(_native.ISA_ENV)
    os.environ[_native.ISA_ENV] = level
    try:
        return _native._build(c_compiler())
    finally:
        if old is None:
            del os.environ[_native.ISA_ENV]
        else:
            os.environ[_native.ISA_ENV] = old


def open_lib(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    vp, i64, ci = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.hfs_run.argtypes = [ci, i64, i64, i64, ci, vp, vp, vp, ci, vp, vp, i64, vp]
    lib.hfs_run.restype = None
    lib.hfs_isa.restype = ci
    return lib


def packed(
    fmt: str,
    rows: int,
    in_f: int,
    density: float,
    values: str,
    g: torch.Generator,
    copy_bytes: int = COPY_BYTES,
) -> list[dict]:
    """Copies of one packed weight (random weight and mask) filling COPY_BYTES: the kernel arguments of
    each."""
    mask = (torch.rand(rows, in_f, generator=g) < density).to(torch.uint8)
    opts = {"kernel": "native"}
    if values == "int8":
        opts.update(values="int8", activations="int8")
    if fmt == "gather":
        opts.update(layout="gather")
    w = torch.randn(rows, in_f, generator=g) / in_f**0.5
    b = get_backend("native_dense" if fmt == "dense" else "bitmask").from_dense(w, mask, **opts)
    meta = b.gather if fmt == "gather" else getattr(b, "bits", None)
    one = {"values": b.values, "meta": meta, "rowptr": getattr(b, "rowptr", None)}
    n = max(1, -(-copy_bytes // b.storage_bytes))
    out = [{k: None if t is None else t.clone() for k, t in one.items()} for _ in range(n)]
    for a in out:
        a["bytes"] = b.storage_bytes
    return out


def call(lib, op: int, rows: int, in_f: int, a: dict, vt: int, x, y, nthreads: int) -> None:
    lib.hfs_run(
        op, rows, in_f, _native.chunk_rows(rows, nthreads), nthreads,
        None if a["rowptr"] is None else a["rowptr"].data_ptr(),
        None if a["meta"] is None else a["meta"].data_ptr(),
        a["values"].data_ptr(), vt, x.data_ptr(), y.data_ptr(), 1, None,
    )  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", default="avx2,native", help="levels built (HF_SPARSITY_NATIVE_ISA values)")
    p.add_argument("--lib", action="append", default=[], help="NAME=path.so: a library built elsewhere")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--ms", type=float, default=20.0, help="milliseconds of calls per row per round")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--levels", default="0.5,0.7,dense", help="bitmask densities' sparsities, and dense")
    p.add_argument("--values", default="fp32,int8")
    p.add_argument("--gather", action="store_true", help="the fp32 bitmask rows on the gathered layout too")
    p.add_argument(
        "--copy-mb", type=float, default=COPY_BYTES / 2**20,
        help="MiB of weight copies cycled through (past the last-level cache: read from memory; 1: in cache)",
    )  # fmt: skip
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    copy_bytes = int(args.copy_mb * 2**20)
    libs = {lv: open_lib(build(lv)) for lv in args.isa.split(",") if lv}
    for spec in args.lib:
        name, _, path = spec.partition("=")
        libs[name] = open_lib(path)
    names = list(libs)
    g = torch.Generator().manual_seed(0)
    rows_spec = []
    for shape in args.shapes.split(","):
        r, c = SHAPES[shape]
        for level in args.levels.split(","):
            fmts = ["dense"] if level == "dense" else ["bitmask"] + (["gather"] if args.gather else [])
            for values in args.values.split(","):
                for fmt in fmts if values == "fp32" else fmts[:1]:
                    copies = packed(
                        fmt, r, c, 1.0 if fmt == "dense" else 1 - float(level), values, g, copy_bytes
                    )
                    label = f"{shape} {r}x{c} {'dense' if fmt == 'dense' else f'{float(level):.0%}'} {values}"
                    label += " gather" if fmt == "gather" else ""
                    rows_spec.append((label, OPS[fmt], r, c, copies, 3 if values == "int8" else 0))
    x = torch.randn(1, max(c for _, c in SHAPES.values()), generator=g)
    for label, op, r, c, copies, vt in rows_spec:  # every library gives the first one's result
        xs, ys = x[:, :c].contiguous(), [torch.empty(1, r) for _ in names]
        for lib, y in zip(libs.values(), ys):
            call(lib, op, r, c, copies[0], vt, xs, y, args.threads)
        for name, y in zip(names[1:], ys[1:]):
            torch.testing.assert_close(
                y, ys[0], rtol=1e-4, atol=1e-4, msg=lambda m, n=name, lb=label: f"{lb} {n}: {m}"
            )
    times = {(lbl, n): [] for lbl, *_ in rows_spec for n in names}
    # one thread: the calling thread's CPU time (the time it ran: a shared machine's other processes left
    # out); more: wall time
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for rnd in range(args.rounds):
        for label, op, r, c, copies, vt in rows_spec:
            xs, y = x[:, :c].contiguous(), torch.empty(1, r)
            spent, calls = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
            for burst in range(BURSTS):  # short turns, the first library rotating: alike conditions
                for i in range(len(names)):
                    name = names[(i + burst + rnd) % len(names)]
                    lib, n, k, t0 = libs[name], 0, calls[name] % len(copies), clock()
                    while True:
                        call(lib, op, r, c, copies[k], vt, xs, y, args.threads)
                        n, k = n + 1, (k + 1) % len(copies)
                        if n % 4 == 0 and clock() - t0 > args.ms / 1e3 / BURSTS:
                            break
                    spent[name] += clock() - t0
                    calls[name] += n
            for name in names:
                times[(label, name)].append(spent[name] / calls[name] * 1e6)
    lib_isa = {n: _native.ISA_NAMES[lib.hfs_isa()] for n, lib in libs.items()}
    print(f"threads {args.threads}, {args.rounds} rounds, torch {torch.__version__}; libraries: "
          + ", ".join(f"{n} ({lib_isa[n]})" for n in names))  # fmt: skip
    head = f"{'product':32}" + "".join(f"{n + ' us':>12}{'GB/s':>7}" for n in names)
    head += "".join(f"{n + '/' + names[0]:>14}" for n in names[1:])
    print(head)
    for label, _, _, _, copies, _ in rows_spec:
        med = {n: statistics.median(times[(label, n)]) for n in names}
        line = f"{label:32}" + "".join(
            f"{med[n]:12.1f}{copies[0]['bytes'] / med[n] / 1e3:7.1f}" for n in names
        )
        line += "".join(f"{med[n] / med[names[0]]:14.2f}" for n in names[1:])
        print(line)
    # each sparse row against the dense row of its shape and values: a kernel bound by memory reads its
    # bytes as fast as the dense kernel, so its time ratio equals its bytes ratio (t/bytes 1.00)
    dense = {
        (lb.split()[0], lb.split()[3]): copies[0]["bytes"] for lb, *_, copies, _ in rows_spec if "dense" in lb
    }
    pairs = []
    for label, _, _, _, copies, _ in rows_spec:
        shape, _, level, values, *_ = label.split()
        d = next(
            (lb for lb, *_ in rows_spec if lb.split()[0] == shape and lb.split()[2:4] == ["dense", values]),
            None,
        )
        if level != "dense" and d is not None:
            pairs.append((label, d, copies[0]["bytes"] / dense[(shape, values)]))
    if pairs:
        print("\nagainst dense (same shape, values): bytes ratio; per library time ratio, time / bytes ratio")
        print(f"{'product':32}{'bytes':>7}" + "".join(f"{n + ' time':>14}{'t/bytes':>8}" for n in names))
        for label, d, br in pairs:
            tr = {n: statistics.median(times[(label, n)]) / statistics.median(times[(d, n)]) for n in names}
            print(f"{label:32}{br:7.3f}" + "".join(f"{tr[n]:14.3f}{tr[n] / br:8.2f}" for n in names))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
