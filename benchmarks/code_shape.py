"""Code shape: module sizes, long functions (Python and C), shims, import cycles and layering.

    python benchmarks/code_shape.py            # a table, then the offenders
    python benchmarks/code_shape.py --json     # the same figures as JSON

Lines are physical lines (``wc -l``). A function's length runs from its ``def`` to its
last line; a C function's (``hf_sparsity/backends/csrc``) from the line that names it to its
closing brace. A *shim* is a module kept for an old import path: a module other than a package
``__init__`` whose top level is only imports (and ``__all__``), a module-level ``__getattr__``
outside the package root's lazy face, or code that issues a ``DeprecationWarning``.

Import edges are the package's own imports found anywhere in a module
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


CSRC = ROOT / "hf_sparsity" / "backends" / "csrc"


def _c_code(text: str) -> str:
    """``text`` with comments, string / char literals and preprocessor lines blanked (newlines kept)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif c == "#" and (i == 0 or text[i - 1] == "\n" or not text[text.rfind("\n", 0, i) + 1 : i].strip()):
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
        else:
            out.append(c)
            i += 1
            continue
        out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
        i = j
    return "".join(out)


def c_functions(path: Path) -> list[tuple[str, int, bool]]:
    """``(name, lines, says why)`` of every function defined in the C / C++ file ``path``."""
    text = path.read_text(encoding="utf-8")
    code, lines = _c_code(text), text.splitlines()
    out, depth, head, sig_end = [], 0, 0, 0
    for i, c in enumerate(code):
        if c == "{":
            if depth == 0:
                sig_end = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                fn = _c_function_name(code, head, sig_end)
                if fn is not None:
                    name, at = fn
                    first, last = code.count("\n", 0, at) + 1, code.count("\n", 0, i) + 1
                    body = lines[first - 1 : min(first + 60, last)]
                    out.append((name, last - first + 1, any(REASON.lstrip("# ") in ln for ln in body)))
                head = i + 1
        elif c == ";" and depth == 0:
            head = i + 1
    return out


def _c_function_name(code: str, head: int, end: int) -> tuple[str, int] | None:
    """``(name, offset)`` of the function whose signature is ``code[head:end]`` (its parameter list is the
    last top-level parenthesis); ``None`` for a struct, enum, union or initializer."""
    sig, level, opens = code[head:end], 0, []
    for k, c in enumerate(sig):
        if c == "(":
            if level == 0:
                opens.append(k)
            level += 1
        elif c == ")":
            level -= 1
    if not opens or "=" in sig[: opens[-1]]:
        return None
    words = sig[: opens[-1]].split()
    if not words or any(w in ("struct", "typedef", "enum", "union") for w in words[:1]):
        return None
    name = words[-1].lstrip("*&")
    return name, head + sig.rindex(name, 0, opens[-1])


def _shim(path: Path, tree: ast.Module, text: str) -> bool:
    if "DeprecationWarning" in text:
        return True
    top = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in top):
        return not any(LAZY_MODULE in line for line in text.splitlines()[:40])  # else: a lazy package face
    only_imports = all(
        isinstance(n, (ast.Import, ast.ImportFrom))
        or isinstance(n, ast.Assign)
        and [getattr(t, "id", "") for t in n.targets] == ["__all__"]
        for n in top
    )
    return bool(top) and only_imports and path.name != "__init__.py"


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
    modules, functions, graph, explained, fn_imports, shims = {}, [], {}, [], [], []
    for p in files:
        text = p.read_text(encoding="utf-8")
        tree = ast.parse(text)
        name = _modname(p)
        lines = text.splitlines()
        modules[name] = len(lines)
        if name.startswith("hf_sparsity"):
            fn_imports += _function_imports(p, tree, lines)
            if _shim(p, tree, text):
                shims.append(name)
        # A package __init__ re-exporting its children is not a dependency of them.
        graph[name] = set() if p.name == "__init__.py" else _imports(p, tree, known)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = text.splitlines()[node.lineno - 1 : node.end_lineno]
                if any(REASON in line for line in body[:60]):  # a long function that says why
                    explained.append(f"{name}:{node.name}")
                    continue
                functions.append((f"{name}:{node.name}", node.end_lineno - node.lineno + 1))
    c_long, c_explained, c_count = {}, [], 0
    for p in sorted(CSRC.glob("*.[ch]")) + sorted(CSRC.glob("*.cpp")):
        for fn, n, why in c_functions(p):
            c_count += 1
            if why:
                c_explained.append(f"{p.name}:{fn}")
            elif n > FUNCTION_LIMIT:
                c_long[f"{p.name}:{fn}"] = n
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
        "c_functions": c_count,
        "c_functions_over_limit": dict(sorted(c_long.items(), key=lambda kv: -kv[1])),
        "long_c_functions_with_a_reason": sorted(c_explained),
        "shims": sorted(shims),
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
    print(
        f"C functions over {FUNCTION_LIMIT} lines, no reason given (of {m['c_functions']}): "
        f"{m['c_functions_over_limit'] or 'none'}"
    )
    if m["long_c_functions_with_a_reason"]:
        print(f"long C functions that say why: {m['long_c_functions_with_a_reason']}")
    print(f"shims (old import paths): {len(m['shims'])} {m['shims'] or ''}")
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
