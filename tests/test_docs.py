"""The docs pages read on any machine: no page names a folder of the machine a measurement was taken on."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|root|home|mnt|opt)/[\w.+-]")


def test_no_docs_page_holds_a_machine_path():
    found = [f"{p.name}:{i}: {line.strip()[:100]}" for p in sorted(DOCS.glob("*.md"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if MACHINE_PATH.search(line)]
    assert not found, "\n".join(found)


def test_the_rule_catches_a_machine_path():
    assert MACHINE_PATH.search("refit export: 87.3 s (/work/fd/bench/engine)")
    assert MACHINE_PATH.search("run in /tmp/w on 2026-12-06")
    assert not MACHINE_PATH.search("WORK/bench/engine, runs/demo/ppo, examples/trl_chat/data.jsonl")


GENERATED = {"what-is-where.md", "trl-facade.md"}  # written by scripts/what_is_where.py and refit.learner.trl.fields
HISTORY = "changelog.md"  # the one page that is a log by design
ISSUE_NUMBER = re.compile(r"\bissues?\s*#?\d+", re.I)


def guide_pages() -> list[Path]:
    return [p for p in sorted(DOCS.glob("*.md")) if p.name not in GENERATED | {HISTORY}]


def opening(text: str) -> tuple[str, str]:
    """(the title line, the first paragraph after it): the paragraph is the lines up to the next blank line."""
    lines = text.splitlines()
    title = lines[0] if lines else ""
    rest = lines[1:]
    while rest and not rest[0].strip():
        rest.pop(0)
    para = []
    for line in rest:
        if not line.strip():
            break
        para.append(line)
    return title, "\n".join(para)


def problems_of(name: str, text: str) -> list[str]:
    """What keeps a page from reading as a guide: a title by issue number, no what/when paragraph under the title."""
    title, para = opening(text)
    out = []
    if not title.startswith("# "):
        out.append(f"{name}: the first line is not a '# ' title: {title[:60]!r}")
    if ISSUE_NUMBER.search(title):
        out.append(f"{name}: the title names an issue number: {title!r}")
    if not para or para.lstrip().startswith(("#", "|", "```", "<!--", "    ", "- ", "* ")):
        out.append(f"{name}: no paragraph (what it is, when to use it) right after the title: {para[:60]!r}")
    return out


def test_every_docs_page_opens_with_what_and_when_and_no_issue_number_in_its_title():
    pages = guide_pages()
    assert len(pages) >= 10 and (DOCS / HISTORY).exists(), [p.name for p in pages]
    found = [msg for p in pages for msg in problems_of(p.name, p.read_text())]
    assert not found, "\n".join(found)


def test_the_rule_catches_a_log_page():
    assert problems_of("x.md", "# int8 rollout engines (issue 21, items 1, 2)\n\nWhat it is.\n")
    assert problems_of("x.md", "# The engine at small shapes (Issue #21)\n\nWhat it is.\n")
    assert problems_of("x.md", "# LoRA\n\n## Measured (2026-12-05)\n\ntext\n")
    assert problems_of("x.md", "# LoRA\n\n| a | b |\n|---|---|\n")
    assert problems_of("x.md", "# LoRA\n")
    assert not problems_of("x.md", "# LoRA: an adapter over a frozen base\n\nTrains an adapter; use it when the model\n"
                                    "does not fit for full fine-tuning.\n\n## Current numbers\n")
    assert not problems_of("x.md", "# Tissue 21 of the engine\n\nWhat it is.\n")  # a word ending in 'issue' is not one
