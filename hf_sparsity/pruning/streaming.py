"""Prune a model folder without holding the model in memory: one decoder block at a time.

The model is built from its config with empty (meta) parameters; the tensors outside the
decoder blocks (embeddings, final norm, ``lm_head``) are read from the safetensors shards, and
each block is read when :func:`~.oneshot.prune_oneshot` reaches it, pruned, written to the
output folder as a shard of its own, and dropped. Peak memory is about one block (in float32)
+ the tensors outside the blocks + the calibration activations + 1 bit per targeted weight for
the masks, whatever the depth. Weights are computed in float32 and written back in the dtype
they have on disk (float32, float16 or bfloat16).

Output: ``model-0000i-of-0000n.safetensors`` (one shard per block, then one for the rest), their
``model.safetensors.index.json``, ``config.json`` with the ``sparsity`` section, the masks, the
tokenizer; built under a temporary name and renamed into place (:func:`~hf_sparsity.utils.atomic_dir`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from ..constants import SAFE_WEIGHTS_INDEX_NAME
from ..heap import fix_mmap_threshold, trim_heap
from ..storage.folders import safetensors_error, unreadable_error, weight_shards
from ..storage.masks_file import pack_mask, unpack_mask
from ..utils import SparsityError

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class PackedMasks(Mapping):
    """name -> uint8 mask, held bit-packed (1 bit per weight) and unpacked on access."""

    def __init__(self):
        self._packed: dict[str, tuple[torch.Tensor, tuple[int, ...], int]] = {}

    def __setitem__(self, name: str, mask: torch.Tensor) -> None:
        self._packed[name] = (pack_mask(mask), tuple(mask.shape), int(mask.sum(dtype=torch.int64)))

    def __getitem__(self, name: str) -> torch.Tensor:
        packed, shape, _ = self._packed[name]
        return unpack_mask(packed, shape)

    def packed(self, name: str) -> tuple[torch.Tensor, int]:
        """The stored bytes (the mask file's layout) and the number of kept weights: saved as is."""
        packed, _, nonzeros = self._packed[name]
        return packed, nonzeros

    def shape(self, name: str) -> tuple[int, ...]:
        return self._packed[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._packed)

    def __len__(self) -> int:
        return len(self._packed)


def _tensor_index(model_dir: Path) -> dict[str, str]:
    """Tensor name -> shard path, every shard opened (headers): missing or truncated shards refused."""
    where = {}
    for shard in weight_shards(model_dir):
        if not os.path.isfile(shard):
            raise SparsityError(
                f"Shard {os.path.basename(shard)!r} listed in {SAFE_WEIGHTS_INDEX_NAME} is missing from "
                f"{str(model_dir)!r}: the download or copy is incomplete. Copy the whole model folder again."
            )
        reason = safetensors_error(shard)
        if reason:
            raise SparsityError(
                f"Cannot read {shard!r} ({reason}); the file is truncated or corrupt. Copy the model folder "
                "again (or re-save it with save_pretrained)."
            )
        from safetensors import safe_open

        with safe_open(shard, framework="pt") as f:
            for name in f.keys():
                where[name] = shard
    return where


class StreamingModel:
    """A model folder opened for block-by-block pruning (the ``stream`` of :func:`prune_oneshot`).

    ``model``: the model with meta parameters in its blocks and real ones elsewhere.
    ``load(i)`` reads block ``i`` (float32); ``release(i, masks)`` writes it (when ``masks`` is
    given, i.e. pruned) to the output folder and drops it; ``finish()`` writes the rest.
    """

    def __init__(self, model_dir: str | os.PathLike, config=None):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        # Before the first tensor: every tensor of 1 MiB or more gets its own mmap, so freeing it hands it
        # back to the OS. glibc's dynamic threshold otherwise rises to 32 MiB and freed tensors stay in the
        # heap: peak RSS crept up by about 10 MB per block of a 1024-wide Llama (887 MB in the first block,
        # 1020 MB by the eleventh, on 8 x 256 calibration tokens); with the fixed threshold it peaks at
        # 723 MB in the first block and 745 MB in the sixteenth.
        fix_mmap_threshold()
        self.model_dir = Path(model_dir)
        self.where = _tensor_index(self.model_dir)
        self.config = config or AutoConfig.from_pretrained(str(model_dir))
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(self.config, dtype=torch.float32)
        model.tie_weights()
        self.model = model.eval()
        names = dict(model.named_parameters(remove_duplicate=False))
        canonical = {id(p): n for n, p in model.named_parameters()}
        self.file_name: dict[str, str] = {}  # parameter name -> its name in the shards (tied: any alias)
        for n, p in names.items():
            if n in self.where:
                self.file_name.setdefault(canonical[id(p)], n)
        missing = sorted(set(canonical.values()) - set(self.file_name))
        if missing:
            raise SparsityError(
                f"The shards of {str(model_dir)!r} hold no tensor {missing[0]!r} ({len(missing)} of the "
                f"model's {len(canonical)} weights are missing): a shard is missing or the folder holds "
                "another model. Copy the whole model folder again."
            )
        self.out: Path | None = None
        self.written: dict[str, str] = {}  # file tensor name -> output shard
        self.masks = PackedMasks()
        self.prefix = ""
        self.blocks: nn.ModuleList | None = None

    # -- reading ------------------------------------------------------------------------------
    def _read(self, file_name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = self.where[file_name]
        try:
            with safe_open(shard, framework="pt") as f:
                t = f.get_tensor(file_name)
        except Exception as e:
            raise unreadable_error(shard, e) from None
        # An owned copy: a tensor viewing the shard's memory map would keep the map, and with it
        # every page of the file read so far, resident for as long as the tensor lives.
        return t.to(torch.float32, copy=True) if t.dtype in _FLOATS else t.clone()

    def _dtype_on_disk(self, file_name: str) -> torch.dtype:
        from safetensors import safe_open

        with safe_open(self.where[file_name], framework="pt") as f:
            return _DTYPES[f.get_slice(file_name).get_dtype()]

    def _assign(self, module: nn.Module, prefix: str) -> None:
        state = {}
        for n, _ in module.named_parameters():
            state[n] = self._read(self.file_name[f"{prefix}{n}"])
        for n, _ in module.named_buffers():
            if f"{prefix}{n}" in self.where:
                state[n] = self._read(f"{prefix}{n}")
        module.load_state_dict(state, strict=False, assign=True)
        for p in module.parameters():
            p.requires_grad_(False)

    def begin(self, prefix: str, blocks: nn.ModuleList) -> None:
        """Read every parameter outside the blocks (embeddings, norms, ``lm_head``); re-tie weights."""
        self.prefix, self.blocks = prefix, blocks
        block_re = re.compile(re.escape(prefix) + r"\.\d+\.")
        for name in self.file_name:
            if block_re.match(name):
                continue
            owner, _, pname = name.rpartition(".")
            mod = self.model.get_submodule(owner) if owner else self.model
            mod.load_state_dict({pname: self._read(self.file_name[name])}, strict=False, assign=True)
        self.model.tie_weights()
        for p in self.model.parameters():
            p.requires_grad_(False)

    def load(self, i: int) -> None:
        self._assign(self.blocks[i], f"{self.prefix}.{i}.")

    def release(self, i: int, masks: dict[str, torch.Tensor] | None = None) -> None:
        block = self.blocks[i]
        if masks is not None:
            head = f"{self.prefix}.{i}."
            self._write(f"block{i}", {head + n: p for n, p in block.state_dict().items()})
            for name, m in masks.items():
                self.masks[name] = m
        block.to("meta")
        trim_heap()  # small allocations, below the mmap threshold, still come from the heap

    # -- writing ------------------------------------------------------------------------------
    def _write(self, key: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        out = {}
        for name, t in tensors.items():
            file_name = self.file_name.get(name, name)
            if file_name not in self.where or file_name in self.written:
                continue  # not in the input (non-persistent buffers), or a tied alias already written
            dtype = self._dtype_on_disk(file_name)
            out[file_name] = t.detach().to("cpu", dtype).contiguous()
        if out:
            path = self.out / f"{key}.safetensors.part"
            save_file(out, str(path), metadata={"format": "pt"})
            for n in out:
                self.written[n] = path.name

    def finish(self) -> None:
        """Write the tensors outside the blocks, copy those the model does not hold, index the shards."""
        state = {n: p for n, p in self.model.state_dict().items() if p.device.type != "meta"}
        self._write("rest", state)
        leftover = [n for n in self.where if n not in self.written]
        if leftover:
            self._write("extra", {n: self._read(n) for n in leftover})
        parts = sorted(set(self.written.values()), key=_part_order)
        total = len(parts)
        rename = {}
        for k, part in enumerate(parts, 1):
            final = f"model-{k:05d}-of-{total:05d}.safetensors"
            os.replace(self.out / part, self.out / final)
            rename[part] = final
        size = sum((self.out / f).stat().st_size for f in rename.values())
        index = {
            "metadata": {"total_size": size},
            "weight_map": {n: rename[p] for n, p in sorted(self.written.items())},
        }
        (self.out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for side in ("generation_config.json",):
            if (self.model_dir / side).is_file():
                shutil.copy2(self.model_dir / side, self.out / side)


def _part_order(part: str) -> tuple[int, int]:
    m = re.match(r"block(\d+)\.", part)
    return (0, int(m.group(1))) if m else (1, 0 if part.startswith("rest") else 1)


_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
