"""Check a: the tests marked ``gpu`` and every test that skips for want of CUDA, run here.

On the GPU: the whole ``tests/`` folder is collected and the plugin ``cuda_tests.py`` keeps those
tests; every one must pass (a skip on a CUDA device is a failure: the test did not run). In the dry
run (CPU): only the files that mention CUDA are collected, and every kept test must skip cleanly.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import common


def files(tiny: bool) -> list[str]:
    if not tiny:
        return ["tests"]
    tests = common.REPO / "tests"
    keep = []
    for f in sorted(tests.glob("test_*.py")):
        text = f.read_text(encoding="utf-8").lower()
        if "cuda" in text or "mark.gpu" in text:
            keep.append(str(f.relative_to(common.REPO)))
    return keep


def parse_junit(path) -> dict:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (
                    (child.get("message") or "").strip().splitlines()[0][:200] if child.get("message") else ""
                )
                break
        cases.append(
            {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "reason": reason}
        )
    return {"cases": cases}


def run(report: common.Report, args) -> tuple[str, str]:
    junit = report.out / "junit.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(common.REPO / "benchmarks" / "gpu"), str(common.REPO), env.get("PYTHONPATH", "")]
    )
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run: what a machine without CUDA collects
    has_timeout = importlib.util.find_spec("pytest_timeout") is not None  # not on every GPU machine
    per_test = ["--timeout", "120"] if has_timeout else []
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "cuda_tests", "-q", "-rs",
           f"--junitxml={junit}", *per_test, *files(args.tiny)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=common.REPO, env=env, capture_output=True, text=True)
    (report.out / "pytest.txt").write_text(proc.stdout + proc.stderr)
    if not junit.is_file():
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        return "fail", f"pytest exited {proc.returncode} without a report: {tail[0][:200]}"
    cases = parse_junit(junit)["cases"]
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
    report.figures.update(counts)
    bad = [c for c in cases if c["outcome"] in ("failed", "error")]
    report.figures["failed_tests"] = [f"{c['test']}: {c['reason']}" for c in bad][:20]
    skips = sorted({c["reason"] for c in cases if c["outcome"] == "skipped"})
    report.figures["skip_reasons"] = skips[:10]
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v) or "no tests selected"
    if not cases:
        return "fail", "no test was selected (the gpu marker or the CUDA skips are gone?)"
    if bad:
        return "fail", f"{summary}; first: {bad[0]['test']}"
    if args.device.startswith("cuda") and counts["skipped"]:
        return "fail", f"{summary}: tests skipped on a CUDA device ({skips[0] if skips else '?'})"
    if args.device == "cpu" and counts["passed"]:
        return "fail", f"{summary}: tests meant for CUDA ran on the CPU"
    return "pass", summary


if __name__ == "__main__":
    common.main(run, __doc__)
