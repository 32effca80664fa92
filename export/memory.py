"""The export's own memory: the process's peak resident size (high-water mark), read at the end of each stage.

Linux: ``VmHWM`` of ``/proc/self/status`` (kB); elsewhere ``resource.getrusage`` (``ru_maxrss``: kB on Linux,
bytes on macOS); None where neither is there. The high-water mark is never reset here (``clear_refs`` would
also lower what ``wait4`` / ``/usr/bin/time`` report for the whole process), so a stage's figure is the peak
*so far*: the stage where it jumps is the one that costs.
"""

from __future__ import annotations

import sys


def peak_rss_mb() -> int | None:
    """The process's peak resident set size so far, MB (2**20 bytes); None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return int(kb // 1024 // (1024 if sys.platform == "darwin" else 1))


class StagePeaks:
    """``mark(stage)`` records the peak RSS so far at the end of ``stage``; ``line()`` says them all in one line."""

    def __init__(self):
        self.marks: list[tuple[str, int | None]] = []

    def mark(self, stage: str) -> int | None:
        mb = peak_rss_mb()
        self.marks.append((stage, mb))
        return mb

    @property
    def peak_mb(self) -> int | None:
        known = [mb for _, mb in self.marks if mb is not None]
        return max(known) if known else None

    def line(self) -> str:
        stages = " | ".join(f"{s} {mb if mb is not None else '?'}" for s, mb in self.marks)
        return f"refit export: peak RSS (MB) by the end of each stage: {stages}"
