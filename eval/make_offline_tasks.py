"""Generate offline lm-eval task YAMLs that mirror the installed lm-eval's stock tasks.

python eval/make_offline_tasks.py DATA_DIR/tasks OUT_DIR            # the seven harness7 tasks
python eval/make_offline_tasks.py DATA_DIR/tasks OUT_DIR piqa arc_easy
lm_eval run --model hf --model_args pretrained=MODEL --tasks piqa --include_path OUT_DIR
"""

from __future__ import annotations

import argparse

from hf_sparsity.evaluation import HARNESS7, write_offline_tasks
from hf_sparsity.evaluation.harness import resolve_tasks_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "data_dir", help="folder laid out like DATA_DIR/tasks: <task>/<split>.jsonl (or its parent)"
    )
    parser.add_argument("out_dir", help="where the YAMLs go (one sub-folder per task)")
    parser.add_argument("tasks", nargs="*", default=list(HARNESS7), help="task names (default: harness7)")
    args = parser.parse_args()
    out = write_offline_tasks(resolve_tasks_dir(args.data_dir), args.out_dir, args.tasks)
    for t in args.tasks:
        print(out / t / f"{t}.yaml")


if __name__ == "__main__":
    main()
