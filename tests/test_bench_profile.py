"""bench/profile_phases.py on the committed py-spy profile of the 8B FP8 runs (bench/results/h100/8b/): the steps,
imports and working threads it reads must be those the results page quotes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import profile_phases  # noqa: E402

PROFILE = ROOT / "bench" / "results" / "h100" / "8b" / "fp8_profile.pyspy.txt.gz"

pytestmark = pytest.mark.unit


def test_the_h100_fp8_profile_reads_as_its_page_says() -> None:
    procs = profile_phases.summarize(profile_phases.read(PROFILE), rate=50)
    assert set(procs) == {"quantkit", "llm-compressor directly"}
    q, d = procs["quantkit"], procs["llm-compressor directly"]
    assert (q["main_s"], q["imports_s"]) == (52.02, 16.24)
    assert (d["main_s"], d["imports_s"]) == (47.22, 12.42)
    # the load step's extra 1.8 s is llm-compressor's own import, which the direct script pays among its imports
    assert q["imports"]["linearize:63"] == 1.78
    assert q["steps"]["quantize_one:135 > ArtifactWriter.commit:148 > Sealer.finish:171"] == 2.64
    # the oneshot calls themselves: quantkit's is not the slower one
    assert q["steps"]["quantize_one:125 > CompressedProducer.produce:228 > run:237"] == 21.54
    assert d["steps"]["<module>:632 > main:590 > direct:344"] == 22.12
    # waiting threads are left out; the sealer's hashing and fsync are counted
    assert {"quantkit-seal: sha256_file", "quantkit-seal: fsync_file"} <= set(q["threads"])
    assert not any("Condition.wait" in k or "Event.wait" in k for k in q["threads"])
