"""The export's own memory: the process's peak resident size (high-water mark), read at the end of each stage.

Linux: ``VmHWM`` of ``/proc/self/status`` (kB); elsewhere ``resource.getrusage`` (``ru_maxrss``: kB on Linux,
bytes on macOS); None where neither is there. The high-water mark is never reset here (``clear_refs`` would
also lower what ``wait4`` / ``/usr/bin/time`` report for the whole process), so a stage's figure is the peak
*so far*: the stage where it jumps is the one that costs.
"""

from __future__ import annotations

import sys
import time


def _status_mb(key: str) -> int | None:
    """A ``kB`` line of ``/proc/self/status`` (``VmHWM``, ``VmRSS``) in MB; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_mb() -> int | None:
    """The process's resident set size now, MB; None where it cannot be read (not Linux)."""
    return _status_mb("VmRSS")


def peak_rss_mb() -> int | None:
    """The process's peak resident set size so far, MB (2**20 bytes); None where it cannot be read."""
    hwm = _status_mb("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except (ImportError, OSError):
        return None
    return int(kb // 1024 // (1024 if sys.platform == "darwin" else 1))


class StagePeaks:
    """``mark(stage)`` records, at the end of ``stage``, the peak RSS so far, the RSS now and the stage's seconds;
    ``line()`` says them all in one line."""

    def __init__(self):
        self.marks: list[tuple[str, int | None, int | None, float]] = []
        self._t = time.perf_counter()

    def mark(self, stage: str) -> int | None:
        """Record the end of ``stage``; returns the peak RSS so far (MB, None where unknown)."""
        now = time.perf_counter()
        mb = peak_rss_mb()
        self.marks.append((stage, mb, rss_mb(), now - self._t))
        self._t = now
        return mb

    @property
    def peak_mb(self) -> int | None:
        known = [mb for _, mb, _, _ in self.marks if mb is not None]
        return max(known) if known else None

    def line(self) -> str:
        show = lambda mb: "?" if mb is None else str(mb)  # noqa: E731
        stages = " | ".join(f"{s} {show(peak)} (now {show(now)}, {secs:.1f} s)" for s, peak, now, secs in self.marks)
        return f"refit export: peak RSS (MB) by the end of each stage: {stages}"
