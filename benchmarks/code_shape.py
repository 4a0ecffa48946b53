"""Code shape: module sizes, long functions, import cycles and layering of the package and the recipes.

    python benchmarks/code_shape.py            # a table, then the offenders
    python benchmarks/code_shape.py --json     # the same figures as JSON

Lines are physical lines (``wc -l``). A function's length runs from its ``def`` to its
last line. Import edges are the package's own imports found anywhere in a module
(top level or inside functions), resolved to modules; a cycle is a strongly connected
component of more than one module.

Layering (the order written down in CONTRIBUTING.md, ``LAYERS`` below): a *unit* is a
top-level module or a subpackage of ``hf_sparsity`` (``recipes`` is one unit). A
*two-way pair* is two units that import each other; an *import against the order* is a
unit importing one of a higher layer. A function-level
import of a library module needs a reason: an optional third-party dependency, a heavy one
that ``import hf_sparsity`` does not load (``DEFERRED``), or a ``# Lazy:`` comment on its line
or the line above (``# Lazy imports:`` near a module's top covers the whole module: a package
face or a CLI subcommand loading on first use).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE_LIMIT, FUNCTION_LIMIT = 500, 80
REASON = "# Long by design:"  # a comment near a long function's top that says why it is long
LAZY, LAZY_MODULE = "# Lazy:", "# Lazy imports:"

# From the ground up; a unit may import its own layer and those below it, never one above.
LAYERS = (
    (
        "utilities and formats",
        "utils constants import_utils checks heap hooks masks zero modeling data logging_utils loading "
        "storage",
    ),
    ("mask engine", "mask_engine lora"),
    (
        "training adapters, pruning, inference",
        "callback flops ift pruning backends inference evaluation",
    ),
    ("presenters", "export"),
    ("CLI and recipes", "cli __main__ hf_sparsity recipes"),
)
LAYER_OF = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units.split()}
# Optional dependencies (pyproject's extras) and the standard library's platform-specific parts:
# importing them inside the function that needs them is the reason.
OPTIONAL = {"peft", "deepspeed", "lm_eval", "datasets", "evaluate", "zstandard", "matplotlib", "gguf"}
OPTIONAL |= {"tensorboard", "ninja"}
# Heavy required dependencies that ``import hf_sparsity`` does not load (it imports torch and the
# package's own modules only): a function that needs one imports it, so the import stays light.
DEFERRED = {"transformers", "safetensors", "yaml", "tokenizers", "accelerate", "tqdm"}


def _files() -> list[Path]:
    return sorted(p for d in ("hf_sparsity", "recipes") for p in (ROOT / d).rglob("*.py"))


def _modname(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, tree: ast.AST, known: set[str]) -> set[str]:
    me = _modname(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule ``pkg.sub``; any other name is pkg's own.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != me:
                out.add(n)
    return out


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "hf_sparsity" and len(parts) > 1 else parts[0]


def _layering(graph: dict[str, set[str]]) -> tuple[list[str], list[str], list[str]]:
    """(two-way unit pairs, imports against the layer order, units no layer names)."""
    units: dict[str, set[str]] = {}
    against = set()
    for mod, deps in graph.items():
        u = _unit(mod)
        for d in deps:
            v = _unit(d)
            if v == u:
                continue
            units.setdefault(u, set()).add(v)
            if u in LAYER_OF and v in LAYER_OF and LAYER_OF[v] > LAYER_OF[u]:
                against.add(f"{mod} -> {d} ({LAYERS[LAYER_OF[u]][0]} -> {LAYERS[LAYER_OF[v]][0]})")
    pairs = sorted(
        {" <-> ".join(sorted((u, v))) for u, vs in units.items() for v in vs if u in units.get(v, ())}
    )
    unplaced = sorted({_unit(m) for m in graph} - set(LAYER_OF))
    return pairs, sorted(against), unplaced


def _function_imports(path: Path, tree: ast.AST, lines: list[str]) -> list[str]:
    """Imports inside functions with no reason: neither an optional dependency nor a ``# Lazy:`` comment."""
    if any(LAZY_MODULE in line for line in lines[:40]):
        return []
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                top = "." if node.level else (node.module or "").split(".")[0]
            elif isinstance(node, ast.Import):
                top = node.names[0].name.split(".")[0]
            else:
                continue
            near = lines[max(0, node.lineno - 2) : node.end_lineno]
            if top in OPTIONAL or top in DEFERRED or any(LAZY in line for line in near):
                continue
            own = top == "." or top == "hf_sparsity"
            out.append((str(path.relative_to(ROOT)), node.lineno, "own" if own else top))
    return [f"{f}:{n} ({what})" for f, n, what in sorted(set(out))]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def measure() -> dict:
    files = _files()
    known = {_modname(p) for p in files}
    modules, functions, graph, explained, fn_imports = {}, [], {}, [], []
    for p in files:
        text = p.read_text(encoding="utf-8")
        tree = ast.parse(text)
        name = _modname(p)
        lines = text.splitlines()
        modules[name] = len(lines)
        if name.startswith("hf_sparsity"):
            fn_imports += _function_imports(p, tree, lines)
        # A package __init__ re-exporting its children is not a dependency of them.
        graph[name] = set() if p.name == "__init__.py" else _imports(p, tree, known)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = text.splitlines()[node.lineno - 1 : node.end_lineno]
                if any(REASON in line for line in body[:60]):  # a long function that says why
                    explained.append(f"{name}:{node.name}")
                    continue
                functions.append((f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    recipes = {k: v for k, v in modules.items() if k.startswith("recipes.")}
    shared = sum(v for k, v in recipes.items() if k.rpartition(".")[2].startswith("_"))
    pairs, against, unplaced = _layering(graph)
    return {
        "package_lines": sum(v for k, v in modules.items() if k.startswith("hf_sparsity")),
        "modules_over_limit": {k: v for k, v in sorted(modules.items()) if v > MODULE_LIMIT},
        "functions_over_limit": dict(
            sorted((f for f in functions if f[1] > FUNCTION_LIMIT), key=lambda f: -f[1])
        ),
        "long_functions_with_a_reason": sorted(explained),
        "largest_modules": dict(sorted(modules.items(), key=lambda kv: -kv[1])[:8]),
        "recipes_lines": sum(recipes.values()) - shared,
        "recipes_shared_helper_lines": shared,
        "import_cycles": _cycles(graph),
        # Modules that import the package root (``from . import x`` in a top-level module): a cycle
        # through ``__init__`` that the graph above leaves out.
        "root_imports": sorted(k for k, v in graph.items() if "hf_sparsity" in v),
        "two_way_pairs": pairs,
        "imports_against_order": against,
        "units_without_a_layer": unplaced,
        "function_level_imports_without_reason": fn_imports,
    }


def main() -> None:
    m = measure()
    if "--json" in sys.argv:
        print(json.dumps(m, indent=1))
        return
    print(f"package: {m['package_lines']} lines")
    print(f"modules over {MODULE_LIMIT} lines: {m['modules_over_limit'] or 'none'}")
    print(f"functions over {FUNCTION_LIMIT} lines, no reason given: {m['functions_over_limit'] or 'none'}")
    print(
        f"long functions that say why (a '{REASON}' comment): {m['long_functions_with_a_reason'] or 'none'}"
    )
    print(f"largest modules: {m['largest_modules']}")
    print(
        f"recipes: {m['recipes_lines']} lines; their shared helper: {m['recipes_shared_helper_lines']} lines"
    )
    print(f"import cycles: {m['import_cycles'] or 'none'}")
    print(f"modules importing the package root: {m['root_imports'] or 'none'}")
    print(f"two-way unit pairs: {len(m['two_way_pairs'])} {m['two_way_pairs'] or ''}")
    print(f"imports against the layer order: {len(m['imports_against_order'])}")
    for line in m["imports_against_order"]:
        print(f"  {line}")
    if m["units_without_a_layer"]:
        print(f"units no layer names (add them to LAYERS): {m['units_without_a_layer']}")
    fi = m["function_level_imports_without_reason"]
    own = sum(line.endswith("(own)") for line in fi)
    print(f"function-level imports without a reason: {len(fi)} ({own} of the package's own modules)")
    for line in fi:
        print(f"  {line}")


if __name__ == "__main__":
    main()
