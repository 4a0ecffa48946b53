"""Every ctypes mirror of a C struct agrees with the C definition, field by field.

The native library is called through ``ctypes`` with structures built in Python (``_native.Prepared``
for ``prepared_t``, ``native_step._Layer`` / ``_Decoder`` for ``hfs_layer_t`` / ``hfs_decoder_t``,
``sampling._Sampler`` for ``hfs_sampler_t``). Nothing in C or Python checks that the two declarations
agree: a field added, removed, retyped or reordered on one side only makes the kernels read the wrong
bytes. The library itself reports each struct's
``sizeof`` and every field's name, ``offsetof`` and size (``hfs_struct_size`` / ``hfs_struct_field``,
as the compiler laid them out); these tests compare that with ctypes' ``sizeof`` and ``Field.offset`` /
``Field.size`` of the mirror.
"""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from hf_sparsity.backends import _native
from hf_sparsity.inference import native_step, sampling

PACKAGE = Path(__file__).resolve().parents[1] / "hf_sparsity"

# C struct name -> its ctypes mirror
MIRRORS = {
    "prepared_t": _native.Prepared,
    "hfs_layer_t": native_step._Layer,
    "hfs_decoder_t": native_step._Decoder,
    "hfs_sampler_t": sampling._Sampler,
}


def _c_name(type_name: str, py_name: str) -> str:
    """The C field a mirror's field stands for (the mirrors name some fields differently)."""
    if type_name == "prepared_t":
        return {"in_features": "in", "values": "v"}.get(py_name, py_name)
    if type_name == "hfs_layer_t" and py_name.endswith("_proj"):  # p_q_proj -> q, b_q_proj -> bq
        kind, proj = py_name[:2], py_name[2 : -len("_proj")]
        return proj if kind == "p_" else "b" + proj
    return py_name


@pytest.fixture(scope="module")
def lib():
    lib = _native.load()
    if lib is None:
        pytest.skip(f"native kernel unavailable: {_native.error()}")
    lib.hfs_struct_size.argtypes, lib.hfs_struct_size.restype = [ctypes.c_char_p], ctypes.c_int64
    i64p = ctypes.POINTER(ctypes.c_int64)
    name_p = ctypes.POINTER(ctypes.c_char_p)
    lib.hfs_struct_field.argtypes = [ctypes.c_char_p, ctypes.c_int, name_p, i64p, i64p]
    lib.hfs_struct_field.restype = ctypes.c_int
    return lib


def _c_layout(lib, type_name: str) -> tuple[int, list[tuple[str, int, int]]]:
    """(sizeof, [(field, offsetof, sizeof field)] in declaration order) as the C library reports them."""
    size = lib.hfs_struct_size(type_name.encode())
    fields = []
    name, offset, fsize = ctypes.c_char_p(), ctypes.c_int64(), ctypes.c_int64()
    while lib.hfs_struct_field(type_name.encode(), len(fields), name, offset, fsize):
        fields.append((name.value.decode(), offset.value, fsize.value))
    return size, fields


def _disagreements(lib, type_name: str, mirror: type[ctypes.Structure]) -> list[str]:
    size, c_fields = _c_layout(lib, type_name)
    out = []
    if size != ctypes.sizeof(mirror):
        out.append(f"sizeof: C {size}, ctypes {ctypes.sizeof(mirror)}")
    py_fields = [f[0] for f in mirror._fields_]
    if len(py_fields) != len(c_fields):
        out.append(f"{len(c_fields)} fields in C, {len(py_fields)} in the mirror")
    for py_name, (c_name, offset, fsize) in zip(py_fields, c_fields):
        field = getattr(mirror, py_name)
        if _c_name(type_name, py_name) != c_name:
            out.append(f"field {py_name!r} stands where C has {c_name!r}")
        if (field.offset, field.size) != (offset, fsize):
            out.append(
                f"{c_name}: C offset {offset} size {fsize}, ctypes offset {field.offset} size {field.size}"
            )
    return out


@pytest.mark.parametrize("type_name", sorted(MIRRORS))
def test_the_c_table_lists_every_field(lib, type_name):
    # the layout table in C is written by hand too: its fields must tile the struct (no field left out
    # between two listed ones or after the last, beyond alignment padding)
    size, fields = _c_layout(lib, type_name)
    assert size > 0 and fields, f"the library does not report {type_name}"
    end = 0
    for name, offset, fsize in fields:
        assert end <= offset < end + 8, f"{type_name}: a field missing from the table before {name!r}"
        end = offset + fsize
    assert size - 8 < end <= size, f"{type_name}: a field missing from the table after {fields[-1][0]!r}"


@pytest.mark.parametrize("type_name", sorted(MIRRORS))
def test_each_ctypes_mirror_matches_the_c_struct(lib, type_name):
    problems = _disagreements(lib, type_name, MIRRORS[type_name])
    mirror = MIRRORS[type_name].__qualname__
    assert not problems, f"{mirror} disagrees with {type_name}: " + "; ".join(problems)


def test_a_wrong_mirror_is_caught(lib):
    # the comparison itself: a mirror with two same-typed fields swapped, one retyped, one dropped
    fields = list(_native.Prepared._fields_)
    swapped = [fields[1], fields[0], *fields[2:]]
    retyped = [*fields[:-1], ("vbf16", ctypes.c_int32)]
    for wrong in (swapped, retyped, fields[:-1]):
        mirror = type("Wrong", (ctypes.Structure,), {"_fields_": wrong})
        assert _disagreements(lib, "prepared_t", mirror)


def test_every_ctypes_structure_of_the_package_is_checked():
    # a new ctypes mirror anywhere in the package must be added to MIRRORS (and its C struct to the
    # library's layout table, hfs_struct_field)
    found = set()
    for path in PACKAGE.rglob("*.py"):
        for name in re.findall(r"^class (\w+)\((?:ctypes\.)?(?:Structure|Union)\)", path.read_text(), re.M):
            found.add(name)
    assert found == {m.__name__ for m in MIRRORS.values()}
