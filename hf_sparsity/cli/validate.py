"""``hf_sparsity validate``: dry run of a sparsity config against a model, touching no weights."""

# Lazy imports: a subcommand imports the library when it runs, so `--help` and the others start fast.

from __future__ import annotations

import json
import os


def validate_command_parser(subparsers):
    p = subparsers.add_parser(
        "validate",
        help="list every parameter: sparsified or not, at what level, and which rule decided",
        description="Builds the model on the meta device from its config (no weights are read or allocated).",
    )
    p.add_argument(
        "--config", required=True, help="params YAML with a `sparsity:` section (or a JSON section)"
    )
    p.add_argument("--model", required=True, help="model folder, or a config.json path")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=validate_command)


def load_sparsity_config(path: str):
    from ..mask_engine.config import SparsityConfig
    from ..utils import SparsityError

    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SparsityError(f"Cannot read sparsity config {path!r}: {e}") from None
        return SparsityConfig.from_dict(data.get("sparsity", data) if isinstance(data, dict) else data)
    return SparsityConfig.from_yaml(path)


def meta_model(model: str):
    """A model skeleton on the meta device from a folder or config.json (shapes only, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..utils import SparsityError

    path = os.path.dirname(model) if model.endswith(".json") else model
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SparsityError(
            f"No config.json at {model!r}. Give a model folder or the path of its config.json."
        )
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def validate_command(args) -> int:
    from ..mask_engine.targeting import format_plan, plan_sparsity
    from . import _checks

    _checks.model_config(args.model, "--model")
    config = load_sparsity_config(args.config)
    decisions = plan_sparsity(meta_model(args.model), config)
    if args.json:
        print(json.dumps([d.to_dict() for d in decisions], indent=2))
    else:
        print(format_plan(decisions))
    return 0
