"""Code shape: module sizes, long functions and import cycles of the package and the recipes.

    python benchmarks/code_shape.py            # a table, then the offenders
    python benchmarks/code_shape.py --json     # the same figures as JSON

Lines are physical lines (``wc -l``). A function's length runs from its ``def`` to its
last line. Import edges are the package's own imports found anywhere in a module
(top level or inside functions), resolved to modules; a cycle is a strongly connected
component of more than one module.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE_LIMIT, FUNCTION_LIMIT = 450, 80
REASON = "# Long by design:"  # a comment near a long function's top that says why it is long


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
    modules, functions, graph, explained = {}, [], {}, []
    for p in files:
        text = p.read_text(encoding="utf-8")
        tree = ast.parse(text)
        name = _modname(p)
        modules[name] = len(text.splitlines())
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


if __name__ == "__main__":
    main()
