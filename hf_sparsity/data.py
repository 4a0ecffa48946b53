"""An embedded default: text that needs no network and a tokenizer built from it in a second.

The text is generated from a small seeded grammar (subjects, verbs, objects, clauses),
so it has real structure to learn (a tiny GPT's loss falls well below the unigram
entropy) and needs no file and no hub.
"""

from __future__ import annotations

import random

_SUBJECTS = [
    "the engineer",
    "the gardener",
    "the old sailor",
    "a young student",
    "the committee",
    "my neighbour",
    "the small robot",
    "the city council",
    "a quiet musician",
    "the baker",
    "the teacher",
    "our team",
]
_VERBS = [
    "builds",
    "repairs",
    "paints",
    "measures",
    "describes",
    "carries",
    "counts",
    "finds",
    "opens",
    "watches",
    "writes about",
    "sells",
    "studies",
    "cleans",
    "moves",
]
_OBJECTS = [
    "a wooden bridge",
    "the broken clock",
    "three red boxes",
    "the long letter",
    "a bright lamp",
    "the narrow road",
    "seven green apples",
    "the heavy door",
    "a map of the coast",
    "the new engine",
    "two silver keys",
    "the morning train",
    "a cup of tea",
    "the empty field",
]
_TIMES = [
    "every morning",
    "at night",
    "before lunch",
    "after the storm",
    "on sunday",
    "in the spring",
    "today",
]
_CLAUSES = [
    "because it was needed",
    "while the others slept",
    "although nobody asked",
    "so that the work could continue",
    "and then goes home",
    "but only when it rains",
    "as the sun rises",
]


def embedded_text(num_sentences: int = 6000, seed: int = 0) -> list[str]:
    """Paragraphs of grammatical sentences (deterministic for a seed)."""
    rng = random.Random(seed)
    paragraphs, para = [], []
    for _ in range(num_sentences):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(_TIMES)}"
        if rng.random() < 0.4:
            s += f" {rng.choice(_CLAUSES)}"
        para.append(s[0].upper() + s[1:] + ".")
        if len(para) >= rng.randint(3, 8):
            paragraphs.append(" ".join(para))
            para = []
    if para:
        paragraphs.append(" ".join(para))
    return paragraphs


def build_tokenizer(texts: list[str] | None = None, vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` (default: the embedded text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = texts if texts is not None else embedded_text()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )


def pack_tokens(texts: list[str], tokenizer, block_size: int) -> list[list[int]]:
    """Join documents with EOS and cut into non-overlapping blocks of ``block_size`` tokens."""
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // block_size
    return [ids[i * block_size : (i + 1) * block_size] for i in range(n)]


class BlockDataset:
    """A map-style dataset of fixed-length LM blocks (``input_ids`` = ``labels``)."""

    def __init__(self, blocks: list[list[int]]):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        import torch

        ids = torch.tensor(self.blocks[i], dtype=torch.long)
        return {"input_ids": ids, "labels": ids.clone()}
