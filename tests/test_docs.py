"""The docs hold together: every section the code, the tests, the scripts and the docs cite by
name ("docs/X.md, "Section"") is one that exists, and design.md's Layout names every module.
Read from the files, so that a renamed heading or a new module is caught once nobody looks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CITED = re.compile(r'(?:docs/)?([\w-]+\.md),?\s*\(?"([^"\n]+)"')


def sections(text: str) -> list[str]:
    """A page's headings, and the bold run-in heads of its paragraphs ("**Bounds.** ...")."""
    heads = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return heads + [m.group(1) for m in re.finditer(r"^\*\*([^*\n]+?)\.?\*\*", text, re.M)]


def dangling(texts: dict[str, str], pages: dict[str, list[str]]) -> list[str]:
    """Each citation in `texts` (file -> text) of a section no heading of its page begins with."""
    bad = []
    for where, text in texts.items():
        for m in CITED.finditer(text):
            page, section = m.group(1), m.group(2)
            if page in pages and not any(h.startswith(section) for h in pages[page]):
                bad.append(f"{where}: {page}, {section!r}")
    return bad


def test_every_section_cited_by_name_exists():
    pages = {p.name: sections(p.read_text()) for p in DOCS.glob("*.md")}
    files = [*ROOT.glob("flylocal/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("scripts/**/*.py"),
             *DOCS.glob("*.md"), ROOT / "README.md"]
    files = [p for p in files if p.name != Path(__file__).name]          # its own examples are made up
    bad = dangling({str(p.relative_to(ROOT)): p.read_text() for p in files}, pages)
    assert not bad, "citations of sections that do not exist:\n" + "\n".join(bad)


def test_the_checker_sees_a_dangling_citation():
    pages = {"design.md": sections("# Design\n## Cost model\n**Why the echo rule.** Because.\n")}
    texts = {"a.py": 'see docs/design.md, "Cost model" and design.md ("Why the echo rule")',
             "b.py": 'see (docs/design.md, "Verifiers")', "c.py": 'another page: docs/other.md, "Anything"'}
    assert dangling(texts, pages) == ["b.py: design.md, 'Verifiers'"]


def test_the_layout_names_every_module():
    text = (DOCS / "design.md").read_text()
    layout = text[text.index("## Layout"):]
    layout = layout[: layout.index("\n## ", 4)]
    missing = [str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("flylocal/**/*.py"))
               if p.name not in ("__init__.py", "__main__.py") and f"`{p.name}`" not in layout]
    assert not missing, "docs/design.md's Layout leaves out: " + ", ".join(missing)
