"""docs/guide.md "On your own model", end to end on a tiny llama, through the same commands as the guide.

prune (Wanda, 50%, a tiny calibration file) -> eval wikitext2 -> sparse fine-tune of the pruned
folder (examples/sparse_finetune.py, SparsityCallback) -> interruption after a checkpoint -> resume
-> convert --finalize -> inspect -> eval -> generate. The model and its tokenizer are built offline
into a temporary folder; WikiText-2 comes from ../shared/data (the head of its test file).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from hf_sparsity.cli import main as cli
from hf_sparsity.constants import SPARSITY_MASKS_NAME
from hf_sparsity.storage.masks_file import load_masks

from .conftest import REPO, tiny_config, wikitext2_head_data_dir


def _weights(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder, whether one file or the shards its index lists."""
    from safetensors.torch import load_file

    from hf_sparsity.storage.folders import weight_shards

    return {k: v for shard in weight_shards(folder) for k, v in load_file(shard).items()}


def _finetune(argv):
    spec = importlib.util.spec_from_file_location("sparse_finetune", REPO / "examples" / "sparse_finetune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def _exact_half(masks):
    """Every mask holds exactly round(0.5 * numel) zeros."""
    for name, m in masks.items():
        assert int((m == 0).sum()) == round(0.5 * m.numel()), name


def _wikitext2(folder, data, capsys):
    argv = ["eval", str(folder), "--suite", "wikitext2", "--seqlen", "32", "--max-windows", "4"]
    assert cli(argv + ["--data-dir", str(data), "--device", "cpu", "--no-progress", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["windows"] == 4 and math.isfinite(res["perplexity"])
    return res["perplexity"]


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A tiny llama saved with a tokenizer trained offline, and a small .jsonl of text."""
    from transformers import AutoModelForCausalLM

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
    return model_dir, data


@pytest.mark.slow
def test_own_model_path(tmp_path, tiny_model_dir, capsys):
    from safetensors.torch import load_file

    model_dir, data = tiny_model_dir
    shared = wikitext2_head_data_dir(tmp_path / "shared")  # 4 windows of 32 tokens evaluated

    # 1. one-shot prune (Wanda, 50%) with a tiny calibration file
    pruned = tmp_path / "pruned"
    argv = ["prune", str(model_dir), str(pruned), "--method", "wanda", "--sparsity", "0.5"]
    assert cli(argv + ["--calib-data", str(data), "--nsamples", "4", "--seqlen", "32", "--no-progress"]) == 0
    assert "wanda: 14 tensors" in capsys.readouterr().out
    oneshot, _ = load_masks(pruned)
    assert len(oneshot) == 14
    _exact_half(oneshot)

    # 1b. check it against dense (WikiText-2 perplexity, a few windows)
    assert _wikitext2(model_dir, shared, capsys) > 1 and _wikitext2(pruned, shared, capsys) > 1

    # 2. sparse fine-tune of the pruned folder (no --config: its masks as they are), interrupted
    out = tmp_path / "out"
    ft = ["--model", str(pruned), "--data", str(data), "--output_dir", str(out)]
    ft += ["--max_steps", "4", "--save_steps", "2", "--logging_steps", "1", "--block_size", "32"]
    ft += ["--report_to", "none"]
    with pytest.raises(SystemExit, match="rerun with --resume"):
        _finetune(ft + ["--stop_after", "2"])
    assert (out / "checkpoint-2" / SPARSITY_MASKS_NAME).is_file() and not (out / "final").exists()
    console = capsys.readouterr().out
    assert "'sparsity/total': '0.5'" in console and "sparsity/layer/" not in console

    # 3. resume: same command + --resume; the pruned masks carry over bit for bit
    assert _finetune(ft + ["--resume"]) == 0
    assert "total: 14 tensors" in capsys.readouterr().out  # the end-of-training per-layer table
    for ckpt in (out / "checkpoint-2", out / "checkpoint-4", out / "final"):
        masks, _ = load_masks(ckpt)
        assert masks.keys() == oneshot.keys(), ckpt
        assert all(torch.equal(masks[k], oneshot[k]) for k in oneshot), ckpt
    before = _weights(pruned)  # prune writes one shard per block (streaming)
    after = _weights(out / "final")
    assert any(not torch.equal(before[k], after[k]) for k in oneshot)  # it did train

    # 2'. the same with the guide's --config (50% everywhere): the pruned masks are kept too
    yaml = str(REPO / "examples" / "sparsity_topk50.yaml")
    out2 = tmp_path / "out2"
    ft2 = ["--model", str(pruned), "--config", yaml, "--data", str(data), "--output_dir", str(out2)]
    assert _finetune(ft2 + ["--max_steps", "1", "--save_steps", "1", "--block_size", "32"]
                     + ["--report_to", "none"]) == 0  # fmt: skip
    masks, _ = load_masks(out2 / "final")
    assert all(torch.equal(masks[k], oneshot[k]) for k in oneshot) and masks.keys() == oneshot.keys()
    capsys.readouterr()

    # 4. finalize: zeros baked in, no mask file; exactly the pruned positions are zero
    final = tmp_path / "final"
    assert cli(["convert", "--finalize", str(out / "final"), str(final)]) == 0
    assert not (final / SPARSITY_MASKS_NAME).exists()
    weights = load_file(final / "model.safetensors")
    for name, mask in oneshot.items():
        assert torch.count_nonzero(weights[name][mask == 0]) == 0, name
        assert torch.count_nonzero(weights[name][mask == 1]) == int(mask.sum()), name
    assert cli(["inspect", str(final)]) == 0
    assert "0.5000" in capsys.readouterr().out

    # 5. evaluate: WikiText-2 and Pile-style loss with a small --limit
    assert _wikitext2(final, shared, capsys) > 1
    res = tmp_path / "results"
    assert cli(["eval", str(final), "--suite", "pile", "--pile-data", str(data), "--limit", "2"]
               + ["--context", "32", "--device", "cpu", "--no-progress", "--out", str(res)]) == 0  # fmt: skip
    metrics = json.loads((res / "results.json").read_text())["metrics"]["pile"]
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    capsys.readouterr()

    # 6. run it: hf_sparsity generate on the finalized folder (its exact zeros), tokens/s vs dense
    assert cli(["generate", str(final), "--prompt", "the", "--max-new-tokens", "5", "--threads", "1"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("the") and len(printed.out) > len("the")
    assert "exact zeros" in printed.err
    speed = printed.err.strip().splitlines()[-1]
    assert "[auto:" in speed and "tok/s" in speed and "dense" in speed, speed


def test_finetune_keeps_a_pruned_folder_at_its_own_level(tmp_path, tiny_model_dir):
    """Without --config, the example keeps a 60% folder at 60% (not the 50% default), whether the
    folder's config.json says how it was pruned or only its mask file does."""
    model_dir, data = tiny_model_dir
    pruned = tmp_path / "mag60"
    assert cli(["prune", str(model_dir), str(pruned), "--method", "magnitude", "--sparsity", "0.6"]) == 0
    oneshot, _ = load_masks(pruned)
    for name, m in oneshot.items():
        assert int((m == 0).sum()) == round(0.6 * m.numel()), name
    ft = ["--data", str(data), "--max_steps", "1", "--save_steps", "1", "--block_size", "32"]
    ft += ["--report_to", "none"]
    assert _finetune(["--model", str(pruned), "--output_dir", str(tmp_path / "a"), *ft]) == 0

    cfg_path = pruned / "config.json"  # a sparse folder without the sparsity section
    cfg = json.loads(cfg_path.read_text())
    del cfg["sparsity"]
    cfg_path.write_text(json.dumps(cfg))
    assert _finetune(["--model", str(pruned), "--output_dir", str(tmp_path / "b"), *ft]) == 0
    for run in ("a", "b"):
        masks, _ = load_masks(tmp_path / run / "final")
        assert masks.keys() == oneshot.keys(), run
        assert all(torch.equal(masks[k], oneshot[k]) for k in oneshot), run
