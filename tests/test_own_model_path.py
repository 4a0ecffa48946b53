"""README "On your own model", end to end on a tiny llama, through the same commands as the README.

validate -> sparse fine-tune (SparsityCallback, 50% topk from a YAML) -> interruption after a
checkpoint -> resume -> convert --finalize -> inspect -> eval -> generate. The model and its
tokenizer are built offline into a temporary folder (nothing from a hub or ../shared).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from hf_sparsity.cli import main as cli
from hf_sparsity.constants import SPARSITY_MASKS_NAME
from hf_sparsity.serialization import load_masks

from .conftest import REPO, tiny_config


def _finetune(argv):
    spec = importlib.util.spec_from_file_location("sparse_finetune", REPO / "examples" / "sparse_finetune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


@pytest.mark.slow
def test_own_model_path(tmp_path, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_sparsity.data import build_tokenizer, embedded_text

    texts = embedded_text(400)
    tok = build_tokenizer(texts, vocab_size=256)
    cfg = tiny_config("llama", vocab=len(tok), layers=2, hidden=32)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = tok.eos_token_id
    torch.manual_seed(0)
    model_dir = tmp_path / "mymodel"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": " ".join(texts[i : i + 20])}) + "\n" for i in range(0, 400, 20))
    )
    yaml = str(REPO / "examples" / "sparsity_topk50.yaml")
    out = tmp_path / "out"

    # 1. sparsify: the plan (dry run), then topk masks at train begin
    assert cli(["validate", "--config", yaml, "--model", str(model_dir)]) == 0
    assert "mlp.down_proj" in capsys.readouterr().out

    # 2. sparse fine-tune, interrupted right after the checkpoint of step 2
    ft = ["--model", str(model_dir), "--config", yaml, "--data", str(data), "--output_dir", str(out)]
    ft += [
        "--max_steps",
        "4",
        "--save_steps",
        "2",
        "--logging_steps",
        "1",
        "--block_size",
        "32",
        "--report_to",
        "none",
    ]
    with pytest.raises(SystemExit, match="rerun with --resume"):
        _finetune(ft + ["--stop_after", "2"])
    assert (out / "checkpoint-2" / SPARSITY_MASKS_NAME).is_file() and not (out / "final").exists()
    console = capsys.readouterr().out
    assert "'sparsity/total': '0.5'" in console and "sparsity/layer/" not in console

    # 3. resume: same command + --resume; the masks carry over unchanged
    assert _finetune(ft + ["--resume"]) == 0
    assert "total: 14 tensors" in capsys.readouterr().out  # the end-of-training per-layer table
    masks2, _ = load_masks(out / "checkpoint-2")
    masks_final, _ = load_masks(out / "final")
    assert masks2.keys() == masks_final.keys() and len(masks2) == 14
    assert all(torch.equal(masks2[k], masks_final[k]) for k in masks2)

    # 4. finalize: zeros baked in, no mask file
    final = tmp_path / "final"
    assert cli(["convert", "--finalize", str(out / "final"), str(final)]) == 0
    assert not (final / SPARSITY_MASKS_NAME).exists()
    weights = load_file(final / "model.safetensors")
    for name, mask in masks_final.items():
        assert torch.count_nonzero(weights[name][mask == 0]) == 0, name
    assert cli(["inspect", str(final)]) == 0

    # 5. evaluate (small --limit)
    res = tmp_path / "results"
    assert cli(["eval", str(final), "--suite", "pile", "--pile-data", str(data), "--limit", "2"]
               + ["--device", "cpu", "--no-progress", "--out", str(res)]) == 0  # fmt: skip
    metrics = json.loads((res / "results.json").read_text())["metrics"]["pile"]
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))

    # 6. run it: generate text
    tok2 = AutoTokenizer.from_pretrained(final)
    lm = AutoModelForCausalLM.from_pretrained(final)
    ids = tok2("the", return_tensors="pt")["input_ids"]
    gen = lm.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tok2.eos_token_id)
    assert gen.shape[1] == ids.shape[1] + 5
    assert isinstance(tok2.decode(gen[0]), str)
