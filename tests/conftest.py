"""Shared fixtures: tiny random models built from configs, and the offline data in ../shared/data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("HF_SPARSITY_SHARED_DATA", REPO.parent / "shared" / "data"))


def shared_data_dir() -> Path:
    """``../shared/data``: CI (HF_SPARSITY_REQUIRE_SHARED=1) fails without it; elsewhere the test skips."""
    if (SHARED_DATA / "README.md").is_file():
        return SHARED_DATA
    msg = f"../shared/data not found at {SHARED_DATA} (set HF_SPARSITY_SHARED_DATA to its location)"
    if os.environ.get("HF_SPARSITY_REQUIRE_SHARED") == "1":
        pytest.fail(msg + "; CI requires it.")
    pytest.skip(msg)


@pytest.fixture
def shared_data() -> Path:
    return shared_data_dir()


def tiny_config(arch: str, vocab: int = 128, layers: int = 2, hidden: int = 32):
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, OPTConfig

    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    if arch == "gpt2":
        return GPT2Config(n_layer=layers, n_embd=hidden, n_head=4, n_positions=64, **common)
    if arch == "llama":
        return LlamaConfig(
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **common,
        )
    if arch == "gpt_neox":
        return GPTNeoXConfig(
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=4 * hidden,
            num_attention_heads=4,
            max_position_embeddings=64,
            **common,
        )
    if arch == "opt":
        return OPTConfig(
            num_hidden_layers=layers,
            hidden_size=hidden,
            ffn_dim=4 * hidden,
            num_attention_heads=4,
            word_embed_proj_dim=hidden,
            max_position_embeddings=64,
            **common,
        )
    raise ValueError(arch)


def tiny_model(arch: str, seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kw))


ARCHS = ["gpt2", "llama", "gpt_neox", "opt"]


@pytest.fixture(autouse=True)
def _fresh_plan_cache(tmp_path_factory, monkeypatch):
    """Each test starts with an empty ``auto`` plan cache of its own (never the user's)."""
    monkeypatch.setenv("HF_SPARSITY_PLAN_CACHE", str(tmp_path_factory.mktemp("plans") / "plans.json"))
