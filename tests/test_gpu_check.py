"""``benchmarks/gpu_check.py``: the GPU check's runner, its reports, skips and time limits, and its CPU dry
run (the same code paths at tiny shapes), so the check cannot rot between the days a GPU is at hand."""

from __future__ import annotations

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
    assert sum(c.limit for c in gpu_check.CHECKS) <= 485  # 9 minutes with the DeepSpeed install and start
    assert {c.letter for c in gpu_check.CHECKS} == set("abcdef")
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


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the dry run reads /proc")
def test_full_dry_run_every_check_passes_on_cpu(tmp_path):
    """Every check's set-up and code path at tiny shapes on the CPU (minutes on a 2-core machine); check a
    collects the gpu-marked tests and they all skip here."""
    out = tmp_path / "report"
    rc = gpu_check.main([str(out), "--dry-run", "--scale", "2"])  # limits catch hangs, not a loaded machine
    _, by_name, _ = _report(out)
    bad = {n: c["summary"] for n, c in by_name.items() if c["status"] != "pass"}
    if importlib.util.find_spec("deepspeed") is None:
        assert by_name["zero3"]["status"] == "skip"
        bad.pop("zero3")
    assert rc == 0 and not bad, bad
    assert set(by_name) == {"pytest_gpu", "train", "overhead", "fsdp2", "zero3", "inference", "prune"}
    a = by_name["pytest_gpu"]  # check a on the CPU: the gpu tests are selected and all skip
    assert a["figures"]["skipped"] >= 100 and a["figures"]["passed"] == 0 and a["figures"]["failed"] == 0
    assert all("CUDA" in r or "GPU" in r for r in a["figures"]["skip_reasons"])
    assert (out / "pytest_gpu" / "junit.xml").is_file()
    train = by_name["train"]["figures"]
    for key in ("gpt2/adamw_torch_fused", "gpt2/adamw_torch", "llama/adamw_torch_fused", "llama/adamw_torch"):
        assert train[key]["violations_per_step"] == [0, 0, 0] and train[key]["events"] == ["prune"]
    assert train["llama/adamw_torch_fused"]["resume_masks_identical"]
    assert train["llama/adamw_torch_fused"]["finalize_masked_nonzeros"] == 0


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
