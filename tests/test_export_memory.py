"""The export's memory record (refit/export/memory.py): the process's peak RSS, per stage and in the manifest."""

from __future__ import annotations

import sys

import pytest

from refit.export.memory import StagePeaks, peak_rss_mb, rss_mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status is Linux's")
def test_peak_is_the_high_water_mark_and_stages_say_it_in_one_line():
    before = peak_rss_mb()
    assert before >= rss_mb() > 0
    peaks = StagePeaks()
    block = bytearray(64 << 20)  # touched: 64 MB resident
    peaks.mark("grow")
    del block
    peaks.mark("shrink")
    (s1, p1, n1, t1), (s2, p2, n2, t2) = peaks.marks
    assert (s1, s2) == ("grow", "shrink") and p2 >= p1 >= n1 and p1 >= before and t1 >= 0 and t2 >= 0
    assert peaks.peak_mb == p2
    line = peaks.line()
    assert "\n" not in line and line.startswith("refit export: peak RSS (MB)") and f"grow {p1} (now {n1}," in line


def test_no_marks_no_peak():
    assert StagePeaks().peak_mb is None
