"""The model card ``convert --finalize`` writes: Hub metadata, figures equal to ``inspect``'s, eval table."""

from __future__ import annotations

import json

import pytest
import yaml

from hf_sparsity import SparsityConfig, SparsityEngine, SparsityError
from hf_sparsity.cli import main as cli_main
from hf_sparsity.export.model_card import split_front_matter
from hf_sparsity.storage.folders import inspect_checkpoint

from .conftest import tiny_model

RESULTS = {
    "model": "out/sparse",
    "metrics": {"pile": {"loss": 3.5, "perplexity": 33.1}, "harness": {"arc_easy": {"acc": 0.41}}},
    "settings": {"limit": 10, "dtype": "float32", "device": "cpu"},
}


def sparse_folder(tmp_path, arch="llama"):
    model = tiny_model(arch)
    cfg = SparsityConfig(sparsity=0.6, init_method="topk", seed=7)
    eng = SparsityEngine(model, cfg)
    eng.build_masks()
    eng.apply()
    eng.install_save_hook()
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M"  # as if loaded from the Hub
    path = tmp_path / "sparse"
    model.save_pretrained(path)
    cfgj = json.loads((path / "config.json").read_text())
    cfgj["_name_or_path"] = "HuggingFaceTB/SmolLM2-135M"
    (path / "config.json").write_text(json.dumps(cfgj))
    return path


def cli(*argv):
    try:
        return cli_main(list(argv))
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_card_yaml_and_figures_match_inspect(tmp_path, arch):
    src = sparse_folder(tmp_path, arch)
    (tmp_path / "results.json").write_text(json.dumps(RESULTS))
    out = tmp_path / "final"
    assert cli("convert", "--finalize", str(src), str(out), "--results", str(tmp_path / "results.json")) == 0
    text = (out / "README.md").read_text()
    assert text.startswith("---\n")
    meta, body = split_front_matter(text)
    assert meta["library_name"] == "transformers"
    assert "sparse" in meta["tags"]
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M"
    assert meta["pipeline_tag"] == "text-generation"
    rep = inspect_checkpoint(out)
    t = rep["totals"]
    assert f"Over all {t['params']:,} parameters, {t['nonzero_params']:,} are nonzero" in body
    assert f"({t['sparsity']:.2%} sparse overall)" in body
    masked = [r for r in inspect_checkpoint(src)["layers"] if r["masked"]]
    by_type = {}
    for r in masked:
        final = next(x for x in rep["layers"] if x["name"] == r["name"])
        k = ".".join(r["name"].split(".")[-3:-1])
        p, nz = by_type.get(k, (0, 0))
        by_type[k] = (p + final["numel"], nz + final["nonzeros"])
    assert len(by_type) >= 3
    for k, (p, nz) in by_type.items():
        assert f"| {k} | " in body and f"| {p:,} | {nz:,} | {1 - nz / p:.2%} |" in body
    tp, tnz = sum(v[0] for v in by_type.values()), sum(v[1] for v in by_type.values())
    assert f"**{1 - tnz / tp:.2%} sparse**" in body and abs(1 - tnz / tp - 0.6) < 0.01
    from hf_sparsity.flops import count_flops_from_config

    fl = count_flops_from_config(str(src))
    assert f"| {fl.inference_flops_per_token:.4g} | {fl.dense().inference_flops_per_token:.4g} |" in body
    assert "| init_method | `topk` |" in body and "| sparsity | `0.6` |" in body
    assert "| Pile-style loss ↓ | 3.5000 |" in body and "arc_easy acc" in body


