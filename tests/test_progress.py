"""What a run prints where no live display can be drawn (a log, a CI capture, stderr under ``--json``)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from quantkit.progress import Reporter

pytestmark = pytest.mark.unit


def test_a_log_gets_one_line_per_step_and_no_empty_ones() -> None:
    """Rich's Progress prints an empty line when it stops on a console that is not interactive: a run's output
    started with one and had one before every step's line. Each step is its line, a bar its last state."""
    out = io.StringIO()
    r = Reporter(Console(file=out, width=120, force_terminal=False, highlight=False))
    with r.step("load", "Loading"):
        pass
    with r.layers("quantize", "Quantizing"):
        pass
    with r.bar("Scoring", total=2) as task:
        task.advance(2)
    r.log("done")
    lines = out.getvalue().splitlines()
    assert "" not in lines, lines
    assert [line.split()[:2] for line in lines] == [["✓", "Loading"], ["✓", "Quantizing"], ["Scoring", "━" * 40],
                                                    ["done"]], lines
