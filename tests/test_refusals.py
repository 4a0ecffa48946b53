"""Limits tested at the limit and one past it: the CLI's context check for generation, sparsity levels
0 and the top of [0, 1), N:M patterns, and greedy decoding's prompt / new-token counts. (The native
step's refusals, one per reason, are in test_realistic_decode.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from hf_sparsity.utils import SparsityError

from .realistic import generate_greedy, prompt, realistic_config, realistic_model


@pytest.fixture
def gpt2_dir(tmp_path):
    realistic_config("gpt2", positions=40).save_pretrained(tmp_path)
    return str(tmp_path)


def test_generation_that_uses_exactly_the_context_is_accepted_and_one_more_token_is_not(gpt2_dir):
    """The last new token is never fed back: a prompt of n tokens and m new ones use n + m - 1 positions."""
    from hf_sparsity.cli._checks import generate_fits

    ids = prompt(10)
    generate_fits(gpt2_dir, ids, 31)  # 10 + 31 - 1 = 40 positions: the model's 40
    with pytest.raises(
        SparsityError, match="exceed the model's context of 40 tokens: use --max-new-tokens 31"
    ):
        generate_fits(gpt2_dir, ids, 32)
    generate_fits(gpt2_dir, prompt(40), 1)  # a prompt of exactly the context, one new token
    with pytest.raises(SparsityError, match="shorten the prompt"):
        generate_fits(gpt2_dir, prompt(41), 1)


def test_the_model_really_runs_at_its_context_and_not_past_it():
    """What the check protects: GPT-2's position table has exactly 40 rows."""
    model = realistic_model("gpt2", positions=40)
    ids = prompt(10)
    assert generate_greedy(model, ids, 31).shape[1] == 41
    with pytest.raises((IndexError, RuntimeError)):
        with torch.no_grad():
            model(prompt(41))


def test_token_ids_at_the_last_embedding_row_and_one_past(gpt2_dir):
    from hf_sparsity.cli._checks import generate_fits

    generate_fits(gpt2_dir, torch.tensor([[0, 100]]), 1)  # vocabulary of 101: id 100 is the last row
    with pytest.raises(SparsityError, match="token id 101, but the model's embedding has 101 rows"):
        generate_fits(gpt2_dir, torch.tensor([[0, 101]]), 1)


@pytest.mark.parametrize("level", [0.0, 0, 0.5, math.nextafter(1.0, 0.0)])
def test_levels_from_0_to_just_below_1_are_accepted(level):
    from hf_sparsity import SparsityConfig

    assert SparsityConfig(sparsity=level).sparsity == float(level)


@pytest.mark.parametrize("level", [1.0, 1, -1e-12, float("nan"), True, "0.5"])
def test_levels_at_1_and_outside_are_refused(level):
    from hf_sparsity import SparsityConfig

    with pytest.raises(SparsityError, match="sparsity"):
        SparsityConfig(sparsity=level)


def test_level_0_keeps_every_weight_and_099_keeps_its_share():
    from hf_sparsity import SparsityConfig, SparsityEngine

    for level, kept in ((0.0, lambda n: n), (0.99, lambda n: n - round(0.99 * n))):
        model = realistic_model("llama")
        eng = SparsityEngine(model, SparsityConfig(sparsity=level, init_method="topk"))
        eng.build_masks()
        for name, m in eng.masks.items():
            assert int(m.sum()) == kept(m.numel()), (level, name)


@pytest.mark.parametrize("structure,ok", [("1:4", True), ("4:4", True), ("5:4", False), ("0:4", False)])
def test_nm_pattern_bounds(structure, ok):
    from hf_sparsity import SparsityConfig

    if ok:
        SparsityConfig(sparsity=0.0 if structure == "4:4" else 0.75, structure=structure)
    else:
        with pytest.raises(SparsityError, match="N:M pattern"):
            SparsityConfig(sparsity=0.5, structure=structure)


def test_greedy_decode_prompt_and_token_count_bounds():
    from hf_sparsity.inference.decoding import greedy_decode

    model = realistic_model("llama")
    out = greedy_decode(model, prompt(1), 1, eos_token_id=[])
    assert out.shape == (1, 2)
    with pytest.raises(SparsityError, match="at least 1"):
        greedy_decode(model, prompt(1), 0)
    with pytest.raises(SparsityError, match="one prompt"):
        greedy_decode(model, torch.zeros(1, 0, dtype=torch.long), 1)
