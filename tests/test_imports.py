"""The library's import graph: no module of `sparseflash` imports one that imports it back.

Once `sparseflash.mask` and `sparseflash.analysis` imported each other (the mask's `.plot()`
reached into analysis, which imports the mask). The pictures now live in `sparseflash._picture`,
below both. Checked two ways: the import statements anywhere in each file (module level or inside
functions) form an acyclic graph, and a fresh interpreter importing `sparseflash.mask` (and drawing
a mask) never loads `sparseflash.analysis`. About 3 s on CPU.
"""

import ast
import pathlib
import subprocess
import sys

import sparseflash

PACKAGE = pathlib.Path(sparseflash.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """Library modules that ``path`` imports anywhere (``from pkg import submodule`` counts as the
    submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    # A module's parent packages run before it: importing from them is no cycle.
    return {name: {m for m in _imports(path, known) if m != name and not name.startswith(m + ".")}
            for name, path in files.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == "open":
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = "done"
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_library_imports_are_acyclic():
    graph = _graph()
    assert "sparseflash.mask" in graph and "sparseflash._picture" in graph["sparseflash.mask"]
    assert "sparseflash.analysis" not in graph["sparseflash.mask"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_mask_does_not_load_analysis(tmp_path):
    code = (
        "import sys, torch\n"
        "import sparseflash.mask as M\n"
        "assert 'sparseflash.analysis' not in sys.modules, 'import'\n"
        "m = M.BlockMask.from_layout(torch.eye(3, dtype=torch.bool), block_size=16)\n"
        "repr(m)\n"
        f"m.plot(path={str(tmp_path / 'm.png')!r})\n"
        "assert 'sparseflash.analysis' not in sys.modules, 'plot'\n"
        "import sparseflash.analysis\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    assert (tmp_path / "m.png").stat().st_size > 0
