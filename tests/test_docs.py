"""The Markdown files of the repository: every relative link and anchor resolves inside it.

A link (``[text](target)``, ``![alt](target)`` or a ``[label]: target`` definition)
outside code blocks and code spans must be a web URL (``http(s)://``, ``mailto:``),
an anchor in the same page, or a path relative to the page that exists and stays
inside the repository. Links to ``../shared`` or to absolute paths fail: they work
on no reader's machine. An anchor (``page.md#part`` or ``#part``) must name a heading
of the target page, spelled as GitHub spells heading anchors.

Also: every page of ``docs/`` is in the index ``docs/README.md``, every result file of
``bench/results/`` is named ``<theme>_<gpu>_<yyyymmdd>.md`` and listed in that folder's
README, and the user documentation says nothing about how it was measured beyond what,
where and how (no "GPU machine", sessions or run numbers).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".git", ".venv", "build", "runs", "data", "node_modules", ".pytest_cache",
             ".ruff_cache", "__pycache__", ".whl", ".gl"}
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:)")  # http:, https:, mailto:, ...


def markdown_files(root: Path = REPO) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*.md")):
        rel = path.relative_to(root).parts
        # Hidden folders (.git, .venv*, caches, local scratch) hold no docs of the project.
        if not any(part in SKIP_DIRS or part.startswith(".") for part in rel[:-1]):
            out.append(path)
    return out


def strip_code(text: str) -> str:
    """Text without fenced code blocks and inline code spans (their links are examples)."""
    text = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1[^\n]*$", "", text)
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", text, flags=re.S)


def links(text: str) -> list[str]:
    body = strip_code(text)
    return INLINE.findall(body) + DEFINITION.findall(body)


def problems(page: Path, root: Path = REPO) -> list[str]:
    """What is wrong with the links of one page (empty: all fine)."""
    found = []
    for target in links(page.read_text(encoding="utf-8")):
        if EXTERNAL.match(target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0].split("?", 1)[0]
        where = f"{page.relative_to(root)}: link {target!r}"
        if path.startswith("/"):
            found.append(f"{where} is an absolute path (use a path relative to the page)")
            continue
        resolved = (page.parent / path).resolve()
        if resolved != root and root not in resolved.parents:
            found.append(f"{where} leaves the repository")
        elif "shared" in Path(path).parts and not resolved.exists():
            found.append(f"{where} points at a shared folder outside the repository")
        elif not resolved.exists():
            found.append(f"{where} does not exist")
    return found


HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s[^>]*\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text (inline code, links and images
    reduced to their text, HTML tags dropped), lower case, every character but letters,
    digits, '_', '-' and spaces dropped, each space turned into '-'."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors a page defines: its headings' slugs (a repeated slug gets -1, -2, ...
    as on GitHub) and explicit ``<a id=...>`` / ``<a name=...>`` anchors."""
    text = page.read_text(encoding="utf-8")
    body = re.sub(r"(?ms)^\s*(```|~~~).*?^\s*\1[^\n]*$", "", text)
    found, seen = set(), {}
    for heading in HEADING.findall(body):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found | set(HTML_ANCHOR.findall(body))


def anchor_problems(page: Path, root: Path = REPO) -> list[str]:
    """Anchor links of one page (``#part``, ``other.md#part``) that name no heading."""
    found = []
    for target in links(page.read_text(encoding="utf-8")):
        if EXTERNAL.match(target) or "#" not in target:
            continue
        path, fragment = target.split("#", 1)
        dest = (page.parent / path.split("?", 1)[0]).resolve() if path else page
        if not fragment or dest.suffix != ".md" or not dest.is_file():
            continue  # missing pages are problems(); anchors of non-Markdown files aren't ours
        if fragment not in anchors(dest):
            found.append(f"{page.relative_to(root)}: link {target!r}: no heading "
                         f"{fragment!r} in {dest.relative_to(root)}")
    return found


def test_there_are_docs():
    names = {p.relative_to(REPO).as_posix() for p in markdown_files()}
    assert {"README.md", "docs/README.md", "docs/parallel_state.md",
            "docs/distributed_fused_adam.md", "docs/checkpoints.md", "docs/errors.md",
            "docs/example_gpt.md", "examples/gpt/README.md"} <= names


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve_inside_the_repository(page):
    assert not problems(page), "\n".join(problems(page))


