"""Shared fixtures: tiny random models built from configs, and the offline data in ../shared/data."""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
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


def wikitext2_head_data_dir(folder: Path, lines: int = 40) -> Path:
    """A data folder laid out as ``../shared/data`` (its tokenizers and corpus linked) whose WikiText-2 test
    file is the first ``lines`` lines of the real one (40: 1,746 GPT-2 tokens), for runs that evaluate a
    few windows: the same first windows, without tokenizing the whole test split each time."""
    shared = shared_data_dir()
    wiki = Path("text", "wikitext-2-raw", "wiki.test.raw")
    (folder / wiki).parent.mkdir(parents=True)
    for part in ("tokenizer", "corpus"):
        (folder / part).symlink_to(shared / part, target_is_directory=True)
    with open(shared / wiki, encoding="utf-8", newline="") as f:
        head = "".join(itertools.islice(f, lines))
    (folder / wiki).write_text(head, encoding="utf-8", newline="")
    return folder


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


# ---------------------------------------------------------------------- parallel runs (pytest-xdist, -n 2)
WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in a worker; None in a plain run
# DeepSpeed's CPU backend compiles a C++ op (torch.utils.cpp_extension, deepspeed_shm_comm) when a launched
# run starts, cached under one name: two checkouts with different environments on one machine would each
# rebuild it in turn, for every run. A folder per Python environment builds it once per environment.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "torch_extensions",
        "env-" + hashlib.sha256(sys.prefix.encode()).hexdigest()[:12],
    ),
)
if WORKER:
    # Each worker gets one core's share: one intra-op thread here and in the processes tests start
    # (launchers set their own OMP_NUM_THREADS=1). Tests that check thread counts set them themselves.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


# Handed out first, in this order (the longest work first, so none starts last and leaves a worker idle at
# the end: the files that go to one worker whole and the longest single tests, longest first); then the
# other slow tests, then the rest, each in file order. An ordering only: a file may go.
FIRST = (
    "test_deepspeed_zero3_resume.py",
    "test_frontier.py",
    "test_deepspeed.py",
    "test_evaluation.py",
    "test_resume_after_crash.py",
    "test_recipes_ddp.py",
    "test_fsdp2.py",
    "test_ddp.py",
    "test_native_kernels.py",
    "test_gpu_check.py",
)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the slow tests first (see FIRST); the same order in every worker."""
    if not WORKER:
        return

    def rank(item):
        name = item.path.name
        slow = item.get_closest_marker("slow") is not None
        return (not slow, FIRST.index(name) if slow and name in FIRST else len(FIRST))

    items.sort(key=rank)  # stable: the rest stay in file order


_module_fixtures: dict[str, bool] = {}


def _shares_a_module_fixture(path: str) -> bool:
    """Whether the test file defines a module-scoped fixture (a training run, a built wheel)."""
    if path not in _module_fixtures:
        try:
            text = (REPO / path).read_text(encoding="utf-8")
        except OSError:
            text = ""
        _module_fixtures[path] = 'scope="module"' in text
    return _module_fixtures[path]


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook; ignored without it
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: each test goes to the next free worker, except that the tests of a file with a
    module-scoped fixture go to one worker together, so the fixture is built once. (pytest-xdist's own
    loadgroup, driven by ``xdist_group`` marks, does not group under pytest 9: it renames a node
    attribute pytest no longer reads.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByModuleFixture(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _shares_a_module_fixture(path) else nodeid

    config.option.loadscopereorder = False  # keep the collection's order (slow tests first)
    return ByModuleFixture(config, log)
