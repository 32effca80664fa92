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
