"""``benchmarks/gpu_check.py``: the GPU check's runner, its reports, skips and time limits, and its CPU dry
run (the same code paths at tiny shapes), so the check cannot rot between the days a GPU is at hand."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from .conftest import REPO

GPU_DIR = REPO / "benchmarks" / "gpu"


def _load():
    name = "_benchmarks_gpu_check"  # benchmarks/ is no package; dataclasses need the module registered
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "gpu_check.py")
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


def _script(tmp_path, name: str, body: str) -> str:
    """A check script: ``run(report, args)`` under the shared ``common.main``, as the real checks are."""
    path = tmp_path / name
    head = f"import os, sys, time\nsys.path.insert(0, {str(GPU_DIR)!r})\nimport common\n\n"
    tail = "\n\nif __name__ == '__main__':\n    common.main(run, 'test check')\n"
    path.write_text(head + textwrap.dedent(body) + tail)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status  # a zombie has ended; only its exit status is left


def _report(out):
    data = json.loads((out / "report.json").read_text())
    return data, {c["name"]: c for c in data["checks"]}, (out / "report.md").read_text()


def test_missing_package_skips_with_reason_and_the_rest_still_run(tmp_path, monkeypatch, capsys):
    ok = _script(
        tmp_path, "ok.py", "def run(report, args):\n    report.figures['x'] = 1.5\n    return 'pass', 'fine'"
    )
    boom = _script(
        tmp_path, "boom.py", "def run(report, args):\n    raise ValueError('shape too big for memory')"
    )
    monkeypatch.setattr(
        gpu_check,
        "CHECKS",
        (
            gpu_check.Check(
                "x", "needs_pkg", ok, ("no_such_package_hfs",), 10, 10, "needs a missing package"
            ),
            gpu_check.Check("y", "boom", boom, (), 60, 60, "raises"),
            gpu_check.Check("z", "ok", ok, (), 60, 60, "passes"),
        ),
    )
    out = tmp_path / "report"
    rc = gpu_check.main([str(out), "--dry-run"])
    assert rc == 1  # one check failed; the others still ran
    data, by_name, md = _report(out)
    assert by_name["needs_pkg"]["status"] == "skip"
    assert by_name["needs_pkg"]["summary"] == "needs no_such_package_hfs (not installed)"
    assert (
        by_name["boom"]["status"] == "fail"
        and by_name["boom"]["summary"] == "ValueError: shape too big for memory"
    )
    assert by_name["ok"]["status"] == "pass" and by_name["ok"]["figures"] == {"x": 1.5}
    assert data["device"] == "cpu" and data["tiny"] and "torch" in data["env"]["packages"]
    # One printed line per check, and the Markdown table row of each.
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln[:4] in ("PASS", "FAIL", "SKIP")]
    assert [ln.split()[:3] for ln in printed] == [
        ["SKIP", "x", "needs_pkg"],
        ["FAIL", "y", "boom"],
        ["PASS", "z", "ok"],
    ]
    assert "| check | status | seconds | limit | summary |" in md
    assert "| z ok | pass |" in md and "| x needs_pkg | skip |" in md and "- x: 1.5" in md


def test_a_hanging_check_is_killed_with_every_process_it_started(tmp_path):
    """Past its limit the check, its process group and a child in a session of its own (as torchrun's
    workers are) are killed; a result written before the hang is kept as the partial summary."""
    pidfile = tmp_path / "child.pid"
    hang = _script(
        tmp_path,
        "hang.py",
        f"""
        import subprocess
        def run(report, args):
            sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
            child = subprocess.Popen(sleeper, start_new_session=True)
            open({str(pidfile)!r}, "w").write(str(child.pid))
            report.figures["step1_s"] = 0.5
            report.write("pass", "first half done")
            time.sleep(600)
            return "pass", "never"
        """,
    )
    check = gpu_check.Check("h", "hang", hang, (), 4, 4, "hangs")
    t0 = time.perf_counter()
    outcome = gpu_check.run_check(check, tmp_path / "out", "cpu", True, 4)
    assert time.perf_counter() - t0 < 30
    assert outcome.status == "fail"
    assert outcome.summary.startswith("timed out after 4 s") and "first half done" in outcome.summary
    assert outcome.figures == {"step1_s": 0.5}
    pid = int(pidfile.read_text())
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the check's child in its own session was left running"


def test_a_check_that_dies_without_a_result_is_a_failure_with_its_last_line(tmp_path):
    dies = tmp_path / "dies.py"
    dies.write_text(
        "import sys\nprint('loading the model')\nsys.exit('CUDA out of memory at the 7B shape')\n"
    )
    outcome = gpu_check.run_check(
        gpu_check.Check("d", "dies", str(dies), (), 30, 30, ""), tmp_path, "cpu", True, 30
    )
    assert outcome.status == "fail"
    assert outcome.summary == "exited 1 without a result: CUDA out of memory at the 7B shape"


def test_unknown_check_name_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown check"):
        gpu_check.main([str(tmp_path), "--dry-run", "--only", "q"])


def test_the_checks_fit_the_gpu_budget_and_exist():
    # under 8 minutes: the limits, DeepSpeed's install and the start within the budget
    assert sum(c.limit for c in gpu_check.CHECKS) <= gpu_check.BUDGET_S - 15 and gpu_check.BUDGET_S < 480
    assert {c.letter for c in gpu_check.CHECKS} == set("abcdefg")
    assert {c.name for c in gpu_check.CHECKS} == {n for n, _ in DRY_RUN}
    assert all(c.tiny_limit <= 90 for c in gpu_check.CHECKS)  # the dry run: limits that catch hangs
    for c in gpu_check.CHECKS:
        assert (GPU_DIR / c.script).is_file(), c.script


def test_selection_plugin_keeps_gpu_marked_and_cuda_skipping_tests(tmp_path):
    (tmp_path / "test_sel.py").write_text(
        textwrap.dedent(
            """
            import pytest

            @pytest.mark.gpu
            def test_marked(): pass

            @pytest.mark.skipif(True, reason="no CUDA")
            def test_skips_for_cuda(): pass

            @pytest.mark.skipif(True, reason="checks the CPU-only message")
            def test_skips_for_another_reason(): pass

            def test_plain(): pass
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=str(GPU_DIR))
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "cuda_tests", "--co", "-q",
           "-o", "markers=gpu", str(tmp_path / "test_sel.py")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    ids = [ln.split("::")[-1] for ln in proc.stdout.splitlines() if "::" in ln]
    assert ids == ["test_marked", "test_skips_for_cuda"], proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- the dry run, check by check
