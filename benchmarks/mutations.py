"""Mutation check: put in, one at a time, bugs the suite must catch, and run the tests that should.

    python benchmarks/mutations.py              # every mutation
    python benchmarks/mutations.py finalize     # the ones whose name contains "finalize"

Each mutation is a text substitution applied to a temporary copy of the repository (the
working tree as git sees it); the listed test files then run against that copy. A
mutation is *caught* when at least one test fails. Not part of the CI suite: it runs the
relevant tests once per mutation (a few minutes in all).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file, old text, new text); old must occur exactly once
    tests: tuple[str, ...]


PRUNING_TESTS = ("tests/test_pruning.py", "tests/test_pruning_definitions.py")
LORA_TESTS = ("tests/test_lora.py",)

MUTATIONS = (
    Mutation(
        "grads-masked-late",
        "gradients masked only in before_step (after clipping and DDP all-reduce), not as produced",
        (("hf_sparsity/enforcement.py", "if is_dtensor(p) or not p.requires_grad:", "if True:"),),
        ("tests/test_enforcement.py",),
    ),
    Mutation(
        "reader-nonzeros",
        "the mask reader no longer checks nonzero counts",
        (("hf_sparsity/storage/masks_file.py", 'if nnz != info[name]["nonzeros"]:', "if False:"),),
        ("tests/test_serialization.py",),
    ),
    Mutation(
        "reader-format",
        "the mask reader no longer checks the format name and version",
        (
            ("hf_sparsity/storage/masks_file.py", 'if meta.get("format") != MASK_FORMAT_NAME:', "if False:"),
            ("hf_sparsity/storage/masks_file.py", "if version > MASK_FORMAT_VERSION:", "if False:"),
        ),
        ("tests/test_serialization.py",),
    ),
    Mutation(
        "reader-metadata-vs-tensors",
        "the mask reader no longer checks that metadata and tensors agree",
        (("hf_sparsity/storage/masks_file.py", 'if set(meta["tensors"]) != keys:', "if False:"),),
        ("tests/test_serialization.py",),
    ),
    Mutation(
        "finalize-no-mask",
        "convert --finalize no longer applies the mask",
        (("hf_sparsity/export/finalize.py", "return t * m.to(t.dtype)", "return t"),),
        ("tests/test_finalize.py",),
    ),
    Mutation(
        "after-step-no-rezero",
        "after_step no longer re-zeroes masked weights",
        (
            (
                "hf_sparsity/enforcement.py",
                "        for name, p in self._params.items():\n"
                "            local(p).mul_(self._dev_masks[name])\n"
                "        self._mask_gathered()\n"
                "        self.mask_optimizer_state(every_step=True)\n",
                "        self._mask_gathered()\n        self.mask_optimizer_state(every_step=True)\n",
            ),
        ),
        ("tests/test_enforcement.py",),
    ),
    Mutation(
        "on-save-second-writer",
        "the callback's on_save writes the mask file again (after trainer_state.json) instead of checking it",
        (
            (
                "hf_sparsity/callback.py",
                "            if not os.path.isfile(os.path.join(ckpt, SPARSITY_MASKS_NAME)):\n",
                "            self.engine.save(ckpt)\n            if False:\n",
            ),
        ),
        ("tests/test_checkpoints.py",),
    ),
    Mutation(
        "wanda-nm-ignores-activations",
        "Wanda N:M scores by |W| alone, ignoring the activation norms",
        (
            (
                "hf_sparsity/pruning/methods.py",
                "        return prune_nm(score, *nm)\n    return prune_per_row(score, k)",
                "        return prune_nm(W.detach().abs().float(), *nm)\n    return prune_per_row(score, k)",
            ),
        ),
        PRUNING_TESTS,
    ),
    Mutation(
        "owl-levels-reversed",
        "OWL gives blocks with more outliers a higher level instead of a lower one",
        (
            (
                "hf_sparsity/pruning/levels.py",
                "levels[n] - density_shift[block_of[n]]",
                "levels[n] + density_shift[block_of[n]]",
            ),
        ),
        PRUNING_TESTS,
    ),
    Mutation(
        "owl-rounding-on-one-tensor",
        "OWL puts every zero left over from rounding on one tensor, off its block's level",
        (
            (
                "hf_sparsity/pruning/levels.py",
                "            if 0 <= counts[n] + step < numels[n]:\n"
                "                counts[n] += step\n"
                "                missing -= step\n",
                "            if 0 <= counts[n] + missing < numels[n]:\n"
                "                counts[n] += missing\n"
                "                missing = 0\n",
            ),
        ),
        PRUNING_TESTS,
    ),
    Mutation(
        "owl-span-halved",
        "OWL shifts block levels over lambda instead of 2·lambda",
        (("hf_sparsity/pruning/levels.py", "/ span * 2 * lam", "/ span * lam"),),
        PRUNING_TESTS,
    ),
    Mutation(
        "owl-ratios-from-magnitude",
        "OWL's outlier ratios use |W| without the activation norms",
        (
            (
                "hf_sparsity/pruning/levels.py",
                "wanda_score(linear_view(model.get_parameter(d.name), d), stats[d.name])",
                "linear_view(model.get_parameter(d.name), d).abs()",
            ),
        ),
        PRUNING_TESTS,
    ),
    Mutation(
        "lora-masked-forward-unmasked",
        "lora: masked applies the plain B·A in the forward pass",
        (
            (
                "hf_sparsity/lora/masked.py",
                "            delta = self.delta(module, active_adapter)\n",
                "            delta = module.get_delta_weight(active_adapter)\n",
            ),
        ),
        LORA_TESTS,
    ),
    Mutation(
        "lora-masked-merge-unmasked",
        "lora: masked merges the plain B·A (peft's merge_adapter / merge)",
        (
            (
                "hf_sparsity/lora/masked.py",
                "            return delta * self.mask.to(delta.device, delta.dtype)",
                "            return delta",
            ),
            (
                "hf_sparsity/lora/masked.py",
                "            delta = self.delta(module, active_adapter)\n",
                "            delta = module.get_delta_weight(active_adapter) * self.mask\n",
            ),
        ),
        LORA_TESTS,
    ),
    Mutation(
        "lora-masked-no-dropout",
        "lora: masked skips the adapter's dropout",
        (
            (
                "hf_sparsity/lora/masked.py",
                "F.linear(module.lora_dropout[active_adapter](x), weight)",
                "F.linear(x, weight)",
            ),
        ),
        LORA_TESTS,
    ),
    Mutation(
        "lora-merge-then-mask-no-mask",
        "merge_sparse no longer re-applies the masks after merging",
        (("hf_sparsity/export/merge.py", "    apply_masks(merged, mask_dict)\n", "    pass\n"),),
        LORA_TESTS,
    ),
)


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for f in filter(None, files):
        src = ROOT / f.decode()
        if src.is_file():
            out = dst / f.decode()
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, out)


def run(m: Mutation) -> tuple[bool, str, float]:
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        tmp = Path(tmp)
        _copy_tree(tmp)
        for rel, old, new in m.edits:
            path = tmp / rel
            text = path.read_text()
            if text.count(old) != 1:
                raise SystemExit(
                    f"{m.name}: {old!r} occurs {text.count(old)} times in {rel}; update the mutation."
                )
            path.write_text(text.replace(old, new))
        env = dict(os.environ, PYTHONPATH=str(tmp), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        env.update(HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        # The copy has no ../shared beside it; point the data fixture at the real one.
        env.setdefault("HF_SPARSITY_SHARED_DATA", str(ROOT.parent / "shared" / "data"))
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
        )
        failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
        if proc.returncode not in (0, 1):  # 2-5: the run itself broke (collection, usage, no tests)
            raise SystemExit(
                f"{m.name}: pytest exited {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
            )
        return (
            proc.returncode == 1,
            (failed[0] if failed else proc.stdout.strip().splitlines()[-1]),
            (time.perf_counter() - t0),
        )


def main() -> int:
    chosen = [m for m in MUTATIONS if not sys.argv[1:] or any(a in m.name for a in sys.argv[1:])]
    missed = 0
    for m in chosen:
        caught, detail, secs = run(m)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {m.name:<28} {secs:6.1f}s  {m.what}\n        {detail}")
    print(f"{len(chosen) - missed}/{len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
