"""The card's shape: five self-contained stages sharing a small common.py, every other piece in its place.

1. Each stage reads alone: it imports common.py, another stage only for that stage's product (02 and 04: 01's
   rubric; 04 and 05: 03's environment), and the support modules (backends.py, sampling.py, engine.py,
   offline.py, plots.py, runs.py, benchmarks/), at the top of the file; 04 holds its own update (not 02's). A
   support module imports common.py and the support modules below it (options.py, the options and the command
   line; parallel.py, the data-parallel helpers;
   runs.py, a run's files and the update's statistics; sampling.py, the sampler and the scorer; backends.py, the
   chat backends), never a stage, and never in a cycle; a benchmark
   module may import its own package too (benchmarks/__init__.py: the rule labelling a checkout). sampling.py
   imports nothing of the project, and common.py nothing but sampling.py (load_policy's check of the scorer).
2. common.py holds only plumbing that two or more callers (stages, support modules) use.
3. The layout: the CPU stand-ins in offline.py, every figure in plots.py (matplotlib nowhere else), one file
   per external benchmark in benchmarks/; processes talk only inside parallel.py's data-parallel helpers
   (accelerate carries the collectives), which 04 and runs.UpdateStats call.
4. The layout is ruff's (pyproject.toml; `make test` runs `ruff format --check` and `ruff check` first): no line
   count or width is held here; sizes are what the design gives (docs/files.md reports them). No tuple-expression
   statement, no lambda bound to a name, no walrus in a comprehension.
5. Every citation of docs/reference.md resolves inside the repository; the README stays a newcomer's page.
6. Every markdown table row has as many cells as its header.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = sorted(ROOT.glob("[0-9][0-9]_*.py"))
COMMON = ROOT / "common.py"
SUPPORT = [
    ROOT / name
    for name in (
        "backends.py",
        "engine.py",
        "offline.py",
        "options.py",
        "parallel.py",
        "plots.py",
        "runs.py",
        "sampling.py",
    )
] + sorted((ROOT / "benchmarks").glob("*.py"))
# what a support module may import of the project, besides common.py: the modules below it (no cycle)
BELOW = {
    "options": set(),
    "parallel": set(),
    "runs": {"options", "parallel"},
    "sampling": set(),
    "backends": {"options", "sampling"},
    "engine": {"backends", "options", "sampling"},
}
# sampling.py imports nothing of the project (common.py imports it)
PROJECT = (
    STAGES
    + [COMMON]
    + SUPPORT
    + sorted((ROOT / "scripts").glob("*.py"))
    + sorted((ROOT / "experiments").glob("*.py"))
    + sorted((ROOT / "tests").glob("*.py"))
)
# the stages a stage may import, and what for (its docstring says so too)
ALLOWED = {"01": set(), "02": {"01"}, "03": set(), "04": {"01", "03"}, "05": {"03"}}


def project_imports(tree):
    """(module, the function it is imported in or None, line) for every import of common.py, a stage or a
    support module: `import common`, `from common import x`, `from benchmarks import sage` (as
    benchmarks.sage), importlib.import_module("NN_...")."""
    names = {p.stem for p in STAGES} | {"common", "benchmarks"} | {p.stem for p in SUPPORT if p.parent == ROOT}
    out = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Import):
                out.extend((a.name, func, child.lineno) for a in child.names if a.name.split(".")[0] in names)
            elif isinstance(child, ast.ImportFrom) and child.module == "benchmarks":
                out.extend((f"benchmarks.{a.name}", func, child.lineno) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and (child.module or "").split(".")[0] in names:
                out.append((child.module, func, child.lineno))
            elif (
                isinstance(child, ast.Call)
                and getattr(child.func, "attr", getattr(child.func, "id", None)) == "import_module"
                and child.args
                and isinstance(child.args[0], ast.Constant)
            ):
                out.append((child.args[0].value, func, child.lineno))
            visit(child, inner)

    visit(tree, None)
    return out


def test_the_stages_are_found():
    assert [p.name[:2] for p in STAGES] == ["01", "02", "03", "04", "05"]


@pytest.mark.parametrize("path", STAGES, ids=lambda p: p.name)
def test_a_stage_imports_common_and_only_the_products_it_names(path):
    text = path.read_text(encoding="utf-8")
    found = project_imports(ast.parse(text))
    for name, func, line in found:
        assert func is None, f"{path.name}:{line}: imports {name} inside {func}() (imports go at the top)"
    stages = {name[:2] for name, _, _ in found if name[:2].isdigit()}
    assert stages == ALLOWED[path.name[:2]], f"{path.name} imports stages {sorted(stages)}"
    assert ("common", None) in {(n, f) for n, f, _ in found}
    doc = ast.get_docstring(ast.parse(text))
    assert doc.startswith(path.name) and 'if __name__ == "__main__":' in text
    for stage in stages:  # the docstring names each stage it imports, and why
        assert re.search(rf"^Imports .*{stage}_\w+", doc, re.M | re.S), f"{path.name}: the docstring names {stage}"


@pytest.mark.parametrize("path", SUPPORT, ids=lambda p: p.name)
def test_a_support_module_imports_common_and_never_a_stage(path):
    found = project_imports(ast.parse(path.read_text(encoding="utf-8")))
    own = {"benchmarks"} if path.parent.name == "benchmarks" else set()  # `import benchmarks`: its package
    below = BELOW.get(path.stem, {"options", "runs", "sampling", "backends"})  # offline, plots, a benchmark
    allowed = set() if path.stem == "sampling" else {"common"} | below | own
    assert {name for name, _, _ in found} <= allowed, f"{path.name} imports {sorted({n for n, _, _ in found})}"
    assert ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))), f"{path.name} opens with a docstring"


def test_common_imports_only_the_scorer_and_nothing_imports_upwards():
    """common.py imports sampling.py only (load_policy measures the scorer against the model's forward); the
    import graph of common.py and the support modules has no cycle."""
    graph = {
        p.stem: {n.split(".")[0] for n, _, _ in project_imports(ast.parse(p.read_text(encoding="utf-8")))}
        for p in [COMMON] + [s for s in SUPPORT if s.parent == ROOT]
    }
    assert graph["common"] == {"sampling"}, graph["common"]
    assert graph["sampling"] == set(), graph["sampling"]
    done, stack = set(), []

    def visit(name):
        assert name not in stack, f"an import cycle: {' -> '.join(stack + [name])}"
        if name in done or name not in graph:
            return
        stack.append(name)
        for child in graph[name]:
            visit(child)
        stack.pop()
        done.add(name)

    for name in graph:
        visit(name)


def test_every_piece_is_in_its_place():
    for name in ("offline.py", "plots.py", "benchmarks/eqbench3.py", "benchmarks/sage.py", "benchmarks/emobench.py"):
        assert (ROOT / name).is_file(), name
    for p in PROJECT:
        if p.name != "plots.py":  # every figure is plots.py's
            assert not re.search(r"^\s*(import|from) matplotlib", p.read_text(encoding="utf-8"), re.M), p.name
    offline = ast.parse((ROOT / "offline.py").read_text(encoding="utf-8"))
    classes = {n.name for n in offline.body if isinstance(n, ast.ClassDef)}
    assert {"EmbedJudge", "ScriptedUser", "EmbedBackend"} <= classes


def test_04_writes_its_own_update():
    tree = ast.parse((ROOT / "04_mica_train.py").read_text(encoding="utf-8"))
    assert "02_rubric_pref_rl" not in {name for name, _, _ in project_imports(tree)}
    defs = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert {
        "clipped_surrogate",
        "policy_update",
        "mica_advantages",
        "grpo_advantages",
        "reinforce_pp_advantages",
        "discounted_returns",
        "turn_rewards",
        "cut_off_penalty",
        "idr_rewards",
        "rlver_rewards",
        "train_loop",
    } <= defs
    # CARE's and Kardia-R1's reward loops stand beside the criteria judge they call, in 01
    sft = ast.parse((ROOT / "01_rubric_sft.py").read_text(encoding="utf-8"))
    assert {"care_rewards", "kardia_rewards", "write_rubrics", "load_graders", "CriteriaJudge"} <= {
        n.name for n in sft.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
    }


def test_04_uses_nothing_before_it_defines_it():
    """04 reads top to bottom: a top-level function, class or constant of the file uses only the file's names
    defined above it."""
    tree = ast.parse((ROOT / "04_mica_train.py").read_text(encoding="utf-8"))
    defined_at = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined_at.setdefault(node.name, i)
        for target in getattr(node, "targets", []) + [getattr(node, "target", None)]:
            for name in ast.walk(target) if target is not None else []:
                if isinstance(name, ast.Name):
                    defined_at.setdefault(name.id, i)
    early = [
        (node.lineno, n.id)
        for i, node in enumerate(tree.body)
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and defined_at.get(n.id, -1) > i
    ]
    assert early == [], early


# the data-parallel helpers (parallel.py): the only functions in which processes talk (each does nothing on one
# process)
DP_HELPERS = {
    "sum_over_processes",
    "gather_over_processes",
    "gather_groups",
    "as_many_minibatches",
    "on_main_process",
}
COLLECTIVE = re.compile(r"reduce|all_reduce|gather|broadcast|all_gather|scatter|barrier|wait_for_everyone", re.I)


def collectives_outside(tree, helpers) -> list[tuple[int, str]]:
    """(line, name) of every call of a collective (accelerate's reduce / gather / broadcast, torch.distributed's)
    outside the named helper functions; calls of the helpers themselves are fine."""
    found = []

    def visit(node, func):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call):
                name = getattr(child.func, "attr", getattr(child.func, "id", ""))
                if COLLECTIVE.search(name) and name not in helpers and func not in helpers:
                    found.append((child.lineno, name))
            visit(child, inner)

    visit(tree, None)
    return found


def test_processes_talk_only_in_the_data_parallel_helpers():
    parallel = ast.parse((ROOT / "parallel.py").read_text(encoding="utf-8"))
    assert DP_HELPERS <= {n.name for n in parallel.body if isinstance(n, ast.FunctionDef)}
    # the files of a data-parallel training step (elsewhere `gather` is torch's tensor gather, not a collective)
    for path in (ROOT / "04_mica_train.py", ROOT / "runs.py", ROOT / "parallel.py", ROOT / "engine.py"):
        text = path.read_text(encoding="utf-8")
        assert "torch.distributed" not in text, path.name  # accelerate carries the collectives
        assert collectives_outside(ast.parse(text), DP_HELPERS) == [], path.name


def test_the_layout_test_catches_a_collective_outside_the_helpers():
    code = (
        "def sum_over_processes(acc, x):\n    return acc.reduce(x, 'sum')\n"
        "def update(acc, g):\n    n = sum_over_processes(acc, g)\n    flat = acc.reduce(g, 'sum')\n"
        "    dist.all_reduce(g)\n    parts = gather_object([g])\n    broadcast(g)\n    acc.wait_for_everyone()\n"
    )
    found = collectives_outside(ast.parse(code), DP_HELPERS)
    assert found == [(5, "reduce"), (6, "all_reduce"), (7, "gather_object"), (8, "broadcast"), (9, "wait_for_everyone")]


def test_the_layout_test_catches_a_nested_import():
    bad = ast.parse(
        "import importlib\nx = importlib.import_module('04_mica_train')\ndef f():\n    import common\n"
        "from benchmarks import sage\nimport plots\n"
    )
    assert project_imports(bad) == [
        ("04_mica_train", None, 2),
        ("common", "f", 4),
        ("benchmarks.sage", None, 5),
        ("plots", None, 6),
    ]


def stage_uses(common_text: str, stage_texts: list[str]) -> dict[str, tuple[int, bool]]:
    """Every top-level function, class and constant of common.py -> (how many stages use it as common.<name>,
    whether common.py itself uses it beyond its definition)."""
    tree = ast.parse(common_text)
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    names += [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)]
    return {
        name: (
            sum(re.search(rf"\bcommon\.{name}\b", t) is not None for t in stage_texts),
            len(re.findall(rf"\b{name}\b", common_text)) > 1,
        )
        for name in names
    }


def one_stage_names(uses: dict) -> list[str]:
    """A name one stage uses belongs in that stage, unless common.py calls it too (it then serves a name that
    other stages call); a name no stage uses and common.py does not call is dead."""
    return sorted(name for name, (n, inside) in uses.items() if not name.startswith("_") and n < 2 and not inside)


def test_common_holds_only_what_two_or_more_callers_use():
    uses = stage_uses(COMMON.read_text(encoding="utf-8"), [p.read_text(encoding="utf-8") for p in STAGES + SUPPORT])
    assert one_stage_names(uses) == [], {n: uses[n] for n in one_stage_names(uses)}


def test_the_layout_test_catches_a_one_stage_helper_and_a_dead_one():
    common_text = (
        "def shared():\n    helper()\n\n\ndef helper():\n    pass\n\n\n"
        "def mine():\n    pass\n\n\ndef dead():\n    pass\n"
    )
    stages = ["common.shared()", "common.shared(); common.mine()"]
    assert one_stage_names(stage_uses(common_text, stages)) == ["dead", "mine"]


def dense_habits(tree) -> list[tuple[int, str]]:
    """(line, what) for each tuple-expression statement (`a(), b()`), lambda bound to a name, and walrus inside
    a comprehension: each writes two things where a learner reads one."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Tuple):
            found.append((node.lineno, "a tuple-expression statement"))
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Lambda):
            found.append((node.lineno, "a lambda bound to a name"))
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            found += [(n.lineno, "a walrus in a comprehension") for n in ast.walk(node) if isinstance(n, ast.NamedExpr)]
    return found


