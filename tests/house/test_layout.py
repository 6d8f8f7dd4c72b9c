"""The house rules of the layout, checked: modules of at most 500 lines and small classes, one door
to torch's private APIs, a public face with an explicit ``__all__``, no printing in the library.
(What each module may import: tests/house/test_import_contract.py.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import ncclguard

REPO = Path(__file__).parents[2]
LIBRARY = sorted([*(REPO / "ncclguard").rglob("*.py"), *(REPO / "integrations").rglob("*.py")])
# Modules whose job is to print: the command-line faces.
PRINTS = ("ncclguard/cli/", "ncclguard/bench/", "/__main__.py")


def test_no_module_over_500_lines() -> None:
    # A module that long holds more than one job: give each its own module (docs/architecture.md).
    long_modules = {str(p.relative_to(REPO)): n for p in LIBRARY if (n := len(p.read_text().splitlines())) > 500}
    assert long_modules == {}


def test_no_class_over_300_lines() -> None:
    # Modules are split along the seams of docs/architecture.md's layers (tests/house/test_import_contract.py),
    # not to fit a line count; a class that long does more than one job.
    long_classes = {}
    for p in LIBRARY:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > 300:  # type: ignore[operator]
                long_classes[f"{p.relative_to(REPO)}:{node.name}"] = n
    assert long_classes == {}


def test_no_function_over_80_lines() -> None:
    # A function that long holds parts that have names: split it there (docs/architecture.md).
    long_functions = {}
    for p in LIBRARY:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := node.end_lineno - node.lineno + 1) > 80:  # type: ignore[operator]
                    long_functions[f"{p.relative_to(REPO)}:{node.name}"] = n
    assert long_functions == {}


def test_private_torch_distributed_apis_only_through_the_compat_module() -> None:
    private = re.compile(
        r"c10d\._[a-z]|_C\._distributed_c10d|\._get_sequence_number_for_group|options\._timeout|dataloader\._[A-Za-z]"
    )
    offenders = [
        f"{p.relative_to(REPO)}:{i}"
        for p in LIBRARY
        if p.name != "_torch_compat.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if private.search(line.split("#")[0]) and not line.lstrip().startswith(("``", '"', "'"))
    ]
    assert offenders == []


def test_the_public_face_lists_what_it_exports() -> None:
    assert sorted(ncclguard.__all__) == sorted(set(ncclguard.__all__))
    for name in ncclguard.__all__:
        assert hasattr(ncclguard, name), name


def test_the_library_logs_and_never_prints() -> None:
    offenders = []
    for p in LIBRARY:
        rel = str(p.relative_to(REPO))
        if any(part in rel or rel.endswith(part) for part in PRINTS):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == []


def test_every_test_lives_in_the_folder_of_the_room_it_tests() -> None:
    # docs/architecture.md, "Checks": a newcomer finds a capability's tests in one folder.
    assert sorted(p.name for p in (REPO / "tests").glob("test_*.py")) == []
    folders = {p.parent.name for p in (REPO / "tests").rglob("test_*.py")}
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert folders and all(f"`tests/{f}/`" in doc for f in folders), folders


def launches(tree: ast.Module) -> set[tuple[str, str | None]]:
    """The (worker, scenario) of each ``run_ranks`` call of a test module with constant arguments;
    the scenario is None where the call passes none or passes options (``--...``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run_ranks":
            consts = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else None for a in node.args]
            if consts and consts[0] is not None:
                scenario = consts[2] if len(consts) > 2 else None
                found.add((consts[0], scenario if scenario and not scenario.startswith("-") else None))
    return found


def test_every_multirank_test_says_what_each_of_its_launches_runs() -> None:
    # A multi-rank test's meaning is split between its assertions and a worker's scenario: the
    # module's docstring names the worker (tests/workers/<worker>.py) and each scenario it launches
    # (``<scenario>``, with what it does), so the assertions are read beside the story they check.
    missing = {}
    for p in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(p.read_text())
        if not any(isinstance(n, ast.ImportFrom) and n.module == "harness" for n in tree.body):
            continue
        doc = ast.get_docstring(tree) or ""
        for worker, scenario in sorted(launches(tree), key=str):
            for needed in (f"tests/workers/{worker}.py", f"``{scenario}``" if scenario else None):
                if needed and needed not in doc:
                    missing.setdefault(str(p.relative_to(REPO)), []).append(needed)
    assert missing == {}, missing


def _timeout_marks(tree: ast.Module) -> tuple[float | None, list[float]]:
    """The module's ``pytestmark`` timeout (or None) and every ``@pytest.mark.timeout(s)`` in it."""
    module, marks = None, []
    for node in ast.walk(tree):
        func = node.func if isinstance(node, ast.Call) else None
        if isinstance(func, ast.Attribute) and func.attr == "timeout" and getattr(func.value, "attr", "") == "mark":
            marks.append(float(node.args[0].value))  # type: ignore[union-attr]
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in stmt.targets):
            found = [
                n for n in ast.walk(stmt.value) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "timeout"
            ]
            module = float(found[0].args[0].value) if found else None  # type: ignore[attr-defined]
    return module, marks


def test_every_launch_ends_by_its_own_hang_guard_before_pytest_timeout_ends_the_test() -> None:
    # The harness kills a launch past its ``timeout_s`` and shows every rank's output. pytest-timeout
    # ending the test first leaves the ranks running and their output unread: a part-C hang of
    # tests/integrations/test_hf_recover_multirank.py (300 s each) said nothing of why.
    default = float(re.search(r"^timeout = (\d+)", (REPO / "pyproject.toml").read_text(), re.M).group(1))  # type: ignore[union-attr]
    short = {}
    for p in sorted((REPO / "tests").rglob("test_*.py")):
        tree = ast.parse(p.read_text())
        guards = [
            float(kw.value.value)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "run_ranks"
            for kw in n.keywords
            if kw.arg == "timeout_s" and isinstance(kw.value, ast.Constant)
        ]
        module, marks = _timeout_marks(tree)
        limit = module or (min(marks) if marks else default)
        if guards and max(guards) + 60 > limit:
            short[str(p.relative_to(REPO))] = (max(guards), limit)
    assert short == {}, f"launch guard and test timeout (give the module a pytestmark timeout 60 s above): {short}"
