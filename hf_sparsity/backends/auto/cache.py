"""``auto``'s plan cache: each group's decision and the whole-model verdict, per CPU model, kernel build,
thread count, layer group and options, in one JSON file written atomically."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any

import torch

from .. import _native
from .cost import PLAN_VERSION

logger = logging.getLogger("hf_sparsity.backends.auto")


class PlanCache:
    """``auto``'s decisions on disk, keyed by CPU model, kernel build (``_native.build_id``: sources and
    instruction-set level), threads, layer group and options (a JSON file, ``$HF_SPARSITY_PLAN_CACHE`` or
    ``plans.json`` in the kernel cache folder; written atomically). A corrupt or unreadable file counts as
    empty."""

    def __init__(self, mode: bool | str = True):
        self.mode = mode
        self.path = os.environ.get("HF_SPARSITY_PLAN_CACHE") or os.path.join(
            _native.cache_dir(), "plans.json"
        )
        self.entries: dict[str, Any] = {}
        self.dirty = False
        if mode is True:
            try:
                with open(self.path, encoding="utf-8") as f:
                    data = json.load(f)
                self.entries = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                self.entries = {}

    @staticmethod
    def key(*parts: Any) -> str:
        cpu = hashlib.sha256(_native._cpu_id().encode()).hexdigest()[:12]
        build = _native.build_id()  # a plan measured on the kernels built at another level is not this one's
        text = json.dumps([PLAN_VERSION, cpu, build, torch.get_num_threads(), [str(p) for p in parts]])
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def get(self, key: str) -> dict | None:
        hit = self.entries.get(key) if self.mode is True else None
        return dict(hit) if isinstance(hit, dict) else None

    def put(self, key: str, value: dict) -> None:
        if self.mode is not False:
            self.entries[key] = value
            self.dirty = True

    def save(self) -> None:
        if not self.dirty:
            return
        try:
            folder = os.path.dirname(self.path) or "."
            os.makedirs(folder, exist_ok=True)
            try:  # merge with what another process wrote meanwhile
                with open(self.path, encoding="utf-8") as f:
                    merged = {**json.load(f), **self.entries}
            except (OSError, ValueError, TypeError):
                merged = self.entries
            fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(merged, f)
            os.replace(tmp, self.path)
            self.dirty = False
        except OSError as e:  # a read-only cache folder: plans are measured again next time
            logger.info("auto: could not write the plan cache %s: %s", self.path, e)
