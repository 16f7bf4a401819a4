"""The Markdown files of the repository: every relative link resolves inside it.

A link (``[text](target)``, ``![alt](target)`` or a ``[label]: target`` definition)
outside code blocks and code spans must be a web URL (``http(s)://``, ``mailto:``),
an anchor in the same page, or a path relative to the page that exists and stays
inside the repository. Links to ``../shared`` or to absolute paths fail: they work
on no reader's machine.
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
        if not any(part in SKIP_DIRS or part.startswith(".venv") for part in rel[:-1]):
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
