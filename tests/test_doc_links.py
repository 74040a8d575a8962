"""Every relative link in README.md and docs/*.md resolves: the file exists, and a ``#anchor`` names
a heading of it (GitHub's slugs) or an explicit ``<a id>``/``<a name>``."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+).*?\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXPLICIT_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def _prose_lines(text: str) -> list[str]:
    """The lines, those of fenced code blocks blank (a line's number stays its number)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
            continue
        lines.append("" if fenced else line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    counts: dict[str, int] = {}
    for line in _prose_lines(page.read_text(encoding="utf-8")):
        found.update(_EXPLICIT_ANCHOR.findall(line))
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match[2])
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def relative_links(page: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in enumerate(_prose_lines(page.read_text(encoding="utf-8")), 1):
        line = _INLINE_CODE.sub("", line)  # a link shown as code is no link
        targets = _LINK.findall(line) + _REFERENCE.findall(line)
        for target in targets:
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:...
                continue
            links.append((number, target))
    return links


def broken_links(page: Path) -> list[str]:
    problems = []
    for number, target in relative_links(page):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / unquote(path_part)).resolve() if path_part else page
        where = f"{page.relative_to(REPO)}:{number}: {target}"
        if not resolved.exists():
            problems.append(f"{where}: no file {resolved.relative_to(REPO) if resolved.is_relative_to(REPO) else resolved}")
        elif anchor and resolved.suffix == ".md" and unquote(anchor) not in anchors(resolved):
            problems.append(f"{where}: no heading or <a id> '{anchor}' in {resolved.relative_to(REPO)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(f"{__name__}.REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# The `format`, v1 (current)\n\n## Same\n\n## Same\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md#the-format-v1-current) [ok2](docs/a.md#same-1) [self](#top) [web](https://x.org/#y)\n"
        "[gone](docs/b.md) [bad anchor](docs/a.md#nope)\n"
        "```\n[in code](docs/c.md)\n```\n"
        "`[inline](docs/d.md)`\n\n# Top\n"
        "[ref]: docs/e.md\n"
    )
    problems = broken_links(page)
    assert [p.split(": ", 1)[0] for p in problems] == ["README.md:2", "README.md:2", "README.md:9"], problems
    assert "no file docs/b.md" in problems[0] and "'nope'" in problems[1] and "docs/e.md" in problems[2]
