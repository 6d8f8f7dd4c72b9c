"""The layers of docs/architecture.md, checked against the code's imports.

The table under "## Layers" in docs/architecture.md is the contract: one row per part, its layer
number and its paths. A module may import its own part and the parts of lower layers, never a part
of its own layer or above; two top folders never import each other; ``integrations/`` imports nothing
private of the library. The test reads the table, so the document and the code cannot drift apart
without this test failing; a planted offender shows the check can fail.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"


@dataclass(frozen=True)
class Part:
    name: str
    layer: int
    paths: tuple[str, ...]  # relative to the package root: "store/", "errors.py"; integrations/ is "integrations/"


def read_contract(doc: Path) -> list[Part]:
    """The parts listed in the "## Layers" table: ``| layer | part | paths | what it holds |``."""
    text = doc.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    parts = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].isdigit():
            continue
        paths = tuple(re.findall(r"`([^`]+)`", cells[2]))
        parts.append(Part(name=cells[1], layer=int(cells[0]), paths=paths))
    return parts


def part_of(rel: str, parts: list[Part]) -> Part | None:
    """The part a file (``ncclguard/store/bounded_calls.py``, ``integrations/hf/__init__.py``) belongs to."""
    rel = rel.removeprefix("ncclguard/")
    best: tuple[int, Part] | None = None
    for part in parts:
        for path in part.paths:
            if rel == path or (path.endswith("/") and rel.startswith(path)):
                if best is None or len(path) > best[0]:
                    best = (len(path), part)
    return best[1] if best else None


def module_file(module: str, root: Path) -> str | None:
    """The file, relative to ``root``, that ``module`` (``ncclguard.x.y``) names, or None."""
    if module != "ncclguard" and not module.startswith("ncclguard."):
        return None
    names = module.split(".")[1:]
    if names[:1] == ["integrations"]:
        base, names = root / "integrations", names[1:]
    else:
        base = root / "ncclguard"
    for i in range(len(names), -1, -1):
        cand = base.joinpath(*names[:i])
        if cand.with_suffix(".py").is_file() and i:
            return str(cand.with_suffix(".py").relative_to(root))
        if (cand / "__init__.py").is_file():
            return str((cand / "__init__.py").relative_to(root))
    return None


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in ``path``, lazy ones included; ``from P import name``
    counts as ``P.name`` when that is a module, else as ``P``."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(root)
    package = ".".join(("ncclguard", *rel.parts[1:-1])) if rel.parts[0] == "integrations" else ".".join(rel.parts[:-1])
    if rel.parts[0] == "integrations":
        package = "ncclguard.integrations" + ("." + ".".join(rel.parts[1:-1]) if len(rel.parts) > 2 else "")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append(
                    (
                        node.lineno,
                        sub
                        if module_file(sub, root) and sub.count(".") > mod.count(".") and _is_module(sub, root)
                        else mod,
                    )
                )
    return out


def _is_module(module: str, root: Path) -> bool:
    names = module.split(".")[1:]
    base = root / "integrations" if names[:1] == ["integrations"] else root / "ncclguard"
    names = names[1:] if names[:1] == ["integrations"] else names
    cand = base.joinpath(*names)
    return cand.with_suffix(".py").is_file() or (cand / "__init__.py").is_file()


def offences(root: Path, parts: list[Part]) -> list[str]:
    """Every import in the library under ``root`` that the contract forbids, as readable lines."""
    found = []
    files = sorted([*(root / "ncclguard").rglob("*.py"), *(root / "integrations").rglob("*.py")])
    for path in files:
        rel = str(path.relative_to(root))
        me = part_of(rel, parts)
        if me is None:
            found.append(f"{rel}: in no part of the table")
            continue
        for line, module in sorted(set(imported_modules(path, root))):
            target_file = module_file(module, root)
            if target_file is None:
                continue  # not ncclguard
            other = part_of(target_file, parts)
            if other is None or other.name == me.name:
                continue
            if other.layer >= me.layer:
                found.append(
                    f"{rel}:{line}: {me.name} (layer {me.layer}) imports {module} of {other.name} (layer {other.layer})"
                )
    return found


def private_imports(root: Path) -> list[str]:
    """Every import in ``integrations/`` of a private module or name of ncclguard (one whose dotted
    path or imported name has a ``_``-prefixed part): adapters use the public API and the adapter
    toolkit (``ncclguard/toolkit.py``) alone. Imports between the integrations' own modules are theirs."""
    found = []
    for path in sorted((root / "integrations").rglob("*.py")):
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                pairs = [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                pairs = [(alias.name, "") for alias in node.names]
            else:
                continue
            for module, name in pairs:
                parts = module.split(".")
                if parts[0] != "ncclguard" or parts[1:2] == ["integrations"]:
                    continue
                private = [p for p in [*parts[1:], name] if p.startswith("_") and not p.startswith("__")]
                if private:
                    found.append(
                        f"{rel}:{node.lineno}: imports {module}{'.' + name if name else ''} (private: {private[0]})"
                    )
    return found


def folder_cycles(root: Path) -> list[str]:
    """Pairs of the package's top folders that import each other: each folder is one band of
    layers, so imports between two folders go one way (``watching/`` imports ``incidents/``, never
    the reverse). A top-level module (``world.py``) is a folder of its own."""
    edges: set[tuple[str, str]] = set()
    for path in sorted((root / "ncclguard").rglob("*.py")):
        rel = path.relative_to(root / "ncclguard")
        mine = rel.parts[0]
        for _, module in imported_modules(path, root):
            target = module_file(module, root)
            if target is None or not target.startswith("ncclguard/"):
                continue
            theirs = Path(target).relative_to("ncclguard").parts[0]
            if theirs != mine:
                edges.add((mine, theirs))
    return sorted(f"{a} <-> {b}" for a, b in edges if (b, a) in edges and a < b)


def test_the_table_names_every_module_and_every_part_exists() -> None:
    parts = read_contract(ARCHITECTURE)
    assert len(parts) >= 8
    names = [p.name for p in parts]
    assert len(names) == len(set(names)), names
    for part in parts:
        for path in part.paths:
            where = REPO / path if path.startswith("integrations/") else REPO / "ncclguard" / path
            assert where.exists(), f"{part.name}: {path} does not exist"


def test_the_code_keeps_the_layers() -> None:
    assert offences(REPO, read_contract(ARCHITECTURE)) == []


def test_no_two_folders_import_each_other() -> None:
    assert folder_cycles(REPO) == []


def test_the_integrations_import_nothing_private() -> None:
    assert private_imports(REPO) == []


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for folder in ("ncclguard", "integrations"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_planted_upward_import_is_caught(tree: Path) -> None:
    target = tree / "ncclguard" / "collectives" / "groups.py"
    target.write_text(target.read_text() + "\nfrom ncclguard.watching.watchdog import Watchdog  # planted\n")
    found = offences(tree, read_contract(ARCHITECTURE))
    assert len(found) == 1 and found[0].startswith("ncclguard/collectives/groups.py:")
    assert "imports ncclguard.watching.watchdog of watchdog (layer 7)" in found[0]


def test_a_planted_core_import_of_the_integrations_and_a_sideways_one_are_caught(tree: Path) -> None:
    (tree / "ncclguard" / "cli" / "doctor.py").write_text(
        (tree / "ncclguard" / "cli" / "doctor.py").read_text()
        + "\n\ndef _planted():\n    from ncclguard.integrations import hf\n"
    )
    (tree / "ncclguard" / "env" / "versions.py").write_text(
        (tree / "ncclguard" / "env" / "versions.py").read_text()
        + "\nfrom ncclguard.recovery import rebuild  # planted\n"
    )
    found = offences(tree, read_contract(ARCHITECTURE))
    assert [f.split(":")[0] for f in found] == ["ncclguard/cli/doctor.py", "ncclguard/env/versions.py"], found


def test_a_module_in_no_part_is_caught(tree: Path) -> None:
    (tree / "ncclguard" / "stray").mkdir()
    (tree / "ncclguard" / "stray" / "__init__.py").write_text("")
    assert offences(tree, read_contract(ARCHITECTURE)) == ["ncclguard/stray/__init__.py: in no part of the table"]


def test_the_watchdog_rooms_keep_their_order(tree: Path) -> None:
    # The sensors and the ladder sit side by side (neither may import the other); the incident
    # model (layer 3) may not reach up to the watchdog's desk that handles incidents (layer 6).
    sensor = tree / "ncclguard" / "watching" / "sensors" / "liveness.py"
    sensor.write_text(sensor.read_text() + "\nfrom ncclguard.watching.ladder import actions  # planted\n")
    model = tree / "ncclguard" / "incidents" / "model.py"
    model.write_text(model.read_text() + "\nfrom ncclguard.watching.desk import desk  # planted\n")
    found = offences(tree, read_contract(ARCHITECTURE))
    assert [f.split(":")[0] for f in found] == [
        "ncclguard/incidents/model.py",
        "ncclguard/watching/sensors/liveness.py",
    ], found
    assert "of desk (layer 6)" in found[0] and "of ladder (layer 5)" in found[1]


def test_a_planted_private_import_in_an_integration_is_caught(tree: Path) -> None:
    hf = tree / "integrations" / "hf" / "__init__.py"
    hf.write_text(
        hf.read_text()
        + "\nfrom ncclguard.recovery._rebuild.restarts import restart_count  # planted"
        + "\nfrom ncclguard.recovery.heal import _check  # planted"
        + "\nimport ncclguard._torch_compat  # planted"
        + "\nfrom ncclguard.toolkit import restart_count  # the public door: allowed\n"
    )
    found = private_imports(tree)
    assert [f.split(": ", 1)[1] for f in found] == [
        "imports ncclguard.recovery._rebuild.restarts.restart_count (private: _rebuild)",
        "imports ncclguard.recovery.heal._check (private: _check)",
        "imports ncclguard._torch_compat (private: _torch_compat)",
    ], found


def test_a_planted_import_back_between_two_folders_is_caught(tree: Path) -> None:
    # analysis.py (layer 3) importing the desk (layer 6) also breaks the layers; the folder rule
    # names the two folders as well: incidents/ and watching/ would import each other.
    analysis = tree / "ncclguard" / "incidents" / "analysis.py"
    analysis.write_text(analysis.read_text() + "\nfrom ncclguard.watching.desk import cases  # planted\n")
    assert folder_cycles(tree) == ["incidents <-> watching"]
