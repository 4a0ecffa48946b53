"""The wheel holds every file the package reads at run time.

A non-editable install (``pip install .``, a wheel from an index) has only what the wheel holds: a C or
C++ source left out of ``[tool.setuptools.package-data]`` means the native kernels or the C++ custom ops
cannot build there, and the library silently falls back to a slower path. The wheel is built offline
from a copy of the package (``pip wheel --no-deps --no-build-isolation --no-index``) and its file list is
checked against (a) every file in the package folder and (b) every file under the package that the
code opens or hands to a compiler while it imports and builds its kernels (recorded with an audit hook).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_sparsity"
SKIP = {"__pycache__", ".pytest_cache"}


def _package_files() -> set[str]:
    """Every file of the package folder (paths as in a wheel), less bytecode and build outputs."""
    found = set()
    for path in PACKAGE.rglob("*"):
        if path.is_file() and not SKIP & set(path.parts) and path.suffix not in (".pyc", ".so", ".o"):
            found.add(path.relative_to(REPO).as_posix())
    return found


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (an in-tree build would write build/ into the clone)."""
    if not _has_pip():
        pytest.skip("pip is not installed")
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(
        PACKAGE, src / "hf_sparsity", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    )
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run(
        [*cmd, "-q", "-w", str(root / "dist"), str(src)], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        pytest.fail(f"pip wheel failed: {proc.stderr[-2000:]}")
    (found,) = (root / "dist").glob("hf_sparsity-*.whl")
    return found


def _has_pip() -> bool:
    return subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_wheel_holds_every_file_of_the_package(wheel):
    names = _names(wheel)
    missing = sorted(_package_files() - names)
    assert not missing, f"the wheel lacks {missing}: add their pattern to [tool.setuptools.package-data]"
    # the native sources are there by name (a pattern that matched nothing would pass the check above
    # only if the sources were gone from the tree too)
    assert any(n.endswith(".c") for n in names) and any(n.endswith(".cpp") for n in names)


# Run in a fresh interpreter: records every file under the package's folder that Python opens, and every
# file or include folder under it named on a compiler's command line or handed to torch's C++ extension
# builder, while the package is imported whole and its native kernel is built (or found in the kernel
# cache). The C++ ops' build is recorded, not run (a torch extension build takes half a minute).
_RECORD = r"""
import importlib, importlib.util, json, os, pkgutil, sys
root = os.path.dirname(os.path.abspath(importlib.util.find_spec("hf_sparsity").origin))
seen = set()

def under(p):
    try:
        p = os.path.abspath(os.fsdecode(p))
    except TypeError:
        return
    if p.startswith(root + os.sep):
        if os.path.isdir(p):  # an include folder: the compiler may read any file in it
            for d, _, files in os.walk(p):
                seen.update(os.path.join(d, f) for f in files if not f.endswith((".py", ".pyc")))
        elif not p.endswith((".py", ".pyc")):
            seen.add(p)

def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        under(args[0])
    elif event == "subprocess.Popen":
        for a in args[1] or ():
            a = os.fsdecode(a) if isinstance(a, (str, bytes)) else str(a)
            under(a[2:] if a.startswith(("-I", "-L")) else a)

sys.addaudithook(hook)
from torch.utils import cpp_extension

def record_load(name, sources, *args, extra_include_paths=None, **kw):
    for p in [*sources, *(extra_include_paths or ())]:
        if not os.path.exists(p):
            raise FileNotFoundError(p)
        under(p)
    raise RuntimeError("recorded")

cpp_extension.load = record_load
cpp_extension.is_ninja_available = lambda: True
import hf_sparsity
for m in pkgutil.walk_packages(hf_sparsity.__path__, "hf_sparsity."):
    if m.name.endswith("__main__"):  # runs the CLI
        continue
    try:
        importlib.import_module(m.name)
    except ImportError:  # an optional dependency this machine lacks
        pass
from hf_sparsity.backends import _native, ops
native = _native.load() is not None
if native:
    ops.build_cpp_ops()
print(json.dumps({"root": root, "opened": sorted(seen), "native": native, "cpp_error": ops.cpp_ops_error()}))
"""


def _record(pythonpath: Path, cwd: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run(
        [sys.executable, "-c", _RECORD], capture_output=True, text=True, timeout=600, env=env, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_wheel_holds_every_file_the_code_opens(wheel, tmp_path):
    # from the source tree: what the code reads at run time
    got = _record(REPO, tmp_path)
    assert Path(got["root"]) == PACKAGE
    opened = {Path(p).relative_to(REPO).as_posix() for p in got["opened"]}
    if got["native"]:
        assert any(p.endswith(".c") for p in opened), "the hook saw no C source read: is the recorder broken?"
    missing = sorted(opened - _names(wheel))
    assert not missing, f"the code reads {missing}, which the wheel lacks: add them to package-data"

    # installed from the wheel alone: the same kernels build (or load) there
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    installed = _record(site, tmp_path)
    assert Path(installed["root"]) == site / "hf_sparsity"
    assert installed["native"] == got["native"]
    assert installed["cpp_error"] == got["cpp_error"]  # "recorded": every C++ source was found