# Every check's set-up and code path at tiny shapes on the CPU, each through the runner (its own process
# group and limit) as the GPU run takes it; check b in two halves (GPT-2, Llama) to stay well under a minute.
DRY_RUN = [
    ("pytest_gpu", ()),
    ("train", ("--shapes", "gpt2")),
    ("train", ("--shapes", "llama")),
    ("overhead", ()),
    ("fsdp2", ()),
    ("zero3", ()),
    ("inference", ()),
    ("prune", ()),
    ("sparse24", ()),
]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the dry run reads /proc")
@pytest.mark.parametrize("name,args", DRY_RUN, ids=[f"{n}{'-' + a[1] if a else ''}" for n, a in DRY_RUN])
def test_dry_run_check_passes_on_cpu(name, args, tmp_path):
    check = next(c for c in gpu_check.CHECKS if c.name == name)
    missing = gpu_check.missing_packages(check.needs)
    if missing:
        pytest.skip(f"check {name} needs {', '.join(missing)}")
    check = dataclasses.replace(check, args=args)
    o = gpu_check.run_check(check, tmp_path, "cpu", True, 2 * check.tiny_limit)  # limits catch hangs
    assert o.status == "pass", o.summary
    f = o.figures
    if name == "pytest_gpu":  # the gpu tests are selected and all skip, for a CUDA reason
        assert f["skipped"] >= 100 and f["passed"] == 0 and f["failed"] == 0
        assert all("CUDA" in r or "GPU" in r for r in f["skip_reasons"])
        assert (tmp_path / "pytest_gpu" / "junit.xml").is_file()
    elif name == "train":
        shape = args[1]
        for optim in ("adamw_torch_fused", "adamw_torch"):
            key = f"{shape}/{optim}"
            assert f[key]["violations_per_step"] == [0, 0, 0] and f[key]["events"] == ["prune"], key
        assert f[f"{shape}/adamw_torch_fused"]["resume_masks_identical"]
        assert f[f"{shape}/adamw_torch_fused"]["finalize_masked_nonzeros"] == 0
        assert f[f"{shape}/adamw_torch_fused"]["finalize_masked"] > 0
        assert not any(k.startswith("gpt2" if shape == "llama" else "llama") for k in f)
    elif name == "overhead":
        for phase in ("eager", "compiled"):
            assert 6 <= f[phase]["pairs"] <= 8 and f[phase]["median_pair_ratio"] > 0, f[phase]
    elif name == "inference":
        rows = f["parity_vs_cpu_emulator"]
        assert all(rows[b]["max_rel_diff"] <= rows[b]["tol"] for b in ("csr", "masked_dense", "emulator"))
        assert rows["cusparselt"].startswith("skipped: cuSPARSELt needs a CUDA GPU")
        assert rows["semi_structured"].startswith("skipped:")
    elif name == "sparse24":
        assert f["layers"]["backends"] == ["masked_dense"] and len(f["layers"]["rows"]) == 9
        assert all(r["masked_dense_max_rel_diff"] == 0 for r in f["layers"]["rows"].values())
        for regime in ("prefill", "one token"):  # the converted model computes what the pruned one does
            assert f["model"][regime]["max_rel_diff"] <= 0.05
            assert f["model"][regime]["graphed"] == "skipped: CUDA graphs need a CUDA device"
        assert f["model"]["converted_layers"] > 0
        assert any("masked_dense stands in" in n for n in o.notes)


