"""benchmarks/module_walks.py's pieces that need no launch: the line classes, the profile hook's
rules (library calls counted once per module and thread, module bodies not), the docs section read."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from harness import load_benchmark

REPO = Path(__file__).parents[2]


def walks() -> ModuleType:
    return load_benchmark("module_walks")


SOURCE = '''"""A module docstring
over two lines."""

import os  # a comment beside code counts as code

# a comment alone


def f(x):
    """Its docstring.

    With a blank line inside."""
    s = """a string, not a docstring

    (its blank line is code)"""
    return x, s
'''


def test_the_lines_of_a_module_fall_in_one_class_each() -> None:
    counts = walks().count_lines(SOURCE)
    assert counts == {"total": 16, "code": 6, "comment": 6, "docstring": 5, "blank": 4}
    assert counts["code"] + counts["comment"] + counts["blank"] == counts["total"]


def test_the_hook_counts_calls_into_the_library_once_per_module_and_not_module_bodies(tmp_path: Path) -> None:
    mw = walks()
    pkg = tmp_path / "ncclguard"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "walked_a.py").write_text("def a():\n    return 1\n")
    (pkg / "walked_b.py").write_text("def b():\n    return a() + a()\n")
    tracer = mw.Tracer(tmp_path)
    ns_a: dict = {}
    ns_b: dict = {}
    old = sys.getprofile()
    sys.setprofile(tracer.hook)
    try:
        tracer.open()
        for path, ns in ((pkg / "walked_a.py", ns_a), (pkg / "walked_b.py", ns_b)):
            exec(compile(path.read_text(), str(path), "exec"), ns)  # module bodies: not counted
        ns_b["a"] = ns_a["a"]
        ns_b["b"]()
        rec = tracer.close()
    finally:
        sys.setprofile(old)
    assert [(c["module"], c["first"]) for c in rec["calls"]] == [
        ("ncclguard/walked_b.py", "b"),
        ("ncclguard/walked_a.py", "a"),
    ]


def test_where_to_add_things_is_read_from_a_commit() -> None:
    d = walks().where_to_add("HEAD")
    assert d["architecture_md"] and d["section"]
    entries = [e for e in (d["sensor"], d["detector"]) if e is not None]
    assert entries and all(e["files"] for e in entries)
