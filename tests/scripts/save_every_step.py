"""A tiny Trainer + SparsityCallback run that saves a checkpoint every step, for crash-and-resume tests.

    python tests/scripts/save_every_step.py OUT MAX_STEPS [--resume] [--die STEP:MOMENT]

(or ``run([OUT, MAX_STEPS, ...])`` in a process of its own: ``tests/test_resume_after_crash.py``)

``--resume`` continues from ``last_complete_checkpoint(OUT)``. ``--die`` makes the process
SIGKILL itself while Trainer writes ``checkpoint-STEP``, at MOMENT: ``weights`` (right after
``model.safetensors``, before the masks), ``optimizer`` (as ``optimizer.pt`` is about to be
written) or ``state`` (halfway through writing ``trainer_state.json``). The final weights go to
``OUT/final`` and ``OUT/result.json`` records where the run resumed from.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import transformers.modeling_utils as modeling_utils  # noqa: E402
from transformers.trainer_callback import TrainerState  # noqa: E402

from hf_sparsity import SparsityCallback, SparsityConfig, last_complete_checkpoint  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.trainer_utils import make_trainer  # noqa: E402


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def arm(step: int, moment: str) -> None:
    """Kill this process at ``moment`` of writing ``checkpoint-step`` (hooks on the writers Trainer calls)."""
    folder = f"checkpoint-{step}"
    if moment == "weights":
        save_file = modeling_utils.safe_save_file

        def killing_save_file(tensors, filename, *a, **kw):
            save_file(tensors, filename, *a, **kw)
            if folder in str(filename):
                die()

        modeling_utils.safe_save_file = killing_save_file
    elif moment == "optimizer":
        save = torch.save

        def killing_save(obj, f, *a, **kw):
            if folder in str(f) and str(f).endswith("optimizer.pt"):
                die()
            return save(obj, f, *a, **kw)

        torch.save = killing_save
    elif moment == "state":
        save_to_json = TrainerState.save_to_json

        def half_written(self, json_path):
            if folder not in str(json_path):
                return save_to_json(self, json_path)
            save_to_json(self, json_path)
            with open(json_path, "r+", encoding="utf-8") as f:
                f.truncate(len(f.read()) // 2)
            die()

        TrainerState.save_to_json = half_written
    else:
        raise SystemExit(f"unknown moment {moment!r}")


def main(out: str, max_steps: int, resume: bool, die_at: str | None) -> None:
    if die_at:
        step, moment = die_at.split(":")
        arm(int(step), moment)
    model = tiny_model("gpt2", seed=0, hidden=64)
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0
    cb = SparsityCallback(SparsityConfig(sparsity=0.5, init_method="random", seed=7))
    start = last_complete_checkpoint(out) if resume else None
    print(f"resuming from {start}", flush=True)
    trainer = make_trainer(model, out, [cb], max_steps=max_steps, save_strategy="steps", save_steps=1)
    trainer.train(resume_from_checkpoint=start)
    trainer.save_model(os.path.join(out, "final"))
    with open(os.path.join(out, "result.json"), "w", encoding="utf-8") as f:
        json.dump({"resumed_from": start, "global_step": trainer.state.global_step}, f)


def run(args: list[str]) -> None:
    """The command line (the usage above) without the script name."""
    die_at = args[args.index("--die") + 1] if "--die" in args else None
    main(args[0], int(args[1]), "--resume" in args, die_at)


if __name__ == "__main__":
    run(sys.argv[1:])