def test_readme_links_the_docs():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for page in ("docs/parallel_state.md", "docs/distributed_fused_adam.md",
                 "docs/checkpoints.md", "docs/errors.md", "docs/example_gpt.md"):
        assert f"]({page})" in text, page


def test_the_checker_catches_bad_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("x")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[a](ok.md) [b](ok.md#part) [c](https://example.org) [d](#top)\n"
                    "[dead](missing.md) [up](../../outside.md) [abs](/etc/hosts)\n"
                    "[spec](../shared/SPEC.md)\n[ref]: nowhere.md\n"
                    "`[code](ignored.md)`\n```\n[block](ignored.md)\n```\n")
    got = problems(page, tmp_path)
    assert len(got) == 5, got
    assert any("missing.md" in g and "does not exist" in g for g in got)
    assert any("outside.md" in g and "leaves the repository" in g for g in got)
    assert any("/etc/hosts" in g and "absolute" in g for g in got)
    assert any("shared" in g for g in got)
    assert any("nowhere.md" in g for g in got)


@pytest.mark.parametrize("page", markdown_files(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_anchor_links_name_a_heading(page):
    assert not anchor_problems(page), "\n".join(anchor_problems(page))


def test_github_slugs():
    assert slug("Kernel performance") == "kernel-performance"
    assert (slug("GPT 1.3B: mpzero against FSDP2 (2026-12-07)")
            == "gpt-13b-mpzero-against-fsdp2-2026-12-07")
    assert slug("`--bf16` and [links](x.md)") == "--bf16-and-links"
    assert slug("store_param_remainders — memory") == "store_param_remainders--memory"


def test_the_anchor_checker_catches_bad_anchors(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text(
        "# Title\n\n## The step, 402.8M parameters\n\n## Twice\n\n## Twice\n"
        "```\n## Not a heading\n```\n<a id=\"explicit\"></a>\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Here\n\n## A part\n\n"
        "[a](other.md#title) [b](other.md#the-step-4028m-parameters) [c](#a-part)\n"
        "[d](other.md#twice-1) [e](other.md#explicit) [f](../x.py#L3) [g](https://e.org/#x)\n"
        "[bad1](other.md#the-step) [bad2](#no-such-part) [bad3](other.md#not-a-heading)\n"
        "[bad4](other.md#twice-2) `[code](other.md#ignored)`\n")
    (tmp_path / "x.py").write_text("")
    got = anchor_problems(page, tmp_path)
    assert len(got) == 4, got
    for bad in ("other.md#the-step'", "#no-such-part", "#not-a-heading", "#twice-2"):
        assert any(bad in g for g in got), (bad, got)


def test_the_docs_index_lists_every_page():
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    targets = {t.split("#", 1)[0] for t in links(index)}
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md") if p.name != "README.md")
    missing = [p for p in pages if p not in targets]
    assert pages and not missing, f"docs/README.md does not link {missing}"


RESULTS = REPO / "bench" / "results"
RESULT_NAME = re.compile(r"^[a-z0-9-]+_[a-z0-9-]+_20\d{6}\.md$")


def test_result_files_are_named_and_listed():
    files = sorted(p.name for p in RESULTS.glob("*.md") if p.name != "README.md")
    assert files, "bench/results/ holds no result file"
    assert not [f for f in files if not RESULT_NAME.match(f)], files
    index = (RESULTS / "README.md").read_text(encoding="utf-8")
    listed = {t.split("#", 1)[0] for t in links(index)}
    assert not [f for f in files if f not in listed], "bench/results/README.md does not list them"


# How a page was made is not the reader's business: no lab-notebook wording.
LAB_WORDS = re.compile(
    r"GPU machine|this session|lent (?:GPU|machine)|\bwas lent\b|no (?:GPU|H100|H200) came|"
    r"\b(?:tenth|eleventh|twelfth|thirteenth|fourteenth) run\b|#13\b|cap\.py", re.I)


def test_the_docs_say_nothing_about_how_they_were_made():
    top = ("README.md", "docs", "bench")
    pages = [p for p in markdown_files() if p.relative_to(REPO).parts[0] in top]
    hits = [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
            for p in pages for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if LAB_WORDS.search(line)]
    assert not hits, "\n".join(hits)
