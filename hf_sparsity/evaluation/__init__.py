"""Evaluation of dense and sparse causal LMs: the metrics of Cerebras' sparse GPT work.

* :func:`pile_loss`: Pile-style validation loss (token-weighted cross-entropy over a
  Pile-format ``{"text", "meta"}`` jsonl / jsonl.zst corpus, non-overlapping windows).
* :func:`wikitext103_perplexity`: WikiText-103 perplexity adjusted to the original
  word-level tokens, as Megatron computes it (:func:`adjusted_perplexity`).
* :func:`run_harness`: lm-eval tasks, e.g. :data:`HARNESS7` (arc_easy, arc_challenge,
  hellaswag, lambada_openai, openbookqa, piqa, winogrande), zero-shot; online with the
  stock tasks or offline over a local folder with :func:`write_offline_tasks`.
* :func:`evaluate`: any of the suites ``pile``, ``lambada``, ``wikitext103``, ``wikitext2``
  (the Wanda / SparseGPT perplexity), ``harness7`` on a model folder (masks applied) or
  in-memory model, with the model's per-layer sparsity; :func:`write_report` /
  :func:`compare` write ``results.json``, Markdown and a bar chart.
* :class:`EvalCallback`: the same suites inside ``transformers.Trainer``.

The command line is ``hf_sparsity eval`` (see ``hf_sparsity eval --help``).
"""

# Lazy imports: EvalCallback imports transformers' Trainer machinery; it loads on first use.

from .harness import HARNESS7, run_harness, write_offline_tasks
from .models import apply_masks, load_model_for_eval, sparsity_summary
from .perplexity import (
    adjusted_perplexity,
    count_original_tokens,
    iter_documents,
    pile_loss,
    sliding_window_nll,
    wikitext103_perplexity,
    wikitext_detokenize,
)
from .report import compare, flat_metrics, format_markdown, load_results, write_report
from .runner import SUITES, evaluate


def __getattr__(name: str):
    # EvalCallback imports transformers' Trainer machinery; load it on first use only.
    if name == "EvalCallback":
        from .callback import EvalCallback

        return EvalCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "HARNESS7",
    "SUITES",
    "EvalCallback",
    "adjusted_perplexity",
    "apply_masks",
    "compare",
    "count_original_tokens",
    "evaluate",
    "flat_metrics",
    "format_markdown",
    "iter_documents",
    "load_model_for_eval",
    "load_results",
    "pile_loss",
    "run_harness",
    "sliding_window_nll",
    "sparsity_summary",
    "wikitext103_perplexity",
    "wikitext_detokenize",
    "write_offline_tasks",
    "write_report",
]
