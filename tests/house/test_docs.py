"""The docs as a whole: every relative link between the pages (and from the README) reaches a file,
and a link to a heading reaches a heading of that page, as GitHub makes its anchors. Pure text."""

from __future__ import annotations

import re
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
    first_code = text.index("```python")
    assert text.startswith("# ") and "\n+" in text[first_code : text.index("```", first_code + 3)]
    assert "ncclguard run --ncclguard-restarts" in text[: text.index("\n## ") if "\n## " in text else len(text)]
