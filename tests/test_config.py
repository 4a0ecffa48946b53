"""SparsityConfig: every input form of the Cerebras `sparsity:` section, round trips, and clear errors."""

import json

import pytest

from hf_sparsity import (
    SparsityConfig,
    SparsityConfigMixin,
    SparsityError,
    get_sparsity_config,
    set_sparsity_config,
)

from .conftest import tiny_config, tiny_model


def test_seed_forms():
    c = SparsityConfig.from_dict(
        {"sparsity": 0.3, "init_method": "topk", "param_name_patterns": "ffn.*weight"}
    )
    assert c.sparsity == 0.3 and c.init_method == "topk" and c.param_name_patterns == "ffn.*weight"
    c = SparsityConfig.from_dict(
        {"sparsity": 0.9, "param_name_patterns": ["dense_layer.weight", "linear.weight"]}
    )
    assert c.param_name_patterns == ["dense_layer.weight", "linear.weight"]
    c = SparsityConfig.from_dict(
        {
            "init_method": "topk",
            "seed": 1234,
            "param_name_patterns": {"fc_layers": {"sparsity": 0.3}, "attn": 0.4},
        }
    )
    assert c.param_name_patterns == {"fc_layers": {"sparsity": 0.3}, "attn": {"sparsity": 0.4}}
    assert SparsityConfig.from_dict(0.5).sparsity == 0.5


def test_later_cerebras_form_and_groups():
    c = SparsityConfig.from_dict(
        {"algorithm": "static", "sparsity": 0.5, "param_filter": ["*mlp*", "*attn*"]}
    )
    assert c.param_filter == ["*mlp*", "*attn*"]
    c = SparsityConfig.from_dict(
        [{"sparsity": 0.5, "param_filter": "*mlp*"}, {"sparsity": 0.25, "param_filter": "*attn*", "seed": 7}]
    )
    assert [g.sparsity for g in c.groups] == [0.5, 0.25] and c.groups[1].seed == 7


def test_yaml_section_beside_model_and_optimizer(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text(
        "model:\n  hidden_size: 32\noptimizer:\n  optimizer_type: AdamW\n"
        "sparsity:\n  sparsity: 0.3\n  init_method: random\n  seed: 1234\n"
    )
    c = SparsityConfig.from_yaml(p)
    assert (c.sparsity, c.init_method, c.seed) == (0.3, "random", 1234)
    # The flat form printed in the seed: keys at top level next to model/optimizer.
    p.write_text("model: {}\noptimizer: {}\nsparsity: 0.3\ninit_method: topk\nseed: 1\n")
    c = SparsityConfig.from_yaml(p)
    assert (c.sparsity, c.init_method, c.seed) == (0.3, "topk", 1)
    p.write_text("model: {}\n")
    with pytest.raises(SparsityError, match="no `sparsity:` section"):
        SparsityConfig.from_yaml(p)


@pytest.mark.parametrize(
    "data",
    [
        {"sparsity": 0.75},
        {
            "sparsity": 0.3,
            "init_method": "topk",
            "seed": 9,
            "param_name_patterns": {"mlp": {"sparsity": 0.5}},
        },
        [{"sparsity": 0.5, "param_filter": "*mlp*"}, {"sparsity": 0.2, "param_filter": "*attn*"}],
        {"sparsity": 0.5, "structure": "2:4"},
    ],
)
def test_json_round_trip(data):
    c = SparsityConfig.from_dict(data)
    c2 = SparsityConfig.from_json(json.dumps(c.to_dict()))
    assert c2 == c and c2.to_dict() == c.to_dict()
    assert c.to_dict()["hf_sparsity_version"]


@pytest.mark.parametrize(
    "data, match",
    [
        ({"sparsity": 1.0}, r"outside \[0, 1\)"),
        ({"sparsity": -0.1}, r"outside \[0, 1\)"),
        ({"sparsity": "0.5"}, "must be a number"),
        ({"sparsity": 0.5, "init_method": "magnitude"}, "not a known init method.*random, topk"),
        ({"sparsity": 0.5, "sparsty": 1}, "Unknown key.*sparsty.*did you mean `sparsity`"),
        ({"sparsity": 0.5, "param_name_patterns": "("}, "not a valid regex"),
        ({"param_name_patterns": {"mlp": {"sparsity": 0.5, "level": 2}}}, "Unknown override key"),
        ({"init_method": "random"}, "No sparsity level"),
        ({"sparsity": 0.5, "algorithm": "gmpp"}, "algorithm"),
        ({"sparsity": 0.5, "structure": "4:2"}, "N:M"),
    ],
)
def test_bad_input_names_the_key(data, match):
    with pytest.raises(SparsityError, match=match):
        SparsityConfig.from_dict(data)


def test_unknown_keys_from_newer_version_are_dropped(caplog):
    c = SparsityConfig.from_dict({"sparsity": 0.5, "future_key": 1, "hf_sparsity_version": "99.0"})
    assert c.sparsity == 0.5
    assert "future_key" in caplog.text


def test_mixin_round_trips_through_config_json(tmp_path):
    from transformers import AutoConfig, GPT2Config

    class SparseGPT2Config(SparsityConfigMixin, GPT2Config):
        model_type = "gpt2"

    cfg = SparseGPT2Config(n_layer=1, sparsity={"sparsity": 0.75, "seed": 3})
    assert cfg.sparsity_config == SparsityConfig(sparsity=0.75, seed=3)
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)  # stock class: the section is plain JSON
    assert get_sparsity_config(back) == SparsityConfig(sparsity=0.75, seed=3)
    loaded = SparseGPT2Config.from_pretrained(tmp_path)
    assert loaded.sparsity_config.seed == 3
    loaded.sparsity_config = None
    assert loaded.sparsity_config is None


def test_set_sparsity_config_on_any_model(tmp_path):
    model = tiny_model("llama")
    set_sparsity_config(model.config, SparsityConfig(sparsity=0.5), state={"optimizer_steps": 4})
    model.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["sparsity"]["sparsity"] == 0.5 and data["sparsity"]["_state"] == {"optimizer_steps": 4}
    assert get_sparsity_config(tiny_config("gpt2")) is None
