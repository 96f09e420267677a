"""The library's import graph: no module of `sparseflash` imports one that imports it back, and
none uses another module's underscore names.

Once `sparseflash.mask` and `sparseflash.analysis` imported each other (the mask's `.plot()`
reached into analysis, which imports the mask). The pictures now live in `sparseflash._picture`,
below both. Checked two ways: the import statements anywhere in each file (module level or inside
functions) form an acyclic graph, and a fresh interpreter importing `sparseflash.mask` (and drawing
a mask) never loads `sparseflash.analysis`. About 3 s on CPU.

Modules talk to each other through names without a leading underscore, so that a module's private
names can change without breaking another (`from M import _x` and `M._x`, where ``M`` is a library
module, are flagged; modules whose own name starts with an underscore, such as `sparseflash._compat`,
are the package's private helpers and may be imported by its modules).
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


# Modules that import nothing of the library: every module may read its settings and constants there.
LEAVES = {"sparseflash._env", "sparseflash._consts"}


def test_leaves_and_one_place_for_the_environment():
    """`_env` and `_consts` import nothing of the library, and `_env` is the only module of the
    library that reads the environment (each variable in one place)."""
    graph = _graph()
    for leaf in LEAVES:
        assert not {m for m in graph[leaf] if m.startswith("sparseflash")}, leaf
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if "os.environ" in p.read_text() and p.name != "_env.py")
    assert readers == [], readers


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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(path: pathlib.Path, name: str, known: set[str]) -> set[str]:
    """``module.name`` of every underscore name of another library module that ``path`` (module
    ``name``) imports or reads: ``from M import _x``, ``_x`` read off a name bound to M
    (``import M as m``, ``from P import M``; submodules along the way resolved), or named in
    ``setattr(m, "_x", ...)`` (monkeypatch's too), ``getattr`` or ``delattr``."""
    tree = ast.parse(path.read_text())
    bound, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    bound[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("sparseflash"):
            for a in node.names:
                if f"{node.module}.{a.name}" in known:
                    bound[a.asname or a.name] = f"{node.module}.{a.name}"
                elif _private(a.name) and node.module != name:
                    found.add(f"{node.module}.{a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, cur = [node.attr], node.value
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if not (isinstance(cur, ast.Name) and cur.id in bound):
            continue
        mod, rest = bound[cur.id], chain[::-1]
        while rest and f"{mod}.{rest[0]}" in known:
            mod = f"{mod}.{rest.pop(0)}"
        if len(rest) == 1 and _private(rest[0]) and mod != name:
            found.add(f"{mod}.{rest[0]}")
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        fname = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if fname not in ("setattr", "getattr", "delattr") or len(node.args) < 2:
            continue
        target, attr = node.args[0], node.args[1]
        if not (isinstance(attr, ast.Constant) and isinstance(attr.value, str) and _private(attr.value)):
            continue
        chain, cur = [], target
        while isinstance(cur, ast.Attribute):
            chain.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in bound:
            mod = ".".join([bound[cur.id], *chain[::-1]])
            if mod in known and mod != name:
                found.add(f"{mod}.{attr.value}")
    return found


# Underscore uses that a test may still allow while a module is being edited; empty now. Remove an
# entry when its use goes; the test fails while a listed use no longer exists.
KNOWN: dict[str, set[str]] = {}


def test_private_use_finder():
    """It sees both forms, through an alias and a submodule, and leaves the module's own names,
    dunders and the package's underscore modules alone."""
    import tempfile

    code = ("import sparseflash.flash.launch as L\n"
            "from sparseflash import flash, _compat\n"
            "from sparseflash.mask import _tracing, BlockMask\n"
            "from sparseflash.flash.fast import _DENSE\n"
            "L._fit; flash.native._MOD; flash.launch.__name__; _compat.check_interpreter_versions; L.fwd\n"
            "monkeypatch.setattr(flash.tiles, '_p2', None); getattr(L, 'fwd'); setattr(L, '_x', 1)\n")
    known = {"sparseflash", "sparseflash.flash", "sparseflash.flash.launch", "sparseflash.flash.native",
             "sparseflash.flash.fast", "sparseflash.flash.tiles", "sparseflash.mask", "sparseflash._compat"}
    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "m.py"
        path.write_text(code)
        assert _private_uses(path, "sparseflash.flash.fast", known) == {
            "sparseflash.mask._tracing", "sparseflash.flash.launch._fit", "sparseflash.flash.native._MOD",
            "sparseflash.flash.tiles._p2", "sparseflash.flash.launch._x"}


def test_no_module_uses_another_modules_underscore_names():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    # the pattern zoo installs as sparseflash.patterns from the top-level patterns/ folder
    zoo = PACKAGE.parent / "patterns"
    files |= {"sparseflash.patterns" + ("" if p.stem == "__init__" else "." + p.stem): p for p in zoo.glob("*.py")}
    assert "sparseflash.patterns._grid" in files
    known = set(files)
    found = {name: _private_uses(path, name, known) for name, path in files.items()}
    new = {n: sorted(u - KNOWN.get(n, set())) for n, u in found.items() if u - KNOWN.get(n, set())}
    assert not new, f"underscore names of other modules (give them a public name or a home of their own): {new}"
    gone = {n: sorted(u - found.get(n, set())) for n, u in KNOWN.items() if u - found.get(n, set())}
    assert not gone, f"no longer used, remove from KNOWN: {gone}"


# Tests and experiments reach the kernel package through its documented names too.
KERNEL_PACKAGE = "sparseflash.flash."


def test_tests_and_experiments_use_no_underscore_names_of_the_kernel_package():
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    repo = pathlib.Path(__file__).resolve().parents[1]
    scripts = [p for folder in ("tests", "experiments") for p in (repo / folder).rglob("*.py")]
    assert len(scripts) > 100 and repo / "tests" / "test_launch.py" in scripts
    found = {}
    for path in scripts:
        uses = {u for u in _private_uses(path, "", known)
                if u.startswith(KERNEL_PACKAGE)}
        if uses:
            found[str(path.relative_to(repo))] = sorted(uses)
    assert not found, f"underscore names of sparseflash.flash (use or add a documented name): {found}"


def test_short_path_layering():
    """The repeated-call short path is one unit entered through `fast`: fast calls native, native
    imports nothing of the library (its C++ backward reaches Python only through the fallback each
    plan is given); the Hopper kernels share their helpers through `hopper.common`, which imports
    neither of them."""
    graph = _graph()
    assert "sparseflash.flash.native" in graph["sparseflash.flash.fast"]
    assert not {m for m in graph["sparseflash.flash.native"] if m.startswith("sparseflash.")} - LEAVES
    assert "sparseflash.flash.hopper.common" in graph["sparseflash.flash.hopper.backward"]
    assert "sparseflash.flash.hopper.common" in graph["sparseflash.flash.hopper.forward"]
    assert not graph["sparseflash.flash.hopper.common"] - LEAVES


def test_launcher_layering():
    """The portable op's host side: `launch` (the launchers) asks `dispatch` (portable or Hopper
    kernels), `tiles` (tile and TMA policy) and `operands` (the kernels' arguments); none of these
    imports `launch`, `tiles` imports none of them, and each file stays within 500 lines."""
    graph = _graph()
    flash = "sparseflash.flash."
    assert {flash + m for m in ("dispatch", "tiles", "operands", "kernels")} <= graph[flash + "launch"]
    for m in ("dispatch", "tiles", "operands"):
        assert flash + "launch" not in graph[flash + m], m
    assert not {m for m in graph[flash + "tiles"] if m.startswith("sparseflash.")} - LEAVES
    for m in ("launch", "dispatch", "tiles", "operands", "fast", "autograd"):
        lines = (PACKAGE / "flash" / f"{m}.py").read_text().count("\n")
        assert lines <= 500, f"{m}.py has {lines} lines"


def test_command_modules_do_not_import_the_entry_point():
    """`sparseflash.cli` loads the modules that contribute commands (importlib, so a missing extra
    is skipped); none of them imports `sparseflash.cli` back (they take the shared helpers from the
    leaf `sparseflash.cmdline`), so the command line has no hidden import loop."""
    from sparseflash import cli

    root = PACKAGE.parent
    for name in cli._REGISTRARS:
        parts = name.split(".")
        path = (PACKAGE.joinpath(*parts[1:]) if parts[1] != "experiments" else root.joinpath(*parts[1:]))
        text = path.with_suffix(".py").read_text()
        assert "sparseflash.cli " not in text and "sparseflash.cli\n" not in text and "from sparseflash import cli" \
            not in text, name
    assert not {m for m in _graph()["sparseflash.cmdline"] if m.startswith("sparseflash")} - LEAVES
