"""The layers of eprt, kept honest: no import cycle, and no module importing from a layer above its own.

Every module under eprt/ is parsed with `ast` (nothing is imported, so no import side effect can
hide an edge). Every `import` statement counts wherever it stands: at module level, inside a
function (a lazy import is still a dependency), under `if TYPE_CHECKING`. Importing a module's own
parent package (`from eprt import __version__`) is no edge: Python has run that package's
`__init__` before the module anyway. A reference to a module by name in a string (importlib) is
not an import and is not seen here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "eprt"

# Low to high: a module may import from its own layer and the layers below it, never above.
# A module (or package) is placed by its longest listed prefix; a `*` stands for one name, so that
# a new family folder (eprt/families/<name>/) is placed without a line of its own.
LAYERS = (
    ("foundation", ("eprt.errors", "eprt.units", "eprt.flags", "eprt.progress")),
    ("model description", ("eprt.config", "eprt.config_fields", "eprt.layout")),  # pure Python: no torch, no files
    ("storage", ("eprt.storage",)),  # checkpoint, safetensors, encodings, HF file names, atomic output
    ("report", ("eprt.report",)),  # the quality report as a page: rendering only, from its JSON
    # a family described: its config reader, its tensor layout, the entry's type (no torch-side code)
    ("family description", ("eprt.families.family", "eprt.families.*.config", "eprt.families.*.layout")),
    ("kernels", ("eprt.kernels",)),
    ("parallel", ("eprt.parallel",)),
    ("models", ("eprt.models", "eprt.families.*.model")),  # the shared blocks, and each family's model
    ("family table", ("eprt.families",)),  # each folder's FAMILY entry (it names the model class), the table
    ("loading", ("eprt.loading",)),  # a checkpoint resolved by its family, its model built and read
    ("quant", ("eprt.quant", "eprt.data", "eprt.calib_files", "eprt.samples")),
    ("hf", ("eprt.hf",)),  # the Hugging Face border: convert in, export out, checks
    ("testing", ("eprt.testing",)),  # fixtures the demo, eprt-make-tiny and the tests share
    ("commands", ("eprt.commands", "eprt.cli", "eprt.ptq")),
)
ROOT = "eprt"  # the package's own __init__ (it loads the model code on first use): the top layer


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The eprt modules `module` imports, anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                base = ".".join(
                    [*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])]
                )
            # `from eprt.families import deepseek_v3` imports the submodule; `from eprt.x import name`, eprt.x
            found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names}
    return {m for m in found if m in known and not module.startswith(m + ".") and m != module}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(m, p, set(mods)) for m, p in mods.items()}


def under(module: str, prefix: str) -> bool:
    """`module` is `prefix` or inside it, a `*` in `prefix` matching any one name."""
    parts, want = module.split("."), prefix.split(".")
    return len(parts) >= len(want) and all(w in ("*", p) for w, p in zip(want, parts))


def layer(module: str) -> int:
    if module == ROOT:
        return len(LAYERS) - 1
    best = max(
        ((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes if under(module, prefix)),
        default=None,
    )
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best[1]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in g[v]:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_lazy_and_submodule_imports():
    g = graph()
    # a function-level import (eprt/__init__.py loads the loader on first use)
    assert "eprt.loading.loader" in g["eprt"]
    # `from eprt.kernels import grouped_mm` is an edge to the package, which imports its submodules
    assert "eprt.kernels.grouped_gemm" in g["eprt.kernels"]


def test_no_import_cycles():
    found = cycles(graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_from_a_higher_layer():
    g = graph()
    upward = [
        f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
        for m in sorted(g)
        for d in sorted(g[m])
        if layer(d) > layer(m)
    ]
    assert not upward, "imports from a higher layer:\n  " + "\n  ".join(upward)


def test_a_family_folder_is_placed_by_its_parts():
    """A family's config and layout sit below the model code, its model among the models, its
    entry above them: a new folder needs no line here."""
    placed = {
        part: LAYERS[layer(f"eprt.families.new_family{part}")][0] for part in (".config", ".layout", ".model", "")
    }
    assert placed == {
        ".config": "family description",
        ".layout": "family description",
        ".model": "models",
        "": "family table",
    }
