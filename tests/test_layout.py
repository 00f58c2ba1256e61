"""The package's layout rules (ARCHITECTURE.md): the import-linter contracts of pyproject.toml hold, no module
imports the package's face, and there are no import circles between modules."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dynaquant"


def test_import_linter_contracts_hold():
    """`lint-imports` (pyproject.toml's [tool.importlinter]): the stage layers, quant's purity, independent siblings."""
    exe = (shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
           or pytest.fail("import-linter is not installed (pip install -e '.[dev]')"))
    run = subprocess.run([exe, "--no-cache", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": str(Path(sys.executable).parent)})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    mod = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
    pkg = pkg.removesuffix(".__init__")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            out.append((node.lineno, base, [a.name for a in node.names]))
    return out


def test_nothing_imports_the_package_face():
    """`from dynaquant import X` where X is not a subpackage or module: the face imports the stages, never the reverse."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "__init__.py":
            continue
        for line, base, names in _imports(path):
            if base == "dynaquant":
                bad += [f"{path.relative_to(ROOT)}:{line}: {n}" for n in names
                        if not (PACKAGE / n).is_dir() and not (PACKAGE / f"{n}.py").is_file()]
    assert not bad, "imports of the package's face:\n" + "\n".join(bad)


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    modules = sorted(m for m in graph.modules if m.startswith("dynaquant"))
    edges = {m: sorted(x for x in graph.find_modules_directly_imported_by(m) if x.startswith("dynaquant")) for m in modules}
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root):
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges.get(w, ()))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))

    for m in modules:
        if m not in index:
            visit(m)
    return out


def test_no_import_circles_between_modules():
    """No two modules of the package import each other, directly or around a circle (imports inside functions
    count: they are arrows too). A package's ``__init__`` re-exporting its own modules is not a circle."""
    sys.path.insert(0, str(ROOT))
    graph = grimp.build_graph("dynaquant", cache_dir=None)
    inits = {m for m in graph.modules if (PACKAGE.parent / Path(*m.split(".")) / "__init__.py").is_file()}
    for m in inits:  # a package's face importing its modules is not an arrow between modules
        for x in list(graph.find_modules_directly_imported_by(m)):
            graph.remove_import(importer=m, imported=x)
    assert _cycles(graph) == []