def test_median_spread_is_the_width_of_the_order_statistic_interval():
    sys.path.insert(0, str(GPU_DIR))
    try:
        spec = importlib.util.spec_from_file_location("_check_overhead", GPU_DIR / "check_overhead.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GPU_DIR))
    assert module.median_spread([1.0] * 5) == float("inf")  # too few for a 95% interval
    # n = 100: ranks 50 -+ 9.8 -> sorted[40] and sorted[60] (0-based), by the definition
    ratios = [1.0 + i / 1000 for i in range(100)]
    assert module.median_spread(list(reversed(ratios))) == pytest.approx(ratios[60] - ratios[40])
    # n = 9: 4.5 -+ 2.94 -> ranks 1 and 8
    nine = [0.9, 1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.2, 1.5]
    assert module.median_spread(nine) == pytest.approx(1.5 - 1.0)


def test_sigterm_ends_the_running_check_and_keeps_the_report(tmp_path, monkeypatch):
    """An outer ``timeout`` (SIGTERM) mid-check: the check's processes end, the report says so."""
    import signal
    import threading

    pidfile = tmp_path / "child.pid"
    hang = _script(
        tmp_path,
        "hang.py",
        f"""
        import subprocess
        def run(report, args):
            sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
            child = subprocess.Popen(sleeper, start_new_session=True)
            open({str(pidfile)!r}, "w").write(str(child.pid))
            time.sleep(600)
            return "pass", "never"
        """,
    )
    ok = _script(tmp_path, "ok.py", "def run(report, args):\n    return 'pass', 'fine'")
    Check = gpu_check.Check
    checks = (Check("y", "ok", ok, (), 60, 60, ""), Check("h", "hang", hang, (), 60, 60, ""))
    monkeypatch.setattr(gpu_check, "CHECKS", checks)
    out = tmp_path / "report"

    def stop_when_started():
        deadline = time.time() + 60
        while not pidfile.is_file() and time.time() < deadline:
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_started, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    assert gpu_check.main([str(out), "--dry-run"]) == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    _, by_name, _ = _report(out)
    assert by_name["ok"]["status"] == "pass"
    assert by_name["hang"]["status"] == "fail"
    assert by_name["hang"]["summary"].startswith("interrupted by SIGTERM")
    pid = int(pidfile.read_text())
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
