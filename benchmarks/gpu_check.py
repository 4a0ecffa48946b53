"""Every GPU check of the library in one command: one line per check, a JSON and a Markdown report.

    python benchmarks/gpu_check.py OUT_DIR                # on a CUDA machine: the real shapes
    python benchmarks/gpu_check.py OUT_DIR --dry-run      # CPU, tiny shapes, tiny limits: same code paths
    python benchmarks/gpu_check.py OUT_DIR --only b,c     # some checks (by letter or name)

Each check (``benchmarks/gpu/check_*.py``) runs in its own process group with its own time limit,
so a hang or a crash costs that check only; the report is rewritten after every check, so a run
cut short still leaves one. A check whose packages are missing is skipped with the reason.
DeepSpeed is installed from ``wheels/`` (``make gpu-wheels``) with ``--no-index`` when it is missing
and the folder is there. See docs/gpu_check.md.

Checks (limits in seconds on the GPU, set from the times the checks took on an H100; with DeepSpeed's
install the run stays under 8 minutes):
  a  pytest_gpu   the tests marked ``gpu`` and every test that skips without CUDA
  b  train        Trainer, bf16, GPT-2-small and a Llama shape: enforcement after every step (fused and
                  foreach AdamW), a prune event, resume with bit-identical masks, convert --finalize
  c  overhead     the callback's step-time cost, interleaved pairs until the median's spread is under
                  the 2% judged, eager and torch.compile (goal <= 1.02)
  d  fsdp2        accelerate launch with recipes/configs/fsdp2_gpu.yaml, one process
  d  zero3        accelerate launch with recipes/configs/zero3.yaml, one process
  e  inference    csr / masked_dense / semi_structured / cusparselt against the emulator
  f  prune        hf_sparsity prune --device cuda vs cpu (SparseGPT, Wanda, streaming) on a 2-block Llama
  g  sparse24     cusparselt and semi_structured against dense bf16 on Llama-7B layers (1 to 2048
                  tokens); a 2:4 ~1B Llama's prefill through sparsify_for_inference(model, "auto")
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "benchmarks" / "gpu"
WHEELS = REPO / "wheels"
PACKAGES = ("torch", "transformers", "accelerate", "peft", "safetensors", "numpy", "pytest", "deepspeed")


@dataclass(frozen=True)
class Check:
    letter: str
    name: str
    script: str
    needs: tuple[str, ...]  # import names
    limit: int  # seconds on the GPU
    tiny_limit: int  # seconds in the CPU dry run
    what: str
    args: tuple[str, ...] = ()  # more arguments for the script


CHECKS = (
    Check("a", "pytest_gpu", "check_pytest.py", ("pytest",), 55, 60, "tests marked gpu / skipping for CUDA"),
    Check("b", "train", "check_train.py", ("accelerate", "safetensors"), 70, 90, "Trainer bf16 end to end"),
    Check("c", "overhead", "check_overhead.py", (), 95, 60, "callback step-time overhead"),
    Check("d", "fsdp2", "check_launch.py", ("accelerate",), 60, 60, "accelerate launch, fsdp2_gpu.yaml"),
    Check("d", "zero3", "check_launch.py", ("accelerate", "deepspeed"), 45, 90, "accelerate launch, zero3"),
    Check("e", "inference", "check_inference.py", (), 25, 60, "backends vs emulator"),
    Check("f", "prune", "check_prune.py", ("tokenizers", "safetensors"), 55, 60, "prune: cuda vs cpu"),
    Check("g", "sparse24", "check_sparse24.py", (), 50, 60, "2:4 vs dense: layers, Llama prefill"),
)  # fmt: skip
ALWAYS = ("torch", "transformers", "numpy")
MARKER = "HF_SPARSITY_GPU_CHECK"
BUDGET_S = 470  # the whole run on the GPU, DeepSpeed's install included: under 8 minutes
INSTALL_S = 90  # per pip step; building DeepSpeed's source distribution took 39 s on a 2-core CPU


@dataclass
class Outcome:
    letter: str
    name: str
    status: str  # pass / fail / skip
    summary: str
    seconds: float = 0.0
    limit: int = 0
    figures: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


def missing_packages(needs: tuple[str, ...]) -> list[str]:
    return [p for p in (*ALWAYS, *needs) if importlib.util.find_spec(p) is None]


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in PACKAGES:
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = "missing"
    return out


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    env["packages"] = versions()
    env["cuda_available"] = torch.cuda.is_available()
    if device.startswith("cuda") and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["gpu"] = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}"
        env["cuda"] = torch.version.cuda
        try:
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            env["driver"] = f"unknown ({type(e).__name__})"
    return env


def install_from_wheels(wheels: Path, log: list[str]) -> None:
    """Install DeepSpeed from ``wheels`` (``download_wheels.sh``) with ``--no-index`` when it is missing.

    DeepSpeed comes as its source distribution, built here against this machine's torch
    (``--no-build-isolation``: setuptools and wheel first, from the same folder, if missing).
    """
    if importlib.util.find_spec("deepspeed") is not None or not wheels.is_dir():
        return
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels)]
    build = [p for p in ("setuptools", "wheel") if importlib.util.find_spec(p) is None]
    steps = ([build] if build else []) + [["--no-build-isolation", "deepspeed"]]
    for args in steps:
        try:
            proc = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=INSTALL_S)
        except subprocess.TimeoutExpired:
            log.append(f"pip install {' '.join(args)} from {wheels}: timed out after {INSTALL_S} s")
            return
        if proc.returncode:
            log.append(f"pip install {' '.join(args)} from {wheels} FAILED: {proc.stderr.strip()[-300:]}")
            return
    importlib.invalidate_caches()
    log.append(f"installed deepspeed from {wheels} (--no-index)")


def run_check(check: Check, out: Path, device: str, tiny: bool, limit: int) -> Outcome:
    """The check's script in its own process group, killed with the group when it runs past ``limit``."""
    folder = out / check.name
    folder.mkdir(parents=True, exist_ok=True)
    result = folder / "result.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / check.script), "--out", str(folder), "--device", device, *check.args]
    if tiny:
        cmd.append("--tiny")
    if check.script == "check_launch.py":
        cmd += ["--backend", check.name, "--launch-timeout", str(max(limit - 15, 5))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    marker = env[MARKER] = uuid.uuid4().hex  # every process this check starts inherits it
    if tiny:  # tiny shapes gain nothing from threads; on a small shared machine they only contend
        env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = None
        finally:
            kill_group(proc)  # whatever the check left in its group (compile workers, pytest)
            swept = sweep(marker)  # and in sessions of their own (torchrun's workers)
    seconds = round(time.perf_counter() - t0, 1)
    outcome = Outcome(check.letter, check.name, "fail", "", seconds, limit)
    if swept:
        outcome.notes.append(f"killed {swept} leftover processes of this check")
    if result.is_file():
        r = json.loads(result.read_text())
        outcome.status, outcome.summary = r["status"], r["summary"]
        outcome.figures, outcome.notes = r.get("figures", {}), r.get("notes", []) + outcome.notes
    if rc is None:
        partial = f"; {outcome.summary}" if outcome.summary else ""
        outcome.status = "fail"
        outcome.summary = f"timed out after {limit} s (processes killed){partial}"
    elif not result.is_file():
        tail = (folder / "log.txt").read_text(errors="replace").strip().splitlines()[-1:] or [""]
        outcome.summary = f"exited {rc} without a result: {tail[0][:200]}"
    return outcome


def kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            try:  # the leader is gone; its children may not be
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return


def sweep(marker: str) -> int:
    """SIGKILL every process still carrying this check's marker in its environment (Linux ``/proc``)."""
    killed = 0
    needle = f"{MARKER}={marker}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
        except (OSError, ValueError):
            continue  # gone, or not ours to read
    return killed


def line(o: Outcome) -> str:
    return f"{o.status.upper():<4}  {o.letter} {o.name:<11} {o.seconds:6.1f} s  {o.summary}"


def write_reports(out: Path, header: dict, outcomes: list[Outcome]) -> None:
    data = {**header, "checks": [asdict(o) for o in outcomes]}
    tmp = out / "report.json.tmp"
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, out / "report.json")
    md = ["# GPU check", ""]
    md.append(f"- command: `{header['command']}`")
    md.append(
        f"- device: {header['env'].get('gpu', header['device'])}"
        + (" (tiny shapes)" if header["tiny"] else "")
    )
    for k in ("driver", "cuda", "python", "platform"):
        if k in header["env"]:
            md.append(f"- {k}: {header['env'][k]}")
    md.append("- packages: " + ", ".join(f"{k} {v}" for k, v in header["env"]["packages"].items()))
    for entry in header["setup"]:
        md.append(f"- set-up: {entry}")
    md.append(f"- started {header['started']}, wall {header['wall_s']:.0f} s")
    md += ["", "| check | status | seconds | limit | summary |", "|---|---|---:|---:|---|"]
    for o in outcomes:
        summary = o.summary.replace("|", "\\|").replace("\n", " ")
        md.append(f"| {o.letter} {o.name} | {o.status} | {o.seconds:.1f} | {o.limit} | {summary} |")
    for o in outcomes:
        if o.figures or o.notes:
            md += ["", f"## {o.letter} {o.name}", ""]
            md += [f"- {k}: {json.dumps(v, default=str)}" for k, v in o.figures.items()]
            md += [f"- {n}" for n in o.notes]
    tmp = out / "report.md.tmp"
    tmp.write_text("\n".join(md) + "\n")
    os.replace(tmp, out / "report.md")


