"""Shared machinery for the recipes: arguments, data, models, what a stage leaves behind, plots, results.

Each recipe (``static.py``, ``imp.py``, ``spdf.py``, ``variable_spdf.py``,
``sparse_ift.py``, ``prune_recover.py``) keeps its defaults in one block and its story top to
bottom, its ``TrainingArguments``, ``Trainer`` (with ``callbacks=[SparsityCallback(...), ...]``)
and ``trainer.train(resume_from_checkpoint=...)`` included; what they all need that is not the
``Trainer`` lives here:

* :func:`parse_args`: ``--key value`` for every default, ``--config FILE.yaml``;
  unknown keys refused.
* :func:`load_texts` / :func:`prepare_data`: the embedded default (no network, nothing
  from any data folder), a local ``.txt`` / ``.jsonl`` file, or any HF dataset name.
* :class:`ScheduledData`: the training stream in a fixed, seeded order, cut into
  segments: a new segment starts at each prune (the seeded reshuffle of
  Cerebras' iterative pruning) and at each stage change (a later stage draws from a disjoint pool of
  blocks, so it never repeats the earlier stage's data, as in Variable SPDF). The order
  is a pure function of the schedule and the seed, and a recipe's Trainer walks it
  sequentially (``train_sampling_strategy="sequential"``), so a resumed run sees exactly the
  samples an uninterrupted one does.
* :func:`stage_done` (with ``--resume``, a stage already finished is not run again) and
  :func:`record_stage` (a finished stage's figures, ``stage_done.json``); :class:`EvalAt` and
  :class:`StagePrinter`, callbacks a recipe lists; :func:`finalize` and :func:`load_model`
  between stages.
* :func:`plot_stages`, :func:`write_results`.

By concern: ``_args.py`` (arguments, the output folder, which process writes), ``_data.py``
(texts, blocks, the training stream, the model), ``_stages.py`` (skipping and recording a
stage, finalize between stages), ``_outputs.py`` (plot, results). This module gathers them, so
a recipe reads ``C.<name>``.

Stateless: nothing here holds state between calls.
"""

from _args import (  # noqa: F401
    SHARED_DEFAULTS,
    is_main_process,
    log,
    parse_args,
    prepare_output_dir,
    recipe_defaults,
    wait_for_main_process,
)
from _data import (  # noqa: F401  (re-exported: recipes use them as C.<name>)
    ScheduledData,
    Segment,
    build_model,
    data_to_text,
    load_texts,
    prepare_data,
    prepare_finetune,
    split_blocks,
    stage_data,
    world_size,
)
from _outputs import fmt_flops, plot_stages, write_results  # noqa: F401
from _stages import (  # noqa: F401
    STAGE_DONE,
    EvalAt,
    StagePrinter,
    StageResult,
    eval_every,
    finalize,
    load_model,
    record_stage,
    sparsity_levels,
    stage_done,
)


def start(defaults: dict, doc: str, argv: list[str] | None = None):
    """A recipe's first steps: parse its arguments, make the output folder, build the data.

    Returns ``(args, tokenizer, train_blocks, eval_blocks)``; recipes that read fine-tuning text too
    (SPDF, Variable SPDF) call :func:`prepare_data` with it themselves."""
    args = parse_args(defaults, doc, argv)
    prepare_output_dir(args)
    return (args, *prepare_data(args))
