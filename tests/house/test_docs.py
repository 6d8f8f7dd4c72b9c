"""The docs as a whole: every relative link between the pages (and from the README) reaches a file,
and a link to a heading reaches a heading of that page, as GitHub makes its anchors; every snippet
compiles, and a python one defines every name it uses. Pure text (and one ruff run). The blocks
marked runnable run in tests/house/test_snippets_run.py."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept),
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on ``page`` (a repeated one numbered ``-1``, ``-2``, as GitHub does)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"^#+\s+(.*)", line)
        if m:
            a = anchor(m.group(1))
            n = seen.get(a, 0)
            seen[a] = n + 1
            found.add(a if n == 0 else f"{a}-{n}")
    return found


def broken_links(root: Path) -> list[str]:
    """Each relative link of the docs and the README that reaches no file or no heading."""
    bad = []
    for page in sorted([*root.glob("docs/**/*.md"), root / "README.md"]):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for m in LINK.finditer(text):
            link = m.group(1)
            if re.match(r"^[a-z]+:", link):
                continue  # https:, mailto:
            target, _, heading = link.partition("#")
            dest = (page.parent / target).resolve() if target else page
            where = f"{page.relative_to(root)}: {link}"
            if not dest.exists():
                bad.append(f"{where}: no such file")
            elif heading and dest.suffix == ".md" and heading not in anchors(dest):
                bad.append(f"{where}: no such heading")
    return bad


def test_every_link_between_the_docs_reaches_its_page_and_its_heading() -> None:
    assert broken_links(REPO) == []


def test_a_link_to_a_missing_heading_or_page_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## The settings (`Config`; each as `X_<FIELD>`)\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#the-settings-config-each-as-x_field) [page](docs/a.md)\n"
        "[gone](docs/a.md#settings) [none](docs/b.md) [web](https://example.org/#x)\n"
        "```\n[in code](docs/c.md)\n```\n"
    )
    assert broken_links(tmp_path) == [
        "README.md: docs/a.md#settings: no such heading",
        "README.md: docs/b.md: no such file",
    ]


@pytest.mark.parametrize("page", sorted(p.name for p in (REPO / "docs" / "stacks").glob("*.md")))
def test_each_stack_page_starts_with_the_lines_to_add_then_the_command(page: str) -> None:
    # docs/stacks/: one short page per stack for a user who wants the lines to add and the command.
    text = (REPO / "docs" / "stacks" / page).read_text()
    first_code = text.index("```diff")
    assert text.startswith("# ") and "\n+" in text[first_code : text.index("```", first_code + 3)]
    assert "ncclguard run --ncclguard-restarts" in text[: text.index("\n## ") if "\n## " in text else len(text)]


# The mark on the line right before a python block's fence that says it runs as pasted on this many
# CPU ranks (gloo; 1: plain python, more: torchrun), invisible when rendered.
RUNNABLE = re.compile(r"<!-- runnable: (\d+) ranks? -->")


@dataclass(frozen=True)
class Block:
    """A fenced block of a page: its language, its code, where its fence is, and its runnable mark."""

    lang: str
    code: str
    page: str  # relative to the root
    line: int  # the opening fence's line; the code's line n is the page's line + n
    ranks: int | None  # from the mark right before the fence, else None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(root: Path) -> list[Block]:
    """Every ```` ```python ```` and ```` ```diff ```` block of README.md and docs/, in page order."""
    out = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        text = page.read_text()
        for m in re.finditer(r"^```(python|diff)\n(.*?)^```", text, re.S | re.M):
            before = text[: m.start()].splitlines()
            mark = RUNNABLE.fullmatch(before[-1].strip()) if before else None
            ranks = int(mark.group(1)) if mark else None
            out.append(Block(m.group(1), m.group(2), str(page.relative_to(root)), len(before) + 1, ranks))
    return out


def snippet_problems(root: Path) -> list[str]:
    """Every ``python`` block of README.md and docs/ that does not compile, and every ``diff`` block
    whose result (its context and ``+`` lines, the marker column dropped) does not; a diff with an
    elided context line (`` ...``) is an excerpt, not a whole script, and is not compiled."""
    out = []
    for block in blocks(root):
        lang, code, where = block.lang, block.code, block.where
        lines = code.splitlines()
        marked = [n for n, line in enumerate(lines, 1) if lang == "python" and re.match(r"[+-][A-Za-z_]", line)]
        if marked:  # +guard(x) compiles (a unary plus) and fails when run
            out.append(f"{where}: python block: a diff marker on its line {marked[0]} (a diff block is ```diff)")
            continue
        if lang == "diff":
            if any(line.strip() == "..." for line in lines):
                continue
            code = "\n".join(line[1:] for line in lines if not line.startswith("-"))
        try:
            ast.parse(code)
        except SyntaxError as exc:
            out.append(f"{where}: {lang} block: {exc.msg} (its line {exc.lineno})")
    return out


def test_every_python_snippet_compiles_and_every_diff_ends_in_code_that_compiles() -> None:
    # A diff marker inside a python block is a TypeError or a SyntaxError for whoever pastes it.
    assert snippet_problems(REPO) == []


def test_a_diff_marker_in_a_python_block_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```python\nimport x\n+guard = x\n```\n```python\nimport x\n+guard(x)\n```\n")
    (tmp_path / "docs" / "a.md").write_text(
        "```diff\n import x\n+if x:\n+guard(x)\n```\n```diff\n x\n ...\n+  y\n```\n"
    )
    got = snippet_problems(tmp_path)
    assert got == [
        "README.md:1: python block: a diff marker on its line 2 (a diff block is ```diff)",
        "README.md:5: python block: a diff marker on its line 2 (a diff block is ```diff)",
        "docs/a.md:1: diff block: expected an indented block after 'if' statement on line 2 (its line 3)",
    ]


# ruff's checks of a name used and never defined: undefined, in __all__ and undefined, used before its
# assignment in a function.
UNDEFINED = "F821,F822,F823"


def undefined_names(root: Path, scratch: Path) -> list[str]:
    """Each name a ``python`` block of README.md and docs/ uses without defining it, as
    ``page:line: F821 ...`` (the page's line of the name): whoever pastes the block gets a NameError
    there. Static, by ruff, in one run over every block written to ``scratch``."""
    where: dict[str, Block] = {}
    for n, block in enumerate(b for b in blocks(root) if b.lang == "python"):
        (scratch / f"block{n}.py").write_text(block.code)
        where[f"block{n}.py"] = block
    if not where:
        return []
    # --exit-zero: any status but 0 is ruff not running (not installed: the lint extra), never a finding.
    cmd = [
        sys.executable,
        "-m",
        "ruff",
        "check",
        "--isolated",
        "--no-cache",
        "--exit-zero",
        "--output-format",
        "concise",
    ]
    run = subprocess.run(
        [*cmd, "--select", UNDEFINED, *sorted(where)], cwd=scratch, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, f"ruff did not run ({run.returncode}): {run.stderr}"
    out = []
    for line in run.stdout.splitlines():
        m = re.match(r"(block\d+\.py):(\d+):\d+: (F82\d .*)", line)
        if m:
            block = where[m.group(1)]
            out.append((block.page, block.line + int(m.group(2)), m.group(3)))
    return [f"{page}:{line}: {what}" for page, line, what in sorted(out)]


def test_every_python_snippet_defines_every_name_it_uses(tmp_path: Path) -> None:
    # An excerpt that uses `model`, `loader` or `dist` without making them is a NameError for whoever
    # pastes it: a python block is a whole script (a fragment of one is a ```diff block).
    assert undefined_names(REPO, tmp_path) == []


def test_a_python_block_that_uses_an_undefined_name_is_caught(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# A\n\n```python\nimport torch\n\nx = torch.ones(2)\n```\n\n```python\nimport torch\n\nloss = model(x)\n```\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        "```diff\n+y = undefined_in_a_diff\n```\n```python\ndef f():\n    print(n)\n    n = 1\n```\n"
    )
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert undefined_names(tmp_path, scratch) == [
        "README.md:12: F821 Undefined name `model`",
        "README.md:12: F821 Undefined name `x`",
        "docs/a.md:6: F821 Undefined name `n`",
    ]


def test_every_runnable_mark_stands_right_before_a_python_block() -> None:
    # A mark on a wrong line (or misspelt) would leave its block out of tests/house/test_snippets_run.py
    # without a word.
    marks, bad = set(), []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines, 1):
            if "runnable:" in line and line.lstrip().startswith("<!--"):
                marks.add((str(page.relative_to(REPO)), n + 1))  # the fence's line
                if not (RUNNABLE.fullmatch(line.strip()) and n < len(lines) and lines[n] == "```python"):
                    bad.append(f"{page.relative_to(REPO)}:{n}: {line.strip()}")
    assert bad == []
    assert {(b.page, b.line) for b in blocks(REPO) if b.ranks} == marks


def test_the_recovery_picture_draws_the_placement_the_ranks_compute(tmp_path: Path) -> None:
    """docs/recovery.png is made by docs/examples/recovery_picture.py; it draws the buddies the
    library's placement gives (each rank's replica at its place on the next host), and runs here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "recovery_picture", REPO / "docs" / "examples" / "recovery_picture.py"
    )
    assert spec is not None and spec.loader is not None
    picture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(picture)
    drawn = picture.draw(tmp_path / "recovery.png")
    assert drawn == [4, 5, 6, 7, 0, 1, 2, 3]
    assert (tmp_path / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (REPO / "docs" / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
