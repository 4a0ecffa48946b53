"""Mutation check: put in, one at a time, bugs the suite must catch, and run the tests that should.

    python benchmarks/mutations.py              # every mutation
    python benchmarks/mutations.py finalize     # the ones whose name contains "finalize"
    python benchmarks/mutations.py --before decode   # without the newest test files (NEW_TEST_FILES)
    python benchmarks/mutations.py --not-slow zero   # leaving out the tests marked slow (launchers)

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
from dataclasses import dataclass, replace
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
        "recover-pruned-levels-ignored",
        "prune_recover --pruned trains under --sparsity instead of the pruned folder's own levels",
        (("recipes/prune_recover.py", "config = get_sparsity_config(student.config) or config", "pass"),),
        ("tests/test_prune_recover.py",),
    ),
    Mutation(
        "recover-bf16-teacher-in-float32",
        "prune_recover --bf16 runs the distillation teacher's forward in float32 (outside the student's "
        "autocast)",
        (
            (
                "recipes/prune_recover.py",
                "with torch.no_grad(), self.accelerator.autocast():",
                "with torch.no_grad():",
            ),
        ),
        ("tests/test_prune_recover.py",),
    ),
    Mutation(
        "recover-bf16-evaluates-under-autocast",
        "prune_recover --bf16 leaves the student's forward wrapped in autocast, so the evaluations after "
        "training run in bf16",
        (
            (
                "recipes/prune_recover.py",
                "    trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)\n",
                "",
            ),
        ),
        ("tests/test_prune_recover.py",),
    ),
    Mutation(
        "frontier-recover-temperature-dropped",
        "frontier.py's recovery rows leave out --recover-temperature: the recipe's default temperature runs",
        (
            (
                "benchmarks/frontier.py",
                '        "--distill_temperature", str(args.recover_temperature),\n',
                "",
            ),
        ),
        ("tests/test_frontier.py::test_the_recovery_rows_pass_every_recover_option_to_the_recipe",),
    ),
    Mutation(
        "frontier-prune-from-ignored",
        "frontier.py's --prune-from only renames the rows: every row is still pruned from the dense model",
        (
            (
                "benchmarks/frontier.py",
                "        res = prune_folder(source, folder, **common, **kw)\n",
                "        res = prune_folder(dense, folder, **common, **kw)\n",
            ),
        ),
        ("tests/test_frontier.py::test_prune_from_prunes_every_row_from_the_given_folder_and_tags_it",),
    ),
    Mutation(
        "step-ab-positions-ignored",
        "step_ab.py's --positions sizes the cache but decoding still restarts only before 512 positions",
        (
            (
                "benchmarks/step_ab.py",
                "if state[name] is None or state[name][1] + args.segment > args.positions:",
                "if state[name] is None or state[name][1] + args.segment > 512:",
            ),
        ),
        ("tests/test_step_ab.py::test_step_ab_restarts_each_cache_before_it_passes_positions",),
    ),
    Mutation(
        "frontier-round-ratio-of-medians",
        "frontier.py's per-round column divides the rows' medians instead of pairing rows within a round",
        (
            (
                "benchmarks/frontier.py",
                '    return statistics.median(pairs) if pairs else float("nan")',
                '    return statistics.median(vals) / statistics.median(base) if pairs else float("nan")',
            ),
        ),
        ("tests/test_frontier.py",),
    ),
    Mutation(
        "grads-masked-late",
        "gradients masked only in before_step (after clipping and DDP all-reduce), not as produced",
        (("hf_sparsity/mask_engine/enforcement.py", "if is_dtensor(p) or not p.requires_grad:", "if True:"),),
        ("tests/test_enforcement.py",),
    ),
    Mutation(
        "fused-grad-mask-before-ddp-copy",
        "the end-of-backward gradient pass runs as soon as it is queued, before callbacks the backward "
        "queued later (DDP's copy of averaged gradients into .grad)",
        (
            (
                "hf_sparsity/mask_engine/enforcement.py",
                "        queue_after_backward(self._mask_fused_grads)",
                "        self._mask_fused_grads()",
            ),
        ),
        ("tests/test_fused_grad_mask.py",),
    ),
    Mutation(
        "fused-grad-mask-flag-sticks",
        "the end-of-backward pass is queued once per flag, not per backward: a backward that failed leaves "
        "the next one unmasked",
        (
            (
                "hf_sparsity/mask_engine/enforcement.py",
                "if task != self._queued_in:",
                "if self._queued_in == -1:",
            ),
        ),
        ("tests/test_fused_grad_mask.py",),
    ),
    Mutation(
        "cusparselt-tokens-unpadded",
        "cusparselt hands cuSPARSELt the token count as it comes, not padded to the multiple it needs",
        (("hf_sparsity/backends/cusparselt.py", "pad = (-tokens) % self._multiple", "pad = 0"),),
        ("tests/test_cusparselt.py",),
    ),
    Mutation(
        "cusparselt-search-every-call",
        "cusparselt searches the algorithm on every call instead of once per shape and token bucket",
        (("hf_sparsity/backends/cusparselt.py", "        if alg is None:\n", "        if True:\n"),),
        ("tests/test_cusparselt.py",),
    ),
    Mutation(
        "auto-cuda-always-sparse",
        "auto on CUDA takes cusparselt for every regime, even where dense measured faster",
        (
            (
                "hf_sparsity/backends/cusparselt.py",
                'regime: "cusparselt" if t["cusparselt"] < t["dense"] * (1.0 - margin) else "dense"',
                'regime: "cusparselt"',
            ),
        ),
        ("tests/test_cusparselt.py",),
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
                "hf_sparsity/mask_engine/enforcement.py",
                "            for name, p in self._params.items():\n"
                "                local(p).mul_(self._dev_masks[name])\n"
                "        self._mask_gathered()\n",
                "            pass\n        self._mask_gathered()\n",
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
                "            return delta * self.mask  #",
                "            return delta  #",
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
    # ---- the newest code: each with the test written from its definition that catches it
    Mutation(
        "cli-context-off-by-one",
        "generate's context check counts the last new token as fed back: a run that fits is refused",
        (
            (
                "hf_sparsity/cli/_checks.py",
                "if limit and n + max_new_tokens - 1 > limit:",
                "if limit and n + max_new_tokens > limit:",
            ),
        ),
        (
            "tests/test_cli_errors.py",
            "tests/test_refusals.py::test_generation_that_uses_exactly_the_context_is_accepted_and_one_more_token_is_not",
        ),
    ),
    Mutation(
        "decode-norm2-is-input-norm",
        "the native step's norm before the MLP uses the input norm's weight, not the post-attention one's",
        (
            (
                "hf_sparsity/inference/native_step.py",
                "(layer.post_attention_layernorm.weight, None)]",
                "(layer.input_layernorm.weight, None)]",
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_native_step_matches_generate_over_head_layouts",
        ),
    ),
    Mutation(
        "decode-gelu-accepted",
        "native_step_reason no longer refuses a GELU / ReLU MLP (the native step runs SiLU)",
        (
            (
                "hf_sparsity/inference/native_step.py",
                'if getattr(cfg, "hidden_act", None) != "silu":',
                'if getattr(cfg, "hidden_act", None) not in ("silu", "gelu", "gelu_pytorch_tanh", "relu"):',
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_refuses_other_activations",
        ),
    ),
    Mutation(
        "decode-longrope-accepted",
        "longrope past original_max_position_embeddings runs natively (its tables are built once)",
        (
            (
                "hf_sparsity/inference/native_step.py",
                'if rope.get("rope_type") == "longrope" and original is not None and length > original:',
                "if False:",
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_longrope_past_its_original_length_falls_back_to_the_forward_loop",
        ),
    ),
    Mutation(
        "decode-window-off-by-one",
        "a generation reaching exactly the sliding window is refused (>= instead of >)",
        (
            (
                "hf_sparsity/inference/native_step.py",
                'getattr(cfg, "use_sliding_window", True) and length > window:',
                'getattr(cfg, "use_sliding_window", True) and length >= window:',
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_sliding_window_at_the_limit_runs_natively_and_one_past_falls_back",
        ),
    ),
    Mutation(
        "native-generate-processors-on-all-threads",
        "native_generate runs transformers' processors on torch's whole team between native steps",
        (
            (
                "hf_sparsity/inference/decoding.py",
                "with torch_threads(1):",
                "with torch_threads(torch.get_num_threads()):",
            ),
        ),
        ("tests/test_native_generate.py",),
    ),
    Mutation(
        "native-sampling-uniform-among-survivors",
        "native_generate's torch path draws uniformly among top-k's survivors, not by their probabilities",
        (
            (
                "hf_sparsity/inference/sampling.py",
                "cum = nn.functional.softmax(sub[0].double(), dim=-1).cumsum(0)",
                "cum = (torch.ones(sub.shape[-1], dtype=torch.float64) / sub.shape[-1]).cumsum(0)",
            ),
        ),
        ("tests/test_native_generate.py",),
    ),
    Mutation(
        "native-warpers-skipped-on-survivors",
        "the warpers after top-k (temperature, top-p, min-p) are not run on top-k's survivors",
        (("hf_sparsity/inference/sampling.py", "sub = p(ids, sub)", "sub = sub + 0"),),
        ("tests/test_native_generate.py",),
    ),
    Mutation(
        "native-step-grows-at-one-thread",
        "the native cache rebuilt inside native_generate's loop takes the loop's one torch thread",
        (
            (
                "hf_sparsity/inference/native_step.py",
                "with torch_threads(self.threads):  # the prepared calls",
                "with torch_threads(torch.get_num_threads()):  # the prepared calls",
            ),
        ),
        ("tests/test_native_generate.py",),
    ),
    Mutation(
        "decode-final-norm-unchecked",
        "a final norm whose weight is not contiguous float32 is read by the native step as if it were",
        (
            (
                "hf_sparsity/inference/native_step.py",
                "for t in (table, parts.pos_embed, *parts.final)):",
                "for t in (table, parts.pos_embed)):",
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_refuses_each_unreadable_tensor_and_the_forward_loop_runs_it",
        ),
    ),
    Mutation(
        "kernel-decode-final-norm-weight",
        "the C decode step applies layer 0's input-norm weight as the final norm's",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "norm(x, d->final_norm, d->final_norm_bias, h, d->hidden, d->eps);",
                "norm(x, d->layers[0].norm1, d->final_norm_bias, h, d->hidden, d->eps);",
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_native_step_matches_generate_over_head_layouts",
        ),
    ),
    Mutation(
        "kernel-fused-qkv-bias",
        "the fused q / k / v products of the C decode step add q's bias to all three",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "const float* bs[3] = {L->bq, L->bk, L->bv};",
                "const float* bs[3] = {L->bq, L->bq, L->bq};",
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_native_step_matches_generate_over_head_layouts",
            "tests/test_realistic_decode.py::test_native_step_matches_the_model_on_every_format",
        ),
    ),
    Mutation(
        "kernel-decode-down-bias",
        "the C decode step drops the down projection's bias (Llama with mlp_bias)",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "hfs_run_prepared(L->down, g, o, L->bdown);",
                "hfs_run_prepared(L->down, g, o, NULL);",
            ),
        ),
        (
            "tests/test_decoding.py",
            "tests/test_realistic_decode.py::test_native_step_matches_the_model_on_every_format",
        ),
    ),
    Mutation(
        "arena-part-shared-moved",
        "the arena moves a tensor a parameter shares only in part (same start, other shape)",
        (
            (
                "hf_sparsity/backends/arena.py",
                "h.data_ptr() == t.data_ptr() and h.shape == t.shape and h.dtype == t.dtype",
                "h.data_ptr() == t.data_ptr() and h.dtype == t.dtype",
            ),
        ),
        (
            "tests/test_arena.py",
            "tests/test_exact_internals.py::test_a_tensor_shared_whole_moves_with_its_holder_and_one_shared_in_part_stays",
        ),
    ),
    Mutation(
        "arena-unaligned",
        "the arena packs tensors back to back, not each on a 64-byte boundary",
        (("hf_sparsity/backends/arena.py", "offset += -(-n // _ALIGN) * _ALIGN", "offset += n"),),
        (
            "tests/test_arena.py",
            "tests/test_exact_internals.py::test_a_tensor_shared_whole_moves_with_its_holder_and_one_shared_in_part_stays",
        ),
    ),
    Mutation(
        "auto-cache-key-no-dtype",
        "auto's plan cache ignores the dtype: a bfloat16 group reuses the float32 decision",
        (
            (
                "hf_sparsity/backends/auto/planner.py",
                'cache.key("layer", shape, dtype, level, is24, cands, threads, settings)',
                'cache.key("layer", shape, level, is24, cands, threads, settings)',
            ),
        ),
        (
            "tests/test_auto_plans.py",
            "tests/test_exact_internals.py::test_a_group_differing_in_one_key_part_is_measured_again",
        ),
    ),
    Mutation(
        "auto-cache-key-no-build",
        "auto's plan cache ignores the kernel build: plans measured at HF_SPARSITY_NATIVE_ISA=avx2 are "
        "reused by the native build",
        (
            (
                "hf_sparsity/backends/auto/cache.py",
                "text = json.dumps([PLAN_VERSION, cpu, build, torch.get_num_threads(),",
                "text = json.dumps([PLAN_VERSION, cpu, torch.get_num_threads(),",
            ),
        ),
        (
            "tests/test_exact_internals.py",
            "tests/test_exact_internals.py::test_a_plan_made_on_another_kernel_build_is_measured_again",
        ),
    ),
    Mutation(
        "auto-int8-check-against-float32",
        "with int8 values the whole-model check times the plan against the float32 model as it was",
        (
            (
                "hf_sparsity/backends/auto/backend.py",
                'if options.get("values") == "int8":  # the dense model',
                "if False:  # the dense model",
            ),
        ),
        (
            "tests/test_int8_values.py",
            "tests/test_int8_values.py::test_auto_int8_whole_model_check_is_against_the_int8_dense_gemv",
        ),
    ),
    Mutation(
        "auto-int8-check-falls-back-to-float32",
        "a plan slower than the int8 dense GEMV falls back to the float32 layers (int8 values lost)",
        (("hf_sparsity/backends/auto/backend.py", "    return base_swaps\n", "    return []\n"),),
        (
            "tests/test_int8_values.py",
            "tests/test_int8_values.py::test_auto_int8_whole_model_check_is_against_the_int8_dense_gemv",
        ),
    ),
    Mutation(
        "auto-int8-check-times-its-own-baseline",
        "a plan that is already every layer on the int8 dense GEMV is timed against itself",
        (
            (
                "hf_sparsity/backends/auto/backend.py",
                "        return swaps  # the plan is its own dense model",
                "        pass  # the plan is its own dense model",
            ),
        ),
        (
            "tests/test_int8_values.py",
            "tests/test_int8_values.py::test_auto_int8_whole_model_check_is_against_the_int8_dense_gemv",
        ),
    ),
    Mutation(
        "auto-cache-key-no-values",
        "auto's plan cache ignores values='int8': an int8 group reuses the float32 decision",
        (
            (
                "hf_sparsity/backends/auto/planner.py",
                "stream_bytes, keep_dense_for_prefill, values,\n",
                "stream_bytes, keep_dense_for_prefill,\n",
            ),
        ),
        (
            "tests/test_auto_plans.py",
            "tests/test_exact_internals.py::test_a_group_differing_in_one_key_part_is_measured_again",
        ),
    ),
    Mutation(
        "auto-int8-dense-float",
        "with int8 values auto's native_dense candidate is the float32 GEMV, not the int8 one",
        (
            (
                "hf_sparsity/backends/auto/cost.py",
                "return get_backend(fmt).from_dense(w, m, threads=threads, values=values)",
                "return get_backend(fmt).from_dense(w, m, threads=threads)",
            ),
        ),
        ("tests/test_auto_plans.py",),
    ),
    Mutation(
        "auto-int8-copies-float-bytes",
        "auto streams int8 candidates' copies by float32 bytes: a quarter of the memory traffic, cached",
        (
            (
                "hf_sparsity/backends/auto/planner.py",
                "per = w0.numel() * (esize or w0.element_size())",
                "per = w0.numel() * w0.element_size()",
            ),
        ),
        ("tests/test_auto_plans.py",),
    ),
    Mutation(
        "spdy-uniform-start-solved",
        "SPDY's search solves the uniform start's coefficients instead of scoring the uniform level itself",
        (
            (
                "hf_sparsity/pruning/spdy_search.py",
                "pick = given if given is not None else solve(c)",
                "pick = solve(c)",
            ),
        ),
        ("tests/test_spdy_search.py",),
    ),
    Mutation(
        "spdy-database-not-kept",
        "SPDY fills its own database, not the caller's: a second target runs the error pass again",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "        database = speed.database  # the caller's",
                "        database = {}  # the caller's",
            ),
        ),
        ("tests/test_spdy_search.py",),
    ),
    Mutation(
        "spdy-step-table-not-monotone",
        "the step time table keeps a disturbed sparser level slower than a denser one",
        (
            (
                "hf_sparsity/pruning/speed.py",
                "fit = monotone_decreasing([0.0, *(changes[lv] for lv in grid)], [1e9]",
                "fit = (lambda v, w: v)([0.0, *(changes[lv] for lv in grid)], [1e9]",
            ),
        ),
        ("tests/test_spdy.py",),
    ),
    Mutation(
        "spdy-step-table-not-calibrated",
        "the step time table's shapes are not scaled to the uniform model's measured change",
        (
            (
                "hf_sparsity/pruning/speed.py",
                "per = _fitted({lv: fits[s][lv] * scale[lv] for lv in grid}, grid)",
                "per = _fitted({lv: fits[s][lv] for lv in grid}, grid)",
            ),
        ),
        ("tests/test_spdy.py",),
    ),
    Mutation(
        "spdy-step-table-one-pass",
        "the step time table measures each configuration's pairs in one go, not spread over passes",
        (("hf_sparsity/pruning/speed.py", "passes = max(1, min(passes, rounds))", "passes = 1"),),
        ("tests/test_spdy.py",),
    ),
    Mutation(
        "auto-plan-key-without-tolerance",
        "auto's plan cache key leaves out model_tolerance: a plan decided under another tolerance is reused",
        (
            (
                "hf_sparsity/backends/auto/planner.py",
                "keep_dense_for_prefill, values,\n                model_tolerance)",
                "keep_dense_for_prefill, values)",
            ),
        ),
        ("tests/test_auto_plans.py::test_plan_cache_makes_the_same_plan_without_measuring",),
    ),
    Mutation(
        "spdy-step-table-whole-step",
        "the step time table counts a shape's whole change of the step for each of its layers",
        (("hf_sparsity/pruning/speed.py", "dense_ms[s] + per[lv] / len(names)", "dense_ms[s] + per[lv]"),),
        ("tests/test_spdy.py",),
    ),
    Mutation(
        "auto-predicted-not-per-layer",
        "auto's predicted whole-model ratio counts a pass over all timed copies as one layer's saving",
        (
            (
                "hf_sparsity/backends/auto/backend.py",
                'saved += (ms[dense] - ms[c["decode"]]) / per',
                'saved += ms[dense] - ms[c["decode"]]',
            ),
        ),
        (
            "tests/test_auto_plans.py",
            "tests/test_exact_internals.py::test_predicted_whole_model_ratio_by_hand",
        ),
    ),
    Mutation(
        "decode-tok-s-stops-at-eos",
        "decode_tok_s lets generate stop at EOS: fewer than new_tokens tokens, counted as new_tokens",
        (("hf_sparsity/backends/measure.py", "            min_new_tokens=new_tokens,\n", ""),),
        (
            "tests/test_auto_plans.py",
            "tests/test_exact_internals.py::test_decode_tok_s_times_exactly_new_tokens_tokens",
        ),
    ),
    Mutation(
        "whole-model-check-fastest-rounds",
        "the whole-model check compares the fastest round of each model, not the rounds' ratios",
        (
            (
                "hf_sparsity/backends/auto/backend.py",
                'return statistics.median(ratios), statistics.median(speeds["dense"])',
                'return max(speeds["auto"]) / max(speeds["dense"]), max(speeds["dense"])',
            ),
        ),
        ("tests/test_exact_internals.py::test_whole_model_ratio_is_the_median_of_the_rounds_ratios",),
    ),
    Mutation(
        "step-tok-s-counts-a-token-too-many",
        "step_tok_s divides new_tokens, not the new_tokens - 1 steps between the first and the last token",
        (
            (
                "hf_sparsity/backends/measure.py",
                "return (len(stamps) - 1) / (stamps[-1] - stamps[0])",
                "return len(stamps) / (stamps[-1] - stamps[0])",
            ),
        ),
        ("tests/test_exact_internals.py::test_step_tok_s_times_the_new_tokens_from_the_first_to_the_last",),
    ),
    Mutation(
        "step-tok-s-stops-at-eos",
        "step_tok_s lets greedy decoding stop at the model's end-of-sequence token",
        (
            (
                "hf_sparsity/backends/measure.py",
                "new_tokens, eos_token_id=[], on_token",
                "new_tokens, on_token",
            ),
        ),
        ("tests/test_exact_internals.py::test_step_tok_s_times_the_new_tokens_from_the_first_to_the_last",),
    ),
    Mutation(
        "zero-offload-param-accepted",
        "DeepSpeed ZeRO-3 offload_param is accepted (the masks never reach the offloaded parameters)",
        (
            (
                "hf_sparsity/zero.py",
                'offload = offload or bool(getattr(inner, "offload_param", False))',
                "offload = offload",
            ),
        ),
        (
            "tests/test_deepspeed.py",
            "tests/test_bad_branches.py::test_each_deepspeed_offload_flag_is_refused",
        ),
    ),
    Mutation(
        "refit-accepts-unconverged",
        "refit accepts a CG solve that ran out of iterations",
        (
            (
                "hf_sparsity/pruning/refit.py",
                "    return W, bool((R.norm(dim=1) <= tol * bnorm).all())",
                "    return W, True",
            ),
        ),
        (
            "tests/test_prune_refit.py",
            "tests/test_bad_branches.py::test_refit_retries_a_solve_that_hits_its_iteration_limit_with_more_damping",
            "tests/test_bad_branches.py::test_refit_refuses_when_every_try_runs_out_of_iterations",
        ),
    ),
    Mutation(
        "reconstruct-not-undone",
        "a block reconstruction that raised the error is kept (the weights before it are not put back)",
        (("hf_sparsity/pruning/oneshot.py", "            p.copy_(saved[n])", "            pass"),),
        (
            "tests/test_prune_refit.py",
            "tests/test_bad_branches.py::test_a_reconstruction_that_raises_the_error_is_undone",
        ),
    ),
    Mutation(
        "reconstruct-lr-shifted",
        "the reconstruction's cosine runs one step ahead: its last step runs at learning rate 0",
        (
            (
                "hf_sparsity/pruning/reconstruct.py",
                "math.cos(math.pi * step / steps)",
                "math.cos(math.pi * (step + 1) / steps)",
            ),
        ),
        (
            "tests/test_prune_refit.py",
            "tests/test_exact_internals.py::test_reconstruction_learning_rate_at_every_step_is_the_cosine",
        ),
    ),
    Mutation(
        "stream-drops-unknown-tensor",
        "streamed pruning drops the shard tensors the model class does not hold",
        (("hf_sparsity/pruning/streaming.py", "        if leftover:\n", "        if False:\n"),),
        (
            "tests/test_prune_refit.py",
            "tests/test_bad_branches.py::test_a_shard_tensor_the_model_does_not_hold_is_copied_through_byte_for_byte",
        ),
    ),
    Mutation(
        "tokens-local-times-world",
        "token counts under DDP multiply the local count by the world size instead of summing",
        (
            (
                "hf_sparsity/flops/callback.py",
                "    dist.all_reduce(total)\n    return total\n",
                "    return total * dist.get_world_size()\n",
            ),
        ),
        (
            "tests/test_flops.py",
            "tests/test_ddp.py",
            "tests/test_bad_branches.py::test_ranks_with_different_real_tokens_are_summed_not_multiplied",
        ),
    ),
    Mutation(
        "tokens-resume-recounts",
        "a resumed run whose Trainer counts tokens counts every earlier token again",
        (
            (
                "hf_sparsity/flops/callback.py",
                '        self.seen = int(getattr(state, "num_input_tokens_seen", 0) or 0)\n'
                "        self.pending = 0",
                "        self.seen = 0\n        self.pending = 0",
            ),
        ),
        (
            "tests/test_flops.py",
            "tests/test_bad_branches.py::test_a_resumed_run_with_trainers_count_counts_only_new_tokens",
        ),
    ),
    Mutation(
        "resume-order-by-name",
        "resume orders checkpoints by name: checkpoint-9 is taken for newer than checkpoint-10",
        (
            (
                "hf_sparsity/storage/resume.py",
                "key=lambda p: int(_CHECKPOINT_RE.match(p.name).group(1))",
                "key=lambda p: p.name",
            ),
        ),
        (
            "tests/test_resume_after_crash.py",
            "tests/test_bad_branches.py::test_resume_takes_the_highest_step_not_the_last_name",
        ),
    ),
    Mutation(
        "checksum-without-names",
        "the mask checksum leaves out the mask names (two masks swapped under their names pass)",
        (
            (
                "hf_sparsity/storage/masks_file.py",
                'h.update(name.encode("utf-8") + b"\\0")',
                'h.update(b"\\0")',
            ),
        ),
        (
            "tests/test_serialization.py",
            "tests/test_exact_internals.py::test_mask_checksum_is_sha256_of_names_shapes_and_packed_bits_in_name_order",
        ),
    ),
    Mutation(
        "lora-masked-first-adapter-only",
        "lora: masked masks only the first adapter of a layer; a second one applies plain B·A",
        (
            (
                "hf_sparsity/lora/masked.py",
                "        for adapter in layer.lora_A:\n",
                "        for adapter in list(layer.lora_A)[:1]:\n",
            ),
        ),
        (
            "tests/test_lora.py",
            "tests/test_exact_internals.py::test_two_adapters_on_masked_layers_each_apply_their_own_masked_update",
        ),
    ),
    Mutation(
        "lora-masked-delta-of-active-adapter",
        "lora: masked computes every adapter's update from the first active adapter's B·A",
        (
            (
                "hf_sparsity/lora/masked.py",
                "            delta = module.get_delta_weight(adapter)\n",
                "            delta = module.get_delta_weight(module.active_adapters[0])\n",
            ),
        ),
        (
            "tests/test_lora.py",
            "tests/test_exact_internals.py::test_two_adapters_on_masked_layers_each_apply_their_own_masked_update",
        ),
    ),
    Mutation(
        "tokens-read-every-step",
        "the callback reads the step's token count on the host (a device sync) on every optimizer step",
        (
            (
                "hf_sparsity/callback.py",
                "self._pending.add(self._tokens.step(args, state), self.engine.levels, self.flops)",
                "self.flops.add_tokens(int(self._tokens.step(args, state)), self.engine.levels)",
            ),
        ),
        ("tests/test_host_sync.py::test_steps_without_an_event_do_no_host_work_under_trainer",),
    ),
    Mutation(
        "masks-stay-behind-after-to",
        "masks are placed again only when a parameter object is replaced, not when the model moves device",
        (
            (
                "hf_sparsity/mask_engine/enforcement.py",
                "is not p or local(p).device != self._dev_masks[n].device",
                "is not p",
            ),
        ),
        ("tests/test_host_sync.py::test_masks_follow_their_weights_to_another_device",),
    ),
    Mutation(
        "replaced-params-grads-unmasked",
        "before_step masks only unhooked gradients even when the hooks sat on parameters since replaced",
        (
            (
                "hf_sparsity/mask_engine/enforcement.py",
                "        self.mask_gradients(only_unhooked=not replaced)",
                "        self.mask_gradients(only_unhooked=True)",
            ),
        ),
        ("tests/test_host_sync.py::test_gradients_of_replaced_parameters_are_masked_before_the_step",),
    ),
    Mutation(
        "lora-mask-copied-every-forward",
        "lora: masked moves and casts its mask to the update's device and dtype in every forward",
        (
            (
                "hf_sparsity/lora/masked.py",
                "            return delta * self.mask  #",
                "            return delta * self.mask.to(delta.device, delta.dtype)  #",
            ),
        ),
        ("tests/test_host_sync.py::test_masked_lora_steps_do_no_host_work",),
    ),
    Mutation(
        "event-scores-with-cpu-mask",
        "a prune event scores a GPU weight against the CPU mask (raised on CUDA: found by the GPU check)",
        (
            (
                "hf_sparsity/masks.py",
                "score.masked_fill(mask.to(score.device) == 0, -1.0)",
                "score.masked_fill(mask == 0, -1.0)",
            ),
        ),
        ("tests/test_pruning_methods.py::test_scores_and_selections_stay_on_the_weights_device",),
    ),
    Mutation(
        "wanda-row-counts-on-cpu",
        "Wanda's per-row selection builds its counts and column index on the CPU (raised on CUDA)",
        (
            (
                "hf_sparsity/pruning/methods.py",
                "    counts = row_counts(k, rows, score.device)",
                "    counts = row_counts(k, rows)",
            ),
            (
                "hf_sparsity/pruning/methods.py",
                "torch.arange(cols, device=score.device)",
                "torch.arange(cols)",
            ),
        ),
        ("tests/test_pruning_methods.py::test_scores_and_selections_stay_on_the_weights_device",),
    ),
    Mutation(
        "weights-rezeroed-after-every-step",
        "the weights get a re-zeroing pass after every step, for zero-preserving optimizers too",
        (
            (
                "hf_sparsity/mask_engine/enforcement.py",
                "        if self._weights_every_step():",
                "        if True:",
            ),
        ),
        (
            "tests/test_enforcement.py::test_weights_are_rezeroed_after_a_step_only_where_the_optimizer_could_move_them",
        ),
    ),
    Mutation(
        "native-sample-uniform-draw",
        "the native sampling call draws uniformly among the survivors instead of by their probabilities",
        (("hf_sparsity/backends/csrc/sample.c", "    cum += s->work[j];", "    cum += 1.0 / (double)m;"),),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-penalty-twice-for-repeated-ids",
        "an id seen twice gets the repetition penalty twice (each write reads the row, not the saved value)",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "x[seen[j]] = s->saved[j] < 0.0f ? s->saved[j] * s->penalty : s->saved[j] / s->penalty;",
                "x[seen[j]] = x[seen[j]] < 0.0f ? x[seen[j]] * s->penalty : x[seen[j]] / s->penalty;",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-row-not-restored",
        "the penalized values stay in the logits after the native sampling call",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "      if (seen[j] < n) x[seen[j]] = s->saved[j];",
                "      if (0) x[seen[j]] = s->saved[j];",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-nan-unnoticed",
        "a NaN in the row's vectors no longer sends the token to torch",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) return -1;",
                "",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-top-p-keeps-too-few",
        "top-p in the native call ignores min_tokens_to_keep",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "    for (int64_t i = 0; i < m - keep; i++) {\n      cum += s->work[s->order[i]];",
                "    for (int64_t i = 0; i < m; i++) {\n      cum += s->work[s->order[i]];",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-min-p-keeps-too-few",
        "min-p in the native call ignores min_tokens_to_keep",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "    for (int64_t i = 0; i < m - keep; i++)\n      if (s->work[s->order[i]] < floor)",
                "    for (int64_t i = 0; i < m; i++)\n      if (s->work[s->order[i]] < floor)",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-temperature-by-reciprocal",
        "the native call multiplies by 1 / temperature (not torch's division: other roundings)",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "      s->val[m++] = divide ? x[i + b] / t : x[i + b];",
                "      s->val[m++] = divide ? x[i + b] * (1.0f / t) : x[i + b];",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-sample-prompt-ignore-length-ignored",
        "the repetition penalty's prompt_ignore_length is dropped on the native call",
        (
            (
                "hf_sparsity/inference/sampling.py",
                's.penalty, self.skip = penalty["penalty"], penalty["prompt_ignore_length"] or 0',
                's.penalty, self.skip = penalty["penalty"], 0',
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-argmax-skips-nan",
        "the native step's argmax passes over NaN logits (torch.argmax takes the first NaN)",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "if (y[i] > y[best] || (y[i] != y[i] && y[best] == y[best])) best = i;",
                "if (y[i] > y[best]) best = i;",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-argmax-last-of-ties",
        "the native step's argmax takes the last of tied largest logits (torch.argmax: the first)",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "if (y[i] > y[best] || (y[i] != y[i] && y[best] == y[best])) best = i;",
                "if (y[i] >= y[best] || (y[i] != y[i] && y[best] == y[best])) best = i;",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-stops-ignore-eos",
        "the one end-of-sequence rule (native_generate's criteria on ints, greedy_decode) ignores eos ids",
        (("hf_sparsity/inference/loop.py", "return tok in eos or (", "return False or ("),),
        ("tests/test_native_sampling.py", "tests/test_decoding.py"),
    ),
    Mutation(
        "loop-one-token-past-the-limit",
        "the end-of-sequence rule ends a sequence one token after its length limit",
        (("hf_sparsity/inference/loop.py", "length >= max_length)", "length > max_length)"),),
        ("tests/test_decoding.py",),
    ),
    Mutation(
        "eos-ids-first-only",
        "of several end-of-sequence ids only the first ends a sequence",
        (("hf_sparsity/inference/loop.py", "reshape(-1).tolist()}", "reshape(-1).tolist()[:1]}"),),
        ("tests/test_decoding.py",),
    ),
    Mutation(
        "streamer-not-read-from-generate",
        "native_generate no longer finds the streamer generate was given",
        (("hf_sparsity/hooks.py", "            if frame.f_code is code:", "            if False:"),),
        (
            "tests/test_hooks.py",
            "tests/test_native_generate.py::test_streamer_and_stopping_criteria_see_what_generate_gives_them",
        ),
    ),
    Mutation(
        "own-loop-drops-the-streamer",
        "generate's own loop, run where the native step does not, is not handed the streamer",
        (
            (
                "hf_sparsity/hooks.py",
                'GENERATE_LOOPS = {"_sample": True,',
                'GENERATE_LOOPS = {"_sample": False,',
            ),
        ),
        ("tests/test_hooks.py",),
    ),
    Mutation(
        "top-p-field-misread",
        "the processor hook no longer reads top-p / min-p's min_tokens_to_keep",
        (
            (
                "hf_sparsity/hooks.py",
                'keys = (name, "min_tokens_to_keep", "filter_value")',
                'keys = (name, "filter_value")',
            ),
        ),
        ("tests/test_hooks.py",),
    ),
    Mutation(
        "merge-forgets-the-engine",
        "merge_sparse no longer finds the masks of the engine that ran on the peft model",
        (
            (
                "hf_sparsity/lora/view.py",
                "_ENGINE_STATE[self.peft_model] = (engine.state_, engine.config)",
                "pass",
            ),
        ),
        ("tests/test_lora.py",),
    ),
    Mutation(
        "auto-choices-forgotten",
        "sparsify_for_inference('auto') no longer records its choices for auto_choices / auto_report",
        (("hf_sparsity/inference/conversion.py", "_AUTO_CHOICES[model_u] = choices", "pass"),),
        ("tests/test_inference.py::test_auto_matches_dense_records_choices_frees_memory_and_restores",),
    ),
    Mutation(
        "native-argmax-vectors-skip-nan",
        "the native step's vector argmax passes over NaN logits",
        (("hf_sparsity/backends/csrc/decode.c", "    if (nan) {", "    if (0) {"),),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-argmax-vectors-last-of-ties",
        "the native step's vector argmax takes the last vector holding the largest logit",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "    for (i = 0; i + 16 <= n; i += 16) {\n      const __mmask16 eq",
                "    for (i = (n / 16 - 1) * 16; i >= 0; i -= 16) {\n      const __mmask16 eq",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-exp8-coefficient",
        "the step's exp (EXP_POLY: exp8 on AVX2, exp16) with a wrong polynomial coefficient (0.4 for 0.5)",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "_mm##W##_set1_ps(5.0000001201E-1f)",
                "_mm##W##_set1_ps(4.0E-1f)",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",),
    ),
    Mutation(
        "native-exp8-scale-in-one-piece",
        "exp8 builds 2^n in one piece: e^88.38 overflows to inf, e^-88.38 turns into -inf",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "lo = _mm256_srai_epi32(ni, 1)",
                "lo = _mm256_setzero_si256()",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",),
    ),
    Mutation(
        "native-exp8-sum-half",
        "the AVX2 softmax sum leaves out the upper four lanes of its double accumulators",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "den = (part[0] + part[1]) + (part[2] + part[3]);",
                "den = part[0] + part[1];",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",),
    ),
    Mutation(
        "native-silu8-sign",
        "the AVX2 SiLU takes e^g for e^-g",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));",
                "const __m256 e = exp8(a);",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",),
    ),
    Mutation(
        "native-attn-qk-tail-dropped",
        "the blocked q.k (eight keys) drops the head dimensions past the last multiple of 8",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "for (int64_t i = hd8; i < hd; i++) s += q[i] * k[j * hd + i];",
                "for (int64_t i = hd; i < hd; i++) s += q[i] * k[j * hd + i];",
            ),
        ),
        (
            "tests/test_native_step_vectors.py",
            "tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",
        ),
    ),
    Mutation(
        "native-attn-qk-keys-swapped",
        "the blocked q.k's lane sums give keys 2, 3 the scores of keys 0, 1 and back",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "_mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]))",
                "_mm256_hadd_ps(_mm256_hadd_ps(a[2], a[3]), _mm256_hadd_ps(a[0], a[1]))",
            ),
        ),
        (
            "tests/test_native_step_vectors.py",
            "tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",
        ),
    ),
    Mutation(
        "native-attn-pv-probability-reused",
        "the four-key p.v pass weighs the third key's values by the second key's probability",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "o = _mm256_fmadd_ps(p2, _mm256_loadu_ps(v + 2 * hd + i), o);",
                "o = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v + 2 * hd + i), o);",
            ),
        ),
        (
            "tests/test_native_step_vectors.py",
            "tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",
        ),
    ),
    Mutation(
        "native-argmax8-last-of-ties",
        "the AVX2 argmax takes the last of tied largest logits within a vector of 8",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "if (eq) return i + __builtin_ctz(eq);\n    }\n#endif",
                "if (eq) return i + 31 - __builtin_clz(eq);\n    }\n#endif",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",),
    ),
    Mutation(
        "native-argmax8-skips-nan",
        "the AVX2 argmax's vector pass forgets the NaNs it saw",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "nan = _mm256_movemask_ps(un) != 0;",
                "nan = 0;",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_at_the_avx2_and_scalar_levels[vectors-avx2]",),
    ),
    Mutation(
        "native-sample-temperature-ties-missed",
        "top-k with a temperature above 1 misses the ids whose quotient ties with the k-th largest's",
        (("hf_sparsity/backends/csrc/sample.c", "      if (below / t != kth) break;", "      break;"),),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-top-p-candidates-never-grow",
        "top-p without top-k gives up after 64 candidates instead of growing them to the room",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "    if (K >= s->cap || K >= n) return -1;",
                "    return -1;",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-top-p-decides-on-too-few-candidates",
        "top-p without top-k decides among candidates that hold less than p of the probability",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "    if ((float)(1.0 - mass) <= limit || m == n) {",
                "    if (1) {",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-top-p-keeps-one",
        "top-p without top-k keeps one token at least, not min_tokens_to_keep",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "if (m - 1 - r >= keep && (float)(1.0 - above) <= limit)",
                "if (m - 1 - r >= 1 && (float)(1.0 - above) <= limit)",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "native-top-p-denominator-without-temperature",
        "the whole row's softmax denominator of top-p leaves the temperature out",
        (
            (
                "hf_sparsity/backends/csrc/sample.c",
                "    if (divide) y = _mm512_div_ps(y, _mm512_set1_ps(t));",
                "",
            ),
        ),
        ("tests/test_native_sampling.py",),
    ),
    Mutation(
        "per-layer-logs-without-arrangement",
        "SparsityCallback logs its per-layer values without arrange_logging: they reach no reporter and "
        "flood Trainer's console line",
        (
            (
                "hf_sparsity/callback.py",
                "if self.log_layers and logging_arranged(self):",
                "if self.log_layers:",
            ),
        ),
        ("tests/test_logging.py::test_without_arrange_logging_the_callbacks_stay_as_trainer_built_them",),
    ),
    Mutation(
        "arrange-logging-keeps-plain-printer",
        "arrange_logging lists the callback first but keeps Trainer's plain console printer, which prints "
        "every per-layer value",
        (
            (
                "hf_sparsity/logging_utils.py",
                "        trainer.add_callback(_console_printer(cb, console_layers))",
                "        trainer.add_callback(cb)",
            ),
        ),
        ("tests/test_logging.py",),
    ),
    Mutation(
        "recipe-metrics-callback-after-reporters",
        "spdf.py leaves its metrics callback where Trainer lists it, after TensorBoard (the dense stage's "
        "FLOPs and the sparse model's config section never reach TensorBoard)",
        (("recipes/spdf.py", "    arrange_logging(trainer, metrics_cb)\n", ""),),
        ("tests/test_recipes.py::test_recipe_smoke[spdf]",),
    ),
    Mutation(
        "recipe-interrupted-stage-goes-on",
        "imp.py goes on to the IMP stage after a preemption stopped the dense baseline",
        (
            (
                "recipes/imp.py",
                "        if dense is None:\n            return None\n        stages.append(dense)",
                "        if dense is not None:\n            stages.append(dense)",
            ),
        ),
        ("tests/test_recipes.py::test_an_interrupted_first_stage_stops_the_recipe_and_resume_runs_the_rest",),
    ),
    Mutation(
        "int8-head-off-by-default",
        "values='int8' leaves the LM head float unless head='int8' is asked for",
        (
            (
                "hf_sparsity/inference/conversion.py",
                '    return head or "int8"',
                '    return head or "float32"',
            ),
        ),
        ("tests/test_int8_head.py::test_int8_head_logits_match_their_float64_definition",),
    ),
    Mutation(
        "int8-head-float32-ignored",
        "head='float32' still converts the LM head to int8",
        (
            (
                "hf_sparsity/inference/conversion.py",
                '    if head == "int8":  # the int8 LM head',
                "    if head:  # the",
            ),
        ),
        ("tests/test_int8_head.py::test_head_float32_keeps_the_float_head_and_embedding_bit_exact",),
    ),
    Mutation(
        "int8-head-float-activations-ignored",
        "the int8 head quantizes its activations even with activations='float32'",
        (
            (
                "hf_sparsity/inference/conversion.py",
                'for k in ("threads", "activations", "kernel")',
                'for k in ("threads",)',
            ),
        ),
        ("tests/test_int8_head.py::test_int8_head_logits_match_their_float64_definition",),
    ),
    Mutation(
        "int8-embedding-without-scales",
        "the input embedding tied to the int8 head returns the codes without their row scales",
        (
            (
                "hf_sparsity/inference/conversion.py",
                "rows = codes.index_select(0, flat).float().mul_(scales.index_select(0, flat)[:, None])",
                "rows = codes.index_select(0, flat).float()",
            ),
        ),
        (
            "tests/test_int8_head.py::test_tied_embedding_reads_the_dequantized_codes_exactly_and_frees_the_float_table",
        ),
    ),
    Mutation(
        "int8-head-tie-missed",
        "a tied input embedding keeps its float table beside the int8 head (memory doubled, codes unshared)",
        (
            (
                "hf_sparsity/inference/conversion.py",
                "tied = isinstance(emb, nn.Embedding) and emb.weight is head.weight",
                "tied = False",
            ),
        ),
        (
            "tests/test_int8_head.py::test_tied_embedding_reads_the_dequantized_codes_exactly_and_frees_the_float_table",
        ),
    ),
    Mutation(
        "int8-embedding-restored-untied",
        "restore_dense gives the embedding a copy of the head's weight instead of the head's weight (untied)",
        (
            (
                "hf_sparsity/inference/conversion.py",
                "            emb.weight = w\n",
                "            emb.weight = nn.Parameter(w.detach().clone())\n",
            ),
        ),
        (
            "tests/test_int8_head.py::test_tied_embedding_reads_the_dequantized_codes_exactly_and_frees_the_float_table",
        ),
    ),
    Mutation(
        "native-int8-embedding-unscaled",
        "the native step looks up the int8 embedding's codes without their row scale",
        (("hf_sparsity/backends/csrc/decode.c", "x[i] = (float)c[i] * s;", "x[i] = (float)c[i];"),),
        ("tests/test_int8_head.py::test_native_step_reads_the_int8_embedding_and_head",),
    ),
    Mutation(
        "auto-report-needs-group",
        "auto_report reads every choice's group: the int8 LM head's row (no group) ends in a KeyError",
        (("hf_sparsity/inference/conversion.py", 'group = c.get("group") or (', 'group = c["group"] or ('),),
        ("tests/test_int8_head.py::test_cli_show_choices_with_int8_values_lists_the_int8_head",),
    ),
    Mutation(
        "cli-head-dropped",
        "hf_sparsity generate --head float32 does not reach sparsify_for_inference",
        (("hf_sparsity/cli/generate.py", '        values["head"] = args.head', "        pass"),),
        ("tests/test_int8_head.py::test_cli_generate_int8_head_by_default_and_head_float32",),
    ),
    Mutation(
        "int8-head-without-int8-values-accepted",
        "head='int8' without values='int8' is not refused",
        (
            (
                "hf_sparsity/inference/conversion.py",
                '        if head == "int8":\n            raise SparsityError(',
                "        if False:\n            raise SparsityError(",
            ),
        ),
        ("tests/test_int8_head.py::test_head_option_refusals_leave_the_model_untouched",),
    ),
    Mutation(
        "decode-user-isa-unchecked",
        "benchmarks/decode_user.py runs an --isa level the CPU lacks instead of refusing it",
        (("benchmarks/decode_user.py", "    if missing:\n", "    if False:\n"),),
        ("tests/test_decode_user_args.py",),
    ),
    Mutation(
        "decode-user-f32head-ignored",
        "benchmarks/decode_user.py reads NAME=FOLDER:int8:f32head as int8 with the int8 head",
        (("benchmarks/decode_user.py", 'head="float32" if len(opts) == 2 else None', "head=None"),),
        ("tests/test_decode_user_args.py",),
    ),
    Mutation(
        "avx2-q8-maddubs-saturates",
        "AVX2 int8 products: vpmaddubsw gets 2|w| (sums halved): exact unless a 16-bit pair saturates",
        (
            (
                "hf_sparsity/backends/csrc/packed_int8_avx2.c",
                "_mm256_maddubs_epi16(_mm256_abs_epi8(w),",
                "_mm256_maddubs_epi16(_mm256_add_epi8(_mm256_abs_epi8(w), _mm256_abs_epi8(w)),",
            ),
            (
                "hf_sparsity/backends/csrc/packed_int8_avx2.c",
                "return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));",
                "return _mm256_add_epi32(acc, _mm256_srai_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)),"
                " 1));",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx2-q8-bitmask-second-byte",
        "the AVX2 int8 bitmask expansion reads a 16-column step's second mask byte's codes from the first's",
        (
            (
                "hf_sparsity/backends/csrc/tables.h",
                "g_bm_c0[b][8 + i] = (uint8_t)__builtin_popcount((unsigned)b);",
                "g_bm_c0[b][8 + i] = 0;",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx2-q8-bitmask-clear-lanes",
        "the AVX2 int8 bitmask expansion's second mask byte gives its clear columns a code instead of 0",
        (
            (
                "hf_sparsity/backends/csrc/tables.h",
                "g_bm_c1[b][8 + i] = rank;",
                "g_bm_c1[b][8 + i] = rank & 0x7f;",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx2-q8-bitmask-pair-parity",
        "the AVX2 int8 bitmask kernel's two-block step adds its odd block into the even blocks' accumulators",
        (
            (
                "hf_sparsity/backends/csrc/packed_int8_avx2.c",
                "BM_Q8V_BLOCK(1, b + 1, k1);",
                "BM_Q8V_BLOCK(0, b + 1, k1);",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx2-q8-bitmask-odd-block-twice",
        "the AVX2 int8 bitmask kernel: after an odd count of whole blocks, the last whole one is read "
        "again as the short last block",
        (
            (
                "hf_sparsity/backends/csrc/packed_int8_avx2.c",
                "      BM_Q8V_BLOCK(b, b, k);\n      b++;\n",
                "      BM_Q8V_BLOCK(b, b, k);\n",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx512-int8-expand-not-zeroed",
        "the AVX-512 int8 x int8 bitmask expansion merges into its destination's old contents (no vpxord, no "
        "zero-masking): the pruned columns' lanes keep stale bytes",
        (
            (
                "hf_sparsity/backends/csrc/simd.h",
                '"vpxord %0, %0, %0\\n\\tvpexpandb %1, %0%{%2%}%{z%}" : "=&v"(w)',
                '"vpexpandb %1, %0%{%2%}" : "+v"(w)',
            ),
        ),
        ("tests/test_native_kernels.py::test_native_kernel_matches_emulator_at_every_width[bitmask-int8]",),
    ),
    Mutation(
        "avx512-fp32-bitmask-k64-lanes",
        "the AVX-512 float32-activation bitmask kernel's 64-column step takes each 16 columns' mask bits "
        "eight bits apart, not sixteen",
        (
            (
                "hf_sparsity/backends/csrc/packed_fp32.c",
                "(__mmask16)(k >> (16 * (i)));",
                "(__mmask16)(k >> (8 * (i)));",
            ),
        ),
        ("tests/test_native_kernels.py::test_native_kernel_matches_emulator_at_every_width[bitmask-fp32]",),
    ),
    Mutation(
        "avx512-fp32-bitmask-sums-dropped",
        "the AVX-512 float32-activation bitmask kernel drops its third sum (columns 32-47 of each 64)",
        (
            (
                "hf_sparsity/backends/csrc/packed_fp32.c",
                "z0 = _mm512_add_ps(z0, z2);",
                "z0 = _mm512_add_ps(z0, z0);",
            ),
        ),
        ("tests/test_native_kernels.py::test_native_kernel_matches_emulator_at_every_width[bitmask-fp32]",),
    ),
    Mutation(
        "avx512-fp32-bitmask-tail32-mask",
        "the AVX-512 float32-activation bitmask kernel's 32-column tail reads two mask bytes, not four",
        (("hf_sparsity/backends/csrc/packed_fp32.c", "memcpy(&k, m + g, 4);", "memcpy(&k, m + g, 2);"),),
        ("tests/test_native_kernels.py::test_native_kernel_matches_emulator_at_every_width[bitmask-bf16]",),
    ),
    Mutation(
        "avx2-fp32-bitmask-k64-byte",
        "the AVX2 float32-activation bitmask kernel's 64-column step reads a pair's second mask byte as "
        "its first",
        (
            (
                "hf_sparsity/backends/csrc/packed_fp32.c",
                "m1 = (uint32_t)(k >> (8 * i + 8)) & 255;",
                "m1 = (uint32_t)(k >> (8 * i)) & 255;",
            ),
        ),
        (
            "tests/test_native_kernels.py::"
            "test_every_isa_level_matches_emulator_at_every_width[csr-bitmask-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "gather-tail-unmasked",
        "the gathered kernel multiplies all eight values of a chunk (the next chunk's past its count)",
        (
            (
                "hf_sparsity/backends/csrc/packed_fp32.c",
                "_mm256_and_ps(loadv8_(V, BF, o), _mm256_load_ps((const float*)g_bmg_tail[BMG_N(c)]))",
                "loadv8_(V, BF, o)",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_native_kernel_matches_emulator_at_every_width[bitmask-gather-fp32]",
        ),
    ),
    Mutation(
        "gather-window-not-clamped",
        "a gathered chunk near a row's end starts at its first kept column, its window past the row",
        (
            (
                "hf_sparsity/backends/csrc/packed_fp32.c",
                "const int64_t base = c < in - 16 ? c : in - 16;",
                "const int64_t base = c;",
            ),
        ),
        ("tests/test_native_kernels.py::test_gathered_layout_is_the_greedy_chunking_of_the_mask",),
    ),
    Mutation(
        "gather-scalar-offset",
        "the scalar build's gathered kernel reads each chunk's columns from column 0, not from its base",
        (
            (
                "hf_sparsity/backends/csrc/packed_fp32.c",
                "s += VALB(V, BF, o + i) * xb[BMG_BASE(c) + (int64_t)((c >> (4 * i)) & 15)];",
                "s += VALB(V, BF, o + i) * xb[(int64_t)((c >> (4 * i)) & 15)];",
            ),
        ),
        (
            "tests/test_native_kernels.py::"
            "test_every_isa_level_matches_emulator_at_every_width[csr-bitmask-scalar-scalar-float]",
        ),
    ),
    Mutation(
        "gather-chosen-where-it-costs",
        "layout='auto' takes the gathered layout where it has more chunks than pays (50% sparse on AVX2)",
        (
            (
                "hf_sparsity/backends/formats/bitmask.py",
                "n * GATHER_CHUNK_GROUPS < rows * ((in_features + 7) // 8)",
                "n < rows * ((in_features + 7) // 8)",
            ),
        ),
        ("tests/test_native_kernels.py::test_gathered_layout_is_chosen_on_avx2_builds_where_it_pays",),
    ),
    Mutation(
        "gather-op-runs-the-mask-kernel",
        "op 5 (the gathered layout, the decoding step's fused calls included) runs the bitmask kernel on it",
        (("hf_sparsity/backends/csrc/api.c", "nm24_unpack_rows, bmg_rows};", "nm24_unpack_rows, bm_rows};"),),
        ("tests/test_native_kernels.py::test_gathered_layout_survives_copies_and_runs_in_fused_calls",),
    ),
    Mutation(
        "avx2-q8-odd-block-groups",
        "256-bit int8 products: an odd 64-column block into the even blocks' accumulators (wrong scales)",
        (("hf_sparsity/backends/csrc/packed_int8_avx2.c", "    if ((b) & 1) {  ", "    if (0) {        "),),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx2-q8-nm24-tail",
        "the AVX2 int8 2:4 kernel copies half of the last block's codes",
        (
            (
                "hf_sparsity/backends/csrc/packed_int8_avx2.c",
                "memcpy(tail, vb, (size_t)(cols / 2));",
                "memcpy(tail, vb, (size_t)(cols / 4));",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "avx-vnni-q8-no-correction",
        "AVX-VNNI int8 products start at 0, not at -128 times each group's code sum (unsigned weight codes)",
        (("hf_sparsity/backends/csrc/packed_int8_avx2.c", "#define Q8V_CORR 1", "#define Q8V_CORR 0"),),
        (
            "tests/test_native_kernels.py::"
            "test_every_isa_level_matches_emulator_at_every_width[int8-avx2-vnni-avx2-vnni-avx-vnni]",
        ),
    ),
    Mutation(
        "avx2-fused-not-quantized",
        "the fused products (the decoding step's q / k / v) quantize their input only on AVX-512 VNNI",
        (
            (
                "hf_sparsity/backends/csrc/api.c",
                "if (ok) quantize_q8(x, ps[0]->in, xq);",
                "if (ok && HFS_VNNI) quantize_q8(x, ps[0]->in, xq);",
            ),
        ),
        ("tests/test_native_kernels.py::test_decode_step_with_int8_activations_at_each_avx2_level",),
    ),
    Mutation(
        "avx2-quantize-code-order",
        "the AVX2 activation quantization stores its codes in vpackssdw's lane order, not column order",
        (
            (
                "hf_sparsity/backends/csrc/packed_int8_avx2.c",
                "const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);",
                "const __m256i order = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);",
            ),
        ),
        (
            "tests/test_native_kernels.py::test_every_isa_level_matches_emulator_at_every_width[int8-avx2-avx2-avx2]",
        ),
    ),
    Mutation(
        "isa-avx2-with-vnni",
        "HF_SPARSITY_NATIVE_ISA=avx2 also targets AVX-VNNI (no longer a Zen 2 / Zen 3 build)",
        (
            (
                "hf_sparsity/backends/_native.py",
                '"avx2": (["-march=x86-64-v3", "-mtune=native"],',
                '"avx2": (["-march=x86-64-v3", "-mavxvnni", "-mtune=native"],',
            ),
        ),
        ("tests/test_native_sources.py",),
    ),
    Mutation(
        "isa-no-cpu-check",
        "a level the CPU lacks builds anyway (and its library would fault on the first product)",
        (("hf_sparsity/backends/_native.py", "if flags and missing:", "if False:"),),
        ("tests/test_native_sources.py",),
    ),
    Mutation(
        "isa-scalar-silent",
        "a build that falls back to the scalar loops says nothing",
        (("hf_sparsity/backends/_native.py", 'if level != "scalar" and not lib.hfs_simd():', "if False:"),),
        ("tests/test_native_kernels.py::test_a_build_without_avx2_runs_scalar_with_one_logged_line",),
    ),
    Mutation(
        "spdy-buckets-rounded-down",
        "the speed-target program rounds each layer's time down to whole buckets (can overrun the budget)",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "cost = np.ceil(t / q).astype(np.int64)",
                "cost = np.floor(t / q).astype(np.int64)",
            ),
        ),
        (
            "tests/test_spdy.py::test_the_program_on_real_valued_times_keeps_the_real_budget_and_loses_at_most_a_bucket_a_layer",
        ),
    ),
    Mutation(
        "spdy-dp-keeps-first-not-best",
        "the program keeps the first level reaching a time instead of the one with the least error",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "            better = cand < new[c:]\n",
                "            better = new[c:] == np.inf\n",
            ),
        ),
        ("tests/test_spdy.py::test_the_program_finds_the_brute_force_optimum_on_integer_tables",),
    ),
    Mutation(
        "spdy-sweep-one-count",
        "the stacked SparseGPT sweep prunes every level with the first level's count",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "per_block[j][b]) for j in range(K)",
                "per_block[0][b]) for j in range(K)",
            ),
        ),
        ("tests/test_spdy.py::test_the_error_table_equals_pruning_each_layer_at_each_level",),
    ),
    Mutation(
        "spdy-fastest-budget-refused",
        "a target at exactly the sparsest levels' speed-up is refused (buckets rounded up never hold it)",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "    if float(t[np.arange(len(order)), order].sum()) <= budget:",
                "    if False:",
            ),
        ),
        ("tests/test_spdy.py::test_a_budget_at_exactly_the_fastest_total_gets_the_fastest_levels",),
    ),
    Mutation(
        "spdy-fastest-floor-running-sum",
        "the budget's floor is the fastest times' running sum, which can fall a bit below the DP's own sum",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "float(t.min(1).sum()))",
                "sum(min(r) for r in times))",
            ),
        ),
        ("tests/test_spdy.py::test_the_sparsest_uniform_rows_own_speed_up_is_planned_on_many_layers",),
    ),
    Mutation(
        "spdy-moves-leave-the-budget",
        "a level move is scored once its first sparser layer is chosen, within the budget or not",
        (("hf_sparsity/pruning/spdy_search.py", "            if within(move):", "            if True:"),),
        (
            "tests/test_spdy_search.py::test_level_moves_reach_the_least_loss_in_the_budget_by_brute_force",
            "tests/test_spdy_search.py::test_a_layer_made_denser_is_paid_for_by_up_to_three_sparser_ones",
        ),
    ),
    Mutation(
        "spdy-moves-keep-the-last",
        "every level move is kept, whatever its loss",
        (
            (
                "hf_sparsity/pruning/spdy_search.py",
                "        if loss < best_loss:\n            best_pick, best_loss, kept",
                "        if True:\n            best_pick, best_loss, kept",
            ),
        ),
        ("tests/test_spdy_search.py::test_level_moves_reach_the_least_loss_in_the_budget_by_brute_force",),
    ),
    Mutation(
        "spdy-moves-one-payer",
        "a layer made denser is paid for by one sparser layer only: a big layer never moves",
        (("hf_sparsity/pruning/spdy_search.py", "_PAY_LAYERS = 3", "_PAY_LAYERS = 1"),),
        ("tests/test_spdy_search.py::test_a_layer_made_denser_is_paid_for_by_up_to_three_sparser_ones",),
    ),
    Mutation(
        "spdy-moves-never-asked",
        "the program's plan gives the search no budget check: no level move runs",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "fits[0] if fits else None, lambda p: float(t[np.arange(len(p)), p].sum()) <= budget,",
                "fits[0] if fits else None,",
            ),
        ),
        ("tests/test_spdy_search.py::test_every_scored_loss_is_the_models_own_loss_at_those_levels",),
    ),
    Mutation(
        "spdy-search-keeps-the-last",
        "SPDY's search keeps the last candidate it scored, not the one of least calibration loss",
        (
            (
                "hf_sparsity/pruning/spdy_search.py",
                "= loss_of(pick)\n        if loss < best_loss:\n            best_c",
                "= loss_of(pick)\n        if True:\n            best_c",
            ),
        ),
        (
            "tests/test_spdy_search.py::test_the_search_keeps_the_least_loss_scores_each_assignment_once_and_keeps_the_budget",
        ),
    ),
    Mutation(
        "spdy-search-leaves-database-weights",
        "scoring a candidate leaves the database's weights in the model (not restored)",
        (
            (
                "hf_sparsity/pruning/spdy_search.py",
                "            for n, w in saved.items():\n"
                "                self.model.get_parameter(n).copy_(w)\n",
                "",
            ),
        ),
        ("tests/test_spdy_search.py::test_every_scored_loss_is_the_models_own_loss_at_those_levels",),
    ),
    Mutation(
        "spdy-search-uniform-start-inverted",
        "the uniform start multiplies each layer's errors by e_l(s_u) instead of dividing",
        (
            (
                "hf_sparsity/pruning/spdy_search.py",
                "1.0 / np.maximum(e[:, seed_levels], 1e-12)",
                "np.maximum(e[:, seed_levels], 1e-12)",
            ),
        ),
        (
            "tests/test_spdy_search.py::test_the_search_keeps_the_least_loss_scores_each_assignment_once_and_keeps_the_budget",
        ),
    ),
    Mutation(
        "spdy-search-loss-unshifted",
        "the calibration loss scores each token's own logits instead of the next token's",
        (
            (
                "hf_sparsity/pruning/spdy_search.py",
                "logits = x[0, :-1].double()",
                "logits = x[0, 1:].double()",
            ),
        ),
        ("tests/test_spdy_search.py::test_every_scored_loss_is_the_models_own_loss_at_those_levels",),
    ),
    Mutation(
        "spdy-wanda-error-unsquared",
        "Wanda's error at a level sums |w|·‖x‖² instead of w²·‖x‖²",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "contrib = (W.detach().double() ** 2) * sq_norm",
                "contrib = W.detach().double().abs() * sq_norm",
            ),
        ),
        ("tests/test_spdy.py::test_the_error_table_equals_pruning_each_layer_at_each_level",),
    ),
    Mutation(
        "spdy-budget-ignores-the-rest",
        "the time budget forgets the rest of the step (LM head, attention): the model misses the target",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "budget = max(dense / speedup - table.other_ms, float(",
                "budget = max(dense / speedup, float(",
            ),
        ),
        ("tests/test_spdy.py::test_the_chosen_levels_are_exact_per_layer_and_keep_the_budget",),
    ),
    Mutation(
        "spdy-levels-not-applied",
        "the chosen levels are planned but every layer is pruned at the config's level",
        (
            (
                "hf_sparsity/pruning/spdy.py",
                "num_zeros(plan.levels.get(d.name, float(d.sparsity)), d.numel)",
                "num_zeros(float(d.sparsity), d.numel)",
            ),
        ),
        ("tests/test_spdy.py::test_the_chosen_levels_are_exact_per_layer_and_keep_the_budget",),
    ),
    Mutation(
        "spdy-unreachable-not-refused",
        "a target above what the grid reaches is not refused up front",
        (("hf_sparsity/pruning/spdy.py", "    if speedup > top * (1 + 1e-9):", "    if False:"),),
        ("tests/test_spdy.py::test_a_target_above_the_grid_is_refused_before_pruning",),
    ),
    Mutation(
        "auto-int8-check-no-margin",
        "with int8 values the whole-model check keeps a plan that ties with the int8 dense GEMV model",
        (
            (
                "hf_sparsity/backends/auto/backend.py",
                "    keep_at = INT8_GEMV_MARGIN if base else 1.0",
                "    keep_at = 1.0",
            ),
        ),
        ("tests/test_int8_values.py::test_auto_int8_whole_model_check_is_against_the_int8_dense_gemv",),
    ),
    Mutation(
        "head-screen-no-lower-bound",
        "the screen keeps the rows whose copy's logit plus bound reaches the largest copy's logit, not the "
        "largest lower bound",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "    lo[r] = (double)A[r] - (double)E[r] * nx;",
                "    lo[r] = (double)A[r];",
            ),
        ),
        ("tests/test_head_screen.py::test_the_largest_logit_survives_a_copy_that_overshoots_another_row",),
    ),
    Mutation(
        "head-screen-compares-the-copy",
        "the screen picks among its rows by the int8 copy's logits, never computing them on the head",
        (("hf_sparsity/backends/csrc/decode.c", "    j.fn(&j, r, r + 1);\n", "    (void)j;\n"),),
        (
            "tests/test_head_screen.py::test_screen_picks_the_first_of_an_exact_tie_and_the_larger_of_a_near_one",
        ),
    ),
    Mutation(
        "head-screen-last-of-a-tie",
        "the screen takes the last of equal largest logits, not the first (torch.argmax's)",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "if (best < 0 || A[r] > A[best]) best = r;",
                "if (best < 0 || A[r] >= A[best]) best = r;",
            ),
        ),
        (
            "tests/test_head_screen.py::test_screen_picks_the_first_of_an_exact_tie_and_the_larger_of_a_near_one",
        ),
    ),
    Mutation(
        "head-screen-top-k-no-penalty",
        "the top-k screen bounds the seen ids' logits without the repetition penalty the sampler applies",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "  if (penalty > 0.0f)\n    for (int64_t j = 0; j < n_seen; j++) {",
                "  if (0)\n    for (int64_t j = 0; j < n_seen; j++) {",
            ),
        ),
        ("tests/test_head_screen.py::test_top_k_screen_keeps_every_survivor_exactly",),
    ),
    Mutation(
        "head-screen-top-k-from-upper-bounds",
        "the top-k screen's threshold is the k-th largest upper bound, not lower bound",
        (
            (
                "hf_sparsity/backends/csrc/decode.c",
                "    const double v = lo[r];",
                "    const double v = hi[r];",
            ),
        ),
        ("tests/test_head_screen.py::test_top_k_screen_keeps_every_survivor_exactly",),
    ),
    Mutation(
        "head-screen-top-k-keeps-the-copy",
        "the top-k screen leaves the copy's logits in the rows it drops instead of -inf",
        (("hf_sparsity/backends/csrc/decode.c", "      d->logits[r] = -INFINITY;", "      (void)0;"),),
        ("tests/test_head_screen.py::test_top_k_screen_keeps_every_survivor_exactly",),
    ),
    Mutation(
        "head-screen-top-k-with-logits-kept",
        "sampling screens the head when output_logits asks for the raw logits",
        (
            (
                "hf_sparsity/inference/decoding.py",
                "sampler = processing.sampler if do_sample and not keep_scores and not keep_logits else None",
                "sampler = processing.sampler if do_sample and not keep_scores else None",
            ),
        ),
        ("tests/test_head_screen.py::test_sampling_draws_the_same_tokens_with_the_screen",),
    ),
    Mutation(
        "head-screen-biased-head",
        "a head with a bias gets a screen (its copy has no bias)",
        (
            (
                "hf_sparsity/inference/native_step.py",
                'if getattr(head, "bias", None) is not None or prep.op not in _ROW_OPS',
                "if prep.op not in _ROW_OPS",
            ),
        ),
        ("tests/test_head_screen.py::test_heads_the_screen_does_not_take_run_whole",),
    ),
    Mutation(
        "head-screen-with-logits-kept",
        "generate screens the head when output_logits asks for the logits",
        (
            (
                "hf_sparsity/inference/decoding.py",
                "screened = step_argmax and not keep_logits",
                "screened = step_argmax",
            ),
        ),
        ("tests/test_head_screen.py::test_greedy_loops_give_the_same_tokens_with_the_screen",),
    ),
)

NEW_TEST_FILES = (
    "tests/test_realistic_decode.py",
    "tests/test_refusals.py",
    "tests/test_bad_branches.py",
    "tests/test_exact_internals.py",
    "tests/test_host_sync.py",
    "tests/test_native_sampling.py",
    "tests/test_spdy.py",
    "tests/test_spdy_search.py",
    "tests/test_native_step_vectors.py",
)
"""The test files written with the last mutations above (their entries name the test that catches each);
``--before`` leaves them out (what the suite caught without them)."""


def _new(test: str) -> bool:
    return test.split("::")[0] in NEW_TEST_FILES


PYTEST_MARKS: tuple[str, ...] = ()  # ("-m", "not slow") with --not-slow


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
        tests = sorted(m.tests, key=lambda t: not _new(t))  # the targeted tests first (-x stops there)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *PYTEST_MARKS, *tests],
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
    args = sys.argv[1:]
    before = "--before" in args
    global PYTEST_MARKS
    if "--not-slow" in args:
        PYTEST_MARKS = ("-m", "not slow")
    args = [a for a in args if a not in ("--before", "--not-slow")]
    chosen = [m for m in MUTATIONS if not args or any(a in m.name for a in args)]
    if before:  # the same mutations against the tests that existed before the new files
        chosen = [replace(m, tests=tuple(t for t in m.tests if not _new(t))) for m in chosen]
    missed = 0
    for m in chosen:
        caught, detail, secs = run(m)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'}  {m.name:<28} {secs:6.1f}s  {m.what}\n        {detail}")
    print(f"{len(chosen) - missed}/{len(chosen)} mutations caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
