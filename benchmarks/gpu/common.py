"""What every check of ``benchmarks/gpu_check.py`` shares: its command line, its result file, its shapes.

A check is a script ``benchmarks/gpu/check_*.py`` run in its own process by ``gpu_check.py``:

    python benchmarks/gpu/check_train.py --out DIR --device cuda [--tiny]

It writes ``DIR/result.json`` (``status`` pass / fail / skip, a one-line ``summary``, ``figures``,
``notes``) and exits 0; an exception becomes a ``fail`` whose summary is the exception's last line.
``--tiny`` runs the same code path at tiny shapes (the CPU dry run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESULT_NAME = "result.json"


class Report:
    """The result a check builds up: figures and notes as it goes, a status at the end."""

    def __init__(self, out: Path, device: str, tiny: bool):
        self.out, self.device, self.tiny = out, device, tiny
        self.figures: dict = {}
        self.notes: list[str] = []
        self.t0 = time.perf_counter()

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.notes.append(text)

    def write(self, status: str, summary: str) -> None:
        result = {
            "status": status,
            "summary": summary,
            "figures": self.figures,
            "notes": self.notes,
            "device": self.device,
            "tiny": self.tiny,
            "seconds": round(time.perf_counter() - self.t0, 2),
        }
        tmp = self.out / (RESULT_NAME + ".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        os.replace(tmp, self.out / RESULT_NAME)


def main(run: Callable[[Report, argparse.Namespace], tuple[str, str]], doc: str, extra=None) -> None:
    """Parse the shared arguments, call ``run(report, args) -> (status, summary)``, write the result."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for result.json and the check's files")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: the CPU dry run of the same path")
    if extra is not None:
        extra(ap)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out, args.device, args.tiny)
    try:
        status, summary = run(report, args)
    except Exception as e:  # the check's own failure: reported, never a crash without a result
        traceback.print_exc()
        last = f"{type(e).__name__}: {e}".strip().splitlines()
        status, summary = "fail", (last[0] if last else type(e).__name__)[:300]
    report.write(status, summary)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_blocks(n: int, length: int, vocab: int, seed: int = 0):
    """``n`` blocks of ``length`` random token ids (a map-style LM dataset, no tokenizer needed)."""
    import torch

    from hf_sparsity.data import BlockDataset

    g = torch.Generator().manual_seed(seed)
    return BlockDataset(torch.randint(2, vocab, (n, length), generator=g).tolist())


def gpt2_config(tiny: bool):
    """GPT-2 small (124M: 12 x 768, 12 heads, vocab 50257), or a 2-layer 64-wide one."""
    from transformers import GPT2Config

    if tiny:
        return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=512)
    return GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257)


def llama_config(tiny: bool):
    """A Llama shape with GQA (8 x 1024, FFN 2816, 16 heads, 4 KV heads, vocab 32000), or a tiny one."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=176, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, vocab_size=512,
        )  # fmt: skip
    return LlamaConfig(
        num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=2048, vocab_size=32000,
    )  # fmt: skip


def masked_nonzeros(tensor, mask) -> int:
    """How many positions where ``mask`` is 0 hold a nonzero in ``tensor`` (compared on the mask's device)."""
    import torch

    t = tensor.detach()
    if hasattr(t, "full_tensor"):  # a DTensor (FSDP2): the whole tensor, gathered
        t = t.full_tensor()
    off = (mask == 0).to(t.device)
    return int(torch.count_nonzero(t.reshape(off.shape)[off]))