def select(only: str) -> list[Check]:
    if not only:
        return list(CHECKS)
    keys = {k.strip() for k in only.split(",") if k.strip()}
    chosen = [c for c in CHECKS if c.letter in keys or c.name in keys]
    unknown = keys - {c.letter for c in CHECKS} - {c.name for c in CHECKS}
    if unknown or not chosen:
        names = ", ".join(f"{c.letter}/{c.name}" for c in CHECKS)
        sys.exit(f"gpu_check: unknown check {sorted(unknown)}; pick from {names}.")
    return chosen


class Interrupted(Exception):
    """SIGTERM or SIGINT (an outer ``timeout``, the lease ending, Ctrl-C) while a check runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the checks; on SIGTERM / SIGINT end the running check's processes and keep the report."""
    previous = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(argv)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", help="report folder (report.json, report.md, one sub-folder per check)")
    ap.add_argument("--device", help="cuda (default where visible) or cpu")
    ap.add_argument("--dry-run", action="store_true", help="--device cpu --tiny: every check's path, tiny")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and the tiny time limits")
    ap.add_argument("--only", default="", help="comma-separated letters or names, e.g. a,b or zero3")
    ap.add_argument("--budget", type=float, help=f"run's seconds (default {BUDGET_S}; tiny: limits' sum)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every check's time limit")
    ap.add_argument("--list", action="store_true", help="list the checks, their limits and needs; run none")
    ap.add_argument("--wheels", default=str(WHEELS), help="folder of pre-downloaded wheels (default wheels/)")
    a = ap.parse_args(argv)
    if a.list:
        for c in CHECKS:
            needs = ", ".join((*ALWAYS, *c.needs))
            limits = f"{c.limit:>4} s (tiny {c.tiny_limit:>3} s)"
            print(f"{c.letter} {c.name:<11} {limits}  {c.what}; needs {needs}")
        return 0
    if not a.out:
        ap.error("give the report folder, e.g. gpu_report")
    import torch

    device = "cpu" if a.dry_run else a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tiny = a.tiny or a.dry_run or device == "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(
            "gpu_check: --device cuda but torch sees no CUDA device; run with --dry-run on a CPU machine."
        )
    budget = a.budget or (sum(c.tiny_limit for c in CHECKS) * a.scale if tiny else BUDGET_S)
    t0 = time.perf_counter()  # the budget counts the install too
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    setup: list[str] = []
    install_from_wheels(Path(a.wheels), setup)
    header = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device": device,
        "tiny": tiny,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "env": environment(device),
        "setup": setup,
        "wall_s": 0.0,
    }
    print(f"gpu_check on {header['env'].get('gpu', device)}{' (tiny shapes)' if tiny else ''} -> {out}")
    print("packages: " + ", ".join(f"{k} {v}" for k, v in header["env"]["packages"].items()))
    for entry in setup:
        print(f"set-up: {entry}")
    outcomes: list[Outcome] = []
    interrupted: Interrupted | None = None
    for check in select(a.only):
        left = budget - (time.perf_counter() - t0)
        limit = int(min((check.tiny_limit if tiny else check.limit) * a.scale, left))
        missing = missing_packages(check.needs)
        if missing:
            o = Outcome(check.letter, check.name, "skip", f"needs {', '.join(missing)} (not installed)")
        elif limit < 5:
            o = Outcome(check.letter, check.name, "skip", f"no time left in the {budget:.0f} s budget")
        else:
            try:
                o = run_check(check, out, device, tiny, limit)
            except Interrupted as stop:  # the check's processes are gone (run_check's finally)
                o = Outcome(check.letter, check.name, "fail", f"interrupted by {stop} (processes killed)")
                interrupted = stop
        outcomes.append(o)
        print(line(o), flush=True)
        header["wall_s"] = time.perf_counter() - t0
        write_reports(out, header, outcomes)
        if interrupted is not None:
            print(f"stopped by {interrupted}; reports: {out / 'report.md'}", flush=True)
            return 128 + interrupted.signum
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skip")}
    tally = f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
    print(f"{tally} in {header['wall_s']:.0f} s")
    print(f"reports: {out / 'report.md'}, {out / 'report.json'}")
    return 1 if counts["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
