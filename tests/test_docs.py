"""README.md and BENCHMARKS.md stay true to the tree: the "Where things are" tree names
only paths that exist and every folder of experiments/results/ and experiments/studies/, and every
repository path the two documents cite exists; sparseflash/flash/README.md names only what the code
defines. Reads files only; well under 1 s."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tree_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Where things are"):]
    block = section[section.index("```") + 3:]
    return block[block.index("\n") + 1:block.index("```")].splitlines()


def _tree_paths(lines) -> list[str]:
    """Paths of the tree's entries: a first word ending in / or a file suffix, nested by indentation."""
    paths, stack = [], []
    for line in lines:
        if not line.strip():
            continue
        indent = (len(line) - len(line.lstrip())) // 2
        word = line.split()[0]
        if not (word.endswith("/") or re.search(r"\.(py|sh|md|toml)$", word)) or indent > len(stack):
            continue  # a continuation line of a description
        stack = stack[:indent]
        paths.append("".join(stack) + word)
        if word.endswith("/"):
            stack.append(word)
    return paths


def test_tree_parser():
    lines = ["a/   the a", "  b.py   x", "  c/     y", "    d.py", "           continued/ words", "e.md"]
    assert _tree_paths(lines) == ["a/", "a/b.py", "a/c/", "a/c/d.py", "e.md"]


def test_tree_entries_exist():
    paths = _tree_paths(_tree_block())
    assert "sparseflash/mask.py" in paths and "experiments/bench/" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README's tree names paths that do not exist: {missing}"


def test_tree_names_every_results_and_studies_folder():
    block = "\n".join(_tree_block())
    for parent in ("experiments/results", "experiments/studies"):
        for d in sorted((ROOT / parent).iterdir()):
            if d.is_dir() and not d.name.startswith(("_", ".")):
                assert re.search(rf"(^|\s){re.escape(d.name)}/", block), f"{parent}/{d.name}/ is not in README's tree"


def test_cited_paths_exist():
    missing = []
    for doc in ("README.md", "BENCHMARKS.md"):
        for path in re.findall(r"`((?:experiments|sparseflash|patterns|tests)/[^`\s*<]+)`", (ROOT / doc).read_text()):
            if not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{doc}: {path}")
    assert not missing, missing


def _top_level_names(path: pathlib.Path) -> set[str]:
    """The names a module file defines or imports at its top level."""
    import ast

    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_flash_readme_names_what_exists():
    """sparseflash/flash/README.md, the path from a call to a kernel, names only modules, files and
    functions that exist: each `module.name` (a module of sparseflash/flash/ or sparseflash/) defines
    the name, each bare name is defined by a module of sparseflash/flash/, each file exists."""
    flash = ROOT / "sparseflash" / "flash"
    text = (flash / "README.md").read_text()
    modules = {p.stem: p for p in (ROOT / "sparseflash").glob("*.py")} | {p.stem: p for p in flash.glob("*.py")}
    defined = set().union(*(_top_level_names(p) for p in flash.glob("*.py")))
    missing = []
    for token in re.findall(r"`([^`]+)`", text):
        token = re.sub(r"\(.*\)$", "", token)
        if not re.fullmatch(r"[\w./]+", token):
            continue  # code, or a torch.library op's name
        if token.endswith((".py", ".md", "/")):
            ok = (flash / token).exists()
        else:
            parts = token.removeprefix("sparseflash.").split(".")
            if token.startswith("sparseflash.") and len(parts) == 1:  # the package's own name, or a module
                ok = parts[0] in modules or parts[0] in _top_level_names(ROOT / "sparseflash" / "__init__.py")
            elif len(parts) == 1:
                ok = parts[0] in defined or parts[0] in modules
            else:
                ok = parts[0] in modules and parts[1] in _top_level_names(modules[parts[0]])
        if not ok:
            missing.append(token)
    assert len(re.findall(r"^\d+\. ", text, flags=re.M)) == 10, "the path is ten numbered lines"
    assert not missing, f"sparseflash/flash/README.md names what does not exist: {missing}"


def test_result_folders_are_named_by_their_question():
    """A results folder is named by the question it answers, not by the commit it ran at (the
    commit goes inside its files: a column, a meta field or commit.txt)."""
    commit_named = re.compile(r"[-_](?=[0-9a-f]*\d)[0-9a-f]{7,40}$")
    assert all(commit_named.search(n) for n in ("host_profile-5246292", "gpu-check-df5fa3e", "lra-speed-before-f74b8e2"))
    assert not any(commit_named.search(n) for n in ("kernel-check-eager-4k", "speed-short-fastpath", "bound-hopper-launches"))
    found = [str(d.relative_to(ROOT)) for d in (ROOT / "experiments").rglob("*")
             if d.is_dir() and "results" in d.relative_to(ROOT).parts[:-1] and commit_named.search(d.name)]
    assert not found, f"results folders named after a commit: {found}"
