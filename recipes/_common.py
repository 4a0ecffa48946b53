"""Shared machinery for the recipes: arguments, data, models, one training stage, plots, results.

Each recipe (``static.py``, ``imp.py``, ``spdf.py``, ``variable_spdf.py``,
``sparse_ift.py``) keeps its defaults in one block and its story top to bottom;
what they all need lives here:

* :func:`parse_args`: ``--key value`` for every default, ``--config FILE.yaml``;
  unknown keys refused with the list of known ones.
* :func:`load_texts` / :func:`prepare_data`: the embedded default (no network, nothing
  from any data folder), a local ``.txt`` / ``.jsonl`` file, or any HF dataset name.
* :class:`ScheduledData`: the training stream in a fixed, seeded order, cut into
  segments: a new segment starts at each prune (the seeded reshuffle of
  Cerebras' iterative pruning) and at each stage change (a later stage draws from a disjoint pool of
  blocks, so it never repeats the earlier stage's data, as in Variable SPDF). The order
  is a pure function of the schedule and the seed, and Trainer walks it
  sequentially, so a resumed run sees exactly the samples an uninterrupted one does.
* :func:`train_stage`: one stage: its ``TrainingArguments`` (:func:`training_arguments`,
  every setting in one place), its ``Trainer`` (or a subclass), then :func:`train_and_save`:
  resume from the last complete checkpoint, train, evaluate, save ``final/``, record the stage
  (:func:`stage_done` skips a stage a resumed run already finished).
* :func:`plot_stages`, :func:`write_results`.

By concern: ``_args.py`` (arguments, the output folder), ``_data.py`` (texts, blocks, the
training stream, the model), ``_stages.py`` (one training stage, finalize between stages),
``_outputs.py`` (plot, results). This module gathers them, so a recipe reads ``C.<name>``.

Stateless: nothing here holds state between calls; the recipes build their sparsity
config and ``SparsityCallback`` themselves and hand them to :func:`train_stage`.
"""

from _args import (  # noqa: F401
    SHARED_DEFAULTS,
    is_main_process,
    log,
    parse_args,
    prepare_output_dir,
    recipe_defaults,
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
    StageResult,
    dense_finetune,
    eval_every,
    finalize,
    load_model,
    sparsity_levels,
    stage_done,
    train_and_save,
    train_stage,
    training_arguments,
)


def start(defaults: dict, doc: str, argv: list[str] | None = None):
    """A recipe's first steps: parse its arguments, make the output folder, build the data.

    Returns ``(args, tokenizer, train_blocks, eval_blocks)``; recipes that read fine-tuning text too
    (SPDF, Variable SPDF) call :func:`prepare_data` with it themselves."""
    args = parse_args(defaults, doc, argv)
    prepare_output_dir(args)
    return (args, *prepare_data(args))
