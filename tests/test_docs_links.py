"""Every link in the docs a reader follows resolves: README.md, docs/**, bench/README.md, bench/journal/**.

A relative link must name a file or folder of the repository; a `#anchor` must name a heading of
the page it points at (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a
repeated heading gets -1, -2, ...). Links inside code (fenced blocks, `inline`) are not links.
External links (http:, https:, mailto:) are not fetched: no network in tests.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(`+).*?\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = ("http://", "https://", "mailto:")


def doc_pages() -> list[Path]:
    """The pages a reader is sent to: the README, everything under docs/, bench's README and journal."""
    pages = [ROOT / "README.md", ROOT / "bench" / "README.md"]
    pages += sorted((ROOT / "docs").rglob("*.md"))
    pages += sorted((ROOT / "bench" / "journal").rglob("*.md"))
    return [p for p in pages if p.is_file()]


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks, with inline code removed."""
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            yield number, INLINE_CODE.sub("", line)


def links(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(text):
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(line)]
        ref = REFERENCE_DEF.match(line)
        if ref:
            found.append((number, ref.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = None if in_fence else HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
    return result


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each link of one page, as 'page:line: target (reason)'."""
    problems = []
    text = page.read_text(encoding="utf-8")
    for number, target in links(text):
        if not target or target.startswith(EXTERNAL):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        if path_part.startswith("/"):
            problems.append(f"{where} (absolute path: write it relative to the page)")
            continue
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif root not in dest.parents and dest != root:
            problems.append(f"{where} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where} (no heading with anchor #{anchor})")
    return problems


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert broken_links(page) == []


def test_the_pages_exist():
    names = {str(p.relative_to(ROOT)) for p in doc_pages()}
    assert {"README.md", "bench/README.md", "docs/README.md"} <= names


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_the_checker_finds_what_is_broken(tmp_path):
    """The checker itself: a missing file, a missing anchor and an absolute path are reported;
    links in code, external links, a good anchor and a repeated heading's anchor are not."""
    (tmp_path / "other.md").write_text("# Other page\n## Same\n## Same\n## Will it fit? `kvgate plan`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n"
        "[ok](other.md) [ok](other.md#other-page) [ok](other.md#same-1) [ok](#top)\n"
        "[ok](other.md#will-it-fit-kvgate-plan) [ext](https://example.com/x)\n"
        "`[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [abs](/etc/passwd)\n"
        "[ref]: also-missing.md\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "missing.md (no such file)",
        "other.md#nowhere (no heading with anchor #nowhere)",
        "/etc/passwd (absolute path: write it relative to the page)",
        "also-missing.md (no such file)",
    ]
