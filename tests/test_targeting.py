"""Default targeting across architectures, explicit overrides, and the dry run."""

import logging
import re

import pytest

from hf_sparsity import SparsityConfig, SparsityError, format_plan, plan_sparsity
from hf_sparsity.cli import main as cli_main

from .conftest import ARCHS, tiny_model

# What the default rule must pick in every block, per architecture.
EXPECTED = {
    "gpt2": {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"},
    "llama": {f"self_attn.{p}_proj" for p in "qkvo"} | {f"mlp.{p}_proj" for p in ("gate", "up", "down")},
    "gpt_neox": {"attention.query_key_value", "attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"},
    "opt": {f"self_attn.{p}_proj" for p in "qkv"} | {"self_attn.out_proj", "fc1", "fc2"},
}


@pytest.mark.parametrize("arch", ARCHS)
def test_default_rule_picks_projections_and_ffn_only(arch):
    model = tiny_model(arch)
    plan = plan_sparsity(model, SparsityConfig(sparsity=0.5))
    picked = {d.name for d in plan if d.sparsify}
    want = set()
    for name, _ in model.named_parameters():
        m = re.search(r"\.(\d+)\.(.*)\.weight$", name)
        if m and m.group(2) in EXPECTED[arch]:
            want.add(name)
    assert picked == want and len(want) == 2 * len(EXPECTED[arch])
    for d in plan:
        if not d.sparsify:
            assert d.rule.startswith("default: skip")
    names = {d.name for d in plan}
    emb = model.get_input_embeddings().weight
    emb_name = next(n for n, p in model.named_parameters() if p is emb)
    assert emb_name in names and emb_name not in picked
    assert not any("norm" in n or "ln_" in n or n.endswith("bias") or "lm_head" in n for n in picked)


def test_tied_weight_is_never_a_default_target():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.layers[0].mlp.up_proj.weight  # tie a projection to the output head
    plan = {d.name: d for d in plan_sparsity(model, SparsityConfig(sparsity=0.5))}
    assert not plan["model.layers.0.mlp.up_proj.weight"].sparsify
    assert "embedding" in plan["model.layers.0.mlp.up_proj.weight"].rule


def test_explicit_patterns_override_the_default():
    model = tiny_model("llama")
    c = SparsityConfig(
        sparsity=0.5,
        param_name_patterns={"mlp": {"sparsity": 0.8, "init_method": "topk"}, "lm_head": {"seed": 5}},
    )
    plan = {d.name: d for d in plan_sparsity(model, c)}
    assert (
        plan["lm_head.weight"].sparsify and plan["lm_head.weight"].seed == 5
    )  # excluded by default, named here
    up = plan["model.layers.1.mlp.up_proj.weight"]
    assert (up.sparsify, up.sparsity, up.init_method) == (True, 0.8, "topk")
    assert not plan["model.layers.0.self_attn.q_proj.weight"].sparsify
    assert "param_name_patterns 'mlp'" in up.rule


def test_param_filter_globs_and_groups():
    model = tiny_model("gpt2")
    c = SparsityConfig.from_dict(
        [
            {"sparsity": 0.9, "param_filter": "*.mlp.c_fc.weight"},
            {"sparsity": 0.3},  # everything else the default rule takes
        ]
    )
    plan = {d.name: d for d in plan_sparsity(model, c) if d.sparsify}
    assert plan["transformer.h.0.mlp.c_fc.weight"].sparsity == 0.9
    assert plan["transformer.h.0.attn.c_attn.weight"].sparsity == 0.3
    assert "group 0: param_filter" in plan["transformer.h.1.mlp.c_fc.weight"].rule


def test_pattern_matching_nothing_is_an_error():
    with pytest.raises(SparsityError, match=r"'ffn\.\*weight' matches no parameter.*hf_sparsity validate"):
        plan_sparsity(tiny_model("gpt2"), SparsityConfig(sparsity=0.5, param_name_patterns="ffn.*weight"))


def test_validate_cli_lists_every_parameter(tmp_path, capsys):
    model = tiny_model("gpt_neox")
    model.config.save_pretrained(tmp_path / "m")
    (tmp_path / "p.yaml").write_text("model: {}\nsparsity:\n  sparsity: 0.6\n  init_method: topk\n")
    assert cli_main(["validate", "--config", str(tmp_path / "p.yaml"), "--model", str(tmp_path / "m")]) == 0
    out = capsys.readouterr().out
    for name, _ in model.named_parameters():
        assert name in out
    assert "gpt_neox.layers.0.attention.query_key_value.weight" in out and "0.6000" in out
    assert "default: skip embedding" in out
    assert out == format_plan(plan_sparsity(model, SparsityConfig(sparsity=0.6, init_method="topk"))) + "\n"
    # Bad input: an error message on stderr and exit code 2, no traceback.
    (tmp_path / "bad.yaml").write_text("sparsity:\n  sparsity: 1.5\n")
    assert cli_main(["validate", "--config", str(tmp_path / "bad.yaml"), "--model", str(tmp_path / "m")]) == 2
    assert "outside [0, 1)" in capsys.readouterr().err


def test_debug_log_lists_the_plan(caplog):
    from hf_sparsity.mask_engine.engine import SparsityEngine

    with caplog.at_level(logging.DEBUG, logger="hf_sparsity"):
        SparsityEngine(tiny_model("gpt2"), SparsityConfig(sparsity=0.5))
    assert "transformer.h.0.attn.c_attn.weight" in caplog.text and "default: Conv1D weight" in caplog.text


def test_trainer_debug_log_level_logs_the_plan(tmp_path, caplog):
    from hf_sparsity import SparsityCallback

    from .trainer_utils import make_trainer

    pkg = logging.getLogger("hf_sparsity")
    try:
        make_trainer(
            tiny_model("llama"), tmp_path / "a", [SparsityCallback(SparsityConfig(sparsity=0.5))], max_steps=1
        ).train()
        assert "model.layers.1.mlp.down_proj.weight" not in caplog.text  # quiet by default
        make_trainer(
            tiny_model("llama"), tmp_path / "b", [SparsityCallback(SparsityConfig(sparsity=0.5))],
            max_steps=1,
            log_level="debug",
        ).train()  # fmt: skip
        assert (
            "model.layers.1.mlp.down_proj.weight" in caplog.text and "default: skip embedding" in caplog.text
        )
    finally:
        pkg.setLevel(logging.NOTSET)
