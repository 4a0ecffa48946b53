"""The recipes' data: texts (embedded, a local file or an HF dataset), the tokenizer, token
blocks, the model to train, and the seeded training stream (:class:`ScheduledData`). Stateless."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_sparsity.data import build_tokenizer, embedded_text, pack_tokens


# ---------------------------------------------------------------------- data
def data_to_text(num: int = 3000, seed: int = 1) -> list[str]:
    """A second embedded task for fine-tuning: structured data -> sentence (a tiny DART, as in Variable
    SPDF, Gupta et al. 2023)."""
    from hf_sparsity import data as D

    rng = random.Random(seed)
    out = []
    for _ in range(num):
        s, v, o = rng.choice(D._SUBJECTS), rng.choice(D._VERBS), rng.choice(D._OBJECTS)
        t = rng.choice(D._TIMES) if rng.random() < 0.5 else None
        fields = f"subject: {s} | action: {v} | object: {o}" + (f" | time: {t}" if t else "")
        sent = f"{s} {v} {o}" + (f" {t}" if t else "")
        out.append(f"<data> {fields} <text> {sent[0].upper() + sent[1:]}.")
    return out


def load_texts(spec: str, text_column: str = "text", limit: int | None = None) -> list[str]:
    """``embedded`` | ``embedded-d2t`` | a ``.txt`` (paragraphs) / ``.jsonl`` file | an HF dataset name."""
    if spec == "embedded":
        return embedded_text(limit or 20000, seed=0)
    if spec == "embedded-d2t":
        return data_to_text(limit or 3000)
    path = Path(spec)
    if path.is_file():
        if path.suffix in (".jsonl", ".json"):
            texts = []
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f):
                    if not line.strip():
                        continue
                    row = json.loads(line)
                    if text_column not in row:
                        raise SystemExit(
                            f"{spec}: line {i + 1} has no {text_column!r} field; pass --text_column NAME."
                        )
                    texts.append(row[text_column])
                    if limit and len(texts) >= limit:
                        break
            return texts
        paras = [p.strip() for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
        return paras[:limit] if limit else paras
    if path.suffix or os.sep in spec and not path.exists():
        raise SystemExit(f"--dataset {spec!r}: no such file. Give a .txt/.jsonl path or an HF dataset name.")
    import datasets

    ds = datasets.load_dataset(spec, split="train")
    if text_column not in ds.column_names:
        raise SystemExit(f"{spec}: no column {text_column!r} (has {ds.column_names}); pass --text_column.")
    texts = ds[text_column]
    return list(texts[:limit] if limit else texts)


def split_blocks(blocks: list[list[int]], n_eval: int) -> tuple[list[list[int]], list[list[int]]]:
    """Held-out evaluation blocks first, the rest for training (deterministic)."""
    if len(blocks) < n_eval + 8:
        raise SystemExit(f"Only {len(blocks)} blocks of text: too little data for training and evaluation.")
    return blocks[n_eval:], blocks[:n_eval]


@dataclass
class Segment:
    start: int  # first sample index (global, across processes) of the segment
    pool: list[int]  # block ids it draws from
    seed: int


class ScheduledData(torch.utils.data.Dataset):
    """The training stream of a stage: sample ``i`` is a block fixed by the seed and the segments.

    A segment draws from its pool in seeded permutations (a new one per pass); a new
    segment (a prune's reshuffle, a new stage's pool) starts a fresh permutation.
    """

    def __init__(self, blocks: list[list[int]], n_samples: int, segments: list[Segment]):
        self.blocks = blocks
        self.segments = sorted(segments, key=lambda s: s.start)
        if not self.segments or self.segments[0].start != 0:
            raise ValueError("The first segment must start at sample 0.")
        order: list[int] = []
        self.segment_of: list[int] = []
        for k, seg in enumerate(self.segments):
            end = self.segments[k + 1].start if k + 1 < len(self.segments) else n_samples
            need, epoch = end - seg.start, 0
            while need > 0:
                perm = list(seg.pool)
                random.Random(f"{seg.seed}|{seg.start}|{epoch}").shuffle(perm)
                take = perm[:need]
                order += take
                self.segment_of += [k] * len(take)
                need -= len(take)
                epoch += 1
        self.order = order[:n_samples]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> dict:
        ids = torch.tensor(self.blocks[self.order[i]], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}


def prepare_data(args, extra_texts: list[str] | None = None):
    """Tokenizer and packed blocks for the pre-training data (plus texts the tokenizer must cover)."""
    texts = load_texts(args.dataset, args.text_column, args.max_texts or None)
    tokenizer = _tokenizer(args, texts + list(extra_texts or []))
    blocks = pack_tokens(texts, tokenizer, args.block_size)
    train, evalb = split_blocks(blocks, args.eval_blocks)
    return tokenizer, train, evalb


def _tokenizer(args, texts: list[str]):
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.model != "tiny-gpt2" and not args.model.endswith(".json"):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    else:
        tok = build_tokenizer(texts, vocab_size=args.vocab_size)
    if tok.eos_token_id is None:
        raise SystemExit("The tokenizer has no EOS token; documents cannot be packed. Pass --tokenizer.")
    return tok


# ---------------------------------------------------------------------- models
def build_model(args, tokenizer, seed: int | None = None):
    """``tiny-gpt2`` (embedded default), a ``config.json`` path (random init) or any model name/path."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed if seed is None else seed)
    if args.model == "tiny-gpt2":
        cfg = GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=args.block_size,
            n_embd=args.n_embd,
            n_layer=args.n_layer,
            n_head=args.n_head,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        return GPT2LMHeadModel(cfg)
    if args.model.endswith(".json"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model))
    return AutoModelForCausalLM.from_pretrained(args.model)


def stage_data(
    blocks, args, steps: int, pools: list[tuple[int, list[int]]], reshuffle_steps=()
) -> ScheduledData:
    """The stream for a stage of ``steps`` optimizer steps.

    ``pools``: ``(first_step, block_ids)`` (a later pool replaces an earlier one: stage
    change); ``reshuffle_steps``: steps after which the order reshuffles (prunes).
    """
    per_step = args.batch_size * args.grad_accum * world_size()
    segs = [Segment(step * per_step, pool, args.seed) for step, pool in pools]
    for t in reshuffle_steps:
        pool = [p for s, p in pools if s <= t][-1]
        segs.append(Segment(t * per_step, pool, args.seed))
    # A prune at a stage boundary is one segment, not two.
    uniq = {s.start: s for s in segs}
    return ScheduledData(blocks, steps * per_step, list(uniq.values()))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def prepare_finetune(args, tokenizer, texts=None):
    """Blocks of the fine-tuning task (``--finetune_dataset``, or its ``texts`` already read), split
    into train / held-out."""
    if texts is None:
        texts = load_texts(args.finetune_dataset, args.text_column)
    blocks = pack_tokens(texts, tokenizer, args.block_size)
    return split_blocks(blocks, args.eval_blocks)