def test_existing_readme_kept_and_section_appended(tmp_path):
    src = sparse_folder(tmp_path)
    (src / "README.md").write_text("---\nlicense: apache-2.0\ntags:\n- llama\n---\n\n# My model\n\nHello.\n")
    out = tmp_path / "final"
    assert cli("convert", "--finalize", str(src), str(out)) == 0
    meta, body = split_front_matter((out / "README.md").read_text())
    assert meta["license"] == "apache-2.0" and meta["tags"][0] == "llama" and "sparse" in meta["tags"]
    assert body.lstrip().startswith("# My model\n\nHello.")
    assert "## Sparsity (hf_sparsity)" in body and "### Evaluation" not in body
    yaml.safe_load((out / "README.md").read_text().split("---")[1])  # the Hub's YAML parser reads it


def test_no_model_card_and_bad_results_change_nothing(tmp_path):
    src = sparse_folder(tmp_path)
    out = tmp_path / "final"
    assert cli("convert", "--finalize", str(src), str(out), "--no-model-card") == 0
    assert not (out / "README.md").exists()
    (tmp_path / "bad.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SparsityError, match="not an `hf_sparsity eval` results file"):
        from hf_sparsity.export.finalize import finalize_checkpoint

        finalize_checkpoint(src, tmp_path / "final2", results=tmp_path / "bad.json")
    assert not (tmp_path / "final2").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_card_of_a_one_shot_pruned_folder_names_method_and_calibration(tmp_path):
    src = sparse_folder(tmp_path)
    cfgj = json.loads((src / "config.json").read_text())
    # what `hf_sparsity prune` records: the method and calibration; init_method is not used
    cfgj["sparsity"]["init_method"] = "random"
    cfgj["sparsity"]["_state"] = {
        "oneshot": {"method": "wanda", "calib_data": "owt.jsonl", "nsamples": 32, "seqlen": 512, "seed": 0}
    }
    (src / "config.json").write_text(json.dumps(cfgj))
    out = tmp_path / "final"
    assert cli("convert", "--finalize", str(src), str(out)) == 0
    body = (out / "README.md").read_text()
    assert "| masks made by | one-shot `wanda` pruning (`hf_sparsity prune`) |" in body
    assert "| calibration | `owt.jsonl`: 32 samples x 512 tokens, seed 0 |" in body
    assert "init_method" not in body


def _edit_section(path, **changes):
    cfgj = json.loads((path / "config.json").read_text())
    cfgj["sparsity"].update(changes)
    (path / "config.json").write_text(json.dumps(cfgj))


def test_invalid_hand_edited_section_is_refused_before_anything_is_written(tmp_path):
    src = sparse_folder(tmp_path)
    _edit_section(src, sparsity=7)
    out = tmp_path / "final"
    with pytest.raises(SparsityError) as err:
        from hf_sparsity.export.finalize import finalize_checkpoint

        finalize_checkpoint(src, out)
    msg = str(err.value)
    assert "config.json" in msg and "not a valid sparsity config" in msg and "--no-model-card" in msg
    assert not out.exists()
    assert cli("convert", "--finalize", str(src), str(out), "--no-model-card") == 0  # the way out it names


def test_section_disagreeing_with_the_weights_is_flagged(tmp_path, caplog):
    """A hand-edited level the weights do not hold: the card shows the measured level and says so."""
    src = sparse_folder(tmp_path)  # masks at 0.6
    _edit_section(src, sparsity=0.5)
    out = tmp_path / "final"
    with caplog.at_level("WARNING", logger="hf_sparsity"):
        assert cli("convert", "--finalize", str(src), str(out)) == 0
    _, body = split_front_matter((out / "README.md").read_text())
    import re

    measured = re.search(r"This checkpoint is \*\*([0-9.]+%) sparse\*\*", body).group(1)
    assert abs(float(measured[:-1]) - 60) < 0.1  # the measured level heads the card, not the edited 50%
    assert (
        f"| sparsity | `0.5` (**disagrees with the measured {measured}**; the figures above are measured) |"
        in body
    )
    assert "checksum" not in body  # file-integrity metadata is not a fact about the model
    assert any("config.json says sparsity 0.5" in r.getMessage() for r in caplog.records)
