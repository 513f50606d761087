"""bench/quantize_cost.py's fit check (issue 44 item 3): every run is held against the machine before it starts, and
one that does not fit is skipped with one line, never started to run out of memory or disk halfway; the source may
live on a tmpfs (``--source-dir``), its outputs on the disk. The verdicts are checked with figures, the route end to
end on the tiny shape with the source in /dev/shm. No timing is asserted."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
import quantize_cost  # noqa: E402
from quantize_cost import Need, Room, fit  # noqa: E402

pytestmark = pytest.mark.unit

GB = 1_000_000_000
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
# The full 32B's figures at 32 x 2048 tokens on one GPU (quantkit's plan, docs/performance.md): source, GPTQ output,
# host floor, GPU peak.
SOURCE = 65_500_000_000
GPTQ = Need("gptq", "quantkit", 19 * GB, 67 * GB, 18 * GB)


def lent(**changed: int | bool | None) -> Room:
    """The lent one-GPU machine's figures: the source into its 128 GiB /dev/shm, the outputs on its 64 GiB disk,
    125 GiB of memory, an H200."""
    room = dict(source_free=128 * 2**30, source_tmpfs=True, shared=False, disk_free=64 * 2**30,
                mem_available=125 * 2**30, gpu_free=139 * 2**30, gpus=1)
    return Room(**{**room, **changed})


def test_a_source_larger_than_its_free_space_is_skipped_in_one_line() -> None:
    ok, line = fit(GPTQ, SOURCE, False, 0, lent(source_free=60 * GB))
    assert not ok and line.startswith("gptq / quantkit: skipped: ") and "\n" not in line
    assert "source: about 65.5 GB (parameters x 2 bytes) exceeds the 60.0 GB free where it is written (tmpfs" in line
    assert "(estimates)" in line


def test_a_tmpfs_source_is_memory_the_runs_no_longer_have() -> None:
    """Before it is built the source comes off MemAvailable; once built MemAvailable already excludes it."""
    ok, line = fit(GPTQ, SOURCE, False, 0, lent(mem_available=120 * GB))
    assert not ok and "host memory: about 67.0 GB (quantkit's plan floor" in line
    assert "exceeds 54.5 GB MemAvailable less the source" in line
    ok, line = fit(GPTQ, SOURCE, True, 0, lent(mem_available=120 * GB - SOURCE))
    assert not ok and "exceeds 54.5 GB MemAvailable" in line and "less the source" not in line
    ok, line = fit(GPTQ, SOURCE, False, 0, lent())
    assert ok and line.startswith("gptq / quantkit: fits, by estimate: source about 65.5 GB (parameters x 2 bytes) "
                                  "into tmpfs, memory the runs lose")
    assert "host about 67.0 GB (quantkit's plan floor) of 68.7 GB MemAvailable less the source" in line


def test_a_source_on_the_workdirs_disk_leaves_less_for_the_outputs() -> None:
    ok, line = fit(GPTQ, SOURCE, False, 0, lent(source_tmpfs=False, shared=True, source_free=64 * 2**30))
    assert not ok and "disk: its output of about 19.0 GB exceeds the 3.2 GB free in the workdir" in line
    assert "host memory" not in line  # a source on disk is page cache, which MemAvailable counts as free


def test_the_gpu_and_the_gpu_count() -> None:
    ok, line = fit(Need("awq", "quantkit@2", GB, GB, 90 * GB), SOURCE, True, 0, lent(gpu_free=78 * 2**30))
    assert not ok and "GPU memory: about 90.0 GB (quantkit's plan) exceeds the 83.8 GB free on one GPU" in line
    assert "GPUs: 2 asked, 1 here" in line and line.startswith("awq / quantkit x2: skipped: ")
    ok, line = fit(GPTQ, SOURCE, True, 0, lent(gpu_free=None, gpus=0))
    assert ok and "no GPU here" in line


def test_kept_outputs_add_up(tmp_path: Path) -> None:
    """With --keep every kept output stays on the disk: the later runs have what the earlier ones left."""
    args = argparse.Namespace(shape="tiny", source_dir=None, workdir=tmp_path, keep="all")
    needs = [Need("gptq", tool, 30 * GB, GB, GB) for tool in ("llm-compressor", "quantkit")]
    fits = quantize_cost.fit_all(args, GB, needs, lent(disk_free=50 * GB, source_tmpfs=False, shared=True))
    assert [ok for ok, _ in fits] == [True, False]
    assert "exceeds the 19.0 GB free in the workdir beside 30.0 GB of kept outputs" in fits[1][1]
    args.keep = None
    assert all(ok for ok, _ in quantize_cost.fit_all(args, GB, needs, lent(disk_free=50 * GB)))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_dev_shm_is_seen_as_tmpfs(tmp_path: Path) -> None:
    room = quantize_cost.room(Path(f"/dev/shm/qk-bench-test-{os.getpid()}/src-tiny"), tmp_path, (None, 0))
    assert room.source_tmpfs and room.source_free > 0 and room.mem_available > 0


@pytest.mark.slow
def test_the_source_in_dev_shm_and_the_outputs_in_the_workdir(tmp_path: Path) -> None:
    """``--source-dir`` on a tmpfs: the source is built there, each run is checked and fits, and the outputs, logs
    and tokens are written to the workdir."""
    shm = Path(f"/dev/shm/qk-bench-test-{os.getpid()}")
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    work, results = tmp_path / "work", tmp_path / "results"
    try:
        p = subprocess.run([sys.executable, str(BENCH / "quantize_cost.py"), "--shape", "tiny", "--samples", "4",
                            "--seq-len", "64", "--methods", "fp8-static", "--source-dir", str(shm), "--workdir",
                            str(work), "--results-dir", str(results), "--keep"],
                           capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        assert (shm / "src-tiny" / "model.safetensors").is_file() and not (work / "src-tiny").exists()
        data = json.loads((results / "quantize_cost_tiny.json").read_text())
        assert data["source_dir"] == str(shm) and len(data["plan"]) == 2
        assert all(": fits, by estimate: source about " in line and "into tmpfs" in line for line in data["plan"])
        for tool, r in data["runs"]["fp8-static"].items():
            assert r["rc"] == 0 and r["fit"].startswith(f"fp8-static / {tool}: fits, by estimate: source built")
            assert (work / f"out-{tool}-fp8-static" / "config.json").is_file()
    finally:
        shutil.rmtree(shm, ignore_errors=True)
