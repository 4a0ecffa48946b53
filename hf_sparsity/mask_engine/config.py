"""``SparsityConfig``: the Cerebras ``sparsity:`` section as a dataclass, and a mixin for
``PretrainedConfig``.

Two input forms are accepted, as the Cerebras docs show them:

* the 1.8 form (the Cerebras Model Zoo guide "Train a model with weight sparsity")::

      sparsity: 0.3
      init_method: topk            # random | topk
      seed: 1234
      param_name_patterns: "ffn.*weight"          # a regex, a list of regexes,
      # or {regex: {sparsity: ..., init_method: ..., seed: ...}}

* the later form: ``algorithm: static`` with ``param_filter`` globs, or a list of
  such groups, each with its own level.

A pattern is a regex matched anywhere in the parameter name (``re.search``); a
``param_filter`` is a glob matched against the whole name (``fnmatch``).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from ..checks import check_level, check_lora_mode, check_structure
from ..constants import CONFIG_SECTION
from ..utils import SparsityError, atomic_write_text, library_version
from .schedules import validate_drop_fraction, validate_schedule, validate_update

__all__ = ["check_level", "check_structure"]  # re-exported: they used to live here

logger = logging.getLogger(__name__)

INIT_METHODS = ("random", "topk")
ALGORITHMS = ("static", "gmp", "set", "rigl")
PATTERN_OVERRIDE_KEYS = ("sparsity", "init_method", "seed", "structure")
_META_KEYS = ("hf_sparsity_version", "_state")
# Top-level keys of a Cerebras params file that are not part of the sparsity section.
_RUN_SECTIONS = ("model", "optimizer", "train_input", "eval_input", "runconfig")


def check_init_method(value: Any, key: str = "init_method") -> str:
    if value not in INIT_METHODS:
        raise SparsityError(
            f"`{key}` = {value!r} is not a known init method. Use one of: {', '.join(INIT_METHODS)}."
        )
    return value


@dataclass
class SparsityConfig:
    """What to sparsify, how much, and how the masks are chosen.

    Round-trips through :meth:`to_dict` / :meth:`from_dict` (and JSON); loads the
    ``sparsity:`` section of a Cerebras params YAML with :meth:`from_yaml`.
    """

    sparsity: float | None = field(
        default=None, metadata={"help": "Fraction of each targeted tensor set to zero, in [0, 1)."}
    )
    init_method: str = field(
        default="random", metadata={"help": "random (seeded per parameter) or topk (prune lowest magnitude)."}
    )
    seed: int = field(
        default=0, metadata={"help": "Base seed; each parameter's random mask derives from it and its name."}
    )
    param_name_patterns: str | list[str] | dict[str, dict[str, Any]] | None = field(
        default=None,
        metadata={
            "help": "Regex (searched in the parameter name), a list of them, or a dict regex -> overrides of "
            "sparsity/init_method/seed. None: the default projection/FFN rule."
        },
    )
    param_filter: str | list[str] | None = field(
        default=None,
        metadata={"help": "Glob(s) matched against whole parameter names (later Cerebras form)."},
    )
    algorithm: str = field(
        default="static",
        metadata={
            "help": "static (fixed masks, or the level changes a `schedule` lists), gmp (cubic pruning), "
            "set or rigl (dynamic sparsity: drop and regrow every `update.freq` steps)."
        },
    )
    schedule: list[dict[str, Any]] | dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "static only: events in optimizer steps, [{step: 100, sparsity: 0.9}, "
            "{step: 200, densify: true}], "
            "or an IMP spec "
            "{type: imp, prune_fraction: 0.2, iterations: 5, dense_steps: N, every: N, rewind_to: R}."
        },
    )
    update: dict[str, int] | None = field(
        default=None,
        metadata={
            "help": "gmp/set/rigl: {freq: N, start: N, stop: N} in optimizer steps; stop defaults to the "
            "last step."
        },
    )
    drop_fraction: float | dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "set/rigl: fraction of active weights dropped and regrown per update, cosine-decayed "
            "to 0 at "
            "update.stop (default 0.3); or {type: cosine|constant, init: 0.3, half_period: N}."
        },
    )
    init_sparsity: float | None = field(
        default=None,
        metadata={"help": "gmp: the level at update.start (default 0.0); `sparsity` is the final level."},
    )
    structure: str | None = field(
        default=None,
        metadata={"help": "Optional N:M structure, e.g. '2:4' (for the semi-structured backend)."},
    )
    lora: str | None = field(
        default=None,
        metadata={
            "help": "peft LoRA on the sparse model: masked (adapter update applied as (B·A) ⊙ M; "
            "merges exactly) or merge_then_mask (plain adapter; hf_sparsity.merge_sparse re-applies "
            "the mask)."
        },
    )
    groups: list[SparsityConfig] | None = field(
        default=None,
        metadata={
            "help": "Several groups, each a config of its own; the first group matching a parameter wins."
        },
    )

    def __post_init__(self) -> None:
        if self.sparsity is not None:
            self.sparsity = check_level(self.sparsity)
        check_init_method(self.init_method)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SparsityError(f"`seed` must be an integer, got {self.seed!r}.")
        if self.algorithm not in ALGORITHMS:
            raise SparsityError(
                f"`algorithm` = {self.algorithm!r} is not supported. Use one of: {', '.join(ALGORITHMS)}."
            )
        check_structure(self.structure)
        self.lora = check_lora_mode(self.lora)
        self._check_schedule_keys()
        self.param_name_patterns = _normalize_patterns(self.param_name_patterns)
        if self.param_filter is not None:
            filters = [self.param_filter] if isinstance(self.param_filter, str) else list(self.param_filter)
            if not filters or not all(isinstance(f, str) and f for f in filters):
                raise SparsityError("`param_filter` must be a glob string or a non-empty list of them.")
            self.param_filter = filters if len(filters) > 1 else filters[0]
        if self.groups is not None:
            if not isinstance(self.groups, list) or not self.groups:
                raise SparsityError("`groups` must be a non-empty list of sparsity sections.")
            self.groups = [
                g if isinstance(g, SparsityConfig) else SparsityConfig.from_dict(g, _parent=self)
                for g in self.groups
            ]
            for g in self.groups:
                if g.groups:
                    raise SparsityError("A group cannot contain `groups` itself; flatten the list.")
        elif not self._has_level():
            raise SparsityError(
                "No sparsity level given. Set `sparsity: 0.75` (or a level for every pattern in a "
                "`param_name_patterns` dict)."
            )

    def _check_schedule_keys(self) -> None:
        self.schedule = validate_schedule(self.schedule)
        self.update = validate_update(self.update)
        self.drop_fraction = validate_drop_fraction(self.drop_fraction)
        if self.init_sparsity is not None:
            self.init_sparsity = check_level(self.init_sparsity, "init_sparsity")
        algo = self.algorithm
        if self.schedule is not None and algo != "static":
            raise SparsityError(
                f"`schedule` is for algorithm static (explicit events or IMP); algorithm {algo!r} is "
                "driven by "
                "`update: {freq, start, stop}`. Remove one of them."
            )
        if algo == "static" and (self.update is not None or self.drop_fraction is not None):
            raise SparsityError(
                "`update` / `drop_fraction` need `algorithm: gmp`, `set` or `rigl`; with static masks use a "
                "`schedule` list instead."
            )
        if self.drop_fraction is not None and algo not in ("set", "rigl"):
            raise SparsityError(f"`drop_fraction` is for set/rigl, not {algo!r}.")
        if self.init_sparsity is not None and algo != "gmp":
            raise SparsityError(f"`init_sparsity` is for algorithm gmp, not {algo!r}.")
        if algo == "gmp" and self.sparsity is not None and (self.init_sparsity or 0.0) > self.sparsity:
            raise SparsityError(
                f"gmp prunes from `init_sparsity` ({self.init_sparsity}) up to `sparsity` ({self.sparsity}); "
                "the final level must be the higher one."
            )

    @property
    def has_schedule(self) -> bool:
        """True when masks change during training (a schedule, GMP, SET or RigL)."""
        return (
            self.algorithm != "static"
            or self.schedule is not None
            or any(g.algorithm != "static" or g.schedule is not None for g in (self.groups or []))
        )

    def _has_level(self) -> bool:
        if self.sparsity is not None:
            return True
        pats = self.param_name_patterns
        return isinstance(pats, dict) and bool(pats) and all("sparsity" in v for v in pats.values())

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: Any, _parent: SparsityConfig | None = None) -> SparsityConfig:
        """Build from a section: a dict, a bare level (``0.3``), or a list of groups."""
        if isinstance(data, SparsityConfig):
            return copy.deepcopy(data)
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return cls(sparsity=data)
        if isinstance(data, list):
            return cls(groups=list(data))
        if not isinstance(data, dict):
            raise SparsityError(
                "A sparsity section must be a mapping, a number or a list of groups, got "
                f"{type(data).__name__}."
            )
        data = dict(data)
        written_by = data.pop("hf_sparsity_version", None)
        data.pop("_state", None)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            if written_by is not None and _newer(written_by, library_version()):
                logger.warning(
                    "Dropping sparsity keys %s written by hf_sparsity %s (this is %s).",
                    unknown,
                    written_by,
                    library_version(),
                )
                for k in unknown:
                    data.pop(k)
            else:
                close = {k: _closest(k, known) for k in unknown}
                hints = "; ".join(
                    f"`{k}`" + (f" (did you mean `{c}`?)" if c else "") for k, c in close.items()
                )
                raise SparsityError(
                    f"Unknown key(s) in the sparsity section: {hints}. Known keys: "
                    f"{', '.join(sorted(known))}."
                )
        if _parent is not None:  # a group inherits what it does not set
            for k in ("sparsity", "init_method", "seed", "algorithm", "structure"):
                data.setdefault(k, getattr(_parent, k))
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> SparsityConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> SparsityConfig:
        """Read the ``sparsity:`` section of a Cerebras-style params YAML (beside ``model:`` and
        ``optimizer:``)."""
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                doc = yaml.safe_load(f)
        except FileNotFoundError:
            raise SparsityError(f"Sparsity params file {str(path)!r} does not exist.") from None
        except yaml.YAMLError as e:
            raise SparsityError(f"{str(path)!r} is not valid YAML: {e}") from None
        if not isinstance(doc, dict) or CONFIG_SECTION not in doc:
            raise SparsityError(
                f"{str(path)!r} has no `{CONFIG_SECTION}:` section. Add one beside `model:` and "
                "`optimizer:`, "
                "e.g.\nsparsity:\n  sparsity: 0.75\n  init_method: random\n  seed: 1234"
            )
        section = doc[CONFIG_SECTION]
        if isinstance(section, (dict, list)):
            return cls.from_dict(section)
        # Flat form: `sparsity: 0.3` with its sibling keys at the top level of the file.
        flat = {k: v for k, v in doc.items() if k not in _RUN_SECTIONS}
        return cls.from_dict(flat)

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "groups" and v is not None:
                v = [g.to_dict() for g in v]
                for g in v:
                    g.pop("hf_sparsity_version", None)
            if v is not None:
                out[f.name] = copy.deepcopy(v)
        out["hf_sparsity_version"] = library_version()
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def save_yaml(self, path: str | os.PathLike) -> None:
        import yaml

        atomic_write_text(path, yaml.safe_dump({CONFIG_SECTION: self.to_dict()}, sort_keys=False))

    def iter_groups(self) -> list[SparsityConfig]:
        return list(self.groups) if self.groups else [self]


def _normalize_patterns(p: Any) -> Any:
    if p is None:
        return None
    if isinstance(p, str):
        _compile(p)
        return p
    if isinstance(p, (list, tuple)):
        if not p:
            raise SparsityError(
                "`param_name_patterns` is an empty list; give at least one regex or remove the key."
            )
        for x in p:
            if not isinstance(x, str):
                raise SparsityError(f"`param_name_patterns` entries must be regex strings, got {x!r}.")
            _compile(x)
        return list(p)
    if isinstance(p, dict):
        out = {}
        for pat, over in p.items():
            _compile(pat)
            over = {} if over is None else over
            if isinstance(over, (int, float)) and not isinstance(over, bool):
                over = {"sparsity": over}
            if not isinstance(over, dict):
                raise SparsityError(
                    f"`param_name_patterns[{pat!r}]` must be a mapping of overrides, got {over!r}. "
                    f"Allowed keys: {', '.join(PATTERN_OVERRIDE_KEYS)}."
                )
            bad = sorted(set(over) - set(PATTERN_OVERRIDE_KEYS))
            if bad:
                raise SparsityError(
                    f"Unknown override key(s) {bad} for pattern {pat!r}. Allowed: "
                    f"{', '.join(PATTERN_OVERRIDE_KEYS)}."
                )
            if "sparsity" in over:
                over["sparsity"] = check_level(over["sparsity"], f"param_name_patterns[{pat!r}].sparsity")
            if "init_method" in over:
                check_init_method(over["init_method"], f"param_name_patterns[{pat!r}].init_method")
            if "structure" in over:
                check_structure(over["structure"])
            out[pat] = dict(over)
        return out
    raise SparsityError(f"`param_name_patterns` must be a regex, a list of regexes or a dict, got {p!r}.")


def _compile(pattern: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise SparsityError(f"`param_name_patterns` entry {pattern!r} is not a valid regex: {e}.") from None


def _closest(key: str, known: set[str]) -> str | None:
    m = difflib.get_close_matches(key, sorted(known), n=1)
    return m[0] if m else None


def _newer(a: str, b: str) -> bool:
    try:  # Lazy: packaging is not a dependency of ours (transformers brings it); without it, not newer
        from packaging.version import Version

        return Version(a) > Version(b)
    except Exception:
        return False


# ---------------------------------------------------------------------- on PretrainedConfig
def get_sparsity_config(config: Any) -> SparsityConfig | None:
    """The sparsity section carried by a ``PretrainedConfig`` (or a ``config.json`` dict), if any."""
    section = (
        config.get(CONFIG_SECTION) if isinstance(config, dict) else getattr(config, CONFIG_SECTION, None)
    )
    if section is None:
        return None
    return SparsityConfig.from_dict(section)


def get_sparsity_state(config: Any) -> dict[str, Any]:
    """The ``_state`` record of the sparsity section (``{}`` without one); a malformed one is refused."""
    section = (
        config.get(CONFIG_SECTION) if isinstance(config, dict) else getattr(config, CONFIG_SECTION, None)
    )
    if not isinstance(section, dict):
        return {}
    state = section.get("_state") or {}
    # The library writes these shapes; anything else is a hand edit or a corrupt file.
    checks = [("_state", state, isinstance(state, dict), "a mapping")]
    if isinstance(state, dict):
        oneshot, events = state.get("oneshot") or {}, state.get("events") or []
        checks += [
            ("_state.oneshot", oneshot, isinstance(oneshot, dict), "a mapping"),
            ("_state.events", events, isinstance(events, list) and all(isinstance(e, dict) for e in events),
             "a list of mappings"),
        ]  # fmt: skip
    for key, value, ok, want in checks:
        if not ok:
            raise SparsityError(
                f"config.json's {CONFIG_SECTION}.{key} is {value!r:.40}, not {want} as hf_sparsity writes "
                f"it: the file was edited or is corrupt. Delete {CONFIG_SECTION}._state from config.json (a "
                "training record; the masks do not need it)."
            )
    return dict(state)


def mask_seeds(config: SparsityConfig) -> dict[str, Any]:
    """The seeds random masks are drawn from: the config's ``seed`` and each group's."""
    out: dict[str, Any] = {"seed": config.seed}
    if config.groups:
        out["groups"] = [g.seed for g in config.groups]
    return out


def with_mask_seeds(config: SparsityConfig, seeds: dict[str, Any] | None) -> SparsityConfig:
    """``config`` with the seeds the masks were built with (``seeds`` from :func:`mask_seeds`), so
    ``config.json`` names the seed that made its masks even after a resume under another seed."""
    if not seeds or seeds == mask_seeds(config):
        return config
    out = copy.deepcopy(config)
    out.seed = int(seeds.get("seed", out.seed))
    groups = seeds.get("groups")
    if out.groups and groups and len(groups) == len(out.groups):
        for g, seed in zip(out.groups, groups):
            g.seed = int(seed)
    return out


def set_sparsity_config(config: Any, sparsity: SparsityConfig | None, state: dict | None = None) -> None:
    """Put (or with ``None`` remove) the sparsity section on a ``PretrainedConfig`` so it lands in
    config.json."""
    if sparsity is None:
        if hasattr(config, CONFIG_SECTION):
            delattr(config, CONFIG_SECTION)
        return
    section = sparsity.to_dict()
    if state:
        section["_state"] = dict(state)
    setattr(config, CONFIG_SECTION, section)


class SparsityConfigMixin:
    """Mix into any ``PretrainedConfig`` subclass so the sparsity section travels in ``config.json``::

        class SparseGPT2Config(SparsityConfigMixin, GPT2Config):
            model_type = "gpt2"

        cfg = SparseGPT2Config(n_layer=2, sparsity={"sparsity": 0.75})
        cfg.sparsity_config            # -> SparsityConfig(sparsity=0.75, ...)

    The section is stored as a plain dict under ``config.sparsity``, so stock
    ``transformers`` reads such a config.json back with any config class.
    """

    @property
    def sparsity_config(self) -> SparsityConfig | None:
        return get_sparsity_config(self)

    @sparsity_config.setter
    def sparsity_config(self, value: SparsityConfig | dict | None) -> None:
        set_sparsity_config(self, None if value is None else SparsityConfig.from_dict(value))
