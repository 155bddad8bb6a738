"""The codebase reads in order: each stage imports only common.py and lower-numbered stages, at the top
of the file; its main loop begins within ~300 lines; no stage is over 800 lines and no function over 80;
every citation of the reference resolves inside the repository."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = sorted(ROOT.glob("[0-9][0-9]_*.py"))
MAIN_LOOP = {"01": "train_loop", "02": "main", "03": "rollout", "04": "train_loop", "05": "main"}
PROJECT = {p.stem for p in STAGES} | {"common"}


def stage_imports(tree):
    """(module name, the function it is imported in or None, line) for every import of a project module:
    `import common`, `from common import x`, and importlib.import_module("NN_...")."""
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                out.extend((a.name, func, child.lineno) for a in child.names if a.name in PROJECT)
            elif isinstance(child, ast.ImportFrom) and child.module in PROJECT:
                out.append((child.module, func, child.lineno))
            elif (isinstance(child, ast.Call) and getattr(child.func, "attr", getattr(child.func, "id", None))
                  == "import_module" and child.args and isinstance(child.args[0], ast.Constant)):
                out.append((child.args[0].value, func, child.lineno))
            visit(child, inner)

    visit(tree, None)
    return out


def test_the_stages_are_found():
    assert [p.name[:2] for p in STAGES] == ["01", "02", "03", "04", "05"]


@pytest.mark.parametrize("path", STAGES + [ROOT / "common.py"], ids=lambda p: p.name)
def test_imports_only_common_and_lower_stages_at_the_top(path):
    me = path.stem[:2] if path.stem[:2].isdigit() else "00"
    found = stage_imports(ast.parse(path.read_text(encoding="utf-8")))
    for name, func, line in found:
        assert func is None, f"{path.name}:{line}: imports {name} inside {func}() (imports go at the top)"
        if name[:2].isdigit():
            assert name[:2] < me, f"{path.name}:{line}: imports stage {name} (only lower-numbered stages)"
    if path.name == "common.py":
        assert not found, f"common.py imports {found}: it is plumbing, below every stage"
    else:
        assert ("common", None) in {(n, f) for n, f, _ in found}


def test_the_layout_test_catches_a_forward_and_a_nested_import():
    bad = ast.parse("import importlib\nx = importlib.import_module('04_mica_train')\n"
                    "def f():\n    import common\n")
    assert stage_imports(bad) == [("04_mica_train", None, 2), ("common", "f", 4)]


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.name)
def test_stage_size(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= 800, f"{path.name} has {n} lines (at most 800)"


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.name)
def test_where_the_main_loop_starts(path):
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    defs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    loop = defs[MAIN_LOOP[path.name[:2]]]
    assert loop.lineno <= 310, f"{path.name}: the main loop {loop.name}() starts at line {loop.lineno}"
    assert ast.get_docstring(tree).startswith(path.name), "the docstring opens with the script's name"
    assert 'if __name__ == "__main__":' in text


@pytest.mark.parametrize("path", STAGES + [ROOT / "common.py"], ids=lambda p: p.name)
def test_no_function_over_80_lines(path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            assert n <= 80, f"{path.name}:{node.lineno}: {node.name}() is {n} lines (at most 80)"


def test_every_reference_citation_resolves_in_the_repository():
    files = STAGES + [ROOT / "common.py", ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")) \
        + sorted((ROOT / "experiments").glob("*.py"))
    reference = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## (\d+)\.", reference, re.M))
    assert sections >= {"1", "2", "3", "4", "5", "6"}
    for f in files:
        text = f.read_text(encoding="utf-8")
        assert "REFERENCE.md" not in text and "../shared" not in text, f"{f.name} cites a file outside the repo"
        for m in re.finditer(r"docs/reference\.md,? sections? ([\d\-, and]+)", text):
            for n in re.findall(r"\d+", m.group(1)):
                assert n in sections, f"{f.name}: cites docs/reference.md section {n}, which does not exist"
    for md in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text(encoding="utf-8")):
            if not re.match(r"[a-z]+:", target):
                assert (md.parent / target).exists(), f"{md.name}: link to {target} does not resolve"


def test_readme_is_a_newcomers_page():
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) <= 15_000