@pytest.mark.parametrize("path", [p for p in PROJECT if not p.parts[-2] == "tests"], ids=lambda p: p.name)
def test_one_statement_a_line(path):
    assert dense_habits(ast.parse(path.read_text(encoding="utf-8"))) == []


def test_the_layout_test_catches_dense_habits():
    tree = ast.parse("a(), b()\nf = lambda x: x\nys = [y for x in z if (y := x)]\nc, d = 1, 2\n")
    assert [w for _, w in dense_habits(tree)] == [
        "a tuple-expression statement",
        "a lambda bound to a name",
        "a walrus in a comprehension",
    ]


def test_every_reference_citation_resolves_in_the_repository():
    files = (
        STAGES
        + [COMMON, ROOT / "README.md"]
        + sorted((ROOT / "docs").glob("*.md"))
        + sorted((ROOT / "experiments").glob("*.py"))
        + sorted((ROOT / "scripts").glob("*.py"))
    )
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
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)  # links outside code
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            page = md.parent / target if target else md
            assert page.exists(), f"{md.name}: link to {target} does not resolve"
            assert not anchor or anchor in heading_anchors(page), f"{md.name}: no heading #{anchor} in {page.name}"


def heading_anchors(md: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_readme_is_a_newcomers_page():
    """What it is, the two commands, the reading order, one result table, the GPU command; depth in docs/."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads[:2] == ["Quick start", "Read the code in this order"], heads
    assert "make demo" in text and "make test" in text and "--model Qwen2.5-7B-Instruct" in text
    assert len(re.findall(r"^\|---", text, re.M)) == 1, "one result table"


def test_every_table_row_has_its_headers_cells():
    """A row with more or fewer cells than its table's header renders shifted: a table edited by hand broke so."""
    for md in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", "", md.read_text(encoding="utf-8"), flags=re.S)
        header = None
        for i, line in enumerate(text.splitlines(), 1):
            if not line.startswith("|"):
                header = None
                continue
            cells = re.sub(r"`[^`]*`|\\\|", "x", line).strip().strip("|").count("|") + 1
            if header is None:
                header = cells
            assert cells == header, f"{md.name}:{i} (outside code blocks): {cells} cells, its header {header}"
